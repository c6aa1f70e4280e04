"""Orbax checkpoints: sharded round trip, exact host state, retention, interval, fingerprint, atomicity."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.run.checkpoint import COMMIT_FILE, CheckpointConfig, Checkpointer, decode_extra, encode_extra

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


# -- host state encoding ---------------------------------------------------------------------------------------------


def json_round_trip(obj):
    """What a save then a restore does to extra: encode, write JSON, read JSON, decode."""
    return decode_extra(json.loads(json.dumps(encode_extra(obj))))


def assert_same_array(got, want):
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, (got, want)
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))  # -0.0, NaN


@pytest.mark.parametrize("arr", [
    np.asarray([0.1, -0.0, np.nan, np.inf, -np.inf, 1e-300], np.float64),
    np.asarray([[0.1, -2.5e-38], [np.inf, -0.0]], np.float32),
    np.asarray([6.1e-5, -65504.0, 1e-7, np.nan], np.float16),  # a subnormal included
    np.asarray([[[1.0078125], [-3.5]]], ml_dtypes.bfloat16),
    np.asarray([-128, 127, 0], np.int8),
    np.asarray([2**62 + 1, -(2**63), 2**63 - 1], np.int64),  # not representable as float64
    np.asarray([2**64 - 1, 0, 2**63 + 1], np.uint64),
    np.asarray([[2**32 - 1], [7]], np.uint32),
    np.arange(6, dtype=np.int16).reshape(3, 2),
    np.asarray([[True], [False]]),
    np.zeros((0, 3), np.int32),
    np.zeros((0,), np.float32),
    np.asarray(-7, np.int32),
    np.asarray(np.nan, ml_dtypes.bfloat16),
], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_every_array_dtype_round_trips_bit_exact(arr):
    assert_same_array(json_round_trip({"a": arr})["a"], arr)
    assert_same_array(json_round_trip([arr])[0], arr)


def test_encoded_extra_is_plain_json_in_a_documented_layout():
    enc = encode_extra({
        "ints": np.arange(4, dtype=np.int32).reshape(2, 1, 2),
        "jax": jnp.asarray([1.5, 2.0], jnp.bfloat16),
        "f32": np.float32(0.1), "f16": np.float16(0.1), "bf16": ml_dtypes.bfloat16(0.1), "ld": np.longdouble(0.25),
        "i64": np.int64(2**62 + 1), "u8": np.uint8(255), "flag": np.bool_(True),
        "tup": (1, ("a", None)), "nested": [{"x": [2.5]}],
    })
    assert enc["ints"] == {"__ndarray__": [0, 1, 2, 3], "dtype": "int32", "shape": [2, 1, 2]}
    assert enc["jax"] == {"__ndarray__": [1.5, 2.0], "dtype": "bfloat16", "shape": [2]}
    # numpy scalars become exact Python numbers of the matching kind
    assert type(enc["f32"]) is float and np.float32(enc["f32"]) == np.float32(0.1)
    assert type(enc["f16"]) is float and enc["f16"] == float(np.float16(0.1))
    assert type(enc["bf16"]) is float and enc["bf16"] == float(ml_dtypes.bfloat16(0.1))
    assert type(enc["ld"]) is float and enc["ld"] == 0.25
    assert type(enc["i64"]) is int and enc["i64"] == 2**62 + 1
    assert type(enc["u8"]) is int and enc["u8"] == 255
    assert enc["flag"] is True
    assert enc["tup"] == [1, ["a", None]] and enc["nested"] == [{"x": [2.5]}]
    assert json.loads(json.dumps(enc)) == enc  # nothing JSON would change
    got = json_round_trip({"tup": (1, ("a", None)), "n": [{"x": (np.int8(3),)}], "s": "", "z": 0, "b": False})
    assert got == {"tup": [1, ["a", None]], "n": [{"x": [3]}], "s": "", "z": 0, "b": False}


def test_encode_extra_copies_the_input():
    arr = np.zeros(3, np.float32)
    state = {"arr": arr, "list": [1, 2]}
    enc = encode_extra(state)
    arr[:] = 5.0
    state["list"].append(3)
    state["new"] = 1
    assert enc == {"arr": {"__ndarray__": [0.0, 0.0, 0.0], "dtype": "float32", "shape": [3]}, "list": [1, 2]}


def test_encode_extra_errors_name_the_path():
    with pytest.raises(TypeError, match=r"^extra\['cache'\]: dict key 3 is a int"):
        encode_extra({"cache": {3: [1, 2]}})
    with pytest.raises(TypeError, match=r"^extra\['a'\]\[1\]\['b'\]\[0\]: dict key \(1, 2\) is a tuple"):
        encode_extra({"a": [0, {"b": [{(1, 2): 0}]}]})
    with pytest.raises(TypeError, match=r"^extra\[2\]: set is not JSON-serialisable"):
        encode_extra([0, 1, {1}])
    with pytest.raises(ValueError, match=r"^extra\['x'\]\[0\]: the key '__ndarray__' is reserved"):
        encode_extra({"x": [{"__ndarray__": [1], "dtype": "int32", "shape": [1]}]})
    with pytest.raises(TypeError, match=r"^extra\['s'\]: cannot store an array of dtype <U2"):
        encode_extra({"s": np.asarray(["ab"])})
    with pytest.raises(TypeError, match=r"^extra\['c'\]\[0\]: cannot store an array of dtype complex64"):
        encode_extra({"c": [np.zeros(2, np.complex64)]})
    with pytest.raises(TypeError, match=r"^model_fingerprint\['m'\]: bytes is not"):
        encode_extra({"m": b"x"}, "model_fingerprint")


def test_fingerprint_must_be_json(tmp_path):
    with pytest.raises(TypeError, match=r"^model_fingerprint\['dtype'\]: type is not JSON-serialisable"):
        Checkpointer(tmp_path, CheckpointConfig(), {"dtype": np.float32})


# -- policy ----------------------------------------------------------------------------------------------------------


def test_config_smallest_valid_values():
    config = CheckpointConfig(save_interval_steps=1, max_to_keep=1, async_save=False)
    assert (config.save_interval_steps, config.max_to_keep) == (1, 1)
    assert CheckpointConfig(max_to_keep=None).max_to_keep is None
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointConfig(save_interval_steps=-5)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointConfig(max_to_keep=-1)


def test_max_to_keep_one_keeps_only_the_latest(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(save_interval_steps=1, max_to_keep=1), FP) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, {"x": jnp.full((2,), step)}, {"step": step})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3]
        step, state, extra = ckpt.restore()
    assert step == 3 and extra == {"step": 3}
    np.testing.assert_array_equal(np.asarray(state["x"]), [3, 3])


def test_defaults_and_on_disk_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Checkpointer("run") as ckpt:  # relative workdir, default config, no fingerprint
        assert ckpt.config == CheckpointConfig()
        assert ckpt.directory == tmp_path / "run" / "checkpoints" and ckpt.directory.is_dir()  # created up front
        assert [s for s in range(151) if ckpt.should_save(s)] == [0, 50, 100, 150]
        assert not ckpt.save(49, {"x": jnp.zeros(2)})
        assert ckpt.save(50, {"x": jnp.arange(2)}, {"pos": np.asarray([4], np.int16)})
        assert ckpt.save(51, {"x": jnp.zeros(2)}, force=True)  # no extra given
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [50, 51]
        step, state, extra = ckpt.restore(50)
        assert ckpt.restore()[2] == {}
    assert step == 50
    np.testing.assert_array_equal(np.asarray(state["x"]), [0, 1])
    assert_same_array(extra["pos"], np.asarray([4], np.int16))
    step_dir = tmp_path / "run" / "checkpoints" / "50"
    assert {"state", "extra", "meta", COMMIT_FILE} <= {p.name for p in step_dir.iterdir()}
    assert json.loads((step_dir / "extra" / "metadata").read_text()) == {
        "pos": {"__ndarray__": [4], "dtype": "int16", "shape": [1]}}
    assert json.loads((step_dir / "meta" / "metadata").read_text()) == {}


def test_fingerprint_is_stored_as_json(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        assert ckpt.model_fingerprint == {**FP, "head_dim": [8, 8]}
        ckpt.save(2, {"x": jnp.zeros(2)}, force=True)
    assert json.loads((tmp_path / "checkpoints" / "2" / "meta" / "metadata").read_text()) == {**FP, "head_dim": [8, 8]}


def test_should_save_at_a_preemption_sync_point(tmp_path, monkeypatch):
    from jax.experimental import multihost_utils

    with Checkpointer(tmp_path, CheckpointConfig(save_interval_steps=5, max_to_keep=None), FP) as ckpt:
        monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: step == 7)
        assert [s for s in range(11) if ckpt.should_save(s)] == [0, 5, 7, 10]
        assert ckpt.save(7, {"x": jnp.zeros(2)})  # off-interval, saved because every host reached the sync point
        assert not ckpt.save(8, {"x": jnp.zeros(2)})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [7]


def test_saves_a_step_below_the_latest(tmp_path):
    """After resuming from an older checkpoint, new steps below the latest on disk are still saved."""
    with Checkpointer(tmp_path, CheckpointConfig(save_interval_steps=5, max_to_keep=None), FP) as ckpt:
        assert ckpt.save(10, {"x": jnp.full(2, 10)}, {"s": 10})
        assert ckpt.save(5, {"x": jnp.full(2, 5)}, {"s": 5})
        assert ckpt.save(np.int64(3), {"x": jnp.full(2, 3)}, {"s": 3}, force=True)
        assert not ckpt.save(np.int32(5), {"x": jnp.zeros(2)}, {"s": -1}, force=True)  # on disk: kept as it is
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3, 5, 10] and ckpt.latest_step() == 10
        assert ckpt.restore(5)[2] == {"s": 5} and ckpt.restore(3)[2] == {"s": 3}
        with pytest.raises(FileNotFoundError, match=r"step 4 .*available steps: \[3, 5, 10\]"):
            ckpt.restore(4)


# -- fingerprint -----------------------------------------------------------------------------------------------------


def test_fingerprint_diff_lists_every_field_and_tells_absent_from_none(tmp_path):
    saved_fp = {"a": 1, "b": None, "c": [1, 2], "same": "x"}
    with Checkpointer(tmp_path, CheckpointConfig(), saved_fp) as ckpt:
        ckpt.save(1, {"x": jnp.zeros(2)}, force=True)
    current = {"a": 2, "c": (1, 3), "d": None, "same": "x"}
    with Checkpointer(tmp_path, CheckpointConfig(), current) as ckpt:
        with pytest.raises(ValueError) as err:
            ckpt.restore()
        with pytest.raises(ValueError):
            ckpt.check_fingerprint(1)
    assert ("differing fields: a: checkpoint=1, current=2; b: checkpoint=None, current='<absent>'; "
            "c: checkpoint=[1, 2], current=[1, 3]; d: checkpoint='<absent>', current=None. ") in str(err.value)
    assert "same" not in str(err.value)
    with Checkpointer(tmp_path, CheckpointConfig(), saved_fp) as ckpt:
        ckpt.check_fingerprint(1)  # the same model: no error
        assert ckpt.restore()[0] == 1


def test_fingerprint_is_checked_for_the_requested_step(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        ckpt.save(1, {"x": jnp.zeros(2)}, {"m": "first"}, force=True)
    other = {**FP, "vocab_size": 128}
    with Checkpointer(tmp_path, CheckpointConfig(), other) as ckpt:
        ckpt.save(2, {"x": jnp.ones(2)}, {"m": "second"}, force=True)
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        assert ckpt.restore(1)[2] == {"m": "first"}
        ckpt.check_fingerprint(1)
        with pytest.raises(ValueError, match="vocab_size: checkpoint=128, current=64"):
            ckpt.restore()
    with Checkpointer(tmp_path, CheckpointConfig(), other) as ckpt:
        assert ckpt.restore()[2] == {"m": "second"}
        with pytest.raises(ValueError, match="vocab_size: checkpoint=64, current=128"):
            ckpt.restore(1)


# -- failures and lifetime -------------------------------------------------------------------------------------------


@pytest.fixture
def disk_full(monkeypatch):
    """Every item is written; the commit (commit file + rename) fails."""
    from orbax.checkpoint._src.path import atomicity

    async def finalize(self):
        raise OSError("disk full")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    return monkeypatch


def test_sync_save_raises_from_save(tmp_path, disk_full):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(1, {"x": jnp.ones(2)}, force=True)
    disk_full.undo()
    ckpt.close()
    assert ckpt.latest_step() is None


def test_close_reports_a_failed_async_save(tmp_path, disk_full):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=True), FP)
    assert ckpt.save(1, {"x": jnp.ones(2)}, force=True)  # returns before the failure
    with pytest.raises(OSError, match="disk full"):
        ckpt.close()
    ckpt.close()  # reported once
    with pytest.raises(OSError, match="disk full"):
        with Checkpointer(tmp_path / "cm", CheckpointConfig(async_save=True), FP) as ckpt:
            ckpt.save(1, {"x": jnp.ones(2)}, force=True)
    disk_full.undo()
    assert ckpt.latest_step() is None


def test_closed_checkpointer_is_released(tmp_path):
    import gc
    import weakref

    ckpt = Checkpointer(tmp_path, CheckpointConfig(), FP)
    ckpt.save(1, {"x": jnp.ones(2)}, force=True)
    ckpt.close()
    assert (tmp_path / "checkpoints" / "1" / COMMIT_FILE).exists()  # close waited for the async save
    ref = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    assert ref() is None  # not kept alive by the exit hook once closed


# -- damaged checkpoints on resume ------------------------------------------------------------------------------------


def _two_steps(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": jnp.sin(jnp.arange(256.0) * step)}, {"step": step}, force=True)  # incompressible
    return tmp_path / "checkpoints"


def _truncate_array_files(step_dir):
    """Cuts every ocdbt data file that holds the array (the 2 KiB of sin values) to 50 bytes."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    for big in (p for p in files if p.stat().st_size > 1000):
        big.write_bytes(big.read_bytes()[:50])


