"""Rollout phases: on-policy, naive partial and RollVerify on the real engine with a random tiny model."""

import numpy as np
import pytest

from rollverify_jax.models import init_model, model_config
from rollverify_jax.rl.partial_rollout import RolloutConfig, RolloutManager
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler

ENGINE = EngineConfig(num_slots=8, page_size=8, max_seq_len=64, steps_per_dispatch=4)


@pytest.fixture(scope="module")
def engine():
    return Engine(init_model(model_config("tiny"), seed=0), ENGINE, SamplingConfig(temperature=1.0), eos_ids=(3,))


def _manager(engine, **kw):
    rng = np.random.default_rng(0)
    cfg = RolloutConfig(**{"batch_groups": 2, "group_size": 2, "max_new_tokens": 40, **kw})
    return RolloutManager(cfg, Scheduler(engine), lambda: {"prompt": "x", "answer": "1"},
                          lambda rec: rng.integers(4, 60, size=5), seed=1)


def test_on_policy_phase_waits_for_exactly_b_groups(engine):
    mgr = _manager(engine)
    phase = mgr.run_phase()
    assert len(phase.groups) == 2 and all(g.complete for g in phase.groups)
    assert len(mgr.cache) == 0 and not mgr.cache.groups
    assert phase.metrics["mode/on_policy"] == 1 and phase.metrics["verify/num_verified"] == 0


def test_partial_phase_pauses_the_long_tail_and_resumes_it(engine):
    mgr = _manager(engine, mode="partial")
    engine.set_version(0)
    first = mgr.run_phase()
    assert len(first.groups) == 2
    paused = {t.uid: list(t.tokens) for t in mgr.cache.paused}
    assert paused, "slots beyond the batch should leave unfinished trajectories behind"
    assert engine.allocator.num_free == engine.allocator.capacity
    seen = []
    for version in (1, 2, 3):  # groups completed beyond B in one phase serve the next one without decoding
        engine.set_version(version)
        phase = mgr.run_phase()
        seen += [t for g in phase.groups for t in g.finished.values()]
        assert phase.metrics["staleness/max"] <= version
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
    assert phase.metrics["verify/tokens_total"] > 0 and phase.metrics["verify/acceptance"] == 0.0


def test_state_dict_round_trip(engine):
    mgr = _manager(engine, mode="partial")
    mgr.run_phase()
    other = _manager(engine, mode="partial")
    other.load_state_dict(mgr.state_dict())
    assert other.next_uid == mgr.next_uid and other.next_group_id == mgr.next_group_id
    assert [t.tokens for t in other.cache.paused] == [t.tokens for t in mgr.cache.paused]
    mgr.scheduler.pause_all()


def test_switch_to_on_policy_drops_cache(engine):
    mgr = _manager(engine, mode="rollverify")
    mgr.run_phase()
    mgr.switch_to_on_policy()
    assert mgr.on_policy and len(mgr.cache) == 0 and not mgr.verifying
    assert mgr.run_phase().metrics["mode/on_policy"] == 1


@pytest.mark.parametrize("kw, match", [
    (dict(mode="async"), r"Unknown rollout mode 'async'.*on_policy"),
    (dict(filter="staleness"), "needs partial rollout"),
    (dict(mode="partial", filter="magic"), "Unknown filter"),
    (dict(mode="rollverify", ds=-0.1), "ds=-0.1"),
    (dict(mode="rollverify", dt=0.0), "dt=0.0"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kw)
