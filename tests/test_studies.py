"""rollverify_jax.studies: the report modules run as ``python -m`` CLIs. The simulator's scale study writes its JSON
(three rollout modes per setting), and the modules that read only files, gin text or JSON import no JAX, so a
report can be rebuilt on a machine without an accelerator stack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def test_sim_scale_writes_every_setting_in_every_mode(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, "-m", "rollverify_jax.studies.sim_scale", "--json", str(out), "--steps",
                           "3", "--sigmas", "0.75", "--fit_runs"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"] and len(report["rows"]) >= 6 * len(report["settings"])  # 3 modes x 2 variants each
    for setting in report["settings"]:
        assert set(setting["modes"]) == {"on_policy", "partial", "rollverify", "rollverify_tiny"}
        assert all(m["device_days"] > 0 for m in setting["modes"].values())


@pytest.mark.parametrize("name", ["seed_stats", "aot_table", "config_reference", "code_stats", "mutation_report",
                                  "planted_bugs", "sim_seeds", "sim_scale", "benchlib"])
def test_file_reading_studies_import_no_jax(name):
    code = f"import sys, rollverify_jax.studies.{name}; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "False", done.stderr[-2000:]
