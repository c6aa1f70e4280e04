"""The engine, the switching state and the simulator agree on the shared scheduling rules (schedule_rules.py):
the same buckets for every shape, the same switch for every acceptance sequence; and the scheduler's decisions
(schedule_decisions.py) by hand (tests/test_scheduler_parity.py replays recorded scheduler traces)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from rollverify_jax import schedule_decisions, schedule_rules
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rl import partial_rollout
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, paged_cache
from rollverify_jax.rollout import engine as engine_lib
from rollverify_jax.sim import CostModel, CutModel, LengthModel, Workload, simulate
from rollverify_jax.sim import config as sim_config
from rollverify_jax.sim import shape as sim_shape
from rollverify_jax.verify import SwitchConfig, update_switch_state


def _doubling(n: int, lo: int, hi: int) -> int:
    """The engine's prefill bucket as it was written before the shared rule: double from lo until >= n."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def _workload(cfg: EngineConfig, live_slots: bool) -> Workload:
    """The simulator's view of an engine config (what ``sim.shape.run_shape`` builds)."""
    return Workload("partial", 1, 1, cfg.num_slots, cfg.steps_per_dispatch, cfg.max_seq_len - 1, prompt_len=1,
                    live_slots=live_slots, min_prefill_len=cfg.min_prefill_len, max_seq_len=cfg.max_seq_len,
                    bucket_ratio=cfg.bucket_ratio, prefill_token_budget=cfg.prefill_token_budget,
                    page_size=cfg.page_size, live_pages=cfg.live_pages)


def test_modes_are_one_tuple():
    """The synchronous modes are one tuple the engine's manager and the simulator's replay share; the manager's
    rollout modes are those plus the asynchronous one (which the simulator replays apart, sim/async_replay.py)."""
    assert sim_config.MODES is schedule_rules.MODES
    assert partial_rollout.MODES is schedule_rules.ROLLOUT_MODES == (*schedule_rules.MODES, schedule_rules.ASYNC_MODE)


def test_pow2_bucket_is_the_ratio_2_ladder():
    # The engine's prefill width (EngineConfig.bucket_ratio 2: the smallest of schedule_rules.prefill_widths
    # holding the prefilled tokens; test_a_real_engine_and_... below checks the engine and the simulator agree on
    # it) is the power-of-two bucket (the learner's length buckets, the tool reply widths) and the engine's old
    # doubling.
    for lo in (1, 3, 16, 32, 512):
        for hi in (lo, 64, 1000, 22528, 65536):
            widths = schedule_rules.prefill_widths(lo, hi)
            for n in [*range(0, 140), 511, 512, 513, 4095, 4096, 4097, 20000, 70000]:
                assert (schedule_rules.smallest_holding(widths, n) == schedule_rules.pow2_bucket(n, lo, hi)
                        == _doubling(n, lo, hi))
    with pytest.raises(ValueError, match="lo=0"):
        schedule_rules.pow2_bucket(5, 0, 64)


SHAPES = [  # (num_slots, page_size, max_seq_len, min_prefill_len, bucket_ratio, prefill_token_budget)
    (4, 8, 64, 32, 2, None), (8, 4, 64, 4, 2, None), (16, 4, 256, 16, 2, 1024), (17, 16, 330, 8, 3, 660),
    (24, 8, 96, 32, 2, None), (64, 2, 128, 2, 4, 512), (12, 64, 512, 32, 2, None)]


