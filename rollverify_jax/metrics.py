"""Run outputs at the edge of the train loop: ``metrics.jsonl``, TensorBoard scalars, console progress, gin config.

``<workdir>/metrics.jsonl`` holds one strict-JSON object per line, ``{"step": int, "<name>": number, ...}``.
Non-finite values (NaN, +-inf) are written as ``null`` so any JSON reader (jq, pandas, a browser) can parse the
file; ``read_metrics`` reads ``null`` back as ``float('nan')``. TensorBoard receives the true value.
Only process 0 writes (every host runs the same program and computes the same replicated metrics).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gin
import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
OPERATIVE_CONFIG_FILE = "operative_config.gin"
CONFIG_FILE = "config.gin"

log = logging.getLogger(__name__)


def _is_primary() -> bool:
    return jax.process_index() == 0


def to_python(name: str, value: Any) -> int | float | str | None:
    """A metric value as a plain Python scalar (jax/numpy 0-d arrays included); bools become 0/1."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise TypeError(f"Metric {name!r} must be a scalar, got shape {arr.shape}; reduce it (mean/max) first.")
    item = arr.reshape(()).item()
    if isinstance(item, bool):
        return int(item)
    if not isinstance(item, int | float):
        raise TypeError(f"Metric {name!r} has unsupported type {type(value).__name__} ({arr.dtype}).")
    return item


def _json_value(value: int | float | str) -> int | float | str | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _read_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) pairs; a line that does not parse (cut off by a crash mid-write) is skipped with a warning."""
    records = []
    if not path.exists():
        return records
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append((line, json.loads(line)))
            except json.JSONDecodeError:
                log.warning("Skipping unparsable line %d of %s: %.80s", lineno, path, line)
    return records


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` (``path`` is the file or its workdir); ``null`` values come back as NaN."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"No metrics file at {path}; is this a workdir written by MetricsWriter?")
    return [{k: float("nan") if v is None else v for k, v in r.items()} for _, r in _read_lines(path)]


class MetricsWriter:
    """Appends ``{"step", **metrics}`` to ``<workdir>/metrics.jsonl`` (flushed per write) and to TensorBoard.

    Pass ``resume_step`` when resuming into the same workdir: records with ``step >= resume_step`` (written after
    the checkpoint being resumed) are dropped first, so the file has no duplicated steps.
    """

    def __init__(self, workdir: str | Path, use_tensorboard: bool = True, resume_step: int | None = None,
                 active: bool | None = None):
        self.workdir = Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.tensorboard_dir = self.workdir / TENSORBOARD_DIR
        self.use_tensorboard = use_tensorboard
        self.active = _is_primary() if active is None else active
        self._file = None
        self._tb = None
        if not self.active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_file(resume_step)
        self._file = self.path.open("a")
        self._open_tensorboard(purge_step=resume_step)

    def _open_tensorboard(self, purge_step: int | None) -> None:
        if not self.use_tensorboard:
            return
        from tensorboardX import SummaryWriter  # imported lazily: only runs that log to TensorBoard pay for it

        # purge_step makes TensorBoard discard events at or after it from earlier (pre-resume) event files.
        self._tb = SummaryWriter(str(self.tensorboard_dir), purge_step=purge_step, flush_secs=30)

    def _truncate_file(self, step: int) -> int:
        records = _read_lines(self.path)
        kept = [line for line, r in records if int(r.get("step", -1)) < step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(tmp, self.path)  # atomic: a crash here leaves the old or the new file, never half of one
        return len(records) - len(kept)

    def truncate_after(self, step: int) -> int:
        """Drops records with ``step >= step`` (and tells TensorBoard to purge them); returns how many were dropped."""
        if not self.active:
            return 0
        if self._file is not None:
            self._file.close()
        dropped = self._truncate_file(step)
        self._file = self.path.open("a")
        if self._tb is not None:
            self._tb.close()
            self._open_tensorboard(purge_step=step)
        return dropped

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Writes one record; returns it with Python scalars (non-finite floats kept, not nulled)."""
        record: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            if name == "step":
                continue
            record[name] = to_python(name, value)
        if not self.active:
            return record
        if self._file is None:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed.")
        line = json.dumps({k: _json_value(v) for k, v in record.items()}, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in record.items():  # an undefined value (NaN: nothing to measure) is no point
                if name != "step" and not isinstance(value, str) and math.isfinite(value):
                    self._tb.add_scalar(name, value, global_step=record["step"])
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProgressBar:
    """tqdm over training steps with the numbers a person watches; silent off a TTY, off process 0, or disabled."""

    POSTFIX_KEYS = (("reward", "reward/mean"), ("acc", "eval/accuracy"), ("tok/s", "rollout/tokens_per_s"))

    def __init__(self, total_steps: int | None = None, start_step: int = 0, disable: bool = False,
                 desc: str = "train"):
        from tqdm.auto import tqdm

        self.disabled = disable or not sys.stderr.isatty() or not _is_primary()
        self._postfix: dict[str, str] = {}
        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, disable=self.disabled,
                         dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves the bar to ``step``; metrics not reported this step (held-out accuracy) keep their last value."""
        self._postfix["step"] = str(int(step))
        for label, key in self.POSTFIX_KEYS:
            if metrics and key in metrics:
                value = float(to_python(key, metrics[key]))
                self._postfix[label] = f"{value:.0f}" if label == "tok/s" else f"{value:.3f}"
        if self.disabled:
            return
        self._bar.set_postfix(self._postfix, refresh=False)
        self._bar.update(max(int(step) - self._bar.n, 0))

    @property
    def postfix(self) -> dict[str, str]:
        return dict(self._postfix)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save_operative_config(workdir: str | Path) -> tuple[Path, Path]:
    """Writes the gin config in effect so a run can be reproduced from its workdir alone.

    ``operative_config.gin`` holds the parameters of configurables that were actually called (so call this after
    the model, optimizer and data have been built); ``config.gin`` holds every binding that was parsed.
    """
    workdir = Path(workdir)
    operative, parsed = workdir / OPERATIVE_CONFIG_FILE, workdir / CONFIG_FILE
    if _is_primary():
        workdir.mkdir(parents=True, exist_ok=True)
        operative.write_text(gin.operative_config_str())
        parsed.write_text(gin.config_str())
    return operative, parsed
