"""The drills, run as their CLIs (``pytest -m drill``; the default suite leaves them out: each takes an hour or
more on a 2-core machine). The fault drill: every fault the trainer must survive, each check passing; the peer
benchmark: this project's rollout against transformers, the correctness check passing (greedy tokens equal,
logits within tolerance) before anything is timed. The default suite runs the drill's injected faults on its own
tiny settings, so that an injection the code has moved away from fails CI, not the next drill."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared import run_params

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def _run(tmp_path, *argv: str, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":"))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_fault_drills_injections_take_effect(tmp_path, policy, compilation_cache):
    """The drill's launch with a fault injected into the trainer (``fault_drill.py --only nan``, the injection that
    once went stale): NaN advantages patched into ``Trainer.learn`` must show as ``train/nonfinite_loss`` rows and
    stop the run (exit 3), and the case checks its injection's own line. On the settings of ``test_train_stops``'
    NaN test (``run_params``, on-policy) and the suite's compilation cache, which holds its programs, so the
    launch mostly loads them. The full drill (``pytest -m drill``) runs the other injections."""
    settings = [p for p in run_params(policy, "on_policy", 4) if not p.startswith("TrainConfig.num_steps")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    done = subprocess.run([sys.executable, str(HERE / "fault_drill.py"), "--root", str(tmp_path / "drill"),
                           "--only", "nan", "--steps", "4", "--cache", str(compilation_cache),
                           "--policy", str(policy), "--gin_file=", *[f"--param={p}" for p in settings]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    assert "PASS  NaN loss injected from step 2" in out and "injected: True" in out and "1 of 1 checks pass" in out


@pytest.mark.drill
def test_fault_drill_passes_every_check(tmp_path):
    done = _run(tmp_path, str(HERE / "fault_drill.py"), "--root", str(tmp_path / "drill"), timeout=4 * 3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "checks pass" in done.stdout


@pytest.mark.drill
def test_peer_benchmark_agrees_with_transformers(tmp_path):
    done = _run(tmp_path, str(HERE / "bench_peers.py"), "--systems", "project", "transformers", "--rounds", "1",
                "--startup-rounds", "0", "--no-write", timeout=2 * 3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
