"""The drills, run as their CLIs (``pytest -m drill``; the default suite leaves them out: each takes an hour or
more on a 2-core machine). The fault drill: every fault the trainer must survive, each check passing; the peer
benchmark: this project's rollout against transformers, the correctness check passing (greedy tokens equal,
logits within tolerance) before anything is timed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def _run(tmp_path, *argv: str, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":"))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
