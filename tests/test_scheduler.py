"""Continuous batching, pause and verified resume."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.stats import RolloutStats

CFG = EngineConfig(num_slots=3, page_size=8, max_seq_len=64, steps_per_dispatch=3)
PAGE_BYTES = 2 * 4 * 2 * 8 * 32 * 4  # K+V, 4 layers, 2 kv heads, 8 tokens, head_dim 32, float32


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, CFG, SamplingConfig(temperature=1.0), eos_ids=(3,))


def _requests(n, seed=0, max_new=30):
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=rng.integers(2, 10)).astype(np.int32),
                       seed=50 + i, max_new_tokens=max_new) for i in range(n)]


def _finish_all(sched):
    sched.run()
    assert sched.engine.allocator.num_free == sched.engine.allocator.capacity
    return {t.uid: t for t in sched.take_finished()}


def test_pause_resume_without_cut_equals_never_pausing(engine):
    reference = _finish_all(_submit(engine, _requests(5)))
    sched = _submit(engine, _requests(5))
    sched.run(max_dispatches=2)
    paused = sched.pause_all()
    assert paused and engine.allocator.num_free == engine.allocator.capacity
    assert any(t.num_tokens > 0 for t in paused) and any(t.num_tokens == 0 for t in paused)  # running + queued
    sched.resume(paused)
    done = {**{t.uid: t for t in sched.take_finished()}, **_finish_all(sched)}
    assert sorted(done) == sorted(reference)
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens, uid
        np.testing.assert_allclose(done[uid].logps, t.logps, atol=1e-4)


def _submit(engine, trajs):
    sched = Scheduler(engine)
    sched.submit(trajs)
    return sched


def test_resume_hands_back_current_logprobs_and_truncates(model, engine):
    sched = _submit(engine, _requests(3, seed=1, max_new=40))
    sched.run(max_dispatches=3)
    paused = [t for t in sched.pause_all() if t.num_tokens >= 4]
    assert paused
    before = {t.uid: (list(t.tokens), list(t.logps), list(t.versions)) for t in paused}
    engine.set_version(1)
    seen = {}

    def keep_half(new_logp, behavior_logp, versions, lengths):
        for row, n in enumerate(lengths):
            seen[int(n), round(float(behavior_logp[row, 0]), 6)] = (new_logp[row, :n].copy(), versions[row, :n].copy())
        return lengths // 2

    sched.resume(paused, keep=keep_half)
    sched.run()
    finished = {t.uid: t for t in sched.take_finished()}
    assert len(sched.verified) == len(paused)
    for uid, (tokens, logps, versions) in before.items():
        t, keep = finished[uid], len(tokens) // 2
        assert t.tokens[:keep] == tokens[:keep] and t.logps[:keep] == logps[:keep]
        assert t.versions[:keep] == [0] * keep and set(t.versions[keep:]) == {1}
        new_logp, ver = seen[len(tokens), round(logps[0], 6)]
        assert list(ver) == versions
        seq = jnp.asarray([list(t.prompt) + tokens], jnp.int32)
        tf = jax.nn.log_softmax(model(seq)[0], axis=-1)
        p = len(t.prompt)
        want = [float(tf[p + j - 1, y]) for j, y in enumerate(tokens)]
        np.testing.assert_allclose(new_logp, want, atol=1e-4)
    engine.set_version(0)


def test_finished_member_that_survives_verification_stays_finished(engine):
    sched = _submit(engine, _requests(2, seed=2, max_new=5))
    done = _finish_all(sched)
    t = done[0]
    tokens = list(t.tokens)
    sched.reset_stats()
    sched.resume([t], keep=lambda new, beh, ver, lengths: lengths)
    sched.run()
    assert sched.take_finished()[0].tokens == tokens
    assert sched.stats.dispatches == 0 and not sched.slots  # nothing was decoded: it went straight back
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize("keep", [0, 2])
def test_cut_finished_member_is_regenerated_under_the_new_version(engine, keep):
    """A finished member cut by verification becomes unfinished, keeps its verified prefix (with its
    original log mu and versions) and is decoded again under the current policy version."""
    done = _finish_all(_submit(engine, _requests(2, seed=2, max_new=5)))
    t = done[0]
    tokens, logps = list(t.tokens), list(t.logps)
    assert t.finished and t.num_tokens == 5 and t.versions == [0] * 5
    sched = Scheduler(engine)
    engine.set_version(1)
    try:
        sched.resume([t], keep=lambda new, beh, ver, lengths: np.minimum(lengths, keep))
        sched.run()
    finally:
        engine.set_version(0)
    again = sched.take_finished()[0]
    assert sched.verified_finished == [(keep, 5)] and sched.verified == []  # a finished member: not the acceptance
    assert again.finished and again.num_tokens == 5 and sched.stats.tokens_generated == 5 - keep
    assert again.tokens[:keep] == tokens[:keep] and again.logps[:keep] == logps[:keep]
    assert again.versions == [0] * keep + [1] * (5 - keep)
    assert engine.allocator.num_free == engine.allocator.capacity


def test_truncate_cuts_and_marks_unfinished():
    t = Trajectory(uid=0, group_id=0, prompt=np.arange(3, dtype=np.int32), seed=0, max_new_tokens=8,
                   tokens=[5, 6, 7, 8], logps=[-0.1, -0.2, -0.3, -0.4], versions=[0, 0, 1, 1], finished=True)
    t.truncate(4)  # keeping everything is not a cut: same draw
    assert t.finished and t.tokens == [5, 6, 7, 8] and (t.draws, t.sample_seed) == (0, 0)
    t.truncate(3)
    assert not t.finished and t.draws == 1
    assert (t.tokens, t.logps, t.versions) == ([5, 6, 7], [-0.1, -0.2, -0.3], [0, 0, 1])
    first_cut_seed = t.sample_seed
    t.truncate(0)
    assert (t.tokens, t.logps, t.versions, t.finished, t.draws) == ([], [], [], False, 2)
    assert len({0, first_cut_seed, t.sample_seed}) == 3  # every draw has its own seed


def _agreement(a: dict, b: dict) -> float:
    """Fraction of equal tokens at the positions two sets of trajectories (same uids) both have."""
    pairs = [(x, y) for uid in a for x, y in zip(a[uid].tokens, b[uid].tokens, strict=False)]
    return float(np.mean([x == y for x, y in pairs]))


def test_regeneration_after_a_cut_is_a_fresh_draw(engine):
    """Weights unchanged and every token cut: the regenerated responses agree with the removed ones only
    as often as two independent samples do (a replay of the removed tokens' keys would agree 100%)."""
    original = _finish_all(_submit(engine, _requests(12, seed=4, max_new=20)))
    fresh = _finish_all(_submit(engine, [dataclasses.replace(t, seed=t.seed + 1000)
                                         for t in _requests(12, seed=4, max_new=20)]))
    cut = {uid: dataclasses.replace(t, tokens=list(t.tokens), logps=list(t.logps), versions=list(t.versions))
           for uid, t in original.items()}
    sched = Scheduler(engine)
    sched.resume(list(cut.values()), keep=lambda new, beh, ver, lengths: np.zeros_like(lengths))
    regenerated = _finish_all(sched)
    assert all(t.draws == 1 for t in regenerated.values())
    fresh_rate, regen_rate = _agreement(original, fresh), _agreement(original, regenerated)
    assert regen_rate < 0.5 and abs(regen_rate - fresh_rate) < 0.15, (regen_rate, fresh_rate)
    # The scheduler's own diagnostic counts the same comparison over the regenerated positions.
    assert sched.stats.regen_tokens > 0
    assert sched.stats.regen_equal / sched.stats.regen_tokens == pytest.approx(regen_rate, abs=0.1)


def test_verifier_sees_each_tokens_own_version(engine):
    """Tokens sampled at versions 0 and 1 reach the keep function with their own versions and log mu, and
    a partial cut keeps exactly the verified prefix."""
    sched = _submit(engine, _requests(3, seed=4, max_new=40))
    sched.run(max_dispatches=2)
    first = sched.pause_all()
    engine.set_version(1)
    seen = {}

    def record(new_logp, behavior_logp, versions, lengths):
        for row, n in enumerate(lengths):
            if n:
                seen[round(float(behavior_logp[row, 0]), 6)] = (versions[row, :n].tolist(),
                                                                behavior_logp[row, :n].tolist())
        return lengths - 1  # a partial cut: drop the last cached token
    try:
        sched.resume(first)
        sched.run(max_dispatches=2)
        second = [t for t in sched.pause_all() if t.num_tokens]
        mixed = {t.uid: (list(t.tokens), list(t.logps), list(t.versions)) for t in second}
        assert any(len(set(v)) == 2 for _, _, v in mixed.values())
        engine.set_version(2)
        sched.resume(second, keep=record)
        sched.step()
        current = {t.uid: t for t in [*sched.slots.values(), *sched.finished]}
    finally:
        engine.set_version(0)
        sched.pause_all()
    assert len(seen) == len(mixed)
    for uid, (tokens, logps, versions) in mixed.items():
        assert seen[round(logps[0], 6)][0] == versions
        np.testing.assert_allclose(seen[round(logps[0], 6)][1], logps, rtol=1e-6)
        t, n = current[uid], len(tokens) - 1
        assert t.tokens[:n] == tokens[:n] and t.versions[:n] == versions[:n] and t.logps[:n] == logps[:n]
        assert set(t.versions[n:]) == {2}


def test_slot_refill_keeps_utilization_high_and_counts_add_up(engine, monkeypatch):
    trajs = _requests(12, seed=3, max_new=12)
    sched = _submit(engine, trajs)
    inside, real = [], engine.dispatch_generate

    def timed():  # a dispatch's time is its call plus the wait in fetch
        t0 = time.perf_counter()
        out = real()
        inside.append(time.perf_counter() - t0)
        fetch = out.fetch

        def timed_fetch():
            t1 = time.perf_counter()
            got = fetch()
            inside[-1] += time.perf_counter() - t1
            return got
        out.fetch = timed_fetch
        return out
    monkeypatch.setattr(engine, "dispatch_generate", timed)
    t0 = time.perf_counter()
    sched.run()
    wall = time.perf_counter() - t0
    assert len(sched.finished) == 12 and sched.idle
    st = sched.stats
    assert st.slot_utilization(CFG.num_slots) > 0.6
    # An admission samples nothing (a prompt's last token is its slot's pending token): every token comes from
    # a decode dispatch.
    assert st.prefill_sequences == 12 and st.preemptions == 0
    assert st.tokens_generated == sum(t.num_tokens for t in trajs) == st.useful_token_steps
    assert st.prefill_tokens == sum(len(t.prompt) - 1 for t in trajs)
    assert st.decode_steps == st.dispatches * CFG.steps_per_dispatch
    assert st.slot_utilization(CFG.num_slots) == st.useful_token_steps / (CFG.num_slots * st.decode_steps)
    assert st.prefill_time > 0 and st.decode_time > 0 and st.host_time >= 0
    # Decode time is the sum over every dispatch (each bracketed by its own timer), and the parts fit the wall.
    assert len(inside) == st.dispatches > 1 and sum(inside) <= st.decode_time
    assert st.prefill_time + st.decode_time + st.host_time <= wall
    assert all(t.finished and len(t.logps) == len(t.versions) == t.num_tokens for t in trajs)
    assert all(t.num_tokens == 12 or t.tokens[-1] == 3 for t in trajs)  # max length or EOS, nothing after
    assert all(3 not in t.tokens[:-1] for t in trajs)
    sched.reset_stats()
    assert sched.stats == type(st)() and sched.verified == []
    assert sched.step() == 0 and sched.stats.dispatches == 0  # an idle scheduler does not dispatch


def test_run_stops_at_the_dispatch_limit_and_the_condition(engine):
    sched = _submit(engine, _requests(4, seed=6, max_new=30))
    sched.run(max_dispatches=2)
    assert sched.stats.dispatches == 2
    sched.run(until=lambda s: s.stats.dispatches >= 3)
    assert sched.stats.dispatches == 3
    assert sorted(sched.free_slots) == sorted(set(range(CFG.num_slots)) - set(sched.slots))
    paused = sched.pause_all()
    assert len(paused) + len(sched.take_finished()) == 4 and not sched.slots and not sched.queue
    assert sched.free_slots == list(range(CFG.num_slots))


def test_request_that_does_not_fit_yet_waits(model):
    small = Engine(model, EngineConfig(num_slots=3, page_size=8, max_seq_len=64, steps_per_dispatch=3,
                                       kv_memory_bytes=7 * PAGE_BYTES, page_reservation="full"),
                   SamplingConfig(temperature=1.0))  # scratch + 6 pages
    sched = _submit(small, [Trajectory(uid=i, group_id=i, prompt=np.arange(4, 12, dtype=np.int32), seed=i,
                                       max_new_tokens=16) for i in range(3)])  # 3 pages each
    sched.step()
    assert len(sched.slots) == 2 and len(sched.queue) == 1
    sched.run()
    assert len(sched.finished) == 3 and small.allocator.num_free == small.allocator.capacity
    never = Trajectory(uid=9, group_id=9, prompt=np.arange(4, 12, dtype=np.int32), seed=0, max_new_tokens=48)
    with pytest.raises(ValueError, match="needs 7 pages but the pool has 6"):  # 56 tokens fit the context of 64
        sched.submit([never])


def test_incremental_pages_preempt_and_still_give_the_same_samples(model, engine):
    """A pool too small for every slot at full length: slots grow page by page, some are preempted and
    resumed later, and every sample equals the one from an unconstrained pool."""
    reference = _finish_all(_submit(engine, _requests(6, seed=5, max_new=40)))
    small_pool = EngineConfig(num_slots=3, page_size=8, max_seq_len=64, steps_per_dispatch=3,
                              kv_memory_bytes=12 * PAGE_BYTES)  # 11 usable pages; 3 full sequences need 18
    tight = Engine(model, small_pool, SamplingConfig(temperature=1.0), eos_ids=(3,))
    sched = _submit(tight, _requests(6, seed=5, max_new=40))
    done = _finish_all(sched)
    assert sched.stats.preemptions > 1
    assert sched.stats.prefill_sequences == 6 + sched.stats.preemptions  # each preemption is one more prefill
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens, uid
        np.testing.assert_allclose(done[uid].logps, t.logps, atol=1e-4)


@pytest.mark.parametrize("prompt, max_new, match", [
    ([], 4, "Empty prompt"), ([5] * 10, 0, "max_new_tokens=0"), ([5] * 60, 10, "exceeds the context of 64"),
])
def test_bad_requests_fail_before_touching_slots(engine, prompt, max_new, match):
    sched = Scheduler(engine)
    free = engine.allocator.num_free
    with pytest.raises(ValueError, match=match):
        sched.submit([Trajectory(uid=0, group_id=0, prompt=np.asarray(prompt, np.int32), seed=0,
                                 max_new_tokens=max_new)])
    assert not sched.queue and engine.allocator.num_free == free


def test_request_boundaries_at_the_context_length(engine):
    sched = Scheduler(engine)
    fits = Trajectory(uid=0, group_id=0, prompt=np.full(54, 5, np.int32), seed=0, max_new_tokens=10)  # 64 = max
    one = Trajectory(uid=1, group_id=1, prompt=np.asarray([5], np.int32), seed=0, max_new_tokens=1)
    sched.submit([fits, one])
    assert [p.traj.uid for p in sched.queue] == [0, 1]
    over = Trajectory(uid=2, group_id=2, prompt=np.full(55, 5, np.int32), seed=0, max_new_tokens=10)
    with pytest.raises(ValueError, match="65 tokens|exceeds the context of 64"):
        sched.submit([over])
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        sched.resume([over])
    sched.run()
    done = {t.uid: t for t in sched.take_finished()}
    assert done[1].num_tokens == 1 and done[1].finished and done[0].num_tokens <= 10


def test_resumed_trajectories_queue_ahead_of_new_ones_in_their_order(engine):
    sched = Scheduler(engine)
    new, old = _requests(2, seed=7), _requests(4, seed=8)[2:]
    sched.submit(new)
    sched.resume(old)
    assert [p.traj.uid for p in sched.queue] == [2, 3, 0, 1]
    assert [p.keep_fn for p in sched.queue] == [None] * 4


def test_prefill_computes_log_probs_only_for_rows_that_are_verified(engine, monkeypatch):
    """Admissions that verify nothing (new prompts, resumes without keep) prefill and activate (``admit``),
    without the log-prob pass; a verified resume prefills with log-probs, then activates."""
    asked, fused = [], []
    real, real_fused = engine.prefill, engine.admit
    monkeypatch.setattr(engine, "prefill", lambda *a, with_logp=True, **k: (asked.append(with_logp),
                                                                             real(*a, with_logp=with_logp, **k))[1])
    monkeypatch.setattr(engine, "admit", lambda *a: (fused.append(len(a[0])), real_fused(*a), asked.clear())[1])
    sched = _submit(engine, _requests(3, seed=9, max_new=20))
    sched.step()
    assert fused == [3] and not asked  # fresh prompts: nothing to verify
    paused = [t for t in sched.pause_all() if t.num_tokens]
    fused.clear()
    sched.resume(paused)  # keep=None: resumed without verification
    sched.step()
    assert sum(fused) == len(paused) and not asked
    paused = [t for t in sched.pause_all() if t.num_tokens]
    fused.clear()
    sched.resume(paused, keep=lambda new, beh, ver, lengths: lengths)
    sched.step()
    assert asked and all(asked) and not fused
    sched.pause_all()


def test_keep_lengths_are_clipped_to_the_cached_tokens(engine):
    sched = _submit(engine, _requests(2, seed=10, max_new=30))
    sched.run(max_dispatches=2)
    paused = [t for t in sched.pause_all() if t.num_tokens]
    lengths = sorted(t.num_tokens for t in paused)
    sched.reset_stats()
    sched.resume(paused, keep=lambda new, beh, ver, n: np.where(np.arange(len(n)) % 2 == 0, n + 5, -3))
    sched.step()
    sched.pause_all()
    assert sorted(n for _, n in sched.verified) == lengths
    assert all(k in (0, n) for k, n in sched.verified)


def test_pause_returns_running_then_queued_and_frees_every_page(engine):
    sched = _submit(engine, _requests(5, seed=11, max_new=30))
    sched.step()
    running = sorted(sched.slots.values(), key=lambda t: t.uid)
    queued = [p.traj for p in sched.queue]
    assert len(running) == CFG.num_slots and queued
    paused = sched.pause_all()
    assert sorted(t.uid for t in paused[: len(running)]) == [t.uid for t in running]
    assert paused[len(running):] == queued
    assert engine.allocator.num_free == engine.allocator.capacity and sched.idle


@pytest.mark.parametrize("reservation", ["incremental", "full"])
def test_pages_reserved_per_admission(model, reservation):
    """Incremental reservation owns the pages of the next dispatch only; full owns prompt + max_new_tokens."""
    cfg = EngineConfig(num_slots=2, page_size=8, max_seq_len=64, steps_per_dispatch=3, page_reservation=reservation)
    eng = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))
    sched = Scheduler(eng)
    sched.submit([Trajectory(uid=0, group_id=0, prompt=np.arange(4, 8, dtype=np.int32), seed=0, max_new_tokens=40)])
    sched._admit()
    owned = len(eng.allocator.owned[0])
    assert owned == (1 if reservation == "incremental" else 6)  # 4 + 3 + 1 = 8 tokens: one page; 44: six
    sched.run()
    assert eng.allocator.num_free == eng.allocator.capacity
    assert sched.stats.decode_steps == 3 * sched.stats.dispatches > 0  # steps per dispatch, not slots (2)


