"""Runs rollout modes (or any gin configs) side by side with the same seeds and budget, and writes
docs/results/<name>.md + plots.

Each run is a separate process (`python -m rollverify_jax.train`) so wall-clock numbers are not shared.
Usage: python -m rollverify_jax.studies.compare --name tiny_modes \
           --modes onpolicy partial staleness opsfilter rollverify \
           --steps 40 [--seeds 0 1 2] [--jobs 2] [--time_budget_s 0] [--gin_param ...]
       python -m rollverify_jax.studies.compare --name mine \
           --configs configs/tiny_rollverify.gin my_variant.gin --steps 40
A mode is configs/tiny_<mode>.gin; --configs takes any gin files instead (each row named by its file's stem).
With several seeds the table shows mean +- standard error over seeds; plots show the mean curve.
--jobs N runs N processes at once (seed-major order, so every config sees the same share of a busy machine);
wall-clock columns then include the contention, which the report says.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from rollverify_jax.run.metrics import pyplot, read_metrics
from rollverify_jax.studies.seed_stats import cell

ROOT = Path(__file__).resolve().parents[2]

LABELS = {"onpolicy": "on-policy GRPO", "partial": "naive partial", "staleness": "partial + staleness filter",
          "opsfilter": "partial + OPS filter", "rollverify": "RollVerify", "gspo": "partial + GSPO",
          "sapo": "partial + SAPO", "vespo": "partial + VESPO", "rollverify_async": "async RollVerify",
          "async_unverified": "async, unverified (re-prefill)", "async_keep_kv": "async, stale KV kept"}
DEFAULT_MODES = ["onpolicy", "partial", "staleness", "opsfilter", "rollverify"]
PLOTS = [("eval/accuracy", "held-out accuracy"), ("policy/entropy", "entropy"), ("ops/token_mean", "train-time OPS"),
         ("verify/acceptance", "acceptance (cycle)")]


def entries(modes: list[str] | None, configs: list[str] | None) -> dict[str, str]:
    """{name: gin file} of the runs to compare: the given configs (named by their stems, absolute paths since
    each run starts in the repository root), else the modes' tiny configs. ValueError on bad input, before any
    run starts."""
    if modes and configs:
        raise ValueError("give --modes or --configs, not both")
    if not configs:
        out = {m: f"configs/tiny_{m}.gin" for m in modes or DEFAULT_MODES}
        missing = [m for m, f in out.items() if not (ROOT / f).is_file()]
        if missing:
            raise ValueError(f"no configs/tiny_<mode>.gin for modes {missing}")
        return out
    out = {}
    for c in configs:
        path = Path(c).resolve()
        if not path.is_file():
            raise ValueError(f"gin file {c} does not exist")
        if path.stem in out:
            raise ValueError(f"two configs are named {path.stem!r}; rename one (rows are named by file stem)")
        out[path.stem] = str(path)
    return out


def run_mode(gin_file: str, workdir: Path, steps: int, budget: float, seed: int, extra: list[str],
             quiet: bool = False) -> None:
    """One training run in its own process; with `quiet` (concurrent runs) its output goes to <workdir>.log."""
    cmd = [sys.executable, "-m", "rollverify_jax.train", f"--gin_file={gin_file}", f"--workdir={workdir}",
           f"--gin_param=TrainConfig.num_steps={steps}", f"--gin_param=TrainConfig.time_budget_s={budget}",
           f"--gin_param=TrainConfig.seed={seed}", *[f"--gin_param={p}" for p in extra]]
    print("+", " ".join(cmd), flush=True)
    if not quiet:
        subprocess.run(cmd, check=True, cwd=ROOT)
        return
    log = workdir.parent / f"{workdir.name}.log"  # beside the workdir: the run creates (and owns) the workdir
    with open(log, "w") as f:
        if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"run {workdir} failed; its output is in {log}")


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pts = [(r["step"], r.get("time/wall", np.nan), r[key]) for r in rows if r.get(key) is not None
           and (key != "verify/acceptance" or r.get("verify/num_verified"))]  # only cycles that verified
    if not pts:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    a = np.asarray(pts, float)
    return a[:, 0], a[:, 1], a[:, 2]


def summarize(rows: list[dict]) -> dict:
    train = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]

    def mean(key, rows=train):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return float(np.mean(vals)) if vals else float("nan")

    def last5(key):  # where the run ended up, against the mean over the run
        return mean(key, train[-5:])
    switch = [r["mode/switch_step"] for r in train if r.get("mode/switch_step") is not None]
    regen = [(r["verify/regen_tokens"], r["verify/regen_equal_rate"]) for r in train if r.get("verify/regen_tokens")]
    accepted = [r["verify/acceptance"] for r in train if r.get("verify/num_verified")]  # cycles that verified
    partial_ops = [r["ops/token_mean"] for r in train if r.get("mode/on_policy") == 0 and r.get("ops/token_mean")
                   is not None]
    return {
        "steps": train[-1]["step"] if train else 0,
        "acc0": evals[0]["eval/accuracy"] if evals else float("nan"),
        "acc": evals[-1]["eval/accuracy"] if evals else float("nan"),
        "reward": float(np.mean([r["reward/mean"] for r in train[-5:]])) if train else float("nan"),
        "wall": train[-1]["time/wall"] if train else 0.0,
        "rollout": sum(r["time/rollout"] for r in train), "train": sum(r["time/train"] for r in train),
        "verify": sum(r["time/verify"] for r in train), "util": mean("rollout/slot_utilization"),
        "ops": mean("ops/token_mean"),
        # Before a switch: the train-time OPS of batches that partial rollout built (on-policy batches have ~0).
        "ops_partial": float(np.mean(partial_ops)) if partial_ops else float("nan"),
        "acceptance": float(np.mean(accepted)) if accepted else float("nan"),
        "switch": float(switch[0]) if switch else float("nan"), "entropy": mean("policy/entropy"),
        "entropy_end": last5("policy/entropy"), "ops_end": last5("ops/token_mean"),
        "kept": mean("filter/kept_fraction"),
        "regen_equal": sum(n * x for n, x in regen) / sum(n for n, _ in regen) if regen else float("nan"),
        # Multi-turn tool use (NaN for single-turn runs: those columns are left out of the table).
        # The asynchronous mode (NaN otherwise: those columns are left out of the table).
        "staleness": mean("staleness/mean"),
        "publishes": (float(sum(r.get("publish/failed") == 0 for r in train)) if any("publish/failed" in r
                                                                                    for r in train) else float("nan")),
        "overlap_tokens": mean("overlap/tokens"),
        "tool_calls": mean("tools/calls_per_trajectory"), "turns": mean("tools/turns_mean"),
        "tool_share": mean("tools/time_share"), "tool_wait": mean("rollout/tool_wait_fraction"),
        "tool_errors": (sum(r.get("tools/errors", 0) for r in train) / sum(r.get("tools/calls", 0) for r in train)
                        if any(r.get("tools/calls") for r in train) else float("nan")),
    }


# (summary key, column header, format) of the report table
COLUMNS = [("seeds", "seeds", ".0f"), ("steps", "steps", ".0f"), ("acc0", "held-out acc (start)", ".3f"),
           ("acc", "held-out acc (end)", ".3f"),
           ("reward", "reward (last 5)", ".3f"), ("wall", "wall (s)", ".0f"), ("rollout", "rollout (s)", ".0f"),
           ("train", "train (s)", ".0f"), ("verify", "verify (s)", ".2f"), ("util", "slot util", ".3f"),
           ("ops", "mean OPS", ".5f"), ("ops_end", "OPS (last 5)", ".5f"),
           ("ops_partial", "OPS before switch", ".5f"), ("kept", "kept by filter", ".3f"),
           ("acceptance", "acceptance", ".3f"), ("regen_equal", "regen = cut", ".3f"), ("entropy", "entropy", ".3f"),
           ("entropy_end", "entropy (last 5)", ".3f"),
           ("switch", "switch step", ".1f")]
TOOL_COLUMNS = [("tool_calls", "tool calls / traj", ".2f"), ("turns", "turns", ".2f"),
                ("tool_errors", "tool error rate", ".3f"), ("tool_share", "tool time share", ".4f"),
                ("tool_wait", "slot-steps waiting on tools", ".3f")]


ASYNC_COLUMNS = [("staleness", "trained staleness", ".3f"), ("publishes", "publishes", ".1f"),
                 ("overlap_tokens", "tokens decoded per update", ".0f")]


def table(summaries: dict[str, list[dict]], first: str) -> list[str]:
    """Markdown rows, one per label, each cell the mean ± standard error over that label's runs (the tool columns
    when some run used tools, the asynchronous ones when some run was asynchronous)."""
    def used(key):
        return any(not np.isnan(r.get(key, np.nan)) for runs in summaries.values() for r in runs)
    columns = COLUMNS + (TOOL_COLUMNS if used("tool_calls") else []) + (ASYNC_COLUMNS if used("publishes") else [])
    lines = [f"| {first} | " + " | ".join(h for _, h, _ in columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    for label, runs in summaries.items():
        lines.append(f"| {label} | " + " | ".join(str(len(runs)) if k == "seeds"
                                                 else cell([r[k] for r in runs], fmt, se_of_one=True)
                                                 for k, _, fmt in columns) + " |")
    return lines


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def plot(results: dict[str, list[list[dict]]], out: Path, name: str) -> list[str]:
    """One line per mode and seed (seeds of a mode share a colour)."""
    plt = pyplot(cli=True)

    files = []
    for axis, idx in (("wall-clock (s)", 1), ("step", 0)):
        fig, axes = plt.subplots(1, len(PLOTS), figsize=(5 * len(PLOTS), 3.8))
        for ax, (key, title) in zip(axes, PLOTS, strict=True):
            for i, (mode, per_seed) in enumerate(results.items()):
                for j, rows in enumerate(per_seed):
                    s = _series(rows, key)
                    if s[2].size:
                        ax.plot(s[idx], s[2], marker="o" if key == "eval/accuracy" else None, ms=3, color=f"C{i}",
                                alpha=0.8, lw=1, label=LABELS.get(mode, mode) if j == 0 else None)
            ax.set_title(title)
            ax.set_xlabel(axis)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fname = f"{name}_vs_{'wall' if idx else 'step'}.png"
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="tiny_modes")
    ap.add_argument("--modes", nargs="+", default=None, help=f"configs/tiny_<mode>.gin (default: {DEFAULT_MODES})")
    ap.add_argument("--configs", nargs="+", default=None, metavar="GIN", help="any gin files, instead of --modes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--time_budget_s", type=float, default=0.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="TrainConfig.seed of each run")
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--skip_runs", action="store_true", help="only re-read existing workdirs and rewrite the report")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process)")
    ap.add_argument("--runs_name", default=None,
                    help="read/write the runs under runs/compare_<runs_name> (default: --name); lets several reports "
                         "share one set of runs with --skip_runs")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    pyplot(cli=True)  # the report's plots need the plot extra: said before any run starts, not after
    try:
        gin_files = entries(args.modes, args.configs)
    except ValueError as e:
        ap.error(str(e))  # one line and exit status 2
    runs = ROOT / "runs" / f"compare_{args.runs_name or args.name}"
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)

    def workdir(mode: str, seed: int) -> Path:
        return runs / (mode if args.seeds == [0] else f"{mode}_s{seed}")

    if not args.skip_runs:
        todo = [(mode, seed) for seed in args.seeds for mode in gin_files]  # seed-major: configs interleave
        for mode, seed in todo:
            if workdir(mode, seed).exists():
                shutil.rmtree(workdir(mode, seed))
        runs.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_mode, gin_files[mode], workdir(mode, seed), args.steps, args.time_budget_s,
                                   seed, args.gin_param, quiet=args.jobs > 1) for mode, seed in todo]
            for f in futures:
                f.result()
    # A re-read (--skip_runs) reports the seeds whose runs finished; the table's "seeds" column says how many.
    results = {mode: [] for mode in gin_files}
    for mode in gin_files:
        for seed in args.seeds:
            path = workdir(mode, seed) / "metrics.jsonl"
            if args.skip_runs and not path.is_file():
                continue
            rows = read_metrics(path)
            if args.skip_runs and max((r["step"] for r in rows), default=0) < args.steps:
                print(f"left out {workdir(mode, seed)}: it has not reached step {args.steps}")
                continue
            results[mode].append(rows)
    missing = [mode for mode, runs_of_mode in results.items() if not runs_of_mode]
    if missing:
        ap.error(f"no runs of {missing} under {runs}; run without --skip_runs first")
    summary = {m: [summarize(r) for r in per_seed] for m, per_seed in results.items()}
    (runs / f"summary_{args.name}.json").write_text(json.dumps(summary, indent=1))
    commit_file = runs / "commit.txt"  # the commit the runs ran at (a --skip_runs re-read keeps it)
    if not args.skip_runs:
        commit_file.write_text(_commit() + "\n")
    commit = commit_file.read_text().strip() if commit_file.exists() else "unknown"
    files = plot(results, out, args.name)
    which = f"--configs {' '.join(args.configs)}" if args.configs else f"--modes {' '.join(gin_files)}"
    lines = [f"# Comparison: {args.name}", "",
             f"Command: `python -m rollverify_jax.studies.compare --name {args.name} {which} --steps "
             f"{args.steps} --seeds {' '.join(map(str, args.seeds))} --jobs {args.jobs} " +
             (f"--runs_name {args.runs_name} " if args.runs_name else "") +
             f"--time_budget_s {args.time_budget_s}" +
             "".join(f" --gin_param \"{p}\"" for p in args.gin_param) + "`", "",
             f"Same seeds, data order and budget for every mode; each run in its own process on this machine "
             f"({args.jobs} at a time), at commit {commit}. {len(args.seeds)} seed(s): mean ± standard error over "
             "seeds; the switch step is averaged over the runs that switched (their count in brackets). "
             "Mean OPS: train-time token OPS of every batch; OPS before switch: of the batches partial rollout "
             "built. Acceptance: mean over the cycles that verified something. Regen = cut: how often a token "
             "sampled where a verification cut removed one "
             "equals the removed token.", "",
             *table({LABELS.get(m, m): per_seed for m, per_seed in summary.items()},
                    "config" if args.configs else "mode")]
    lines += ["", *[f"![{f}]({f})" for f in files], ""]
    report = out / f"{args.name}.md"
    existing = report.read_text() if report.exists() else ""
    notes = existing[existing.index("## Observations"):] if "## Observations" in existing else \
        "## Observations\n\n(written by hand after looking at the run)\n"
    report.write_text("\n".join(lines) + "\n" + notes)
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
