"""Publishing weights from the train devices to the rollout devices (infra/transfer.py): between disjoint device
groups of one process (the session's 8 CPU devices: train 4-7, rollout 0-3) and of two processes x 4 devices
(each gives 2 to rollout, 2 to training), the values arrive whole in the requested shardings, and the call
returns while the source is still being computed."""

import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.infra import multihost_local, transfer

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets 8 CPU ones)")
AXES = mesh_lib.MESH_AXES


def _meshes(rollout_shape=(1, 2, 2)):
    devices = jax.devices()
    return (Mesh(np.array(devices[:4]).reshape(rollout_shape), AXES),
            Mesh(np.array(devices[4:8]).reshape(1, 4, 1), AXES))


def _assert_placed(tree, want_tree, shardings):
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    got, want = jax.tree.leaves(tree), jax.tree.leaves(want_tree)
    dsts = jax.tree.leaves(shardings, is_leaf=is_sharding)
    assert len(got) == len(want) == len(dsts)
    for x, w, s in zip(got, want, dsts, strict=True):
        assert x.sharding == s
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(w)[shard.index])


@needs_8
def test_model_weights_reach_the_serving_layout_on_other_devices(model):
    """The tiny model's params, fsdp-sharded over the train devices, arrive on the rollout devices in the engine's
    serving layout (split over 'tensor'), equal, each leaf as requested; the source is left as it was."""
    rollout, train = _meshes()
    state = nnx.state(model)
    src = jax.device_put(state, mesh_lib.param_shardings(state, train))
    dst = mesh_lib.serving_shardings(state, rollout)
    assert any(s.spec != PartitionSpec() for s in jax.tree.leaves(dst, is_leaf=lambda s: isinstance(s, NamedSharding)))
    out = jax.block_until_ready(transfer.reshard(src, dst))
    assert jax.tree.structure(out) == jax.tree.structure(state)
    _assert_placed(out, state, dst)
    assert all(x.sharding.mesh == train for x in jax.tree.leaves(src))
    assert transfer.tree_bytes(out) == transfer.tree_bytes(state) == sum(x.nbytes for x in jax.tree.leaves(state))


@needs_8
@pytest.mark.parametrize("spec", [PartitionSpec(), PartitionSpec(None, "tensor")])
def test_reshard_returns_while_the_source_is_still_computing(spec):
    """The train step's output is published before it is computed: ``reshard`` returns at dispatch (a source
    held back by a callback until after the call), and the copy completes once the source does, with the values
    it had even when the next step donates the source at once."""
    rollout, train = _meshes()
    release = threading.Event()

    def held(x):
        release.wait()
        return x
    src_sharding = NamedSharding(train, PartitionSpec("fsdp"))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    step = jax.jit(lambda x: jax.pure_callback(held, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1,
                   out_shardings=src_sharding)
    pending = step(jax.device_put(value, src_sharding))
    dst = NamedSharding(rollout, spec)
    result = {}
    caller = threading.Thread(target=lambda: result.update(out=transfer.reshard({"w": pending}, dst)), daemon=True)
    caller.start()
    # A blocking reshard would wait here for the release below. 20 s: far above a dispatch (the staging compile
    # included), below the point where XLA aborts the held program's stuck all-reduce.
    caller.join(timeout=20)
    returned = not caller.is_alive()
    if returned:  # the learner's next step donates the source before the copy has read it
        overwritten = jax.jit(lambda x: x * 0 - 1, donate_argnums=0, out_shardings=src_sharding)(pending)
    release.set()
    caller.join()
    assert returned, "reshard waited for its source to be computed"
    _assert_placed(jax.block_until_ready(result["out"]), {"w": value + 1}, {"w": dst})
    assert (np.asarray(overwritten) == -1).all()


@needs_8
def test_staging_holds_one_destination_shard_per_source_device():
    """What the staging copy costs: split over 'tensor' on the rollout side, each train device stages one
    tensor shard (half the array here), not the whole; with too few source devices per process for the shards
    it needs it falls back to whole copies, and the values still arrive."""
    rollout, train = _meshes()
    dst = NamedSharding(rollout, PartitionSpec(None, "tensor"))
    staged = transfer.staging_sharding(tuple(train.devices.flat), dst)
    assert staged.device_set == set(train.devices.flat)
    assert staged.shard_shape((8, 8)) == (8, 4)
    assert transfer.staging_sharding(tuple(train.devices.flat)[:1], dst).shard_shape((8, 8)) == (8, 8)
    one = NamedSharding(Mesh(np.array(jax.devices()[4:5]).reshape(1, 1, 1), AXES), PartitionSpec())
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = jax.block_until_ready(transfer.reshard([jax.device_put(value, one), value], dst))
    _assert_placed(out, [value, value], [dst, dst])


_TWO_PROCESSES = """
import sys
import numpy as np
from rollverify_jax.infra import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout_s=30)
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rollverify_jax.infra import transfer
local = [jax.local_devices(process_index=p) for p in range(2)]
axes = ("data", "fsdp", "tensor")
value = {"a": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.arange(24, dtype=np.int32).reshape(4, 6)}
for n_rollout in (2, 3):  # 3 + 1: one train device per process, too few to stage the 2 tensor shards it needs
    rollout = Mesh(np.array([d for ds in local for d in ds[:n_rollout]]).reshape(1, n_rollout, 2), axes)
    train = Mesh(np.array([d for ds in local for d in ds[n_rollout:]]).reshape(1, -1, 1), axes)
    src = {k: jax.make_array_from_callback(v.shape, NamedSharding(train, P("fsdp")), lambda i, v=v: v[i])
           for k, v in value.items()}
    assert not src["a"].is_fully_addressable
    pending = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))(src)  # the train step's output, just dispatched
    for spec in (P(), P(None, "tensor")):
        dst = NamedSharding(rollout, spec)
        out = transfer.reshard(pending, dst)
        for k, v in value.items():
            y = jax.block_until_ready(out[k])
            assert y.sharding == dst, y.sharding
            assert {s.device for s in y.addressable_shards} == set(local[jax.process_index()][:n_rollout])
            for s in y.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), (v + 1)[s.index])
print("reshard ok on process", jax.process_index(), flush=True)
"""


@pytest.mark.end_to_end
def test_two_processes_reshard_from_train_to_rollout_devices(tmp_path):
    """2 processes x 4 CPU devices, each giving its first 2 to rollout and its last 2 to training: an
    fsdp-sharded tree spanning both processes' train devices reaches every process's rollout devices, replicated
    and split over 'tensor', with each process holding its whole share (a plain ``jax.device_put`` raises here);
    the same with 3 rollout devices and 1 train device per process (the whole-copy staging)."""
    address = f"127.0.0.1:{multihost_local.free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, address, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for i, out in enumerate(outs):
        assert f"reshard ok on process {i}" in out