DAMAGE = {  # each is positive evidence on disk that the step's files are damaged
    "truncated array file": lambda step_dir: _truncate_array_files(step_dir),
    "missing chunk file": lambda step_dir: [p.unlink() for p in (step_dir / "state").rglob("*")
                                            if p.is_file() and p.parent.name == "d" and p.stat().st_size > 1000],
    "missing item": lambda step_dir: (step_dir / "extra" / "metadata").unlink(),
    "missing item directory": lambda step_dir: shutil.rmtree(step_dir / "extra"),
    "unparsable JSON item": lambda step_dir: (step_dir / "extra" / "metadata").write_text('{"step": '),
    "unparsable manifest": lambda step_dir: (step_dir / "state" / "manifest.ocdbt").write_bytes(b"garbage"),
    "missing manifest": lambda step_dir: (step_dir / "state" / "manifest.ocdbt").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_unreadable_newest_checkpoint_falls_back_and_is_kept_aside(tmp_path, capsys, damage):
    root = _two_steps(tmp_path)
    DAMAGE[damage](root / "2")
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        step, state, extra = ckpt.restore(abstract_state={"x": jax.ShapeDtypeStruct((256,), jnp.float32)})
        assert step == 1 and extra == {"step": 1}
        np.testing.assert_array_equal(np.asarray(state["x"]), np.asarray(jnp.sin(jnp.arange(256.0))))
        err = capsys.readouterr().err
        assert "checkpoint: step 2 cannot be read" in err and "moved to 2.corrupt" in err
        assert (root / "2.corrupt").is_dir() and ckpt.all_steps() == [1]  # kept, out of the step list
        assert ckpt.set_aside_steps() == ["2.corrupt"]
        assert ckpt.save(2, {"x": jnp.full(256, 5.0)}, {"step": 2}, force=True)  # the step can be redone
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        assert ckpt.restore()[2] == {"step": 2}


def test_a_truncated_data_file_of_a_large_array_is_damage_and_seen_without_a_restore(tmp_path, capsys):
    """An array past OCDBT's inline size lives in a data file of its own; cut short, orbax's restore error no
    longer starts with tensorstore's status code (it used to be taken for a storage error: nothing moved, the run
    stopped). The tree's references show it, before any restore too (``step_damage``: the "run complete" check)."""
    from rollverify_jax.run.checkpoint import step_damage

    big = {"x": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": jnp.sin(jnp.arange(4096.0) * step)}, {"step": step}, force=True)
    root = tmp_path / "checkpoints"
    assert step_damage(root / "2") is None
    files = [p for p in (root / "2" / "state").glob("ocdbt.process_*/d/*") if p.stat().st_size > 4096 * 3]
    assert len(files) == 1
    files[0].write_bytes(files[0].read_bytes()[:1000])
    evidence = step_damage(root / "2")
    assert evidence.startswith("state/ocdbt.process_") and "is shorter than the " in evidence, evidence
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        step, state, extra = ckpt.restore(abstract_state=big)
        assert step == 1 and extra == {"step": 1}
    assert "checkpoint: step 2 cannot be read (state/ocdbt.process_" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["1", "2.corrupt"]
    (root / "2.corrupt" / files[0].relative_to(root / "2")).unlink()
    assert "is missing" in step_damage(root / "2.corrupt")
    shutil.rmtree(root / "1" / "extra")
    assert step_damage(root / "1") == "its 'extra' item is missing"


def _failing_restore(monkeypatch, ckpt, error, step=2):
    """orbax's restore of ``step`` raises ``error`` (every other step restores as usual)."""
    real = ckpt._manager.restore

    def restore(s, *a, **kw):
        if s == step:
            raise error
        return real(s, *a, **kw)

    monkeypatch.setattr(ckpt._manager, "restore", restore)


NOT_DAMAGE = {  # what storage, permissions and memory raise while the files are intact
    "permission": PermissionError(13, "Permission denied"),
    "tensorstore permission": ValueError('PERMISSION_DENIED: Error opening "zarr" driver: Error reading "x/.zarray" '
                                         'in OCDBT database at "gs://bucket/run/checkpoints/2/state/"'),
    "storage unavailable": ValueError('UNAVAILABLE: Error opening "cast" driver: Error reading "gs://bucket/run/'
                                      'checkpoints/2/state/manifest.ocdbt": 503 Service Unavailable'),
    "bucket not found": ValueError('NOT_FOUND: Error opening "zarr" driver: Error reading "x/.zarray" in OCDBT '
                                   'database at "gs://bucket/run/checkpoints/2/state/": bucket does not exist'),
    "deadline": ValueError("DEADLINE_EXCEEDED: Error reading local file: timed out"),
    "device memory": RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 536870912 bytes."),
    "disk gone": OSError(5, "Input/output error"),
}


@pytest.mark.parametrize("error", list(NOT_DAMAGE))
def test_a_restore_error_that_is_not_damage_moves_nothing(tmp_path, monkeypatch, capsys, error):
    """Set aside on such an error, every good checkpoint would follow, and the next start would begin at step 0:
    the error stops the restore with one message naming the step and the error, and nothing is renamed."""
    root = _two_steps(tmp_path)
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        _failing_restore(monkeypatch, ckpt, NOT_DAMAGE[error])
        with pytest.raises(ValueError, match="checkpoints/2 could not be restored") as err:
            ckpt.restore()
        assert str(NOT_DAMAGE[error]).split(":")[0][:20] in str(err.value) and "nothing was moved" in str(err.value)
        assert ckpt.all_steps() == [1, 2]
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]
    assert "corrupt" not in capsys.readouterr().err


def test_a_state_of_another_shape_is_a_settings_error_and_moves_nothing(tmp_path):
    root = _two_steps(tmp_path)
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        with pytest.raises(ValueError, match="checkpoints/2 onto abstract_state \\(does the state tree"):
            ckpt.restore(abstract_state={"x": jax.ShapeDtypeStruct((128,), jnp.float32)})
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]


