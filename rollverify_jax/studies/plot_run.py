"""Plots of one or more training runs from their ``metrics.jsonl``: one PNG per topic, one line per run.

Usage: python -m rollverify_jax.studies.plot_run RUN_DIR [RUN_DIR ...] [--out DIR]
RUN_DIR is a workdir (``runs/<name>``) or its ``metrics.jsonl``. Writes accuracy.png, reward.png, entropy.png,
ops.png, acceptance.png, rollout.png and time.png to --out (default: RUN_DIR/plots for one run, ./plots for
several). A metric a run lacks (a mode without verification, a run never evaluated) is skipped with a note.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from rollverify_jax.run.metrics import METRICS_FILE, pyplot, read_metrics

ROOT = Path(__file__).resolve().parents[2]

# file stem -> (figure title, [(metric key, panel title), ...])
FIGURES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "accuracy": ("held-out accuracy", [("eval/accuracy", "eval/accuracy")]),
    "reward": ("reward", [("reward/mean", "reward/mean"), ("reward/correct_fraction", "reward/correct_fraction")]),
    "entropy": ("policy entropy", [("policy/entropy", "policy/entropy")]),
    "ops": ("off-policy shift", [("ops/token_mean", "ops/token_mean (train-time token OPS)")]),
    "acceptance": ("verification", [("verify/acceptance", "verify/acceptance (cycles that verified)"),
                                    ("verify/acceptance_window", "verify/acceptance_window (switching)"),
                                    ("verify/regen_equal_rate", "verify/regen_equal_rate")]),
    "rollout": ("rollout", [("rollout/slot_utilization", "rollout/slot_utilization"),
                            ("rollout/tokens_per_s", "rollout/tokens_per_s")]),
    "time": ("time per step (s)", [("time/step", "time/step"), ("time/rollout", "time/rollout"),
                                   ("time/verify", "time/verify"), ("time/grading", "time/grading"),
                                   ("time/train", "time/train"), ("time/eval", "time/eval")]),
}
# The parts of a step's time for the split bar (time/step minus these is "other": selection, packing, ...).
TIME_PARTS = ["time/rollout", "time/verify", "time/grading", "time/train"]


class InputError(Exception):
    """A run directory that cannot be plotted: reported as one ``error:`` line, exit status 2."""


def load_run(path: str) -> list[dict]:
    """The records of a workdir (or of a metrics.jsonl file); InputError when there are none to read."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path} does not exist")
    if p.is_dir() and not (p / METRICS_FILE).is_file():
        raise InputError(f"{path} has no {METRICS_FILE} (is it a training workdir?)")
    try:
        rows = read_metrics(p)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e}") from e
    if not rows:
        raise InputError(f"{path} has no metrics records yet")
    return rows


