"""The replay decides as the scheduler does: a real scheduler on a tiny engine with a KV pool too small for every
slot at full length (so slots grow page by page and get preempted) records every call of the shared decision
functions (``schedule_decisions``) with its inputs; the replay of the same run (the same shape, each request's
length as the engine sampled it) must make the same calls, in the same order, with the same inputs and the same
decisions: the same admissions into the same slots, the same preemption victims, the same slot moves. Partial
phases add the queue top-up, the phase end and the pause order (what the next phase resumes first)."""

from __future__ import annotations

import numpy as np
import pytest

from rollverify_jax import schedule_decisions
from rollverify_jax.rl.partial_rollout import RolloutConfig, RolloutManager
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory, paged_cache
from rollverify_jax.sim import CostModel, LengthModel, Workload, simulate
from rollverify_jax.verify import SwitchConfig, VerifyConfig

PROMPT, CAP, K, PAGE = 6, 40, 3, 8  # 6 + 40 tokens: 6 pages of 8 at full length


def _engine(model, slots: int, usable_pages: int, prefill_token_budget: int | None = None) -> Engine:
    """``slots`` slots over ``usable_pages`` pages (fewer than 6 per slot): admissions wait for pages and running
    slots are preempted. From 16 slots on, decode runs over 8 once at most 8 slots are held, and the scheduler
    moves the running sequences down to them. A ``prefill_token_budget`` splits an admission round's width
    bucket into several prefill calls (their activation order is the slots' order a pause returns)."""
    page_bytes = paged_cache.kv_bytes_per_page(model.cfg, PAGE, "float32")
    cfg = EngineConfig(num_slots=slots, page_size=PAGE, max_seq_len=64, steps_per_dispatch=K,
                       kv_memory_bytes=(usable_pages + 1) * page_bytes, prefill_token_budget=prefill_token_budget)
    engine = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))
    assert engine.allocator.shard_capacity == usable_pages
    return engine


@pytest.fixture(scope="module")
def small_engine(model) -> Engine:
    return _engine(model, 4, 17)


def _plain(x):
    """A decision's input or output as plain ints (a trajectory as its uid, which is what the replay holds)."""
    if x is None or isinstance(x, int | bool):
        return x
    if hasattr(x, "uid"):
        return x.uid
    if isinstance(x, schedule_decisions.Admission):
        return x
    return tuple(_plain(v) for v in x)