def _other_host(monkeypatch, outcomes):
    """A second process whose restore attempts end as ``outcomes`` (0 restored, 1 damaged, 2 failed), one per
    all-gather: this process is process 0 of 2 for the restore's agreement."""
    from rollverify_jax.infra import distributed

    outcomes = list(outcomes)
    monkeypatch.setattr(distributed, "gather_ints",
                        lambda values: np.asarray([list(values), [outcomes.pop(0)]]), raising=False)


def test_another_hosts_error_moves_nothing_on_any_host(tmp_path, monkeypatch):
    """Process 1 cannot read step 2 (its mount is down); process 0 can: the hosts stop together, nothing moved."""
    root = _two_steps(tmp_path)
    _other_host(monkeypatch, [2])
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        with pytest.raises(ValueError, match=r"checkpoints/2 could not be restored on process\(es\) \[1\]"):
            ckpt.restore()
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]


def test_damage_here_and_an_error_elsewhere_moves_nothing(tmp_path, monkeypatch):
    root = _two_steps(tmp_path)
    _truncate_array_files(root / "2")
    _other_host(monkeypatch, [2])
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        with pytest.raises(ValueError, match=r"on process\(es\) \[1\]"):
            ckpt.restore()
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]


def test_damage_another_host_found_is_set_aside_by_process_0(tmp_path, monkeypatch, capsys):
    """Only process 1 reads the damaged shard: process 0 read its own part fine, and still sets the step aside,
    so both fall back to the same step."""
    root = _two_steps(tmp_path)
    _other_host(monkeypatch, [1, 0])
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        assert ckpt.restore()[0] == 1
    assert "step 2 cannot be read (process(es) [1] found it damaged); moved to 2.corrupt" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["1", "2.corrupt"]


