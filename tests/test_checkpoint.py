"""Orbax checkpoints: sharded round trip, exact host state, retention, interval, fingerprint, atomicity."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rollverify_jax import mesh as mesh_lib
from rollverify_jax.checkpoint import COMMIT_FILE, CheckpointConfig, Checkpointer, decode_extra, encode_extra

FP = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "head_dim": (8, 8)}


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh((2, 2, 2))


def make_state(mesh, seed=0):
    """A train-state-like pytree: sharded params, adam state over them, step, typed and raw PRNG keys."""
    k = jax.random.split(jax.random.key(seed), 3)
    params = {
        "embed": jax.device_put(jax.random.normal(k[0], (16, 8)), NamedSharding(mesh, P("tensor", "fsdp"))),
        "w": jax.device_put(jax.random.normal(k[1], (8, 16), jnp.bfloat16), NamedSharding(mesh, P("fsdp", "tensor"))),
        "norm": jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P())),
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(7 + seed), "rng": k[2],
            "raw_rng": jax.random.PRNGKey(seed)}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sharded_round_trip_onto_abstract_shardings(tmp_path, mesh):
    state = make_state(mesh)
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        assert ckpt.save(7, state, {"data": {"position": 3}}, force=True)
        step, restored, extra = ckpt.restore(abstract_state=abstract(state))
    assert step == 7 and extra == {"data": {"position": 3}}
    assert_same_tree(state, restored)
    assert restored["params"]["w"].sharding.spec == P("fsdp", "tensor")


def test_restore_onto_other_shardings(tmp_path, mesh):
    """Resuming on another layout: arrays are read straight onto the target shardings."""
    state = make_state(mesh)
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        ckpt.save(0, state)
        replicated = NamedSharding(mesh, P())
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), abstract(state))
        _, restored, _ = ckpt.restore(0, abstract_state=target)
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(restored["params"]), strict=True):
        assert y.sharding.is_equivalent_to(replicated, y.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_extra_round_trip_is_exact(tmp_path, mesh):
    rng = np.random.default_rng(0)
    logp = (rng.standard_normal(37) * 5).astype(np.float32)  # float32 log-probs with full mantissas
    paused = [
        {"tokens": rng.integers(0, 50_000, size=n).astype(np.int32), "logp": rng.standard_normal(n).astype(np.float32),
         "version": v}
        for n, v in [(5, 3), (0, 4), (11, 4)]  # variable lengths, one empty
    ]
    extra = {
        "logp_list": [float(x) for x in logp],  # plain JSON floats: float(np.float32) is exact
        "logp_scalar": np.float32(logp[3]),
        "logp_array": logp,
        "paused": paused,
        "bf16": np.asarray([1.0078125, -3.5, 1e-3], dtype=ml_dtypes.bfloat16),
        "big_int": np.int64(2**62 + 1),
        "matrix": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "scalar_arr": np.asarray(2.5, np.float32),
        "mask": np.asarray([True, False]),
        "switch": {"rates": [0.5, float("nan"), float("inf")], "on_policy": False, "switch_step": -1},
        "mode": "partial",
        "nothing": None,
    }
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        ckpt.save(1, {"step": jnp.int32(1)}, extra, force=True)
        _, _, got = ckpt.restore()
    np.testing.assert_array_equal(np.asarray(got["logp_list"], np.float32).view(np.uint32), logp.view(np.uint32))
    assert np.float32(got["logp_scalar"]).view(np.uint32) == logp[3:4].view(np.uint32)[0]
    for key in ("logp_array", "bf16", "matrix", "scalar_arr", "mask"):
        assert got[key].dtype == extra[key].dtype and got[key].shape == extra[key].shape, key
        np.testing.assert_array_equal(got[key], extra[key])
    np.testing.assert_array_equal(got["logp_array"].view(np.uint32), logp.view(np.uint32))
    for g, e in zip(got["paused"], paused, strict=True):
        assert g["version"] == e["version"] and g["tokens"].dtype == np.int32 and g["logp"].dtype == np.float32
        np.testing.assert_array_equal(g["tokens"], e["tokens"])
        np.testing.assert_array_equal(g["logp"].view(np.uint32), e["logp"].view(np.uint32))
    assert got["big_int"] == 2**62 + 1
    assert got["switch"]["rates"][0] == 0.5 and np.isnan(got["switch"]["rates"][1])
    assert got["switch"]["rates"][2] == float("inf")
    assert (got["switch"]["on_policy"], got["mode"], got["nothing"]) == (False, "partial", None)


def test_encode_extra_rejects_what_json_would_change():
    with pytest.raises(TypeError, match=r"extra\['cache'\]: dict key 3"):
        encode_extra({"cache": {3: [1, 2]}})
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        encode_extra({"x": object()})
    assert decode_extra(json.loads(json.dumps(encode_extra({"t": (1, 2)})))) == {"t": [1, 2]}


def test_max_to_keep(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(save_interval_steps=1, max_to_keep=2), FP) as ckpt:
        for step in range(1, 5):
            assert ckpt.save(step, {"x": jnp.full((2,), step)}, {"step": step})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3, 4]
        assert ckpt.restore(3)[2] == {"step": 3}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "4"]


def test_interval_and_force(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(save_interval_steps=5, max_to_keep=None), FP) as ckpt:
        saved = [s for s in range(13) if ckpt.save(s, {"x": jnp.zeros(2)})]
        assert saved == [0, 5, 10]
        assert ckpt.save(12, {"x": jnp.zeros(2)}, force=True)  # e.g. the final step of a run
        assert not ckpt.save(10, {"x": jnp.zeros(2)}, force=True)  # already on disk: skipped, not an error
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [0, 5, 10, 12] and ckpt.latest_step() == 12


def test_no_checkpoints(tmp_path):
    with Checkpointer(tmp_path / "fresh", CheckpointConfig(), FP) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        with pytest.raises(FileNotFoundError, match="nothing to restore"):
            ckpt.restore()


def test_fingerprint_mismatch(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        ckpt.save(3, {"x": jnp.zeros(2)}, force=True)
    other = {**FP, "hidden_size": 64, "num_experts": 4}
    with Checkpointer(tmp_path, CheckpointConfig(), other) as ckpt:
        with pytest.raises(ValueError) as err:
            ckpt.restore()
    msg = str(err.value)
    assert "hidden_size: checkpoint=32, current=64" in msg
    assert "num_experts: checkpoint='<absent>', current=4" in msg
    assert "vocab_size" not in msg and "fresh workdir" in msg
    # The same architecture given with lists instead of tuples is the same model.
    with Checkpointer(tmp_path, CheckpointConfig(), {**FP, "head_dim": [8, 8]}) as ckpt:
        assert ckpt.restore()[0] == 3


def test_async_save_then_wait(tmp_path, mesh):
    state = make_state(mesh)
    extra = {"paused": [1, 2, 3]}
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=True), FP)
    assert ckpt.save(50, state, extra)
    extra["paused"].append(4)  # the caller moves on while the write is in flight
    ckpt.wait_until_finished()
    assert (tmp_path / "checkpoints" / "50" / COMMIT_FILE).exists()
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))
    ckpt.close()
    ckpt.close()  # idempotent
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as again:
        step, restored, got = again.restore(abstract_state=abstract(state))
    assert step == 50 and got == {"paused": [1, 2, 3]}
    assert_same_tree(state, restored)


def test_failed_save_is_never_restored(tmp_path, monkeypatch):
    """A save that dies mid-write stays in a tmp dir that latest_step/restore ignore; bare step dirs are ignored."""
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=True), FP)
    ckpt.save(1, {"x": jnp.ones(4)}, {"ok": True}, force=True)
    ckpt.wait_until_finished()

    async def disk_full(self):  # every item is written; the commit (commit file + rename) fails
        raise OSError("disk full")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    ckpt.save(2, {"x": jnp.full(4, 2.0)}, {"ok": False}, force=True)
    with pytest.raises(OSError, match="disk full"):
        ckpt.wait_until_finished()
    monkeypatch.undo()
    ckpt.close()  # the failure was reported once; closing does not raise it again
    assert ckpt.latest_step() == 1
    assert [p.name for p in (tmp_path / "checkpoints").glob("2*")] == ["2.orbax-checkpoint-tmp"]
    # A step directory without orbax's commit file (e.g. a half-finished copy) is not a checkpoint either.
    (tmp_path / "checkpoints" / "9" / "state").mkdir(parents=True)
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as again:
        assert again.latest_step() == 1
        step, state, extra = again.restore()
        again.save(3, {"x": jnp.ones(4)}, force=True)  # a new Checkpointer removes stale tmp dirs (before it saves)
        again.wait_until_finished()
        assert not list((tmp_path / "checkpoints").glob("*tmp*"))
    assert step == 1 and extra == {"ok": True}
    np.testing.assert_array_equal(np.asarray(state["x"]), np.ones(4))


def test_config_validation():
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointConfig(save_interval_steps=0)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointConfig(max_to_keep=0)
