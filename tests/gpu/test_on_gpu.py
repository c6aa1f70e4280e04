"""The device check on a real GPU (``pytest -m gpu``; the default suite leaves it out): every section of
check_gpu.py passes on the chip, within its own time limit. The CPU runs of the same file are
test_check_gpu.py's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("check_gpu.py")


@pytest.mark.gpu
def test_every_section_of_the_device_check_passes_on_the_gpu(tmp_path):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this machine")
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "OUT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    failed = {k: v.get("status") for k, v in report.get("sections", {}).items() if v.get("status") != "ok"}
    assert report.get("sections") and not failed, failed
