"""Rollout phases: on-policy, naive partial and RollVerify on the real engine with a random tiny model."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from shared import reference_keep

from rollverify_jax.rl.filters import FilterConfig
from rollverify_jax.rl.partial_rollout import AsyncConfig, RolloutConfig, RolloutManager
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.verify import SwitchConfig, VerifyConfig

ENGINE = EngineConfig(num_slots=8, page_size=8, max_seq_len=64, steps_per_dispatch=4)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, ENGINE, SamplingConfig(temperature=1.0), eos_ids=(3,))


def _manager(engine, **kw):
    rng = np.random.default_rng(0)
    verify = VerifyConfig(**{k: kw.pop(k) for k in ("ds", "dt", "verify_finished", "rule") if k in kw})
    asynchronous = kw.pop("asynchronous", None)
    cfg = RolloutConfig(**{"batch_groups": 2, "group_size": 2, "max_new_tokens": 40, **kw})
    return RolloutManager(cfg, Scheduler(engine, coupled=verify.rule == "coupled"),
                          lambda: {"prompt": "x", "answer": "1"},
                          lambda rec: rng.integers(4, 60, size=5), seed=1, switch=SwitchConfig(), verify=verify,
                          asynchronous=asynchronous)


def test_on_policy_phase_waits_for_exactly_b_groups(engine):
    mgr = _manager(engine)
    phase = mgr.run_phase()
    assert len(phase.groups) == 2 and all(g.complete for g in phase.groups)
    assert len(mgr.cache) == 0 and not mgr.cache.groups
    m = phase.metrics
    assert m["mode/on_policy"] == 1 and m["verify/num_verified"] == 0 and m["verify/acceptance"] == 1.0
    assert m["time/verify"] == 0.0 and m["cache/staleness_mean"] == 0.0 and m["cache/size"] == 0
    assert not any(k.startswith("cache/staleness_hist/") for k in m)


def test_default_seed_is_zero(engine):
    mgr = RolloutManager(RolloutConfig(group_size=2), Scheduler(engine), lambda: {"prompt": "x", "answer": "1"},
                         lambda rec: np.arange(4, 9), switch=SwitchConfig(), verify=VerifyConfig())
    assert [t.seed for t in mgr._new_group()] == [0, 1]  # (seed * 1_000_003 + uid) mod (2^31 - 1)


def test_partial_phase_pauses_the_long_tail_and_resumes_it(engine):
    mgr = _manager(engine, mode="partial")
    engine.set_version(0)
    first = mgr.run_phase()
    assert len(first.groups) == 2
    paused = {t.uid: list(t.tokens) for t in mgr.cache.paused}
    assert paused, "slots beyond the batch should leave unfinished trajectories behind"
    assert engine.allocator.num_free == engine.allocator.capacity
    seen = []
    cache_staleness = []
    for version in (1, 2, 3):  # groups completed beyond B in one phase serve the next one without decoding
        engine.set_version(version)
        phase = mgr.run_phase()
        seen += [t for g in phase.groups for t in g.finished.values()]
        assert phase.metrics["staleness/max"] <= version
        stale = mgr.cache.staleness(version)
        assert phase.metrics["cache/staleness_mean"] == pytest.approx(stale.mean() if stale.size else 0.0)
        cache_staleness.append(phase.metrics["cache/staleness_mean"])
    assert max(cache_staleness) > 0
    seen += mgr.cache.paused
    resumed = [t for t in seen if paused.get(t.uid)]
    assert resumed
    for t in resumed:  # naive partial keeps every cached token and its version
        assert t.tokens[: len(paused[t.uid])] == paused[t.uid]
        assert t.versions[: len(paused[t.uid])] == [0] * len(paused[t.uid])
    assert any(len(set(t.versions)) > 1 for t in resumed)
    engine.set_version(0)


def test_rollverify_verifies_cached_tokens_and_reports_acceptance(engine):
    mgr = _manager(engine, mode="rollverify", ds=1e9, dt=1e9)  # thresholds never reached: keep all
    mgr.run_phase()
    phase = _phase_that_verifies(mgr)
    assert phase.metrics["verify/tokens_total"] > 0
    assert phase.metrics["verify/acceptance"] == 1.0


def test_coupled_rule_keeps_every_token_under_unchanged_weights_and_logs_as_the_two_stage_rule(engine):
    """VerifyConfig.rule = 'coupled': the weights did not change, so the new policy samples every cached token
    with its own noise: nothing is cut (acceptance 1), whatever the version numbers say; the same metrics are
    logged. A scheduler that does not compute the check is refused."""
    mgr = _manager(engine, mode="rollverify", rule="coupled")
    mgr.run_phase()
    phase = _phase_that_verifies(mgr)
    m = phase.metrics
    assert m["verify/tokens_total"] > 0 and m["verify/acceptance"] == 1.0 and m["verify/num_cut"] == 0
    assert m["verify/token_stage_cuts"] == 0 and any(k.startswith("verify/segments_checked/") for k in m)
    # the same weights: every checked token agrees and the policy did not move (log pi = log mu up to kernels)
    assert m["verify/token_agreement"] == 1.0 and m["verify/tv_estimate"] < 1e-3
    assert m["verify/near_ties_kept"] == 0  # no tolerance: the exact rule keeps no near-tie
    assert any(k.startswith("verify/token_agreement_age") for k in m)
    assert any(k.startswith("verify/tv_estimate_age") for k in m)
    mgr.scheduler.pause_all()
    with pytest.raises(ValueError, match="coupled=True"):
        RolloutManager(RolloutConfig(), Scheduler(engine), dict, lambda rec: np.arange(4, 9), switch=SwitchConfig(),
                       verify=VerifyConfig(rule="coupled"))


def _phase_that_verifies(mgr):
    """Groups completed beyond B serve the next phase without decoding; run until a phase resumes."""
    for _ in range(4):
        mgr.scheduler.engine.set_version(mgr.scheduler.engine.version + 1)
        phase = mgr.run_phase()
        if phase.metrics["verify/num_verified"]:
            mgr.scheduler.engine.set_version(0)
            return phase
    raise AssertionError("no phase resumed a cached trajectory")


def test_rollverify_cuts_everything_with_zero_thresholds_after_a_version_change(engine):
    """ds = 0 cuts at the first segment: every cached trajectory restarts from its prompt."""
    mgr = _manager(engine, mode="rollverify", ds=0.0)
    mgr.run_phase()
    phase = _phase_that_verifies(mgr)
    m = phase.metrics
    assert m["verify/tokens_total"] > 0 and m["verify/acceptance"] == 0.0
    # the policy shift is logged for the two-stage rule too (unchanged weights: ~0); the agreement is the coupled
    # rule's alone
    assert 0.0 <= m["verify/tv_estimate"] < 1e-3 and "verify/token_agreement" not in m
    # Cut tokens were sampled again: the diagnostic is a rate over them.
    stats = mgr.scheduler.stats  # the phase's counters
    assert m["verify/regen_tokens"] == stats.regen_tokens > 1
    assert m["verify/regen_equal_rate"] == pytest.approx(stats.regen_equal / stats.regen_tokens)
    assert mgr.end_cycle(1, m)["verify/acceptance_window"] == 0.0
    assert mgr.switch_state.count == 1
    mgr.scheduler.pause_all()


def test_state_dict_round_trip(engine):
    mgr = _manager(engine, mode="partial")
    mgr.run_phase()
    mgr.switch_state = mgr.switch_cfg.update(mgr.switch_state, 0.75, 1)
    other = _manager(engine, mode="partial")
    other.load_state_dict(mgr.state_dict())
    assert other.next_uid == mgr.next_uid and other.next_group_id == mgr.next_group_id
    assert [t.tokens for t in other.cache.paused] == [t.tokens for t in mgr.cache.paused]
    assert other.switch_state == mgr.switch_state and not other.on_policy
    on_policy = _manager(engine, mode="on_policy")  # a changed-settings resume to on-policy really is on-policy
    on_policy.load_state_dict(mgr.state_dict())
    assert on_policy.on_policy
    mgr.scheduler.pause_all()


def test_switch_to_on_policy_drops_cache(engine):
    mgr = _manager(engine, mode="rollverify")
    mgr.run_phase()
    mgr.switch_to_on_policy()
    assert mgr.on_policy and len(mgr.cache) == 0 and not mgr.verifying
    assert mgr.run_phase().metrics["mode/on_policy"] == 1


def test_new_groups_get_their_own_ids_uids_and_distinct_seeds(engine):
    mgr = _manager(engine, mode="partial", group_size=3, max_new_tokens=7)
    first, second = mgr._new_group(), mgr._new_group()
    assert [t.uid for t in first + second] == list(range(6)) and mgr.next_uid == 6 and mgr.next_group_id == 2
    assert {t.group_id for t in first} == {0} and {t.group_id for t in second} == {1}
    assert sorted(mgr.cache.groups) == [0, 1] and mgr.cache.groups[1].size == 3 and not mgr.cache.groups[1].finished
    assert all(t.max_new_tokens == 7 and t.num_tokens == 0 and not t.finished for t in first + second)
    assert len({t.seed for t in first + second}) == 6  # group members must not draw the same samples
    np.testing.assert_array_equal(first[0].prompt, first[2].prompt)  # one prompt per group
    assert first[0].prompt.dtype == np.int32  # the encoder here returns int64 tokens
    records = iter([{"prompt": "ab"}, {"prompt": "xyz"}])
    by_record = RolloutManager(mgr.config, mgr.scheduler, lambda: next(records),
                               lambda rec: np.asarray([ord(c) for c in rec["prompt"]]), seed=1,
                               switch=mgr.switch_cfg, verify=mgr.verify_cfg)
    assert by_record._new_group()[0].prompt.tolist() == [97, 98]
    assert by_record._new_group()[0].prompt.tolist() == [120, 121, 122]
    assert by_record.cache.groups[1].record == {"prompt": "xyz"}
    other = RolloutManager(mgr.config, mgr.scheduler, mgr.next_record, mgr.encode_prompt, seed=2,
                           switch=mgr.switch_cfg, verify=mgr.verify_cfg)
    assert {t.seed for t in other._new_group()}.isdisjoint({t.seed for t in first})
    assert all(0 <= t.seed < 2**31 - 1 for t in first + second)


def test_switch_drops_and_counts_every_cached_trajectory_and_survives_a_checkpoint(engine):
    mgr = _manager(engine, mode="rollverify")
    mgr.run_phase()
    cached = len(mgr.cache.paused) + sum(len(g.finished) for g in mgr.cache.groups.values())
    assert cached
    assert mgr.switch_to_on_policy() == cached and not mgr.cache.groups
    other = _manager(engine, mode="rollverify")
    assert not other.on_policy and other.verifying
    other.load_state_dict(mgr.state_dict())
    assert other.on_policy and not other.verifying


@pytest.mark.parametrize("cls, kw", [(VerifyConfig, dict(ds=0.0)), (FilterConfig, dict(name="staleness", s_max=0)),
                                     (FilterConfig, dict(name="ops", ops_threshold=1e-9)),
                                     (RolloutConfig, dict(max_new_tokens=1))])
def test_good_config_boundaries(cls, kw):
    cls(**kw)


@pytest.mark.parametrize("cls, kw, match", [
    (RolloutConfig, dict(mode="fully_async"), r"Unknown rollout mode 'fully_async'.*on_policy.*async"),
    (RolloutConfig, dict(batch_groups=0), "batch_groups=0 must be >= 1"),
    (RolloutConfig, dict(group_size=0), "group_size=0 must be >= 1"),
    (RolloutConfig, dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (FilterConfig, dict(name="staleness", s_max=-1), "s_max >= 0"),
    (FilterConfig, dict(name="ops", ops_threshold=0.0), "threshold > 0"),
    (FilterConfig, dict(name="magic"), "Unknown filter"),
    (VerifyConfig, dict(ds=-0.1), "ds .*must be >= 0, got -0.1"),
    (VerifyConfig, dict(dt=0.0), "dt .*must be > 0, got 0.0"),
])
def test_bad_config(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def _cached(mgr):
    """uid -> trajectory of everything cached (paused, and finished members of incomplete groups)."""
    waiting = [t for g in mgr.cache.groups.values() if not g.complete for t in g.finished.values()]
    return {t.uid: t for t in mgr.cache.paused + waiting}


def _everywhere(mgr, groups):
    trajs = mgr.cache.paused + [t for g in [*groups, *mgr.cache.groups.values()] for t in g.finished.values()]
    return {t.uid: t for t in trajs}


@pytest.mark.parametrize("verify_finished", [True, False])
def test_resume_takes_paused_and_every_cached_finished_member_when_verifying(engine, verify_finished):
    mgr = _manager(engine, mode="rollverify", ds=1e9, dt=1e9, verify_finished=verify_finished, batch_groups=1)
    for _ in range(8):  # until the cache holds finished members of an incomplete group
        mgr.run_phase()
        waiting = [t for g in mgr.cache.groups.values() for t in g.finished.values()]
        if any(not g.complete and g.finished for g in mgr.cache.groups.values()):
            break
    assert waiting and mgr.cache.paused
    expected = {t.uid for t in mgr.cache.paused} | ({t.uid for t in waiting} if verify_finished else set())
    resumed = []
    real_resume = mgr.scheduler.resume
    mgr.scheduler.resume = lambda trajs, keep=None: (resumed.extend(trajs), real_resume(trajs, keep=keep))
    try:
        mgr.run_phase()
    finally:
        mgr.scheduler.resume = real_resume
        mgr.scheduler.pause_all()
    assert {t.uid for t in resumed} == expected


def _carried_phase(engine, verify_finished: bool, switch: SwitchConfig | None = None):
    """A phase at version 1 after phases that completed more than B groups at version 0, with ds = 0 (every
    verified token is cut). Returns (the manager, carried group ids, the phase)."""
    mgr = _manager(engine, mode="rollverify", ds=1e9, dt=1e9, batch_groups=1, group_size=1,
                   verify_finished=verify_finished)
    if switch is not None:
        mgr.switch_cfg, mgr.switch_state = switch, switch.init()
    for _ in range(6):
        mgr.run_phase()
        carried = [g.group_id for g in mgr.cache.groups.values() if g.complete]
        if carried:
            break
    assert carried, "a phase should complete more than B groups with 8 slots and G = 1"
    mgr.cache.paused = []  # the carried members head the resume queue (paused ones would go first)
    mgr.verify_cfg = dataclasses.replace(mgr.verify_cfg, ds=0.0)
    engine.set_version(1)
    try:
        phase = mgr.run_phase()
    finally:
        engine.set_version(0)
        mgr.scheduler.pause_all()
    return mgr, carried, phase


def test_carried_groups_train_as_they_are_by_default(engine):
    """The paper verifies paused trajectories only: a carried group's version-0 tokens train unverified, and
    the acceptance counts paused trajectories alone (all cut at ds = 0), not the finished members."""
    _, carried, phase = _carried_phase(engine, verify_finished=False)
    assert phase.groups[0].group_id == carried[0]
    assert {v for t in phase.groups[0].finished.values() for v in t.versions} == {0}
    assert phase.metrics["verify/finished_verified"] == 0


def test_verification_statistics_of_a_phase(engine):
    """ds = 0 at version 1 cuts every paused trajectory at its first (age 1) segment: all restart from zero."""
    mgr = _manager(engine, mode="rollverify", ds=0.0, dt=1e9, batch_groups=1, group_size=2)
    for _ in range(6):  # until a phase ends with paused tokens and no complete group carried (it would be the batch)
        mgr.run_phase()
        paused = {t.uid: t.num_tokens for t in mgr.cache.paused if t.num_tokens}
        if paused and not mgr.cache.num_complete():
            break
    assert paused and not mgr.cache.num_complete()
    engine.set_version(1)
    try:
        m = mgr.run_phase().metrics
    finally:
        engine.set_version(0)
        mgr.scheduler.pause_all()
    assert m["verify/num_verified"] == m["verify/num_cut"] == m["verify/num_restarted"] == len(paused)
    assert m["verify/acceptance"] == 0.0
    assert m["verify/tokens_removed"] == m["verify/tokens_total"] == sum(paused.values())
    assert m["verify/segments_checked/1"] == m["verify/segments_failed/1"] == len(paused)
    assert m["verify/keep_fraction/1"] == 0.0 and m["verify/token_stage_cuts"] == 0


def test_complete_groups_carried_beyond_b_are_verified_before_they_train(engine):
    """With verify_finished, a group completed beyond B is verified against the version it trains under.
    ds = 0 cuts every verified token, so every token trained in the next phase must have been sampled by the
    current version (unverified, a carried group would train its version-0 tokens)."""
    _, _, phase = _carried_phase(engine, verify_finished=True)
    assert phase.groups
    assert all(t.versions and set(t.versions) == {1} for g in phase.groups for t in g.finished.values())
    assert phase.metrics["verify/finished_verified"] > 0
    assert phase.metrics["verify/finished_cut"] == phase.metrics["verify/finished_verified"]


def test_with_verify_finished_the_acceptance_still_counts_paused_trajectories_only(engine):
    """The acceptance rate (and the switch to on-policy that reads it) counts paused trajectories only, also with
    verify_finished on: finished members cut at ds = 0 are counted apart, and a cycle that verified no paused one
    pushes nothing into the switching window (counted in, they would read as a 0 acceptance and switch)."""
    mgr, _, phase = _carried_phase(engine, verify_finished=True, switch=SwitchConfig(window=1, threshold=0.5))
    m = phase.metrics
    assert m["verify/finished_verified"] > 0 and m["verify/finished_cut"] == m["verify/finished_verified"]
    assert m["verify/num_verified"] == m["verify/num_cut"] == m["verify/tokens_total"] == 0
    assert m["verify/acceptance"] == 1.0
    mgr.end_cycle(1, m)
    assert not mgr.on_policy and int(mgr.switch_state.count) == 0


def test_extra_complete_groups_train_in_the_step_that_completed_them(engine):
    """'train': a phase's batch is every group complete at its end (B or more), oldest first; none is carried."""
    mgr = _manager(engine, mode="partial", batch_groups=1, group_size=1, extra_complete_groups="train")
    sizes = []
    for _ in range(6):
        phase = mgr.run_phase()
        sizes.append(len(phase.groups))
        assert not any(g.complete for g in mgr.cache.groups.values())
        ids = [g.group_id for g in phase.groups]
        assert ids == sorted(ids)
    mgr.scheduler.pause_all()
    assert min(sizes) >= 1 and max(sizes) > 1


