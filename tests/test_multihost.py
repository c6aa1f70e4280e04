"""One run as 2 JAX processes x 4 CPU devices (gloo collectives, a coordinator on 127.0.0.1) against the same
run as 1 process x 8 devices: same mesh shapes, seeds and data. The run is asynchronous RollVerify, the mode
whose two meshes (2 rollout + 2 train devices of each process) both span the processes, so every weight publish
reshards across them; its learner, checkpoints and export are the synchronous modes' own. The per-step metrics
agree, the checkpoint is written once (asynchronously, as by default) and restores on 2 processes, and the resumed
2-process run continues as the uninterrupted one."""

import json
import math

import gin
import numpy as np
import pytest

from rollverify_jax import train
from rollverify_jax.infra import multihost_local
from rollverify_jax.models import init_model, model_config
from rollverify_jax.models.hf import save_pretrained
from rollverify_jax.run.metrics import read_metrics

TIME_LIMIT_S = 420  # per multi-process launch: a hang fails the test instead of stalling the suite
# The reference run (in this process) compiles from the session's compilation cache: the programs of the tiny
# runs of test_train.py, same policy and shapes.
pytestmark = [pytest.mark.end_to_end, pytest.mark.usefixtures("compilation_cache")]


def _params(policy, steps):
    return [f"TrainConfig.policy_path = '{policy}'", f"TrainConfig.num_steps = {steps}",
            "TrainConfig.train_dataset_kwargs = {'n': 256, 'split': 'train', 'max_steps': 6}",
            "TrainConfig.eval_dataset_kwargs = {'n': 8, 'split': 'test', 'max_steps': 6}",
            "TrainConfig.eval_size = 4", "TrainConfig.eval_samples = 2", "TrainConfig.eval_every = 0",
            "EvalConfig.at_start = False", "RewardScorer.name = 'exact'",
            "RolloutConfig.batch_groups = 2", "RolloutConfig.group_size = 4", "RolloutConfig.max_new_tokens = 24",
            "EngineConfig.num_slots = 16", "EngineConfig.page_size = 8", "EngineConfig.max_seq_len = 64",
            "EngineConfig.steps_per_dispatch = 4", "OptimizerConfig.learning_rate = 3e-3",
            "CheckpointConfig.save_interval_steps = 1",  # saves async (the default)
            "RolloutConfig.mode = 'async'", "AsyncConfig.rollout_devices = 0.5", "AsyncConfig.overlap_dispatches = 2",
            "make_mesh.shape = (1, 4, 1)", "AsyncConfig.rollout_mesh = (4, 1, 1)"]


def _comparable(m: dict) -> dict:
    """The metrics that must agree: everything but timings and throughput."""
    return {k: v for k, v in m.items() if not (k.startswith("time/") or k.endswith(("_time", "per_s")))}


def _same(x: float, y: float) -> bool:
    """Equal within float tolerance (reductions split over processes add in another order); NaN equals NaN (a
    rate with nothing to count)."""
    return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6)