def test_slot_utilization_is_useful_over_offered_token_steps():
    stats = RolloutStats(decode_steps=1, useful_token_steps=1)
    assert stats.slot_utilization(1) == 1.0
    assert RolloutStats(decode_steps=4, useful_token_steps=6).slot_utilization(3) == 0.5
    assert RolloutStats().slot_utilization(3) == 0.0  # nothing decoded yet: no division by zero


def test_incremental_admission_keeps_a_page_per_running_slot_free(model, engine):
    """Four usable pages, three 4-token prompts: admitting the third would leave no page for the first two to
    grow into at their first dispatch, so it waits (no prefill wasted on a sequence preempted at once)."""
    cfg = dataclasses.replace(CFG, kv_memory_bytes=5 * PAGE_BYTES)  # scratch + 4
    tight = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))
    assert tight.allocator.capacity == 4
    requests = [Trajectory(uid=i, group_id=i, prompt=np.arange(4, 8, dtype=np.int32), seed=70 + i,
                           max_new_tokens=12) for i in range(3)]
    sched = _submit(tight, [dataclasses.replace(t) for t in requests])
    sched.step()
    assert len(sched.slots) == 2 and len(sched.queue) == 1 and sched.stats.preemptions == 0
    done = _finish_all(sched)
    reference = _finish_all(_submit(engine, [dataclasses.replace(t) for t in requests]))
    assert {uid: t.tokens for uid, t in done.items()} == {uid: t.tokens for uid, t in reference.items()}