@pytest.mark.parametrize("num_slots, page_size, max_seq_len, min_prefill, ratio, budget", SHAPES)
def test_a_real_engine_and_the_simulator_give_the_same_buckets(model, num_slots, page_size, max_seq_len,
                                                              min_prefill, ratio, budget):
    for live_slots, live_pages in ((True, True), (False, True), (True, False)):
        cfg = EngineConfig(num_slots=num_slots, page_size=page_size, max_seq_len=max_seq_len, steps_per_dispatch=4,
                           min_prefill_len=min_prefill, live_slots=live_slots, live_pages=live_pages,
                           bucket_ratio=ratio, prefill_token_budget=budget)
        engine = Engine(model, cfg, SamplingConfig(greedy=True))
        w = _workload(cfg, live_slots and sim_shape.pool_shards((1, 1, 1), num_slots) == 1)
        assert engine.live_slot_buckets() == w.slot_buckets
        if live_pages:  # the engine reads the whole table when live pages are off, whatever its buckets
            assert engine.live_page_buckets() == w.page_buckets
        else:
            assert w.page_buckets == [engine.allocator.pages_per_seq]
        for n in range(1, max_seq_len + 1):
            assert engine.prefill_bucket(n) == w.prefill_bucket(n)
        for width in engine.prefill_widths():
            assert engine.prefill_rows(width) == w.prefill_rows(width)
        assert engine.prefill_widths() == w.prefill_widths
        rng = np.random.default_rng(num_slots)
        split = 0
        for trial in range(40):  # the packed prefill: the calls and (rows, width) of Engine.pack for the same lengths
            n = int(rng.integers(1, num_slots + 1))  # a call packs at most one sequence per slot
            top = max_seq_len if trial % 2 else max(1, min_prefill)  # long resumes, or many short prompts
            drawn = rng.integers(1, top + 1, size=n).tolist()
            for width in {engine.prefill_bucket(m) for m in drawn}:  # the scheduler splits one width bucket
                lengths = [m for m in drawn if engine.prefill_bucket(m) == width]
                parts = engine.split_for_prefill(lengths)
                assert parts == w.split_for_prefill(lengths), lengths
                split += len(parts) > 1
                for part in parts:
                    sub = [lengths[i] for i in part]
                    packed = engine.pack([np.ones(m, np.int32) for m in sub], part, [1] * len(sub))
                    assert packed.tokens.shape == w.prefill_shape(sub) and packed.tokens.shape[1] == width, sub
        assert (split > 0) == (budget is not None)  # a token budget splits some rounds into several calls
        for active in range(1, num_slots + 1):
            assert w.slot_bucket(active) == next(b for b in engine.live_slot_buckets() if b >= active)