def _record(monkeypatch) -> list:
    """Every call of the shared decisions from now on: (name, inputs, decision), as plain ints."""
    log = []

    def wrap(name):
        real = getattr(schedule_decisions, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            log.append((name, _plain((*args, *kwargs.values())), _plain(out)))
            return out
        monkeypatch.setattr(schedule_decisions, name, call)
    for name in ("admit", "grow_or_preempt", "pack_moves", "groups_to_queue", "pause_order"):
        wrap(name)
    return log


def _decisions(log) -> list:
    """The calls that decided something (an admission, a preemption, a slot move, new groups queued, a pause): the
    replay jumps over dispatches where nothing can happen (no free slot, an empty queue, a head waiting for pages,
    every shard's pages enough, every slot below the live bucket), so it makes no call there while the scheduler
    calls at every dispatch. An admission's free slots are cut to the ``n`` lowest of each shard for ``n`` queue
    heads (all ``admit`` can take; the replay lists only those); the slots ``pack_moves`` is given are a set."""
    out = []
    for name, inputs, decision in log:
        if name == "admit" and decision.slots:
            needs, free, per_shard, *rest = inputs
            free = tuple(s for s in free if sum(f // per_shard == s // per_shard and f < s for f in free) < len(needs))
            out.append((name, (needs, free, per_shard, *rest), decision))
        elif name == "pack_moves" and decision:
            out.append((name, (tuple(sorted(inputs[0])), inputs[1]), decision))
        elif name != "admit" and decision:
            out.append((name, inputs, decision))
    return out


def _assert_same(replayed: list, real: list) -> None:
    for i, (ours, theirs) in enumerate(zip(replayed, real, strict=False)):
        assert ours == theirs, f"decision {i} of {len(real)}: replay {ours} != scheduler {theirs}"
    assert len(replayed) == len(real)


def _workload(engine: Engine, mode: str, batch_groups: int, group_size: int, **kw) -> Workload:
    cfg = engine.config
    w = Workload(mode, batch_groups, group_size, cfg.num_slots, cfg.steps_per_dispatch, CAP, PROMPT,
                 min_prefill_len=cfg.min_prefill_len, max_seq_len=cfg.max_seq_len, bucket_ratio=cfg.bucket_ratio,
                 prefill_token_budget=cfg.prefill_token_budget, page_size=cfg.page_size,
                 kv_pages_per_shard=engine.allocator.shard_capacity, page_reservation=cfg.page_reservation, **kw)
    assert w.pool_binds
    return w


def _prompt(uid: int) -> np.ndarray:
    return np.random.default_rng(uid).integers(4, 64, size=PROMPT).astype(np.int32)


def test_a_recorded_scheduler_run_with_preemptions_replays_decision_for_decision(small_engine, monkeypatch):
    engine, b, g = small_engine, 4, 4
    requests = [Trajectory(uid=u, group_id=u // g, prompt=_prompt(u), seed=100 + u, max_new_tokens=CAP)
                for u in range(b * g)]
    log = _record(monkeypatch)
    sched = Scheduler(engine)
    sched.submit(requests)
    sched.run()
    done = {t.uid: t for t in sched.take_finished()}
    real = _decisions(log)
    lengths = [done[u].num_tokens for u in range(b * g)]
    assert sched.stats.preemptions >= 2 and min(lengths) < CAP  # slots were preempted; some ended at EOS
    assert any(name == "admit" and out.page_blocked for name, _, out in log)  # a head waited for pages
    log.clear()
    (rec,) = simulate(_workload(engine, "on_policy", b, g), CostModel(), LengthModel(CAP, lengths=lengths),
                      num_steps=1).steps
    st = sched.stats
    # Admission samples nothing: every token is decoded, the first included.
    assert st.tokens_generated == sum(lengths)
    assert (rec.preemptions, rec.dispatches, rec.tokens_generated, rec.prefill_sequences, rec.batch_tokens) == (
        st.preemptions, st.dispatches, st.tokens_generated, st.prefill_sequences, sum(lengths))
    _assert_same(_decisions(log), real)


@pytest.mark.parametrize("slots, pages, b, g", [(4, 17, 1, 3), (16, 30, 2, 4)], ids=["4_slots", "16_slots_packed"])
def test_recorded_partial_phases_replay_phase_ends_pauses_and_resumes(model, small_engine, monkeypatch, slots, pages,
                                                                      b, g):
    """Three naive partial phases: each ends once B groups are complete, pauses what runs and what is queued,
    and the next resumes them first. The replay makes the same decisions in every phase, so it also ended each
    phase where the scheduler did and resumed the paused trajectories in the same order (running ones in the
    order they were last activated or moved, as the scheduler's slots are ordered)."""
    steps = 3
    # 16 slots: a budget of 64 tokens makes each prefill call at most 2 rows of 32 or 1 row of 64
    engine = small_engine if slots == 4 else _engine(model, slots, pages, prefill_token_budget=64)
    records = iter(range(10**6))
    calls = []
    split = engine.split_for_prefill
    monkeypatch.setattr(engine, "split_for_prefill", lambda lengths: calls.append(split(lengths)) or calls[-1])
    log = _record(monkeypatch)
    sched = Scheduler(engine)
    manager = RolloutManager(RolloutConfig(mode="partial", batch_groups=b, group_size=g, max_new_tokens=CAP), sched,
                             lambda: {"n": next(records)}, lambda r: _prompt(r["n"]), seed=5, switch=SwitchConfig(),
                             verify=VerifyConfig())
    phases, lengths = [], {}
    for step in range(1, steps + 1):
        engine.set_version(step - 1)
        groups = manager.run_phase().groups
        phases.append((sched.stats.preemptions, sched.stats.dispatches,
                       sum(t.num_tokens for grp in groups for t in grp.finished.values())))
        lengths.update({t.uid: t.num_tokens for grp in groups for t in grp.finished.values()})
    real = _decisions(log)
    assert sum(p for p, _, _ in phases) >= 1  # slots were preempted
    pauses = [inputs for name, inputs, _ in real if name == "pause_order"]
    assert len(pauses) == steps and max(len(running) for running, _, _ in pauses) >= 2  # in their order
    assert (slots > 8) == any(name == "pack_moves" for name, _, _ in real)  # 16 slots: packed below 8
    assert (slots > 8) == any(len(parts) > 1 for parts in calls)  # 16 slots: a round split into calls
    # The lengths the cached trajectories would reach: run them out (their samples do not depend on when).
    sched.resume(manager.cache.take_for_resume(include_finished=False))
    sched.run()
    lengths.update({t.uid: t.num_tokens for t in sched.take_finished()})
    lengths.update({t.uid: t.num_tokens for grp in manager.cache.groups.values() for t in grp.finished.values()})
    assert sorted(lengths) == list(range(manager.next_uid))
    engine.set_version(0)
    log.clear()
    res = simulate(_workload(engine, "partial", b, g), CostModel(),
                   LengthModel(CAP, lengths=[lengths[u] for u in range(manager.next_uid)]), num_steps=steps)
    assert [(r.preemptions, r.dispatches, r.batch_tokens) for r in res.steps] == phases
    _assert_same(_decisions(log), real)