def test_every_step_damaged_leaves_nothing_to_restore_and_keeps_them_all(tmp_path, capsys):
    root = _two_steps(tmp_path)
    for step in ("1", "2"):
        (root / step / "extra" / "metadata").unlink()
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        assert ckpt.restore_newest() is None
        assert ckpt.set_aside_steps() == ["1.corrupt", "2.corrupt"] and ckpt.all_steps() == []
        with pytest.raises(FileNotFoundError, match="nothing to restore"):
            ckpt.restore()
    err = capsys.readouterr().err
    assert "step 2 cannot be read (extra/metadata is missing" in err and "step 1 cannot be read" in err


def test_an_explicit_unreadable_step_is_a_clear_error(tmp_path):
    root = _two_steps(tmp_path)
    (root / "2" / "meta" / "metadata").unlink()
    with Checkpointer(tmp_path, CheckpointConfig(), FP) as ckpt:
        with pytest.raises(ValueError, match="checkpoints/2 cannot be read: meta/metadata is missing; "
                                             "FileNotFoundError"):
            ckpt.restore(2)
    assert (root / "2").is_dir()  # asked for by name: left where it is


def test_interrupted_saves_are_cleaned_up_in_one_line_with_the_resumed_step(tmp_path, capsys):
    """A bare step directory without the commit file used to block every later save of that step; it and an
    orbax tmp directory are cleaned up, and one line says what was removed and where the run resumes."""
    root = _two_steps(tmp_path)
    (root / "2" / COMMIT_FILE).unlink()
    (root / "5.orbax-checkpoint-tmp").mkdir()
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False), FP) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.restore()[0] == 1
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("checkpoint:")]
        assert lines == [f"checkpoint: moved step 2 to 2.uncommitted (no {COMMIT_FILE}: never committed); "
                         "removed 5.orbax-checkpoint-tmp (a save interrupted before it committed); "
                         "resuming from step 1"]
        assert ckpt.save(2, {"x": jnp.zeros(256)}, {"step": 2}, force=True)
        assert ckpt.latest_step() == 2
    assert (root / "2.uncommitted").is_dir()


def test_a_second_save_of_a_step_still_being_written_is_skipped(tmp_path):
    """A stop request can save the step whose async save is still in flight: the second call is a no-op."""
    with Checkpointer(tmp_path, CheckpointConfig(async_save=True), FP) as ckpt:
        assert ckpt.save(1, {"x": jnp.ones(4)}, force=True)
        assert not ckpt.save(1, {"x": jnp.zeros(4)}, force=True)
        ckpt.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(ckpt.restore()[1]["x"]), np.ones(4))
