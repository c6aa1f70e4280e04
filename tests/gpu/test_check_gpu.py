"""tests/gpu/check_gpu.py, the one prepared script a GPU session runs: its speed sections on CPU in --small mode
(Pallas interpret mode, the reference prefill), so a device's minutes never find a broken code path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("check_gpu.py")


def _run(tmp_path, *flags, timeout=900):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ROLLVERIFY_COMPILATION_CACHE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a one-GPU machine
    done = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--small", "--out", str(out), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else {}
    return done, report


@pytest.mark.end_to_end  # the whole script in a subprocess: started first under xdist (conftest.py)
def test_speed_sections_run_on_cpu_and_report_what_a_gpu_session_needs(tmp_path):
    done, report = _run(
        tmp_path, "--sections", "long_context", "decode_throughput", "decode_fixed_cost", "train_step",
        "compile_config", "--compile-config", "configs/tiny_base.gin", "--concurrency", "4", "--new-tokens", "8",
        "--fixed-steps", "1", "2", "--fixed-dispatches", "1", "--long-engine-context", "256",
        "--long-engine-new", "4", "--train-rows", "4", "--train-width", "64")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = report["sections"]
    assert {k: v["status"] for k, v in s.items()} == {k: "ok" for k in (
        "env", "long_context", "decode_throughput", "decode_fixed_cost", "train_step", "compile_config")}
    att = s["long_context"]["attention"]
    # The GPU default at a 22,528-token context is the Pallas GPU kernel, equal to the reference there.
    assert att["shape"]["context"] == 22_528 and att["gpu_default_impl"] == "pallas_gpu" and att["ok"]
    assert att["gpu_default"]["max_abs_err"] <= att["tol"] and att["chunked"]["max_abs_err"] <= att["tol"]
    engine = s["long_context"]["engine"]
    assert engine["runs"]["gpu_default"]["paged_impl"] == "pallas_gpu" and engine["tokens_equal_fraction"] == 1.0
    runs = s["decode_throughput"]["runs"]
    assert [r["dispatch_ahead"] for r in runs] == [False, True]
    assert all(0 < r["roofline_fraction"] < 1 and r["decode_s_per_step"] > 0 for r in runs)
    fixed = s["decode_fixed_cost"]
    assert set(fixed["fit"]) >= {"per_dispatch_s", "per_step_s"} and fixed["step_ops"]["launching"] > 0
    assert "kernels" in fixed["profile"]  # on CPU no device kernels: the trace is read all the same
    (train,) = s["train_step"]["runs"]
    assert train["finite"] and 0 < train["mfu"] < 1 and 0 < train["train/useful_token_fraction"] <= 1
    (compiled,) = s["compile_config"]["by_layers"]
    assert compiled["layers"] == 1 and set(compiled["programs"]) == {"train_step", "prefill", "decode"}
    assert "==== summary ====" in done.stdout


def test_the_watchdog_writes_the_report_and_ends_the_run_at_its_hard_limit(tmp_path):
    done, report = _run(tmp_path, "--sections", "long_context", "--hard-limit-s", "3", timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "long_context" in report["watchdog"] and report["sections"]["env"]["status"] == "ok"


def test_without_a_gpu_or_allow_cpu_it_refuses_and_says_so(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}  # this checkout's package
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no GPU" in json.loads(out.read_text())["error"]