def run_labels(paths: list[str]) -> list[str]:
    """Each run's name (its workdir's name); names that repeat get their parent directory too."""
    dirs = [Path(p).resolve().parent if Path(p).is_file() else Path(p).resolve() for p in paths]
    names = [d.name for d in dirs]
    return [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in dirs]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and bool(np.isfinite(value))


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key``, leaving out rows without it or with no value (NaN); acceptance only from
    cycles that verified something (elsewhere it is a placeholder)."""
    pts = [(r["step"], float(r[key])) for r in rows
           if _finite(r.get("step")) and _finite(r.get(key))
           and (key != "verify/acceptance" or r.get("verify/num_verified"))]
    a = np.asarray(pts, float).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def time_split(rows: list[dict]) -> dict[str, float] | None:
    """Total seconds of each part of the training steps (and evaluation), or None without step times."""
    train = [r for r in rows if _finite(r.get("time/step"))]
    if not train:
        return None

    def total(key: str, among: list[dict]) -> float:
        return float(sum(r[key] for r in among if _finite(r.get(key))))
    split = {k.split("/")[1]: total(k, train) for k in TIME_PARTS}
    split["other"] = max(total("time/step", train) - sum(split.values()), 0.0)
    split["eval"] = total("time/eval", rows)
    return split


def _plt():
    return pyplot(cli=True)  # the plot extra, Agg backend: files only, no display needed



LINESTYLES = ("-", "--", ":", "-.")


def lines(series: list[tuple[str, np.ndarray, np.ndarray]]) -> list[tuple[int, str, str, str]]:
    """(color index, run label, line style, legend) of each run's line in a panel, for the runs that have the
    metric. Each run gets its own dash pattern, and one whose values equal an earlier run's says so in the legend:
    identical runs would otherwise draw one line over the other and one of them would look missing."""
    out, drawn = [], []
    for i, (label, x, y) in enumerate(series):
        if not x.size:
            continue
        same = next((other for other, ox, oy in drawn
                     if np.array_equal(ox, x) and np.array_equal(oy, y, equal_nan=True)), None)
        out.append((i, label, LINESTYLES[i % len(LINESTYLES)], f"{label} (= {same})" if same else label))
        drawn.append((label, x, y))
    return out

def plot_figure(stem: str, runs: dict[str, list[dict]], out: Path, notes: list[str]) -> Path | None:
    """One PNG of the figure's panels, one line per run that has the panel's metric; None when no run has any."""
    title, panels = FIGURES[stem]
    found = {(key, label): series(rows, key) for key, _ in panels for label, rows in runs.items()}
    for (key, label), (x, _) in found.items():
        if not x.size:
            notes.append(f"note: {label} has no {key}; skipped")
    panels = [(key, t) for key, t in panels if any(found[key, label][0].size for label in runs)]
    split = {label: time_split(rows) for label, rows in runs.items()} if stem == "time" else {}
    split = {label: s for label, s in split.items() if s is not None}
    if not panels:
        return None
    plt = _plt()
    n = len(panels) + bool(split)
    cols = min(n, 3)
    rows_ = -(-n // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.5 * cols, 3.4 * rows_), squeeze=False)
    axes = axes.reshape(-1)
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax, (key, panel_title) in zip(axes, panels, strict=False):
        for i, label, style, legend in lines([(label, *found[key, label]) for label in runs]):
            x, y = found[key, label]
            ax.plot(x, y, color=f"C{i}", lw=1.2, linestyle=style,
                    marker="o" if key == "eval/accuracy" or x.size < 3 else None, ms=3, label=legend)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if split:
        _plot_split(axes[n - 1], split)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_split(ax, split: dict[str, dict[str, float]]) -> None:
    """Stacked bars: where each run's wall-clock went, summed over its steps."""
    labels = list(split)
    bottom = np.zeros(len(labels))
    for j, part in enumerate(next(iter(split.values()))):
        values = np.asarray([split[label][part] for label in labels])
        ax.bar(labels, values, bottom=bottom, color=f"C{j}", label=part)
        bottom += values
    ax.set_title("total time split (s)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.legend(fontsize=7)


def plot_runs(paths: list[str], out: Path | None = None) -> tuple[list[Path], list[str]]:
    """Writes the PNGs; returns their paths and the notes on skipped metrics. Raises InputError on bad input."""
    if not paths:
        raise InputError("no run directory given")
    runs = dict(zip(run_labels(paths), (load_run(p) for p in paths), strict=True))
    if out is None:
        first = Path(paths[0]) if Path(paths[0]).is_dir() else Path(paths[0]).parent
        out = first / "plots" if len(paths) == 1 else Path("plots")
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    written = []
    for stem in FIGURES:
        path = plot_figure(stem, runs, out, notes)
        if path is None:
            notes.append(f"note: no run has any metric of {stem}.png; not written")
        else:
            written.append(path)
    return written, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a workdir with metrics.jsonl (or the file)")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go")
    args = ap.parse_args(argv)
    try:
        written, notes = plot_runs(args.runs, args.out)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
