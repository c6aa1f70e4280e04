"""rollverify_jax.studies: the modules that read only files, gin text or JSON import no JAX, so a report can be
rebuilt on a machine without an accelerator stack (each report module runs on a tiny setting in
tests/test_published_tables.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("name", ["seed_stats", "aot_table", "config_reference", "code_stats", "mutation_report",
                                  "planted_bugs", "sim_seeds", "sim_scale", "benchlib"])
def test_file_reading_studies_import_no_jax(name):
    code = f"import sys, rollverify_jax.studies.{name}; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "False", done.stderr[-2000:]
