"""Run outputs at the edge of the train loop: ``metrics.jsonl``, TensorBoard scalars, console progress, gin config.

Console progress (``MetricsConfig.progress``): a tqdm bar on a terminal, one flushed line per step where a bar
cannot draw (a log file under nohup or SLURM, a pipe, a notebook). ``MetricsConfig.wandb_project`` also sends
every record to Weights & Biases (the optional ``wandb`` extra).

``<workdir>/metrics.jsonl`` holds one strict-JSON object per line, ``{"step": int, "<name>": number, ...}``.
Non-finite values (NaN, +-inf) are written as ``null`` so any JSON reader (jq, pandas, a browser) can parse the
file; ``read_metrics`` reads ``null`` back as ``float('nan')``. TensorBoard receives the true value.
Only process 0 writes (every host runs the same program and computes the same replicated metrics).

The workdir may be any ``etils.epath`` path (``rollverify_jax.infra.storage``): on an object store such as ``gs://``,
which cannot append, ``metrics.jsonl`` is rewritten whole at every record (one object write, never half a file),
and TensorBoard writes through tensorboardX's own ``gs://`` support (needs ``google-cloud-storage``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from rollverify_jax.infra import storage

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
OPERATIVE_CONFIG_FILE = "operative_config.gin"
CONFIG_FILE = "config.gin"

log = logging.getLogger(__name__)

PROGRESS_STYLES = ("auto", "bar", "lines", "none")
WANDB_INSTALL = "pip install -e '.[wandb]'"
WANDB_RUN_ID_FILE = "wandb_run_id"
PLOT_INSTALL = "pip install -e '.[plot]'"


class MissingExtraError(ImportError, ValueError):
    """An optional package a setting needs is not installed: a configuration error (the CLI's one-line
    ``error:``, exit status 2), still an ImportError for code that catches those."""


def pyplot(cli: bool = False) -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed: SSH, SLURM, CI), imported on first
    use: plotting is the optional ``plot`` extra, which training never needs. Without matplotlib: a
    ``MissingExtraError`` naming the extra, or with ``cli`` (the scripts) that message and exit status 2."""
    try:
        import matplotlib
    except ImportError as e:
        message = f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL}"
        if cli:
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(2) from None
        raise MissingExtraError(message) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wandb_installed() -> bool:
    if "wandb" in sys.modules:  # imported already (or blocked with None)
        return sys.modules["wandb"] is not None
    return importlib.util.find_spec("wandb") is not None


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """How a run reports besides ``metrics.jsonl`` and TensorBoard (``TrainConfig.metrics_tensorboard``).

    progress: 'auto' (a bar when stdout and stderr are terminals, else one line per step), 'bar', 'lines', 'none'.
    wandb_project: a Weights & Biases project to log every record to (None: off). A workdir is one W&B run, named
    ``wandb_run_name`` or the workdir's name, with its files under ``<workdir>/wandb``: its id is kept in
    ``<workdir>/wandb_run_id``, so a resumed run continues the same W&B run.
    profile_steps: ``(first, last)``: a ``jax.profiler`` trace of training steps first..last (inclusive) into
    ``<workdir>/profile`` (``rollverify_jax/run/profiler.py``); None: no trace.
    """

    progress: str = "auto"
    wandb_project: str | None = None
    wandb_entity: str | None = None  # the W&B team or user (None: wandb's default)
    wandb_run_name: str | None = None  # the W&B run's name (None: the workdir's name)
    profile_steps: tuple[int, int] | None = None
    # Every N training steps (0: never), this many of the step's trajectories to samples/rollout_step_<N>.jsonl:
    # prompt, response, reward, advantage, versions and pause / verification history (run/rollout_samples.py).
    rollout_samples_every: int = 0
    rollout_samples_logged: int = 8

    def __post_init__(self):
        if self.progress not in PROGRESS_STYLES:
            raise ValueError(f"MetricsConfig.progress={self.progress!r}; choose one of {list(PROGRESS_STYLES)}.")
        if self.profile_steps is not None:
            window = tuple(self.profile_steps) if isinstance(self.profile_steps, list | tuple) else ()
            if len(window) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in window) \
                    or not 1 <= window[0] <= window[1]:
                raise ValueError(f"MetricsConfig.profile_steps={self.profile_steps!r} must be (first, last) training "
                                 "steps with 1 <= first <= last, e.g. (3, 4), or None.")
            object.__setattr__(self, "profile_steps", window)  # gin may give a list: kept hashable
        if self.rollout_samples_every < 0 or self.rollout_samples_logged < 0:
            raise ValueError(f"MetricsConfig.rollout_samples_every={self.rollout_samples_every} and "
                             f"rollout_samples_logged={self.rollout_samples_logged} must be >= 0 (0: off).")
        if self.wandb_project is not None and not _wandb_installed():  # checked before any work is done
            raise MissingExtraError(f"MetricsConfig.wandb_project={self.wandb_project!r} needs the wandb package, "
                                    f"which is not installed: {WANDB_INSTALL}")


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


