"""The trajectory: the policy's view of a response (environment replies left out) that verification and the
learner's batch read, the current turn, truncation across replies, and the plain-dict round-trip."""

import numpy as np

from rollverify_jax.rl.batch import build_batch
from rollverify_jax.rollout.trajectory import Trajectory


def _multi_turn() -> Trajectory:
    """Policy tokens at 0-2, a reply at 3-5, policy tokens at 6-7, a reply at 8, a policy token at 9."""
    t = Trajectory(uid=3, group_id=1, prompt=np.asarray([5, 6], np.int32), seed=11, max_new_tokens=30,
                   tokens=[9, 8, 63], logps=[-1.0, -1.5, -0.25], versions=[0, 0, 1])
    t.append_env([20, 21, 22], version=1)
    t.tokens.extend([7, 63]), t.logps.extend([-0.5, -0.125]), t.versions.extend([2, 2])
    assert t.turn_start == 6
    t.append_env([23], version=2)
    t.tokens.append(4), t.logps.append(-2.0), t.versions.append(3)
    return t


def test_the_policy_view_of_a_single_turn_response_is_the_whole_response():
    t = Trajectory(uid=0, group_id=0, prompt=np.asarray([1], np.int32), seed=0, max_new_tokens=8,
                   tokens=[4, 5, 6], logps=[-0.1, -0.2, -0.3], versions=[0, 1, 1])
    view = t.policy_view()
    assert len(view) == 3 and not view.has_env and view.mask.all() and t.turn_start == 0
    np.testing.assert_array_equal(view.positions, [0, 1, 2])
    assert view.logps.dtype == np.float32 and view.logps.tolist() == np.float32([-0.1, -0.2, -0.3]).tolist()
    assert view.versions.dtype == np.int32 and view.versions.tolist() == [0, 1, 1]
    assert [view.response_index(k) for k in range(5)] == [0, 1, 2, 3, 3]


def test_the_policy_view_leaves_environment_replies_out():
    t = _multi_turn()
    view = t.policy_view()
    assert view.has_env and len(view) == 6 and t.tool_calls == 2 and t.turn_start == 9
    np.testing.assert_array_equal(view.positions, [0, 1, 2, 6, 7, 9])
    assert view.mask.tolist() == [True] * 3 + [False] * 3 + [True] * 2 + [False] + [True]
    assert view.logps.tolist() == [-1.0, -1.5, -0.25, -0.5, -0.125, -2.0]
    assert view.versions.tolist() == [0, 0, 1, 2, 2, 3]
    # A cut keeping k policy tokens lands on the k-th one: the replies before it stay, everything after goes.
    assert [view.response_index(k) for k in range(7)] == [0, 1, 2, 6, 7, 9, 10]
    batch = build_batch([t], np.asarray([1.0]))  # the loss reads the same mask, after the prompt's 2 columns
    np.testing.assert_array_equal(batch["loss_mask"][0, 2:12], view.mask.astype(np.float32))
    assert batch["loss_mask"][0, :2].sum() == 0 and batch["loss_mask"][0, 12:].sum() == 0


def test_a_cut_inside_a_reply_keeps_the_reply_s_start():
    t = _multi_turn()
    t.truncate(5)  # keeps the first reply's first two tokens
    assert t.env_spans == [(3, 5)] and t.draws == 1 and not t.finished
    view = t.policy_view()
    np.testing.assert_array_equal(view.positions, [0, 1, 2])
    assert view.has_env and t.turn_start == 5


def test_the_dict_round_trip_is_exact_and_reads_older_dicts():
    t = _multi_turn()
    t.history.append({"event": "pause", "version": 3, "tokens": 10})
    t.meta["k"] = "v"
    back = Trajectory.from_dict(t.to_dict())
    for field in ("uid", "group_id", "seed", "max_new_tokens", "tokens", "logps", "versions", "finished", "draws",
                  "meta", "history", "env_spans"):
        assert getattr(back, field) == getattr(t, field), field
    np.testing.assert_array_equal(back.prompt, t.prompt)
    old = {k: v for k, v in t.to_dict().items() if k not in ("env_spans", "history", "draws")}  # earlier versions
    back = Trajectory.from_dict(old)
    assert back.env_spans == [] and back.history == [] and back.draws == 0 and back.tokens == t.tokens
