"""metrics.jsonl + TensorBoard writing, resume truncation, progress bar, gin config and workdir creation."""

import json
import math
import struct

import gin
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.run import metrics as metrics_lib
from rollverify_jax.run.metrics import MetricsWriter, ProgressBar, read_metrics, save_operative_config
from rollverify_jax.run.spec import RunSpec


def read_event_scalars(tb_dir):
    """(tag, step, value) of every scalar in the TFRecord event files (no TensorFlow needed)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_write_and_read(tmp_path):
    writer = MetricsWriter(tmp_path)
    record = writer.write(3, {"reward/mean": jnp.float32(0.25), "mode/on_policy": True,
                              "eval/accuracy": np.float64(0.5), "response/length_max": np.int32(17),
                              "ops/token_mean": float("nan"), "note": "x"})
    assert record["mode/on_policy"] == 1 and isinstance(record["response/length_max"], int)
    # Flushed per write: readable before close.
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line == {"step": 3, "reward/mean": 0.25, "mode/on_policy": 1, "eval/accuracy": 0.5,
                    "response/length_max": 17, "ops/token_mean": None, "note": "x"}
    writer.write(4, {"reward/mean": 0.5})
    writer.close()
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == [3, 4] and math.isnan(got[0]["ops/token_mean"])
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["reward/mean"] == 0.5


def test_rejects_non_scalar(tmp_path):
    with MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        with pytest.raises(TypeError, match="'logp' must be a scalar"):
            writer.write(0, {"logp": np.zeros(3)})


def test_truncate_on_resume(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(10):
            writer.write(step, {"reward/mean": step / 10})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 10, "reward/me')  # the process died mid-line
    with MetricsWriter(tmp_path, resume_step=6) as writer:  # resumed from the step-6 checkpoint
        for step in range(6, 8):
            writer.write(step, {"reward/mean": step / 10 + 1})
        assert writer.truncate_after(7) == 1
        writer.write(7, {"reward/mean": 2.0})
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == list(range(8))
    assert read_metrics(tmp_path)[6]["reward/mean"] == 1.6
    assert (tmp_path / "tensorboard").is_dir()


def test_tensorboard_event_file(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"reward/mean": 0.5, "rollout/tokens_per_s": 1234.0})
        writer.write(2, {"reward/mean": 0.75, "verify/regen_equal_rate": float("nan")})
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert files and all(f.stat().st_size > 0 for f in files)
    scalars = read_event_scalars(tmp_path / "tensorboard")
    assert ("reward/mean", 2, 0.75) in scalars and ("rollout/tokens_per_s", 1, 1234.0) in scalars
    assert not any(tag == "verify/regen_equal_rate" for tag, _, _ in scalars)  # undefined: no point, no warning


def test_no_tensorboard_and_inactive(tmp_path):
    with MetricsWriter(tmp_path / "a", use_tensorboard=False) as writer:
        writer.write(0, {"x": 1})
    assert not (tmp_path / "a" / "tensorboard").exists()
    with MetricsWriter(tmp_path / "b", active=False) as writer:  # a non-zero process
        assert writer.write(0, {"x": 1}) == {"step": 0, "x": 1}
    assert not (tmp_path / "b").exists()


def test_progress_bar_postfix():
    with ProgressBar(total_steps=10, disable=True) as bar:
        bar.update(1, {"reward/mean": 0.5, "eval/accuracy": 0.25, "rollout/tokens_per_s": 1500.4})
        bar.update(2, {"reward/mean": jnp.float32(0.75)})  # no held-out eval this step: keep the last value
        assert bar.disabled
        assert bar.postfix == {"step": "2", "reward": "0.750", "acc": "0.250", "tok/s": "1500"}
    assert ProgressBar().disabled  # pytest's stderr is not a TTY


def test_progress_bar_on_tty(monkeypatch, capsys):
    monkeypatch.setattr(metrics_lib.sys.stderr, "isatty", lambda: True, raising=False)
    bar = ProgressBar(total_steps=4, start_step=1)
    assert not bar.disabled
    bar.update(3, {"reward/mean": 0.5})
    assert bar._bar.n == 3
    bar.close()


def test_save_operative_config(tmp_path):
    gin.parse_config("CheckpointConfig.save_interval_steps = 7")
    spec = RunSpec.from_gin()
    assert spec.checkpoint.save_interval_steps == 7
    operative, parsed = save_operative_config(tmp_path, spec.operative_text(), spec.gin_text)
    assert "CheckpointConfig.save_interval_steps = 7" in operative.read_text()
    assert "CheckpointConfig.save_interval_steps = 7" in parsed.read_text()
    # Every value in effect, the defaults too, and in gin syntax: it parses back to the same spec.
    assert "RolloutConfig.mode = 'on_policy'" in operative.read_text()
    gin.clear_config()
    gin.parse_config_file(str(operative))
    assert RunSpec.from_gin().settings() == spec.settings()
    assert operative == tmp_path / "operative_config.gin" and parsed == tmp_path / "config.gin"
