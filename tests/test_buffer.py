"""Paused-trajectory cache: group bookkeeping and an exact checkpoint round trip."""

import numpy as np

from rollverify_jax.rl.buffer import Group, PausedCache
from rollverify_jax.rollout import Trajectory


def _traj(uid, gid, n, finished=False, version=0):
    rng = np.random.default_rng(uid)
    return Trajectory(uid=uid, group_id=gid, prompt=np.arange(3, dtype=np.int32), seed=uid, max_new_tokens=9,
                      tokens=list(rng.integers(0, 50, n)), logps=[float(np.float32(x)) for x in rng.normal(size=n)],
                      versions=[version] * n, finished=finished, meta={"k": uid})


def test_groups_complete_only_with_all_members():
    cache = PausedCache()
    cache.add_group(Group(0, 2, {"prompt": "a", "answer": "1"}))
    cache.add_group(Group(1, 2, {"prompt": "b", "answer": "2"}))
    cache.add_finished(_traj(0, 0, 3, True))
    assert cache.num_complete() == 0
    cache.add_finished(_traj(1, 0, 2, True))
    cache.add_finished(_traj(2, 1, 2, True))
    done = cache.pop_complete()
    assert [g.group_id for g in done] == [0] and 0 not in cache.groups and 1 in cache.groups


def test_take_for_resume_includes_waiting_finished_members_only_when_asked():
    cache = PausedCache()
    cache.add_group(Group(0, 2, {}))
    cache.add_finished(_traj(0, 0, 3, True))
    cache.pause([_traj(1, 0, 4)])
    assert [t.uid for t in cache.take_for_resume(include_finished=False)] == [1]
    cache.pause([_traj(1, 0, 4)])
    assert sorted(t.uid for t in cache.take_for_resume(include_finished=True)) == [0, 1]
    assert not cache.groups[0].finished and not cache.paused


def test_staleness_histogram_input():
    cache = PausedCache()
    cache.add_group(Group(0, 3, {}))
    cache.pause([_traj(1, 0, 4, version=2), _traj(2, 0, 0)])
    cache.add_finished(_traj(3, 0, 2, True, version=4))
    assert sorted(cache.staleness(5).tolist()) == [1, 3]


def test_round_trip_is_exact():
    cache = PausedCache()
    cache.add_group(Group(7, 3, {"prompt": "p", "answer": "4"}))
    cache.add_finished(_traj(10, 7, 5, True, version=3))
    cache.pause([_traj(11, 7, 6, version=2), _traj(12, 7, 0)])
    cache.paused[0].draws = 2  # cut twice: its next suffix is the third draw, after a restart too
    back = PausedCache.from_dict(cache.to_dict())
    assert [t.draws for t in back.paused] == [2, 0] and back.paused[0].sample_seed == cache.paused[0].sample_seed
    assert back.groups[7].record == {"prompt": "p", "answer": "4"} and back.groups[7].size == 3
    for a, b in zip(cache.paused + list(cache.groups[7].finished.values()),
                    back.paused + list(back.groups[7].finished.values()), strict=True):
        assert (a.uid, a.group_id, a.seed, a.max_new_tokens, a.finished, a.draws, a.meta) == \
            (b.uid, b.group_id, b.seed, b.max_new_tokens, b.finished, b.draws, b.meta)
        assert a.tokens == b.tokens and a.logps == b.logps and a.versions == b.versions
        np.testing.assert_array_equal(a.prompt, b.prompt)


def test_staleness_is_measured_from_the_oldest_token():
    cache = PausedCache()
    cache.add_group(Group(0, 3, {}))
    mixed = _traj(1, 0, 3)
    mixed.versions = [1, 3, 4]
    cache.pause([mixed])
    assert cache.staleness(5).tolist() == [4]
    empty = PausedCache().staleness(5)  # integer staleness even with nothing cached (it keys a histogram)
    assert empty.dtype == np.int64 and empty.shape == (0,)


def test_resume_takes_every_finished_member_when_verifying_and_none_otherwise():
    """A complete group left in the cache (carried beyond B) trains one version later, so with re-verification
    its members are resumed too, like an incomplete group's; paused trajectories come first, then groups by id."""
    def cache_with_groups():
        cache = PausedCache()
        cache.add_group(Group(1, 2, {}))
        cache.add_group(Group(0, 2, {}))
        for uid, gid in ((2, 1), (0, 0), (1, 0)):
            cache.add_finished(_traj(uid, gid, 3, True))
        cache.pause([_traj(3, 1, 2)])
        return cache

    cache = cache_with_groups()
    assert [t.uid for t in cache.take_for_resume(include_finished=True)] == [3, 0, 1, 2]
    assert cache.num_complete() == 0 and not any(g.finished for g in cache.groups.values()) and len(cache) == 0
    cache = cache_with_groups()
    assert [t.uid for t in cache.take_for_resume(include_finished=False)] == [3]
    assert sorted(cache.groups[0].finished) == [0, 1] and cache.num_complete() == 1
    assert [g.group_id for g in cache.pop_complete()] == [0]


def test_pop_complete_takes_the_oldest_groups_up_to_the_limit():
    cache = PausedCache()
    for gid in (5, 2, 9):
        cache.add_group(Group(gid, 1, {}))
        cache.add_finished(_traj(gid, gid, 1, True))
    assert [g.group_id for g in cache.pop_complete(2)] == [2, 5]
    assert sorted(cache.groups) == [9] and len(cache) == 0


def test_checkpoint_layout_uses_compact_dtypes():
    """Prompt, tokens and versions are int32 and log mu float32 in a checkpoint; restored values are exact."""
    cache = PausedCache()
    cache.add_group(Group(1, 2, {"prompt": "p"}))
    traj = _traj(4, 1, 3, version=2)
    traj.prompt = traj.prompt.astype(np.int64)  # whatever a caller built the prompt with
    cache.pause([traj])
    saved = cache.to_dict()["paused"][0]
    assert {k: saved[k].dtype.name for k in ("prompt", "tokens", "logps", "versions")} == \
        {"prompt": "int32", "tokens": "int32", "logps": "float32", "versions": "int32"}
    assert (saved["uid"], saved["group_id"], saved["seed"], saved["max_new_tokens"], saved["finished"]) == \
        (4, 1, 4, 9, False)
    del saved["meta"]  # older checkpoints carry no meta
    back = PausedCache.from_dict({"paused": [saved], "groups": []})
    assert back.paused[0].meta == {} and back.paused[0].versions == [2, 2, 2] and len(back) == 1
    assert all(isinstance(x, int) for x in back.paused[0].tokens)
    assert all(isinstance(x, float) for x in back.paused[0].logps)


def test_a_cache_saved_before_draw_counts_loads_with_no_cuts():
    """Checkpoints written before trajectories counted their cuts hold no "draws": they load as 0 (the first
    draw, whose seed is the trajectory seed), so their samples continue as they would have."""
    cache = PausedCache()
    cache.pause([_traj(3, 0, 4)])
    saved = cache.to_dict()
    del saved["paused"][0]["draws"]
    back = PausedCache.from_dict(saved)
    assert back.paused[0].draws == 0 and back.paused[0].sample_seed == back.paused[0].seed == 3