def test_over_complete_groups_serve_the_next_batch_oldest_first(engine):
    """Groups completed beyond B stay in the cache and are the next phase's batch, before any newer group."""
    mgr = _manager(engine, mode="partial", batch_groups=1, group_size=1)
    for _ in range(6):
        phase = mgr.run_phase()
        assert len(phase.groups) == 1
        extra = sorted(g.group_id for g in mgr.cache.groups.values() if g.complete)
        if extra:
            break
    assert extra, "a phase should complete more than B groups with 8 slots and G = 1"
    for gid in extra:
        assert [g.group_id for g in mgr.run_phase().groups] == [gid]
    mgr.scheduler.pause_all()


def _perturbed(model, scale, seed):
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
             else x for x, k in zip(leaves, keys, strict=True)]
    state = jax.tree.unflatten(tree, noisy)
    return state, nnx.merge(graphdef, state)


_LOG_SOFTMAX = nnx.jit(lambda m, ids: jax.nn.log_softmax(m(ids), axis=-1))


def _teacher_forced(model, prompt, tokens):
    """log pi of each response token under ``model``. Right padding to a multiple of 64 keeps compiles few and
    changes nothing before it (causal attention)."""
    seq = np.concatenate([prompt, np.asarray(tokens, np.int32)])
    padded = np.zeros((1, -(-len(seq) // 64) * 64), np.int32)
    padded[0, : len(seq)] = seq
    logp = np.asarray(_LOG_SOFTMAX(model, padded)[0])
    p = len(prompt)
    return np.asarray([logp[p + j - 1, y] for j, y in enumerate(tokens)], np.float32)


DS, DT = 0.06, 0.12  # near this perturbation's typical segment mean and token OPS, so cuts land anywhere


def test_rollverify_with_new_weights_cuts_some_tokens_and_regenerates_from_the_verified_prefix(model, engine):
    """Mixed versions under the same weights, then new weights at a new version: verification sees every token's
    own version and log mu, its keep lengths equal a reference verifier on a full recompute under the new
    weights, kept prefixes keep their log mu and versions, and the continuation is sampled by the new policy."""
    _, original = nnx.split(model)
    mgr = _manager(engine, mode="rollverify", ds=1e9, dt=1e9, batch_groups=1, group_size=4)
    for version in range(8):  # same weights, keep everything, until cached trajectories mix versions
        engine.set_version(version)
        mgr.run_phase()
        before = {uid: (list(t.tokens), list(t.logps), list(t.versions)) for uid, t in _cached(mgr).items()
                  if t.num_tokens}
        if any(len(set(v)) > 1 for _, _, v in before.values()) and not mgr.cache.num_complete():
            break  # (a carried complete group would be the next batch at once, before any resume is verified)
    assert any(len(set(v)) > 1 for _, _, v in before.values())
    mgr.verify_cfg = dataclasses.replace(mgr.verify_cfg, ds=DS, dt=DT)
    new_state, new_model = _perturbed(model, 0.003, seed=7)
    new_version = version + 1
    engine.update_params(new_state, version=new_version)
    calls = []
    real_keep = mgr._keep_fn

    def spy(new_logp, behavior_logp, versions, lengths):
        keep = real_keep(new_logp, behavior_logp, versions, lengths)
        calls.append((np.array(new_logp), np.array(behavior_logp), np.array(versions), np.array(lengths), keep))
        return keep

    mgr._keep_fn = spy
    try:
        phase = mgr.run_phase()
    finally:
        engine.update_params(original, version=0)
        mgr.scheduler.pause_all()
    after = _everywhere(mgr, phase.groups)
    keeps = {}
    for new_logp, behavior, versions, lengths, keep in calls:
        for row in np.flatnonzero(lengths):
            n = int(lengths[row])
            uid = next(u for u, (_, lp, _) in before.items() if len(lp) == n and lp == behavior[row, :n].tolist())
            tokens, logps, vers = before[uid]
            assert versions[row, :n].tolist() == vers
            t = after[uid]
            want_new = _teacher_forced(new_model, t.prompt, tokens)
            np.testing.assert_allclose(new_logp[row, :n], want_new, atol=1e-4)
            ops = np.abs(np.expm1(np.clip(want_new - np.asarray(logps), -20, 20)))
            keeps[uid] = int(keep[row])
            assert keeps[uid] == reference_keep(ops, vers, n, DS, DT)[0], uid
    assert keeps and any(0 < k < len(before[u][0]) for u, k in keeps.items()), keeps
    assert any(k == len(before[u][0]) for u, k in keeps.items()) or any(k == 0 for k in keeps.values())
    assert phase.metrics["verify/acceptance"] == pytest.approx(
        sum(keeps.values()) / sum(len(before[u][0]) for u in keeps))
    for uid, k in keeps.items():
        tokens, logps, vers = before[uid]
        t = after[uid]
        assert t.tokens[:k] == tokens[:k] and t.logps[:k] == logps[:k] and t.versions[:k] == vers[:k]
        assert set(t.versions[k:]) <= {new_version}
        if k < len(tokens) and t.num_tokens > k:  # regenerated under the new weights: log mu is the new policy's
            np.testing.assert_allclose(t.logps[k:], _teacher_forced(new_model, t.prompt, t.tokens)[k:], atol=1e-4)


PHASE_KEYS = {"time/rollout", "time/verify", "rollout/tokens_per_s", "rollout/tokens", "rollout/slot_utilization",
              "rollout/prefill_tokens", "rollout/host_time", "rollout/prefill_time", "rollout/decode_time",
              "rollout/dispatches", "rollout/decode_steps", "rollout/decode_steps_dropped", "staleness/mean",
              "staleness/max", "cache/size",
              "cache/staleness_mean", "verify/acceptance", "verify/num_verified", "verify/tokens_total",
              "verify/regen_tokens", "verify/regen_equal_rate", "mode/on_policy", "verify/num_cut",
              "verify/num_restarted", "verify/tokens_removed", "verify/finished_verified", "verify/finished_cut",
              "verify/token_stage_cuts", "rollout/shared_prompt_tokens"}
PER_AGE = ("cache/staleness_hist/", "verify/segments_checked/", "verify/segments_failed/", "verify/keep_fraction/",
           "verify/tv_estimate_age")


def test_phase_metrics_describe_the_phase(engine):
    mgr = _manager(engine, mode="rollverify", ds=1e9, dt=1e9)
    first = mgr.run_phase()
    for version in range(1, 6):
        engine.set_version(version)
        phase = mgr.run_phase()
        if phase.metrics["verify/num_verified"]:
            break
    engine.set_version(0)
    mgr.scheduler.pause_all()
    for p, version_now in ((first, 0), (phase, version)):
        m = p.metrics
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in m.items() if k.startswith("cache/staleness_hist/")}
        shift = {"verify/tv_estimate"} if m["verify/tokens_total"] else set()  # only where tokens were checked
        assert set(m) - {k for k in m if k.startswith(PER_AGE)} == PHASE_KEYS | shift
        cached = [t for t in mgr.cache.paused + [t for g in mgr.cache.groups.values() for t in g.finished.values()]]
        if p is phase:  # the cache as this phase left it
            assert m["cache/size"] == len(mgr.cache.paused)
            stale = sorted(version_now - min(t.versions) for t in cached if t.versions)
            assert sorted(s for s, c in hist.items() for _ in range(c)) == stale
            assert m["cache/staleness_mean"] == pytest.approx(np.mean(stale) if stale else 0.0)
        batch = [t for g in p.groups for t in g.finished.values()]
        assert m["staleness/max"] == max(version_now - min(t.versions) for t in batch)
        assert m["staleness/mean"] == pytest.approx(np.mean([version_now - min(t.versions) for t in batch]))
        assert m["rollout/tokens"] >= 0 and m["rollout/tokens_per_s"] == pytest.approx(
            m["rollout/tokens"] / (m["time/rollout"] + m["time/verify"]), rel=1e-6)
        assert 0 < m["rollout/slot_utilization"] <= 1 or m["rollout/tokens"] == 0
        assert m["mode/on_policy"] == 0 and m["time/verify"] >= 0
    assert first.metrics["verify/num_verified"] == 0 and first.metrics["verify/acceptance"] == 1.0
    assert first.metrics["rollout/prefill_tokens"] > 0 and first.metrics["rollout/tokens"] > 0
    m = phase.metrics
    assert m["verify/num_verified"] > 0 and m["verify/tokens_total"] > 0 and m["verify/acceptance"] == 1.0
    assert m["time/verify"] > 0
    assert m["verify/regen_tokens"] == 0 and np.isnan(m["verify/regen_equal_rate"])  # nothing was cut


@pytest.mark.parametrize("queue_groups", [0, 1])
def test_partial_phase_decodes_until_b_groups_complete_and_queues_a_bounded_number_of_groups(engine, queue_groups):
    """The phase stops decoding as soon as B groups are complete, and keeps at most `queue target` fresh groups
    queued (by default enough groups to fill every slot: ceil(slots / G))."""
    mgr = _manager(engine, mode="partial", batch_groups=1, group_size=3, queue_groups=queue_groups)
    target = queue_groups or -(-ENGINE.num_slots // 3)  # ceil(8 / 3) = 3 groups
    at_step = []  # (complete groups, requests queued that have not started) whenever the phase decodes
    real_step = mgr.scheduler.step
    mgr.scheduler.step = lambda: (at_step.append((mgr.cache.num_complete(), sum(
        p.traj.num_tokens == 0 for p in mgr.scheduler.queue))), real_step())[1]
    try:
        for _ in range(3):
            carried = sum(t.num_tokens == 0 for t in mgr.cache.paused)
            phase = mgr.run_phase()
            assert len(phase.groups) == 1 and phase.metrics["verify/num_verified"] == 0  # naive: never verified
            assert sum(t.num_tokens == 0 for t in mgr.cache.paused) <= target * 3 + carried
    finally:
        mgr.scheduler.step = real_step
        mgr.scheduler.pause_all()
    assert at_step and max(c for c, _ in at_step) < 1
    assert min(f for _, f in at_step) >= target * 3  # resumed requests with tokens do not count as queued work


def test_end_cycle_pushes_verifying_cycles_only_and_switches_for_good(engine):
    """The window takes the acceptance of cycles that verified something; once full and below the threshold,
    the run switches at this step, drops the cache (counted) and stops pushing."""
    mgr = _manager(engine, mode="rollverify")
    mgr.switch_cfg = SwitchConfig(window=2, threshold=0.5)
    mgr.switch_state = mgr.switch_cfg.init()
    nothing = {"verify/num_verified": 0, "verify/acceptance": 1.0}  # nothing verified: not a cycle
    assert mgr.end_cycle(1, nothing) == {"verify/acceptance_window": 1.0} and mgr.switch_state.count == 0
    m = mgr.end_cycle(2, {"verify/num_verified": 3, "verify/acceptance": 0.6})
    assert m == {"verify/acceptance_window": pytest.approx(0.6)} and not mgr.on_policy
    mgr.cache.pause([Trajectory(uid=0, group_id=0, prompt=np.ones(2, np.int32), seed=0, max_new_tokens=4)])
    m = mgr.end_cycle(3, {"verify/num_verified": 1, "verify/acceptance": 0.2})  # window (0.6 + 0.2) / 2 < 0.5
    assert m == {"mode/dropped_at_switch": 1, "mode/switch_step": 3, "verify/acceptance_window": pytest.approx(0.4)}
    assert mgr.on_policy and not mgr.verifying and len(mgr.cache) == 0
    m = mgr.end_cycle(4, {"verify/num_verified": 2, "verify/acceptance": 0.0})
    assert m == {"verify/acceptance_window": pytest.approx(0.4)}  # nothing after the switch
    partial = _manager(engine, mode="partial")
    m = partial.end_cycle(1, {"verify/num_verified": 5, "verify/acceptance": 0.0})
    assert m == {"verify/acceptance_window": 1.0} and not partial.on_policy


def test_trajectory_seeds_stay_in_int31_for_any_run_seed(engine):
    mgr = RolloutManager(RolloutConfig(group_size=3), Scheduler(engine), lambda: {"prompt": "x"},
                         lambda rec: np.ones(2, np.int32), seed=10**6, switch=SwitchConfig(), verify=VerifyConfig())
    seeds = [t.seed for t in mgr._new_group()]
    assert seeds == [(10**6 * 1_000_003 + uid) % (2**31 - 1) for uid in range(3)]


@pytest.mark.parametrize("at_swap, max_staleness", [("verify", 0), ("reprefill", 1), ("keep_stale_kv", 1)])
def test_async_cycles_hold_the_staleness_cap_and_treat_the_running_trajectories_as_at_swap_says(
        engine, at_swap, max_staleness):
    """The asynchronous mode's cycle as the trainer drives it (phase, overlap while the learner computes, swap to
    the new version): admission stops at exactly (max_staleness + 1) x B groups admitted and not trained (the 8
    slots would take more); at the swap 'verify' and 'reprefill' pause the running trajectories, to be re-prefilled
    under the new version at the next phase (verified with 'verify' only), and 'keep_stale_kv' leaves them
    decoding."""
    cap = (max_staleness + 1) * 1
    mgr = _manager(engine, mode="async", batch_groups=1, group_size=2,
                   asynchronous=AsyncConfig(max_staleness=max_staleness, at_swap=at_swap, overlap_dispatches=2))
    in_flight = []
    real_step = mgr.scheduler.step
    mgr.scheduler.step = lambda: (in_flight.append(mgr.next_group_id - mgr.groups_trained), real_step())[1]
    verified = []
    try:
        for version in (1, 2, 3):
            phase = mgr.run_phase()
            assert len(phase.groups) == 1
            verified.append(phase.metrics["verify/num_verified"])
            mgr.overlap(2)
            engine.set_version(version)
            mgr.at_swap()
            running = len(mgr.scheduler.slots)
            assert (running > 0) == (at_swap == "keep_stale_kv"), running
    finally:
        mgr.scheduler.step = real_step
        engine.set_version(0)
        mgr.scheduler.pause_all()
    assert max(in_flight) == cap
    assert (sum(verified) > 0) == (at_swap == "verify")