def test_a_real_admission_round_is_what_the_replay_charges(model, monkeypatch):
    # One admission round of a real Scheduler on a tiny Engine: a verified resume (prompt 10 + 30 cached: bucket 64)
    # with two new members of group 3 (prompt 40: bucket 64 too), and three new members of group 1 and one of
    # group 2 (prompt 10: bucket 16). Each sequence's last token is its slot's pending token: 9 or 39 prefilled.
    # Bucket 16 verifies nothing: a prefill (no log-probs) and an activation (Engine.admit), group 1's prompt
    # computed once (two 9-token rows: 2 rows of 16), 2 x 9 tokens copied. Bucket 64 verifies: one log-prob
    # prefill of all three (3 rows of 64, the row bucket 4; group 3's prompt computed twice) and an activation.
    # The replay's _charge_prefill of the same round gives the same calls, shapes and token counts.
    from rollverify_jax.rollout import Scheduler, Trajectory
    from rollverify_jax.sim.replay import Replay, StepRecord, _Call

    cfg = EngineConfig(num_slots=8, page_size=8, max_seq_len=128, steps_per_dispatch=2, min_prefill_len=16)
    engine = Engine(model, cfg, SamplingConfig(greedy=True))
    seen = {"pack": [], "prefill": [], "activate": []}
    for name in seen:
        real = getattr(engine, name)

        def wrapped(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            seen[_name].append(out.tokens.shape if _name == "pack" else k.get("with_logp", True))
            return out
        monkeypatch.setattr(engine, name, wrapped)
    rng = np.random.default_rng(0)

    def prompt(n):
        return rng.integers(4, 60, size=n).astype(np.int32)
    p1, p2, p3 = prompt(10), prompt(10), prompt(40)
    new = [Trajectory(uid=u, group_id=1, prompt=p1, seed=u, max_new_tokens=20) for u in range(3)]
    new += [Trajectory(uid=3, group_id=2, prompt=p2, seed=3, max_new_tokens=20)]
    new += [Trajectory(uid=u, group_id=3, prompt=p3, seed=u, max_new_tokens=20) for u in (4, 5)]
    resumed = Trajectory(uid=9, group_id=9, prompt=prompt(10), seed=9, max_new_tokens=60, tokens=[5] * 30,
                         logps=[-1.0] * 30, versions=[0] * 30)
    sched = Scheduler(engine)
    sched.submit(new)
    sched.resume([resumed], keep=lambda new, beh, ver, lengths: lengths)
    sched.step()
    sched.pause_all()
    w = Workload("rollverify", 1, 1, cfg.num_slots, cfg.steps_per_dispatch, 100, prompt_len=10,
                 min_prefill_len=cfg.min_prefill_len, max_seq_len=cfg.max_seq_len)
    rec = StepRecord(step=2, on_policy=False)
    replay = Replay(w, CostModel(), LengthModel(100, lengths=[5]), CutModel())
    replay._charge_prefill(rec, [_Call([10, 10, 10, 10], [1, 1, 1, 2], [False] * 4, [True] * 4),
                                 _Call([40, 40, 40], [-1, 3, 3], [True, False, False], [True] * 3)], 30)
    assert sorted(seen["pack"]) == sorted([w.prefill_shape([10, 10]), w.prefill_shape([40, 40, 40])])
    assert sorted(seen["pack"]) == [(2, 16), (4, 64)]
    assert seen["prefill"] == [False, True]  # bucket 16, then the log-prob prefill of bucket 64
    calls = len(seen["prefill"]) + len(seen["activate"])
    assert calls == rec.prefill_calls == 4
    assert (sched.stats.prefill_tokens, sched.stats.shared_prompt_tokens) == (rec.prefill_tokens,
                                                                               rec.shared_prompt_tokens) == (135, 18)
    assert sched.stats.prefill_sequences == rec.prefill_sequences == 7
    assert rec.prefill_padded_tokens == 2 * 16 + 4 * 64 and rec.logp_tokens == 4 * 64


def test_a_split_admission_round_activates_in_the_engines_call_order(model):
    # Under a prefill token budget of 128 (2 rows of 64, 1 of 128) a round's width bucket is split into calls of
    # first-fit rows, longest first: five resumes of prompt 10 + (30, 50, 40, 35, 25) tokens (39, 59, 49, 44, 34
    # prefilled, one 64-wide row each) are the calls [u1, u2], [u0, u3], [u4], each a prefill and an activation.
    # The slots start decoding in that order, which is the order a pause returns them in; the replay's admission
    # of the same round activates and pauses them in the same order, with the same calls and tokens.
    from rollverify_jax.rollout import Scheduler, Trajectory
    from rollverify_jax.sim.replay import Replay, StepRecord, _Traj

    cfg = EngineConfig(num_slots=8, page_size=8, max_seq_len=128, steps_per_dispatch=2, min_prefill_len=16,
                       prefill_token_budget=128)
    engine = Engine(model, cfg, SamplingConfig(greedy=True))
    calls = []
    for name in ("prefill", "activate"):
        real = getattr(engine, name)

        def wrapped(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)
        setattr(engine, name, wrapped)  # this test's own engine: no other test sees it
    cached = [30, 50, 40, 35, 25]
    rng = np.random.default_rng(1)
    trajs = [Trajectory(uid=u, group_id=u, prompt=rng.integers(4, 60, size=10).astype(np.int32), seed=u,
                        max_new_tokens=100, tokens=[5] * n, logps=[-1.0] * n, versions=[0] * n)
             for u, n in enumerate(cached)]
    sched = Scheduler(engine)
    sched.resume(trajs)
    sched._admit()  # one admission round, no decode dispatch
    paused = [t.uid for t in sched.pause_all()]
    assert paused == [1, 2, 0, 3, 4] and calls == ["prefill", "activate"] * 3
    w = Workload("partial", 1, 1, cfg.num_slots, cfg.steps_per_dispatch, 100, prompt_len=10,
                 min_prefill_len=cfg.min_prefill_len, max_seq_len=cfg.max_seq_len,
                 prefill_token_budget=cfg.prefill_token_budget)
    replay = Replay(w, CostModel(), LengthModel(100, lengths=[100]), CutModel())
    for u, n in enumerate(cached):
        replay.trajs[u] = _Traj(u, u, 100, tokens=n)
        replay.group_members[u], replay.group_done[u] = [u], 0
    replay.queue.extend(range(len(cached)))
    rec = StepRecord(step=1, on_policy=False)
    replay._admit(rec, 1)
    assert replay._pause_all() == paused
    assert (rec.prefill_calls, rec.prefill_tokens, rec.prefill_sequences) == (
        len(calls), sched.stats.prefill_tokens, sched.stats.prefill_sequences) == (6, 39 + 59 + 49 + 44 + 34, 5)
    assert rec.prefill_padded_tokens == (2 + 2 + 1) * 64


def test_a_sharded_engine_and_the_simulator_decode_over_all_slots(model):
    # Mesh (2, 2, 2): the pool is split over the 4 data x fsdp devices, so decode compiles for all slots only;
    # the simulator's pool_shards reads the same from make_mesh.shape, and its pages per shard are the engine's.
    cfg = EngineConfig(num_slots=16, page_size=8, max_seq_len=64, steps_per_dispatch=4)
    engine = Engine(model, cfg, SamplingConfig(greedy=True), mesh=mesh_lib.make_mesh((2, 2, 2)))
    shards = sim_shape.pool_shards((2, 2, 2), cfg.num_slots)
    assert engine.layout.num_shards == shards == 4
    assert engine.live_slot_buckets() == _workload(cfg, cfg.live_slots and shards == 1).slot_buckets == [16]
    budget = dataclasses.replace(cfg, kv_memory_bytes=20 * engine_lib.paged_cache.kv_bytes_per_page(
        model.cfg, cfg.page_size, cfg.kv_dtype))
    pages = engine_lib.pool_pages(model.cfg, budget, shards)
    assert Engine(model, budget, SamplingConfig(greedy=True), mesh=mesh_lib.make_mesh((2, 2, 2))).allocator \
        .shard_capacity == pages // shards - 1


def test_many_shapes_without_an_engine():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        slots, page = int(rng.integers(1, 600)), int(rng.integers(1, 80))
        seq = int(rng.integers(page, 70000))
        live = bool(rng.integers(2))
        w = Workload("on_policy", 1, 1, slots, 8, seq, prompt_len=0, max_seq_len=seq, page_size=page,
                     live_slots=live)
        pps = -(-seq // page)
        assert w.slot_buckets == schedule_rules.live_slot_buckets(slots, live)
        assert w.page_buckets == schedule_rules.live_page_buckets(pps)
        assert w.slot_buckets[-1] == slots and w.page_buckets[-1] == pps
        assert all(b >= 8 for b in w.slot_buckets[:-1]) and all(b >= 4 for b in w.page_buckets[:-1])


def _switch_step(rates: list[tuple[int, float]], cfg: SwitchConfig) -> int:
    """What the trainer decides: SwitchConfig.update over the cycles that verified something."""
    state = cfg.init()
    for step, a in rates:
        state = cfg.update(state, a, step)
        if state.on_policy:
            return state.switch_step
    return -1


def test_switch_due_is_update_switch_state_on_random_sequences():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        window, threshold = int(rng.integers(1, 9)), float(rng.choice([0.5, rng.uniform(0.05, 0.95)]))
        rates = rng.choice([0.5, 0.25, 0.75, 1.0, 0.0, *rng.uniform(0, 1, 4)], size=int(rng.integers(1, 30)))
        cfg = SwitchConfig(window=window, threshold=threshold)
        expected = next((i for i in range(len(rates)) if schedule_rules.switch_due(
            [float(x) for x in rates[max(0, i + 1 - window): i + 1]], window, threshold)), -1)
        assert _switch_step(list(enumerate(rates.tolist())), cfg) == expected
        assert update_switch_state(cfg.init(), float(rates[0]), 0, threshold).on_policy == (
            window == 1 and schedule_rules.window_mean([rates[0]]) < threshold)


def test_the_replay_switches_where_the_trainer_would():
    # Replays under random per-step fail probabilities: each one's acceptance per verifying cycle, fed to
    # SwitchConfig.update, switches at the replay's own switch step (or neither switches); both happen.
    outcomes = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        window, threshold = int(rng.integers(1, 6)), float(rng.uniform(0.2, 0.9))
        w = Workload("rollverify", batch_groups=2, group_size=4, num_slots=8, steps_per_dispatch=2,
                     max_new_tokens=300, prompt_len=5, switch_window=window, switch_threshold=threshold)
        trace = [(float(rng.uniform(0, 0.6)), float(rng.uniform(0, 1))) for _ in range(30)]
        res = simulate(w, CostModel(), LengthModel(300, median=40.0, sigma=1.0, seed=seed), CutModel(trace=trace), 30)
        rates = [(s.step, s.acceptance) for s in res.steps if s.verified > 0 and not s.on_policy]
        assert rates and _switch_step(rates, SwitchConfig(window=window, threshold=threshold)) == res.switch_step
        assert _switch_step(rates, SwitchConfig(window=window, threshold=threshold, enabled=False)) == -1
        outcomes.append(res.switch_step >= 0)
    assert 5 <= sum(outcomes) <= 55


def test_schedule_rules_import_nothing_heavy():
    # The rules and the decisions import neither JAX nor gin; the simulator (which binds its costs through gin) no JAX.
    code = ("import sys; import rollverify_jax.schedule_rules, rollverify_jax.schedule_decisions; "
            "print(sorted(m for m in ('jax', 'gin', 'flax') if m in sys.modules)); "
            "import rollverify_jax.sim, rollverify_jax.sim.calibrate; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]"]


# -- the scheduler's decisions (schedule_decisions.py), shared by the scheduler and the replay ---------------------


def test_reserved_tokens_for_one_and_two_dispatches_capped_and_full():
    # prompt 4, 3 steps per dispatch: the positions written plus the one the next token is read from, at most the cap
    assert schedule_decisions.reserved_tokens(4, 0, 40, 3) == 8
    assert schedule_decisions.reserved_tokens(4, 0, 40, 3, dispatches=2) == 11
    assert schedule_decisions.reserved_tokens(4, 0, 40, 3, dispatches=0) == 5  # what a slot holds after a dispatch
    assert schedule_decisions.reserved_tokens(4, 39, 40, 3) == 44
    assert schedule_decisions.reserved_tokens(4, 0, 40, 3, full=True) == 44
    tokens = np.arange(41)
    assert schedule_decisions.reserved_tokens(4, tokens, 40, 3).tolist() == [
        schedule_decisions.reserved_tokens(4, t, 40, 3) for t in range(41)]
    assert schedule_decisions.pages_for(np.asarray([0, 1, 8, 9]), 8).tolist() == [0, 1, 1, 2]
    w = Workload("partial", 1, 1, 4, 3, 40, prompt_len=4, page_size=8)
    assert [w.reserved_pages(t) for t in (0, 1, 39)] == [1, 2, 6]  # 8, 9 and 44 positions


def test_admission_keeps_queue_order_and_a_page_of_headroom_per_running_slot():
    admit = schedule_decisions.admit
    # one shard, 4 free pages, three 1-page requests: the third would leave no page for the first two to grow
    assert admit([1, 1, 1], [0, 1, 2], 3, [4], [0], headroom=1) == schedule_decisions.Admission((0, 1), True)
    assert admit([1, 1, 1], [0, 1, 2], 3, [4], [0], headroom=0).slots == (0, 1, 2)  # full reservation: no headroom
    # a head that does not fit holds back the request behind it, though that one would fit
    assert admit([3, 1], [0, 1], 2, [2], [0], headroom=0) == schedule_decisions.Admission((), True)
    # out of free slots is not a wait for pages; no page limit takes the lowest free slots
    assert admit([1, 1, 1], [1, 3], 4, [9], [2], headroom=1) == schedule_decisions.Admission((1, 3), False)
    assert admit([5, 5, 5], [2, 5], 4, None, [0, 0], headroom=1) == schedule_decisions.Admission((2, 5), False)
    # two shards of 2 slots: the first free slot whose shard has room (shard 0 is full, shard 1 is not)
    assert admit([2, 2], [1, 2, 3], 2, [1, 5], [1, 0], headroom=1).slots == (2, 3)


def test_admission_decisions_always_fit_the_allocator():
    """Random pools: every admitted request's pages are granted by a real allocator, and a head left waiting
    for pages could not have had them with the headroom on any free slot."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        shards, per_shard, page = int(rng.integers(1, 4)), int(rng.integers(1, 4)), 4
        alloc = paged_cache.PageAllocator(shards * int(rng.integers(3, 12)), page, shards * per_shard, 64, shards)
        for slot in rng.permutation(shards * per_shard)[: int(rng.integers(0, shards * per_shard))].tolist():
            tokens = page * int(rng.integers(1, 3))
            if alloc.can_allocate(tokens, slot):
                alloc.allocate(slot, tokens)
        free_slots = [s for s in range(shards * per_shard) if s not in alloc.owned]
        busy = [sum(alloc.shard_of(s) == sh for s in alloc.owned) for sh in range(shards)]
        needs = rng.integers(1, 4, size=len(free_slots)).tolist()
        headroom = int(rng.integers(0, 2))
        out = schedule_decisions.admit(needs, free_slots, per_shard, [len(f) for f in alloc.free], busy, headroom)
        for slot, need in zip(out.slots, needs, strict=False):
            alloc.allocate(slot, need * page)  # raises if the decision handed out pages the shard lacks
            busy[alloc.shard_of(slot)] += 1
        if out.page_blocked:
            need = needs[len(out.slots)]
            left = [s for s in free_slots if s not in out.slots]
            assert left and not any(alloc.can_allocate((need + headroom * busy[alloc.shard_of(s)]) * page, s)
                                    for s in left)


def test_the_oldest_running_slots_grow_and_the_others_are_preempted():
    grow = schedule_decisions.grow_or_preempt
    # one free page: the oldest takes it; the next two lack theirs (the preempted slot's pages help nobody now)
    assert grow([0, 0, 0], [2, 2, 1], [3, 4, 2], [1]) == (1, 2)
    # a younger slot that needs nothing more keeps running while an older one that needs more is preempted
    assert grow([0, 0, 0], [2, 2, 1], [4, 3, 1], [2]) == (1,)
    # shards are separate pools
    assert grow([0, 1, 0], [1, 1, 1], [2, 2, 2], [1, 0]) == (1, 2)
    assert grow([0, 1], [3, 3], [3, 3], [0, 0]) == ()


def test_pack_moves_take_the_lowest_free_slots_below_the_live_bucket():
    assert schedule_decisions.pack_moves([12, 0, 9, 3], [8, 16]) == ((9, 1), (12, 2))
    assert schedule_decisions.pack_moves([0, 5], [8, 16]) == ()
    assert schedule_decisions.pack_moves(list(range(9)), [8, 16]) == ()  # 9 held: the 16-slot bucket
    assert schedule_decisions.pack_moves([4, 15], [16]) == ()  # one bucket (live slots off): never moves


def test_queue_top_up_and_phase_end():
    assert schedule_decisions.queue_target(0, 16, 3) == 18 and schedule_decisions.queue_target(2, 16, 3) == 6
    for new_queued in range(0, 25):  # the whole groups the manager's loop submitted (one group at a time)
        submitted, n = 0, new_queued
        while n < 18:
            n, submitted = n + 3, submitted + 1
        assert schedule_decisions.groups_to_queue(new_queued, 18, 3) == submitted
    assert not schedule_decisions.phase_done(1, 2) and schedule_decisions.phase_done(2, 2)
    assert schedule_decisions.phase_done(3, 2)  # groups completed together beyond B
    assert schedule_decisions.pause_order([4, 1], [7], [2, 3]) == [4, 1, 7, 2, 3]