def test_when_pages_run_short_the_youngest_request_is_preempted(model):
    """Five usable pages, three running 4-token prompts that each need a second page: the two oldest requests
    (lowest uids) grow and the youngest is preempted, whatever slots they sit in, so the oldest always progress."""
    cfg = dataclasses.replace(CFG, kv_memory_bytes=6 * PAGE_BYTES)  # scratch + 5
    tight = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))
    sched = _submit(tight, [Trajectory(uid=uid, group_id=uid, prompt=np.arange(4, 8, dtype=np.int32), seed=uid,
                                       max_new_tokens=12) for uid in (5, 1, 3)])  # slots 0, 1, 2
    sched.step()  # one page each: 4 prompt tokens and the 3 of this dispatch
    assert sched.stats.preemptions == 0
    sched.step()  # the next dispatch needs a second page each: 3 x 2 > 5
    assert sched.stats.preemptions == 1
    assert sorted(t.uid for t in sched.slots.values()) == [1, 3] and sched.queue[0].traj.uid == 5
    sched.pause_all()


def test_one_packed_prefill_per_length_bucket(engine, monkeypatch):
    """A long resumed trajectory is prefilled on its own, so the short new prompts do not attend over its long
    rows; the short ones share one packed row of their bucket (one row of 32 positions, not 2 x 32)."""
    calls = []
    real = engine.pack
    monkeypatch.setattr(engine, "pack", lambda seqs, *a: (calls.append(real(seqs, *a)), calls[-1])[1])
    long = Trajectory(uid=9, group_id=9, prompt=np.arange(4, 12, dtype=np.int32), seed=1, max_new_tokens=40,
                      tokens=[5] * 30, logps=[-1.0] * 30, versions=[0] * 30)
    short = _requests(2, seed=12)
    sched = Scheduler(engine)
    sched.submit(short)
    sched.resume([long])
    sched.step()
    sched.pause_all()
    lengths = sorted(len(t.prompt) for t in short)
    assert engine.prefill_bucket(38) == 64 and engine.prefill_bucket(sum(lengths)) == 32
    packed_short, packed_long = sorted(calls, key=lambda p: p.tokens.shape[1])
    assert packed_long.tokens.shape == (1, 64) and (packed_long.segments > 0).sum() == 37  # the last: pending
    assert packed_short.tokens.shape == (1, 32) and packed_short.row.tolist()[:2] == [0, 0]
    assert sorted(np.bincount(packed_short.segments.ravel())[1:].tolist()) == [n - 1 for n in lengths]
    assert sorted(packed_short.start.tolist()[:2]) == [0, lengths[1] - 1]  # first-fit decreasing: longest first


