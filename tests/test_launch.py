"""The launch scripts (scripts/launch_tpu_pod.sh, scripts/launch_slurm.sbatch): valid bash, usage without running
anything remote, and the exact command each worker or node runs (gcloud and srun replaced by stand-ins)."""

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "scripts" / "launch_tpu_pod.sh"
SLURM = ROOT / "scripts" / "launch_slurm.sbatch"
TRAIN_ARGS = ["--gin_file=configs/qwen3_8b_dapo.gin", "--gin_param=TrainConfig.run_name = 'my run'",
              "--workdir=gs://bucket/runs/$HOME"]  # a space, quotes and a $ that must reach Python unexpanded


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH directory whose gcloud and srun record that they were called (a test then decides what they do)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcloud", "srun"):
        _tool(bin_dir, name, f'echo called >> {tmp_path / (name + ".called")}\n')
    return bin_dir


def _run(script: Path, *args: str, env: dict | None = None, bin_dir: Path | None = None):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_"))}
    full.update(env or {})
    if bin_dir is not None:
        full["PATH"] = f"{bin_dir}:{full['PATH']}"
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=full, timeout=60)


@pytest.mark.parametrize("script", [TPU, SLURM], ids=["tpu", "slurm"])
def test_scripts_are_valid_bash_and_executable(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert os.access(script, os.X_OK)
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("script", [TPU, SLURM], ids=["tpu", "slurm"])
def test_usage_on_help_or_no_args_runs_nothing(script, fake_bin, tmp_path):
    helped = _run(script, "--help", bin_dir=fake_bin)
    assert helped.returncode == 0 and helped.stdout.startswith("Usage:")
    bare = _run(script, bin_dir=fake_bin)
    assert bare.returncode == 2 and bare.stderr.startswith("Usage:") and bare.stdout == ""
    assert not list(tmp_path.glob("*.called"))  # neither gcloud nor srun ran


def test_tpu_missing_settings_are_one_error_line(fake_bin, tmp_path):
    for args, said in ((["--", "--gin_file=a.gin"], "TPU name and zone are required"),
                       (["--name", "x", "--zone", "z"], "no training arguments"),
                       (["--name"], "--name needs a value"), (["--nmae", "x"], "unknown option --nmae")):
        done = _run(TPU, *args, bin_dir=fake_bin)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1, args
    assert not list(tmp_path.glob("*.called"))


def test_tpu_every_worker_runs_the_training_command(fake_bin, tmp_path):
    """gcloud's stand-in runs --command in a shell as a worker would: the fake interpreter there must receive the
    training arguments exactly, with --distributed added."""
    worker = tmp_path / "worker"
    (worker / ".venv" / "bin").mkdir(parents=True)
    _tool(worker / ".venv" / "bin", "python", 'python3 -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' '
          '"$@" > argv.json\n')
    _tool(fake_bin, "gcloud", f'printf "%s\\n" "$@" > {tmp_path / "gcloud_args"}\n'
          'for a in "$@"; do case "$a" in --command=*) bash -c "${a#--command=}" ;; esac; done\n')
    done = _run(TPU, "--zone", "us-east5-a", "--", *TRAIN_ARGS, env={"TPU_NAME": "rv", "REPO_DIR": str(worker)},
                bin_dir=fake_bin)
    assert done.returncode == 0, done.stderr
    gcloud_args = (tmp_path / "gcloud_args").read_text().splitlines()
    assert gcloud_args[:7] == ["compute", "tpus", "tpu-vm", "ssh", "rv", "--zone=us-east5-a", "--worker=all"]
    assert json.loads((worker / "argv.json").read_text()) == ["-m", "rollverify_jax.train", "--distributed",
                                                             *TRAIN_ARGS]


def test_tpu_print_shows_the_command_and_runs_nothing(fake_bin, tmp_path):
    done = _run(TPU, "--name", "rv", "--zone", "z", "--project", "p", "--detach", "--setup", "git pull", "--print",
                "--", "--distributed", "--gin_file=a.gin", bin_dir=fake_bin)
    assert done.returncode == 0 and not list(tmp_path.glob("*.called"))
    argv = shlex.split(done.stdout)
    assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rv", "--zone=z", "--worker=all"]
    assert argv[-1] == "--project=p"
    command = argv[8].removeprefix("--command=")
    # The repository and log stay ~/... so that they expand on the worker; --distributed is not doubled.
    assert command == ("cd ~/rollverify_jax && { git pull; } && nohup .venv/bin/python -m rollverify_jax.train "
                       "--distributed --gin_file=a.gin > ~/rollverify_train.log 2>&1 < /dev/null &")


def test_slurm_runs_one_task_per_node_owning_every_gpu(fake_bin, tmp_path):
    _tool(fake_bin, "srun", f'python3 -c \'import json, os, sys; print(json.dumps([os.environ.get('
          f'"JAX_LOCAL_DEVICE_IDS"), *sys.argv[1:]]))\' "$@" > {tmp_path / "srun.json"}\n')
    env = {"SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": "/shared/rollverify_jax", "SLURM_GPUS_ON_NODE": "8"}
    done = _run(SLURM, *TRAIN_ARGS, env=env, bin_dir=fake_bin)
    assert done.returncode == 0, done.stderr
    device_ids, *argv = json.loads((tmp_path / "srun.json").read_text())
    assert device_ids == "0,1,2,3,4,5,6,7"
    assert argv == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label", "--chdir=/shared/rollverify_jax",
                    "/shared/rollverify_jax/.venv/bin/python", "-m", "rollverify_jax.train", "--distributed",
                    *TRAIN_ARGS]


def test_slurm_outside_a_job_refuses_to_run(fake_bin, tmp_path):
    done = _run(SLURM, "--gin_file=a.gin", bin_dir=fake_bin)
    assert done.returncode == 2 and "not inside a SLURM job" in done.stderr
    assert not list(tmp_path.glob("*.called"))