def test_two_processes_match_one_and_resume(policy, tmp_path):
    gin.clear_config()
    try:  # the reference: this process's 8 devices
        train.main([f"--workdir={tmp_path / 'one'}", *[f"--gin_param={p}" for p in _params(policy, 2)]])
    finally:
        gin.clear_config()
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")

    two = tmp_path / "two"
    # The resumed launch compiles the programs the first one did: a compilation cache shared by the launches.
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    for steps in (1, 2):  # stopped after step 1, then resumed from its checkpoint
        args = ["--traceback", f"--workdir={two}", *[f"--gin_param={p}" for p in _params(policy, steps)]]
        status = multihost_local.launch(args, 2, 4, tmp_path / f"logs_{steps}", timeout_s=TIME_LIMIT_S,
                                        extra_env=cache)
        logs = "".join((tmp_path / f"logs_{steps}" / f"process_{i}.log").read_text() for i in range(2))
        assert status == 0, logs[-4000:]
    for i in range(2):  # both processes restored the checkpoint the first launch committed
        assert "resumed from checkpoint step 1" in (tmp_path / "logs_2" / f"process_{i}.log").read_text()
    got = read_metrics(two / "metrics.jsonl")
    assert [m["publish/version"] for m in got] == [1, 2] and all(m["publish/failed"] == 0 for m in got)

    assert [m["step"] for m in got] == [m["step"] for m in one] == [1, 2]  # one writer, no step twice
    for a, b in zip(one, got, strict=True):
        a, b = _comparable(a), _comparable(b)
        if a["step"] == 1:  # the first launch ended at step 1, so it evaluated there
            b = {k: v for k, v in b.items() if not k.startswith("eval/")}
        assert set(a) == set(b)
        differ = {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}
        assert not differ, differ
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["1", "2"]  # each step committed once
    assert len((two / "metrics.jsonl").read_text().splitlines()) == 2

    # Export by 2 processes (each gathers, process 0 writes) equals the export of one process.
    exported = tmp_path / "export_two"
    status = multihost_local.launch(["--traceback", f"--checkpoint={two}", f"--out={exported}"], 2, 4,
                                    tmp_path / "logs_export", module="rollverify_jax.export", timeout_s=TIME_LIMIT_S)
    assert status == 0, (tmp_path / "logs_export" / "process_0.log").read_text()[-3000:]
    from rollverify_jax import export

    export.main([f"--checkpoint={two}", f"--out={tmp_path / 'export_one'}"])
    _assert_same_safetensors(tmp_path / "export_one", exported)
    assert json.loads((two / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


_DIES_OR_WAITS = """
import os, sys, time
import jax
from rollverify_jax.infra import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout_s=5)
x = jax.numpy.ones(4)
if jax.process_index() == 1:
    os._exit(9)  # dies without a word, as a preempted host does
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("never reached by process 1")
time.sleep(600)
"""


def test_a_dead_process_stops_the_others_within_the_heartbeat(tmp_path):
    """The survivor of a crashed peer exits with the distributed runtime's error instead of hanging in a
    collective (heartbeat 5 s)."""
    import os
    import subprocess
    import sys

    address = f"127.0.0.1:{multihost_local.free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, "-c", _DIES_OR_WAITS, address, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    # A survivor stuck in the collective (or past it, asleep) fails by TimeoutExpired: a guard that keeps a hang
    # from stalling the suite, generous for a loaded machine, not a bound under test.
    try:
        out, _ = procs[0].communicate(timeout=TIME_LIMIT_S)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0
    assert "another task died" in out or "unhealthy" in out, out[-3000:]


_SAVES = """
import sys
import numpy as np
from rollverify_jax.infra import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout_s=30)
import jax
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import init_model, model_config
from rollverify_jax.models.hf import save_pretrained
mesh = mesh_lib.make_mesh((1, 4, 1))  # 2 devices per process: every parameter spans both processes
model = mesh_lib.shard_model(init_model(model_config("tiny", num_hidden_layers=2), seed=7), mesh)
assert not model.layers[0].mlp.gate_proj[...].is_fully_addressable
save_pretrained(model, sys.argv[3], max_shard_bytes=200_000)
print("saved by", jax.process_index(), flush=True)
"""


def test_save_pretrained_gathers_to_process_zero(tmp_path):
    """Parameters sharded across 2 processes are gathered and written once, by process 0, equal to the same
    model saved by one process."""
    import os
    import subprocess
    import sys

    address = f"127.0.0.1:{multihost_local.free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, "-c", _SAVES, address, str(i), str(tmp_path / "two")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    save_pretrained(init_model(model_config("tiny", num_hidden_layers=2), seed=7), tmp_path / "one",
                    max_shard_bytes=200_000)
    assert len(list((tmp_path / "one").glob("*.safetensors"))) > 2  # several shards
    _assert_same_safetensors(tmp_path / "one", tmp_path / "two")
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary directory left


def _assert_same_safetensors(want_dir, got_dir):
    from safetensors.numpy import load_file

    names = sorted(f.name for f in want_dir.iterdir())
    assert sorted(f.name for f in got_dir.iterdir()) == names
    for name in names:
        if name.endswith(".safetensors"):
            want, got = load_file(want_dir / name), load_file(got_dir / name)
            assert want.keys() == got.keys()
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])