def test_only_trajectories_with_tokens_are_verified_and_one_token_can_be_cut(engine):
    sched = _submit(engine, _requests(5, seed=13, max_new=30))
    sched.step()  # admitted rows hold the tokens of one dispatch; the rest are still queued
    paused = sched.pause_all()
    assert [t.num_tokens > 0 for t in paused] == [True, True, True, False, False]
    for t in paused:  # one token each (the prefix a dispatch of one step would leave), as a fresh draw
        del t.tokens[1:], t.logps[1:], t.versions[1:]
    seen = []

    def cut_all(new, beh, ver, lengths):
        seen.append(sorted(int(n) for n in lengths if n))
        return np.zeros_like(lengths)
    sched.resume(paused[::-1], keep=cut_all)  # the three slots take the two not started, then a one-token one
    sched._admit()
    assert sched.verified == [(0, 1)] and seen == [[1]]  # nothing to verify in a trajectory without tokens
    assert [t.draws for t in paused] == [0, 0, 1, 0, 0]  # the one-token prefix was cut: a new draw
    sched.pause_all()


def test_each_resume_batch_is_verified_by_its_own_keep_function(engine):
    sched = _submit(engine, _requests(3, seed=14, max_new=30))
    sched.run(max_dispatches=2)
    paused = sorted((t for t in sched.pause_all() if t.num_tokens), key=lambda t: t.uid)
    assert len(paused) >= 2
    lengths = {t.uid: t.num_tokens for t in paused}
    sched.resume(paused[:1], keep=lambda new, beh, ver, n: n)  # keep everything
    sched.resume(paused[1:], keep=lambda new, beh, ver, n: np.zeros_like(n))  # cut everything
    sched._admit()
    sched.pause_all()
    assert sorted(sched.verified) == sorted([(lengths[paused[0].uid], lengths[paused[0].uid])]
                                            + [(0, lengths[t.uid]) for t in paused[1:]])


