"""The asynchronous mode (``RolloutConfig.mode = 'async'``): the device split, the weight publish and its failure,
and end to end on the tiny policy (rollout and learner on disjoint CPU devices): each update published whole,
the running trajectories verified at every swap, the staleness cap held, and a run killed mid-overlap resumed to
the uninterrupted run's metrics and train state, bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from shared import final_state, train_run
from test_train import _assert_same_final_state, _assert_same_rows, _Killed

from rollverify_jax.infra.mesh import split_local_devices
from rollverify_jax.rl.partial_rollout import AsyncConfig, RolloutManager
from rollverify_jax.rollout.publish import WeightPublisher


@dataclasses.dataclass(frozen=True)
class _Device:
    id: int
    process_index: int


def test_each_host_splits_its_own_devices():
    devices = [_Device(i, i // 4) for i in reversed(range(8))]  # 2 hosts x 4 devices, in any order
    rollout, train = split_local_devices(2, devices)
    assert [d.id for d in rollout] == [0, 1, 4, 5] and [d.id for d in train] == [2, 3, 6, 7]
    rollout, train = split_local_devices(0.75, devices)
    assert [d.id for d in rollout] == [0, 1, 2, 4, 5, 6] and [d.id for d in train] == [3, 7]
    for bad in (4, 0.1):  # all of a host's devices to one side, or none
        with pytest.raises(ValueError, match="at least one device of every host"):
            split_local_devices(bad, devices)


@pytest.mark.parametrize("kwargs, match", [({"rollout_devices": 1.5}, "rollout_devices"),
                                           ({"rollout_devices": 0}, "rollout_devices"),
                                           ({"rollout_devices": True}, "rollout_devices"),
                                           ({"at_swap": "drop"}, "at_swap"),
                                           ({"max_staleness": -1}, "max_staleness")])
def test_async_config_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncConfig(**kwargs)


class _Engine:
    """What a publisher touches of an engine: the trained part of its serving params (all of them, or a LoRA run's
    adapters), version, placement and swap."""

    def __init__(self):
        self.trainable = {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}
        self.version = 0

    def place_params(self, params):
        return jax.device_put(params, jax.devices()[1])

    def swap_params(self, placed, version):
        self.trainable, self.version = placed, version


def test_a_failed_or_partial_publish_leaves_the_previous_version(capsys):
    engine = _Engine()
    engine.trainable = engine.place_params(engine.trainable)
    serving = engine.trainable
    publisher = WeightPublisher(engine)
    new = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}

    def broken(params):  # a transfer that dies half-way
        raise RuntimeError("connection reset while copying 'w'")

    placed = engine.place_params  # raised; a copy missing an array; of another dtype, shape or device
    for place in (broken, lambda p: {"w": placed(p)["w"]},
                  lambda p: {**placed(p), "w": placed(p)["w"].astype(jnp.bfloat16)},
                  lambda p: {**placed(p), "b": placed({"b": jnp.ones(5)})["b"]},
                  lambda p: jax.device_put(p, jax.devices()[0])):
        publisher.place = place
        publisher.stage(new, version=1)
        m = publisher.swap()
        assert m["publish/failed"] == 1 and m["publish/version"] == 0
        assert engine.version == 0 and engine.trainable is serving
        line = capsys.readouterr().out.strip()
        assert line.count("\n") == 0 and "publish of policy version 1 failed" in line and "stays on version 0" in line
    publisher.place = engine.place_params
    publisher.stage(new, version=2)
    m = publisher.swap()
    assert m["publish/failed"] == 0 and m["publish/version"] == 2 and m["publish/bytes"] == 20 * 4
    assert engine.version == 2 and float(engine.trainable["w"].sum()) == 16.0
    assert publisher.swap() == {}  # nothing staged: nothing to swap


ASYNC = ("AsyncConfig.rollout_devices = 4", "AsyncConfig.overlap_dispatches = 2", "AsyncConfig.max_staleness = 1",
         "RewardScorer.overlong_buffer = 20", "RewardScorer.max_response_length = 24", "EvalConfig.at_start = False",
         "TrainConfig.eval_every = 0")  # an evaluation at the last step only (the resumed launch's is compared)


# Three launches of one run (whole, killed, resumed): started first under xdist, compiled once through the
# session's compilation cache (conftest.py).
@pytest.mark.end_to_end
@pytest.mark.usefixtures("compilation_cache")
def test_an_async_run_publishes_verifies_and_resumes_exactly(policy, tmp_path, monkeypatch, capsys):
    """Three steps: each update is published whole as the next version while the rollout decodes, except step
    1's, whose copy is interrupted (the rollout samples step 2 with version 0 while the learner is at 1); the
    running trajectories are verified at the swaps; at most (S + 1) x B groups are in flight. A launch killed in
    step 3's overlap (the update in flight, its weights staged) resumes from step 2's checkpoint to the
    uninterrupted run's rows and train state, bit for bit."""
    stage = WeightPublisher.stage

    def interrupted_at_1(self, params, version):
        stage(self, params, version)
        if version == 1:
            self._staged.error = RuntimeError("interrupted")

    monkeypatch.setattr(WeightPublisher, "stage", interrupted_at_1)
    full = train_run(policy, tmp_path / "full", "async", 3, ASYNC)
    assert "publish of policy version 1 failed (RuntimeError: interrupted); rollout stays on version 0" in \
        capsys.readouterr().out
    assert [(m["publish/failed"], m["publish/version"]) for m in full] == [(1, 0), (0, 2), (0, 3)]
    assert all(m["publish/bytes"] > 0 and m["overlap/dispatches"] == 2 and m["overlap/tokens"] > 0 for m in full[1:])
    assert sum(m["verify/num_verified"] for m in full) > 0 and sum(m["verify/tokens_removed"] for m in full) > 0
    assert max(m["staleness/max"] for m in full) >= 1  # trained on tokens of an older version, verified
    _, _, extra = final_state(tmp_path / "full", policy)
    rollout = extra["rollout"]
    assert rollout["next_group_id"] - rollout["groups_trained"] <= (1 + 1) * 2 and rollout["groups_trained"] == 6
    assert extra["published_version"] == 3

    overlaps, overlap = [], RolloutManager.overlap

    def dying_overlap(self, dispatches):
        overlaps.append(1)
        if len(overlaps) == 3:
            raise _Killed
        return overlap(self, dispatches)

    monkeypatch.setattr(RolloutManager, "overlap", dying_overlap)
    with pytest.raises(_Killed):
        train_run(policy, tmp_path / "split", "async", 3, ASYNC)
    monkeypatch.setattr(RolloutManager, "overlap", overlap)
    step, _, extra = final_state(tmp_path / "split", policy)
    assert step == 2 and extra["published_version"] == 2 and extra["rollout"]["cache"]["paused"]  # paused at the swap
    resumed = train_run(policy, tmp_path / "split", "async", 3, ASYNC)
    _assert_same_rows(full, resumed)
    _assert_same_final_state(tmp_path, policy, 3)
