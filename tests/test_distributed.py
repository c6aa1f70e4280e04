"""Multi-process helpers, with the other processes simulated: the shares each process computes, the hash that
compares host decisions, and the error when hosts diverge. (The real multi-process run is test_multihost.py.)"""

import numpy as np
import pytest

from rollverify_jax.infra import distributed


class FakeWorld:
    """``processes`` processes run one after the other; ``process_allgather`` returns every process's buffer of
    the same call (a first round only records them)."""

    def __init__(self, monkeypatch, processes: int):
        from jax.experimental import multihost_utils

        self.processes, self.me, self.buffers = processes, 0, {}
        monkeypatch.setattr(distributed.jax, "process_count", lambda: processes)
        monkeypatch.setattr(distributed.jax, "process_index", lambda: self.me)
        monkeypatch.setattr(multihost_utils, "process_allgather", self.gather)

    def gather(self, x, tiled=False):
        self.buffers[self.me] = np.asarray(x)
        return np.stack([self.buffers.get(p, np.zeros_like(x)) for p in range(self.processes)])

    def run(self, fn):
        """fn on every process, twice: the first round only records each process's buffers (what it returns or
        raises is ignored), the second sees them all; the results of the second round."""
        for me in range(self.processes):
            self.me = me
            try:
                fn()
            except distributed.ProcessesDiverged:
                pass
        out = []
        for me in range(self.processes):
            self.me = me
            out.append(fn())
        return out


@pytest.mark.parametrize("n, processes", [(7, 2), (3, 4), (0, 2), (8, 3)])
def test_each_item_is_computed_once_and_every_process_gets_all(monkeypatch, n, processes):
    world = FakeWorld(monkeypatch, processes)
    computed = []

    def compute(indices):
        computed.append((world.me, indices.tolist()))
        return indices * 10.0, np.asarray([len(indices), 1.0])

    results = world.run(lambda: distributed.share_across_processes(compute, n))
    for values, counts in results:
        np.testing.assert_array_equal(values, np.arange(n) * 10.0)
        np.testing.assert_array_equal(counts, [n, processes])  # counts summed over the processes
    last_round = computed[processes:]  # the recording round computed the same shares
    assert sorted(i for _, idx in last_round for i in idx) == list(range(n))  # each item by one process
    assert all(idx == list(range(me, n, processes)) for me, idx in last_round)


def test_digest_is_stable_and_sees_every_part():
    batch = {"tokens": np.arange(6, dtype=np.int32).reshape(2, 3), "mask": np.ones((2, 3), np.float32)}
    same = {"mask": np.ones((2, 3), np.float32), "tokens": np.arange(6, dtype=np.int32).reshape(2, 3)}
    assert distributed.digest(batch) == distributed.digest(same)  # key order does not matter
    assert distributed.digest(batch) != distributed.digest({**batch, "tokens": batch["tokens"].reshape(3, 2)})
    assert distributed.digest(batch) != distributed.digest({**batch, "tokens": batch["tokens"].astype(np.int64)})
    flipped = batch["mask"].copy()
    flipped[1, 2] = 0
    assert distributed.digest(batch) != distributed.digest({**batch, "mask": flipped})
    assert distributed.digest({"mode": "rollverify", "cache": [1, 2]}) != distributed.digest(
        {"mode": "on_policy", "cache": [1, 2]})
    assert 0 <= distributed.digest([]) < 2**63


def test_diverging_processes_are_named(monkeypatch):
    world = FakeWorld(monkeypatch, 2)
    agree = world.run(lambda: distributed.check_same_on_every_process(3, batch=np.ones(4), data={"pos": 7}))
    assert agree == [None, None]
    with pytest.raises(distributed.ProcessesDiverged, match=r"step 3: the processes decided data differently"):
        world.run(lambda: distributed.check_same_on_every_process(3, batch=np.ones(4), data={"pos": 7 + world.me}))


def test_one_process_needs_no_collective(monkeypatch):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(multihost_utils, "process_allgather", lambda *a, **k: pytest.fail("no collective"))
    values, counts = distributed.share_across_processes(lambda i: (i * 2.0, np.asarray([len(i)])), 3)
    np.testing.assert_array_equal(values, [0, 2, 4])
    distributed.check_same_on_every_process(0, batch=np.ones(2))


def test_initialize_flags_go_together():
    with pytest.raises(ValueError, match="go together"):
        distributed.initialize("127.0.0.1:1234", None, None)
    with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


def test_decisions_given_as_functions_are_built_only_on_several_processes(monkeypatch):
    built = []
    distributed.check_same_on_every_process(1, rollout=lambda: built.append(1) or {"cache": []})
    assert built == []  # one process: nothing to compare, nothing built
    world = FakeWorld(monkeypatch, 2)
    with pytest.raises(distributed.ProcessesDiverged, match="rollout"):
        world.run(lambda: distributed.check_same_on_every_process(1, rollout=lambda: {"cache": [world.me]}))