def test_a_finished_trajectory_resumed_unverified_is_finished_at_once(engine):
    """A finished member queued for re-verification and paused before its turn, resumed without verification, is
    handed back as finished without a slot (admitted again, it would decode past its end)."""
    done = Trajectory(uid=0, group_id=0, prompt=np.arange(4, 9, dtype=np.int32), seed=1, max_new_tokens=8,
                      tokens=[5, 3], logps=[-1.0, -2.0], versions=[0, 0], finished=True)
    paused = Trajectory(uid=1, group_id=0, prompt=np.arange(4, 9, dtype=np.int32), seed=2, max_new_tokens=8,
                        tokens=[6], logps=[-1.0], versions=[0])
    sched = Scheduler(engine)
    sched.resume([done, paused])
    assert sched.take_finished() == [done] and [p.traj for p in sched.queue] == [paused]
    assert done.tokens == [5, 3]
    sched.queue.clear()


def test_regeneration_counts_compare_each_position_with_the_token_it_replaces(engine):
    """After a cut at ``keep``, the k-th regenerated token is compared with the k-th removed one, for as many
    positions as both have; a trajectory that ends early leaves no state behind."""
    keep = 2
    original = _finish_all(_submit(engine, _requests(12, seed=15, max_new=16)))
    removed = {uid: list(t.tokens[keep:]) for uid, t in original.items()}
    sched = Scheduler(engine)
    sched.resume(list(original.values()), keep=lambda new, beh, ver, n: np.minimum(n, keep))
    again = _finish_all(sched)
    pairs = [(x, y) for uid, t in again.items() for x, y in zip(removed[uid], t.tokens[keep:], strict=False)]
    assert any(len(removed[uid]) > again[uid].num_tokens - keep for uid in again)  # some ended earlier
    assert sched.stats.regen_tokens == len(pairs) > 0
    assert sched.stats.regen_equal == sum(x == y for x, y in pairs) >= 2  # >= 2: a count, not a last value
    assert not sched._cut_suffix  # nothing per trajectory outlives it (a long run would accumulate it)