def _read_lines(path: epath.Path) -> list[tuple[str, dict[str, Any]]]:
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
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append((line, record))
            else:
                log.warning("Skipping unparsable line %d of %s: %.80s", lineno, path, line)
    return records


def read_metrics(path: storage.PathLike) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` (``path`` is the file or its workdir); ``null`` values come back as NaN."""
    path = storage.as_path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"No metrics file at {path}; is this a workdir written by MetricsWriter?")
    return [{k: float("nan") if v is None else v for k, v in r.items()} for _, r in _read_lines(path)]


class _JsonlFile:
    """Lines appended to a JSONL file: through an open handle on a local disk; on an object store, which cannot
    append, by rewriting the whole object per line (each write is complete and visible at once)."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._handle = path.open("a") if storage.is_local(path) else None
        self._lines = None if self._handle is not None else [line for line, _ in _read_lines(path)]

    def append(self, line: str) -> None:
        if self._handle is not None:
            self._handle.write(line + "\n")
            self._handle.flush()
            return
        self._lines.append(line)
        self.path.write_text("".join(f"{x}\n" for x in self._lines))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


class MetricsWriter:
    """Appends ``{"step", **metrics}`` to ``<workdir>/metrics.jsonl`` (flushed per write) and to TensorBoard.

    Pass ``resume_step`` when resuming into the same workdir: records with ``step >= resume_step`` (written after
    the checkpoint being resumed) are dropped first, so the file has no duplicated steps. ``wandb_run`` (from
    ``open_wandb``) receives every record too, and is finished on close.
    """

    def __init__(self, workdir: storage.PathLike, use_tensorboard: bool = True, resume_step: int | None = None,
                 active: bool | None = None, wandb_run: Any = None):
        self.workdir = storage.as_path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.tensorboard_dir = self.workdir / TENSORBOARD_DIR
        self.use_tensorboard = use_tensorboard
        self.active = _is_primary() if active is None else active
        self._file = None
        self._tb = None
        self._wandb = wandb_run
        if not self.active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_file(resume_step)
        self._file = _JsonlFile(self.path)
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
        # A crash here leaves the old or the new file, never half of one.
        storage.write_text_atomically(self.path, "".join(line + "\n" for line in kept))
        return len(records) - len(kept)

    def truncate_after(self, step: int) -> int:
        """Drops records with ``step >= step`` (and tells TensorBoard to purge them); returns how many were dropped.
        Points already sent to W&B stay there (its API cannot delete them)."""
        if not self.active:
            return 0
        if self._file is not None:
            self._file.close()
        dropped = self._truncate_file(step)
        self._file = _JsonlFile(self.path)
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
        self._file.append(line)
        if self._tb is not None:
            for name, value in record.items():  # an undefined value (NaN: nothing to measure) is no point
                if name != "step" and not isinstance(value, str) and math.isfinite(value):
                    self._tb.add_scalar(name, value, global_step=record["step"])
            self._tb.flush()
        if self._wandb is not None:  # W&B keeps its own step axis: the record's step, not a key of the dict
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProgressBar:
    """tqdm over training steps with the numbers a person watches; silent off process 0, when disabled, and off a
    TTY unless forced (a bar redrawn with carriage returns is noise in a log file)."""

    POSTFIX_KEYS = (("reward", "reward/mean"), ("acc", "eval/accuracy"), ("tok/s", "rollout/tokens_per_s"))

    def __init__(self, total_steps: int | None = None, start_step: int = 0, disable: bool = False,
                 desc: str = "train", force: bool = False):
        from tqdm.auto import tqdm

        self.disabled = disable or not (force or sys.stderr.isatty()) or not _is_primary()
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


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
    """A metric as a float, or None when it is absent or not a number (so a line never fails on an odd value)."""
    value = metrics.get(key)
    if value is None:
        return None
    try:
        value = to_python(key, value)
    except TypeError:
        return None
    return None if isinstance(value, str) else float(value)


def format_step_line(step: int, metrics: Mapping[str, Any], total_steps: int | None = None,
                     mode: str | None = None) -> str:
    """One compact ``key=value`` line of a step's headline numbers (grep- and awk-friendly); a number the step
    did not measure is left out: accuracy off evaluation steps, acceptance in cycles that verified nothing."""
    parts = [f"step={int(step)}" + (f"/{total_steps}" if total_steps else "")]

    def add(label: str, key: str, fmt: str) -> None:
        value = _number(metrics, key)
        if value is not None:
            parts.append(f"{label}={value:{fmt}}")

    add("reward", "reward/mean", ".3f")
    add("acc", "eval/accuracy", ".3f")
    on_policy = _number(metrics, "mode/on_policy")
    if on_policy is not None:  # after a switch the configured mode no longer describes the rollout
        parts.append("mode=" + ("on_policy" if on_policy else (mode or "partial")))
    if (_number(metrics, "verify/num_verified") or 0) > 0:
        add("accept", "verify/acceptance", ".3f")
    add("ops", "ops/token_mean", ".3g")
    add("tok/s", "rollout/tokens_per_s", ".0f")
    add("step_s", "time/step", ".2f")
    add("wall_s", "time/wall", ".0f")
    return " ".join(parts)


class StepLines:
    """One flushed line per step on stdout: what a log file (nohup, SLURM), a pipe or a notebook shows where a
    progress bar cannot draw. Silent off process 0 or when disabled."""

    def __init__(self, total_steps: int | None = None, mode: str | None = None, disable: bool = False):
        self.total_steps = total_steps
        self.mode = mode
        self.disabled = disable or not _is_primary()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if not self.disabled:  # sys.stdout looked up per line: it may be replaced (notebooks, capture)
            print(format_step_line(step, metrics or {}, self.total_steps, self.mode), file=sys.stdout, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> StepLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_style(requested: str = "auto") -> str:
    """The style ``open_progress`` uses: 'auto' is a bar only when both stdout and stderr are terminals."""
    if requested not in PROGRESS_STYLES:
        raise ValueError(f"progress style {requested!r}; choose one of {list(PROGRESS_STYLES)}.")
    if requested != "auto":
        return requested
    return "bar" if sys.stdout.isatty() and sys.stderr.isatty() else "lines"


def open_progress(config: MetricsConfig, total_steps: int | None = None, start_step: int = 0,
                  mode: str | None = None) -> ProgressBar | StepLines:
    """The run's progress display as ``MetricsConfig.progress`` asks (both have ``update(step, metrics)``)."""
    style = progress_style(config.progress)
    if style == "lines":
        return StepLines(total_steps=total_steps, mode=mode)
    return ProgressBar(total_steps=total_steps, start_step=start_step, disable=style == "none", force=style == "bar")


def wandb_run_id(workdir: storage.PathLike) -> str:
    """The W&B run id of this workdir: read from ``<workdir>/wandb_run_id``, or made and written there (atomically,
    once) by the first launch that logs to W&B, so every later launch resumes the same W&B run."""
    path = storage.as_path(workdir) / WANDB_RUN_ID_FILE
    if path.exists():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits
    storage.as_path(workdir).mkdir(parents=True, exist_ok=True)
    storage.write_text_atomically(path, run_id + "\n")
    return run_id


def open_wandb(config: MetricsConfig, workdir: storage.PathLike, start_step: int = 0, gin_text: str = "") -> Any:
    """A W&B run for ``MetricsWriter(wandb_run=...)``, or None when ``wandb_project`` is unset or off process 0.
    The workdir's run id (``wandb_run_id``) with ``resume='allow'``: a resume continues the W&B run, a fresh
    workdir starts one. wandb is imported only here, so runs without it never need the package."""
    if config.wandb_project is None or not _is_primary():
        return None
    try:
        import wandb
    except ImportError as e:
        raise MissingExtraError(f"MetricsConfig.wandb_project is set but wandb cannot be imported ({e}): "
                                f"{WANDB_INSTALL}") from e
    where = storage.absolute(workdir)
    # wandb keeps its files on a local disk: beside the run when the workdir is local, else in wandb's default.
    return wandb.init(project=config.wandb_project, entity=config.wandb_entity,
                      name=config.wandb_run_name or where.name, dir=str(workdir) if storage.is_local(workdir) else None,
                      id=wandb_run_id(workdir), resume="allow",
                      config={"workdir": str(where), "start_step": int(start_step),
                              "gin": gin_text})


def save_operative_config(workdir: storage.PathLike, operative_text: str, gin_text: str
                          ) -> tuple[epath.Path, epath.Path]:
    """Writes the gin config in effect so a run can be reproduced from its workdir alone.

    ``operative_config.gin`` holds every value of the run's spec, bound or default (``RunSpec.operative_text``);
    ``config.gin`` holds every binding that was parsed (``RunSpec.gin_text``).
    """
    workdir = storage.as_path(workdir)
    operative, parsed = workdir / OPERATIVE_CONFIG_FILE, workdir / CONFIG_FILE
    if _is_primary():
        workdir.mkdir(parents=True, exist_ok=True)
        operative.write_text(operative_text)
        parsed.write_text(gin_text)
    return operative, parsed


def run_summary(metrics: list[dict]) -> list[str]:
    """What the run showed, the lines a person checks first after a run: the held-out accuracy from the first
    evaluation to the last, the steps in partial mode (and the switch), slot utilization per mode, where the time
    went and the acceptance."""
    lines = []
    sets = sorted({k[len("eval/"):-len("/accuracy")] for m in metrics for k in m
                   if k.startswith("eval/") and k.endswith("/accuracy") and k != "eval/accuracy"})
    for name in ["", *sets]:
        key = f"eval/{name}/" if name else "eval/"
        evals = [m for m in metrics if f"{key}accuracy" in m]
        if evals:
            first, last = evals[0][f"{key}accuracy"], evals[-1][f"{key}accuracy"]
            at_k = ", ".join(f"{k[len(key):]} {v:.3f}" for k, v in sorted(evals[-1].items())
                             if k.startswith(key) and k[len(key):].split("@")[0] in ("pass", "maj"))
            lines.append(f"held-out accuracy{f' ({name})' if name else ''}: {first:.3f} (step {evals[0]['step']}) -> "
                         f"{last:.3f} (step {evals[-1]['step']}), {100 * (last - first):+.1f} points"
                         + (f"; last: {at_k}" if at_k else ""))
    steps = [m for m in metrics if "time/step" in m]
    if not steps:
        return lines
    partial = [m for m in steps if m.get("mode/on_policy") == 0]
    on_policy = [m for m in steps if m.get("mode/on_policy") == 1]
    switch = next((m["mode/switch_step"] for m in steps if m.get("mode/switch_step") is not None), None)
    total = sum(m["time/step"] for m in steps)
    partial_time = sum(m["time/step"] for m in partial)
    lines += [f"rollout mode: partial for {len(partial)} of {len(steps)} steps ({partial_time / max(total, 1e-9):.0%} "
             "of the step time)" + (f", switched to on-policy at step {switch}" if switch is not None else "")]
    util = [f"{name} {sum(m['rollout/slot_utilization'] for m in group) / len(group):.2f}"
            for name, group in (("partial", partial), ("on-policy", on_policy)) if group]
    lines.append("slot utilization: " + ", ".join(util))
    split = {k: sum(m.get(f"time/{k}", 0.0) for m in steps) for k in ("rollout", "verify", "train")}
    lines.append(f"time: {total:.0f} s in steps: " + ", ".join(
        f"{k} {v:.0f} s ({v / max(total, 1e-9):.0%})" for k, v in split.items()))
    accepted = [m["verify/acceptance"] for m in partial if m.get("verify/num_verified")]
    if accepted:
        def total(key: str) -> int:
            return int(sum(m.get(key, 0) for m in steps))
        lines.append(f"verification: mean cycle acceptance {sum(accepted) / len(accepted):.2f} over "
                     f"{len(accepted)} cycles; {total('verify/num_cut')} of {total('verify/num_verified')} paused "
                     f"trajectories cut, {total('verify/tokens_removed')} of their {total('verify/tokens_total')} "
                     f"tokens removed, {total('verify/regen_tokens')} regenerated")
    return lines