# -- property: random pause / verify / resume schedules on a pool that forces preemption -------------------------------

SCHEDULES = st.lists(st.one_of(
    st.tuples(st.just("run"), st.integers(1, 3)),
    st.tuples(st.just("resume"), st.none()),  # pause everything, resume unverified
    st.tuples(st.just("verify"), st.floats(0.0, 1.0)),  # new version; paused and finished ones verified, cut to frac
), min_size=1, max_size=8)


@pytest.fixture(scope="module", params=[False, True], ids=["in_turn", "dispatch_ahead"])
def tight_engine(model, request):
    cfg = dataclasses.replace(CFG, kv_memory_bytes=12 * PAGE_BYTES,  # 11 usable pages: slots grow and get preempted
                              dispatch_ahead=request.param)
    return Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))


@pytest.fixture(scope="module")
def reference_samples(engine):
    return _finish_all(_submit(engine, _requests(6, seed=16, max_new=24)))


def _every_trajectory(sched):
    return [*sched.slots.values(), *(p.traj for p in sched.queue), *sched.finished]


def _check_bookkeeping(sched):
    alloc = sched.engine.allocator
    held = [p for pages in alloc.owned.values() for p in pages]
    assert len(held) == len(set(held)) and alloc.num_free + len(held) == alloc.capacity
    assert set(alloc.owned) == set(sched.slots)
    uids = [t.uid for t in _every_trajectory(sched)]
    assert len(uids) == len(set(uids))
    for t in _every_trajectory(sched):
        assert len(t.tokens) == len(t.logps) == len(t.versions) <= t.max_new_tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=SCHEDULES)
# Found by a random draw: a finished member queued for re-verification, paused before its turn and resumed
# unverified, was admitted again and decoded past its EOS.
@example(schedule=[("run", 1), ("verify", 0.0), ("run", 1), ("verify", 0.0), ("run", 2), ("verify", 0.0),
                   ("resume", None)])
def test_random_schedules_keep_verified_prefixes_and_uncut_samples(tight_engine, reference_samples, schedule):
    """Whatever the order of decode dispatches, preemptions, pauses, unverified resumes and verified cuts: pages
    are never leaked or shared, each trajectory lives in exactly one place, the prefix a verification kept is never
    altered afterwards, and a trajectory that was never cut ends with exactly the sample of an undisturbed run."""
    sched = _submit(tight_engine, _requests(6, seed=16, max_new=24))
    committed: dict[int, tuple[list, list, list, int]] = {}  # uid -> the newest cut's prefix and version
    pending: dict[int, tuple[int, tuple]] = {}  # uid -> (draws before, the cut its verification will make)
    try:
        for op, arg in schedule:
            if op == "run":
                sched.run(max_dispatches=arg)
            elif op == "resume":
                sched.resume(sched.pause_all())
                pending.clear()  # a verification not yet admitted is dropped with the pause; the caller decides anew
            else:
                tight_engine.set_version(tight_engine.version + 1)
                paused = sched.pause_all() + sched.take_finished()
                pending.clear()
                for t in paused:
                    k = int(arg * t.num_tokens)
                    if k < t.num_tokens:
                        pending[t.uid] = (t.draws, (t.tokens[:k], t.logps[:k], t.versions[:k], tight_engine.version))
                sched.resume(paused, keep=lambda new, beh, ver, n, frac=arg: (frac * n).astype(np.int64))
            for t in _every_trajectory(sched):  # a verification is done once its trajectory was admitted
                if t.uid in pending and t.draws > pending[t.uid][0]:
                    committed[t.uid] = pending.pop(t.uid)[1]
            _check_bookkeeping(sched)
        done = _finish_all(sched)
        committed |= {uid: cut for uid, (draws, cut) in pending.items() if done[uid].draws > draws}
    finally:
        tight_engine.set_version(0)
        sched.pause_all()
    assert sorted(done) == sorted(reference_samples)
    for uid, t in done.items():
        assert t.finished and (t.num_tokens == t.max_new_tokens or t.tokens[-1] == 3) and 3 not in t.tokens[:-1]
        if uid in committed:
            tokens, logps, versions, cut_version = committed[uid]
            assert (t.tokens[: len(tokens)], t.logps[: len(tokens)], t.versions[: len(tokens)]) == (
                tokens, logps, versions)
            assert t.draws > 0 and min(t.versions[len(tokens):]) >= cut_version  # the whole suffix was redrawn
        else:
            assert t.draws == 0 and t.tokens == reference_samples[uid].tokens
            np.testing.assert_allclose(t.logps, reference_samples[uid].logps, atol=1e-4)


def test_running_slots_are_packed_and_decode_runs_over_the_live_slots_only(model):
    """16 slots, 16 requests of which 5 run long: once the short ones finish, the long ones move below slot 8 and
    decode runs over 8 slots; every sample (tokens and behaviour log-probs) equals the all-slots run."""
    cfg = dataclasses.replace(CFG, num_slots=16, max_seq_len=48)
    rng = np.random.default_rng(3)
    lengths = [30 if i % 3 == 1 else 3 for i in range(16)]  # slots 1, 4, 7, 10, 13 run long
    reqs = [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=5).astype(np.int32), seed=70 + i,
                       max_new_tokens=n) for i, n in enumerate(lengths)]
    results, dispatch_slots = {}, []
    for live in (False, True):
        engine = Engine(model, dataclasses.replace(cfg, live_slots=live), SamplingConfig(temperature=1.0))
        real = engine.live_slots
        engine.live_slots = lambda real=real, live=live: (dispatch_slots.append(real()) if live else None, real())[1]
        results[live] = _finish_all(_submit(engine, [dataclasses.replace(t, tokens=[], logps=[], versions=[])
                                                     for t in reqs]))
    assert engine.live_slot_buckets() == [8, 16]
    assert dispatch_slots[0] == 16 and dispatch_slots[-1] == 8  # packed below 8 once the short ones finished
    for uid, t in results[False].items():
        assert results[True][uid].tokens == t.tokens
        np.testing.assert_allclose(results[True][uid].logps, t.logps, atol=1e-6)


def test_a_groups_prompt_is_prefilled_once_and_its_members_sample_as_if_alone(engine, model):
    """G members of one group admitted together: one prefill of their prompt, K/V copied to every member's
    pages, and each member's tokens and log mu equal those it samples when admitted on its own."""
    prompt = np.arange(4, 23, dtype=np.int32)  # 19 tokens: two full pages of 8 and a partial one

    def group():
        return [Trajectory(uid=u, group_id=7, prompt=prompt, seed=100 + u, max_new_tokens=12) for u in range(3)]
    sched = _submit(engine, group())
    sched.run()
    together = {t.uid: t for t in sched.take_finished()}
    assert sched.stats.shared_prompt_tokens == 2 * (len(prompt) - 1)  # the last token is each slot's pending one
    assert sched.stats.prefill_tokens == len(prompt) - 1
    for t in group():
        alone = _submit(engine, [t])
        alone.run()
        (a,) = alone.take_finished()
        assert a.tokens == together[t.uid].tokens
        np.testing.assert_allclose(a.logps, together[t.uid].logps, atol=1e-5)
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize("case", ["eos", "preempting", "packing"])
def test_dispatching_ahead_gives_the_same_rollouts_token_for_token(model, case):
    """EngineConfig.dispatch_ahead: decode n + 1 is dispatched before n is read (a finished slot is refilled a
    dispatch later), yet every trajectory's tokens, log mu and versions equal the in-turn run's: more requests
    than slots with EOS on; a pool so small that slots are preempted; 16 slots packed below 8 as they finish."""
    if case == "packing":
        cfg = dataclasses.replace(CFG, num_slots=16, max_seq_len=48)
        rng = np.random.default_rng(3)
        reqs = [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=5).astype(np.int32), seed=70 + i,
                           max_new_tokens=30 if i % 3 == 1 else 3) for i in range(16)]
    else:
        cfg = CFG if case == "eos" else dataclasses.replace(CFG, kv_memory_bytes=12 * PAGE_BYTES)
        reqs = _requests(10, seed=4, max_new=25) if case == "eos" else _requests(6, seed=5, max_new=40)
    runs, ahead_calls = {}, []
    for ahead in (False, True):
        engine = Engine(model, dataclasses.replace(cfg, dispatch_ahead=ahead), SamplingConfig(temperature=1.0),
                        eos_ids=(3,))
        sched = _submit(engine, [dataclasses.replace(t, tokens=[], logps=[], versions=[]) for t in reqs])
        real = engine.dispatch_generate
        engine.dispatch_generate = lambda real=real, sched=sched: (ahead_calls.append(sched._inflight is not None),
                                                                  real())[1]
        runs[ahead] = _finish_all(sched)
        assert sched._inflight is None and sched.idle
        if case == "preempting":
            assert sched.stats.preemptions > 0
    assert sum(ahead_calls) > len(ahead_calls) // 4  # the dispatch-ahead run did dispatch before reading
    assert sorted(runs[True]) == sorted(runs[False]) == sorted(t.uid for t in reqs)
    for uid, t in runs[False].items():
        assert runs[True][uid].tokens == t.tokens, uid
        assert runs[True][uid].versions == t.versions
        np.testing.assert_allclose(runs[True][uid].logps, t.logps, atol=1e-5)


def test_pause_with_a_dispatch_in_flight_drops_its_tokens(model):
    """A pause while decode n + 1 is in flight returns the trajectories as the host last read them (n), and
    resuming them ends in the same samples as never pausing. The pause waits for the dropped dispatch, so its
    device time is the rollout's decode time (not the next train step's), and counts its steps as dropped: every
    dispatch issued is either read or dropped."""
    cfg = dataclasses.replace(CFG, dispatch_ahead=True)
    engine = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(3,))
    reference = _finish_all(_submit(engine, _requests(5)))
    sched = _submit(engine, _requests(5))
    sched.run(max_dispatches=3)
    assert sched._inflight is not None and sched.stats.decode_steps_dropped == 0
    seen = {t.uid: t.num_tokens for t in sched.slots.values()}
    pending, device_s = sched._inflight.pending, 0.2
    real_fetch = pending.fetch
    pending.fetch = lambda: (time.sleep(device_s), real_fetch())[1]  # a dispatch the device is still running
    decode_time = sched.stats.decode_time
    paused = sched.pause_all()
    assert sched._inflight is None and engine.allocator.num_free == engine.allocator.capacity
    assert sched.stats.decode_time - decode_time >= device_s
    assert sched.stats.decode_steps_dropped == CFG.steps_per_dispatch
    assert sched.stats.decode_steps + sched.stats.decode_steps_dropped == sched.issued * CFG.steps_per_dispatch
    assert {t.uid: t.num_tokens for t in paused if t.uid in seen} == seen
    sched.resume(paused)
    done = {**{t.uid: t for t in sched.take_finished()}, **_finish_all(sched)}
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens, uid
    assert sched.stats.decode_steps + sched.stats.decode_steps_dropped == sched.issued * CFG.steps_per_dispatch
