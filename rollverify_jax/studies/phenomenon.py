"""Issue 28's study: every configs/phenomenon/<row>.gin run over several seeds, each finished run's metrics kept
in git, and one report (tables, Welch tests, plots) gathered from what is there.

A run may outlast one sitting. `run` skips the (row, seed) pairs already archived and resumes an interrupted one
from its checkpoint (the same command in the same workdir), so the queue can be stopped and restarted at will.
Each finished run's metrics (the keys the report reads) go to docs/results/phenomenon/<row>/seed<k>.jsonl with the
commit and command they ran at; commit them. `report` reads the archive only.

Usage: python -m rollverify_jax.studies.phenomenon run --rows onpolicy:5 partial:1-4 rollverify:5 --steps 150 --jobs 2
       python -m rollverify_jax.studies.phenomenon report --steps 150 --name phenomenon_comparison \
           --rows onpolicy partial ...
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rollverify_jax.infra import storage
from rollverify_jax.run.metrics import pyplot, read_metrics
from rollverify_jax.studies.seed_stats import cell, mean_se, welch

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = ROOT / "configs" / "phenomenon"
ARCHIVE = ROOT / "docs" / "results" / "phenomenon"
RUNS = ROOT / "runs" / "phenomenon"
KEPT_KEYS = ("step", "time/wall", "time/step", "time/rollout", "time/train", "time/verify", "eval/accuracy",
             "reward/mean", "policy/entropy", "ops/token_mean", "ops/token_mean_vs_step_start", "verify/acceptance",
             "verify/num_verified", "verify/num_cut", "verify/tokens_removed", "mode/on_policy", "mode/switch_step",
             "response/length_mean", "staleness/mean", "staleness/max", "filter/kept_fraction",
             "rollout/slot_utilization", "policy/clip_fraction", "grad_norm")
LABELS = {"onpolicy": "on-policy GRPO", "partial": "naive partial", "rollverify": "RollVerify (ds 0.03)",
          "rollverify_verify_finished": "RollVerify, finished re-verified", "staleness": "partial + staleness filter",
          "opsfilter": "partial + OPS filter", "gspo": "partial + GSPO", "sapo": "partial + SAPO",
          "vespo": "partial + VESPO", "partial_pi_old": "naive partial, ratio vs pi_old"}


def label(row: str) -> str:
    """A row's name in tables; a row archived under a folder (`timing/onpolicy`) keeps the folder as a note."""
    folder, _, name = row.rpartition("/")
    return LABELS.get(name, name) + (f" ({folder})" if folder else "")


def archive_path(row: str, seed: int) -> Path:
    return ARCHIVE / row / f"seed{seed}.jsonl"


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "rollverify_jax", "configs"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def run_one(row: str, seed: int, steps: int) -> str:
    """One (row, seed) run in its own process (resuming its workdir if a checkpoint is there); archives it."""
    workdir = RUNS / f"{row}_s{seed}"
    cmd = [sys.executable, "-m", "rollverify_jax.train", f"--gin_file=configs/phenomenon/{row}.gin",
           f"--workdir={workdir.relative_to(ROOT)}", f"--gin_param=TrainConfig.num_steps={steps}",
           f"--gin_param=TrainConfig.seed={seed}", "--gin_param=MetricsConfig.progress='none'"]
    RUNS.mkdir(parents=True, exist_ok=True)
    at = commit()
    with open(RUNS / f"{row}_s{seed}.log", "a") as log:
        if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode:
            return f"{row} seed {seed}: failed (see {log.name})"
    return archive(workdir, archive_path(row, seed), {"row": row, "seed": seed, "steps": steps, "commit": at,
                                                      "command": " ".join(cmd[1:])})


def archive(workdir: Path, path: Path, meta: dict) -> str:
    """The run's metrics (the keys the report reads) with `meta` as the first line, written whole or not at all."""
    rows = read_metrics(workdir)
    if max((r["step"] for r in rows), default=0) < meta["steps"]:
        return f"{workdir}: stopped before step {meta['steps']}, not archived"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    kept = [{k: r[k] for k in KEPT_KEYS if k in r} for r in rows]
    text = "\n".join(json.dumps(x) for x in [{"meta": meta}, *kept]) + "\n"
    storage.write_text_atomically(path, text)  # a complete archive or none
    return f"archived {path.relative_to(ROOT)}"


def parse_rows(specs: list[str]) -> list[tuple[str, int]]:
    """'row:N' (seeds 0..N-1) or 'row:A-B' (seeds A..B) -> [(row, seed)], seed-major so that every row sees the
    same share of a busy machine."""
    seeds = {}
    for spec in specs:
        row, _, n = spec.partition(":")
        if not (CONFIGS / f"{row}.gin").is_file():
            raise ValueError(f"no configs/phenomenon/{row}.gin (rows: {sorted(p.stem for p in CONFIGS.glob('*.gin'))})")
        first, _, last = (n or "1").partition("-")
        seeds[row] = range(int(first), int(last) + 1) if last else range(int(first))
    return [(row, s) for s in range(max(max(r, default=0) for r in seeds.values()) + 1)
            for row, r in seeds.items() if s in r]


def load(row: str) -> list[tuple[dict, list[dict]]]:
    """[(meta, rows)] of the row's archived runs, by seed."""
    out = []
    for path in sorted((ARCHIVE / row).glob("seed*.jsonl"), key=lambda p: int(p.stem[4:])):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        rows = [{k: float("nan") if v is None else v for k, v in r.items()} for r in lines[1:]]
        out.append((lines[0]["meta"], rows))
    return out


# ------------------------------------------------------------------------------------------------ the report


def window(rows: list[dict], key: str, lo: int, hi: int, partial_only: bool = False) -> float:
    vals = [r[key] for r in rows if lo <= r["step"] <= hi and r.get(key) is not None and np.isfinite(r[key])
            and "time/step" in r and (not partial_only or r.get("mode/on_policy") == 0)]
    return float(np.mean(vals)) if vals else float("nan")


def evals(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, wall s, accuracy) of each held-out evaluation."""
    return [(r["step"], r.get("time/wall", 0.0), r["eval/accuracy"]) for r in rows
            if r.get("eval/accuracy") is not None and np.isfinite(r["eval/accuracy"])]


def per_run(rows: list[dict], steps: int) -> dict[str, float]:
    ev = evals(rows)
    train = [r for r in rows if r["step"] > 0 and "time/step" in r]
    cycles = [r["verify/acceptance"] for r in train if r.get("verify/num_verified")]
    switch = [r["mode/switch_step"] for r in train if r.get("mode/switch_step") is not None
              and np.isfinite(r["mode/switch_step"])]
    q = max(steps // 6, 1)  # first and last sixth of the run: "rising" compares these
    return {
        "acc0": ev[0][2], "acc": ev[-1][2], "acc_best": max(a for _, _, a in ev),
        "wall": train[-1]["time/wall"],
        "partial_fraction": float(np.mean([r.get("mode/on_policy") == 0 for r in train])),
        "ops_early": window(rows, "ops/token_mean", 1, q, True), "ops_late": window(rows, "ops/token_mean",
                                                                                      steps - q + 1, steps, True),
        "ent_early": window(rows, "policy/entropy", 1, q), "ent_late": window(rows, "policy/entropy", steps - q + 1,
                                                                              steps),
        "len_late": window(rows, "response/length_mean", steps - q + 1, steps),
        "acceptance": float(np.mean(cycles)) if cycles else float("nan"),
        "switch": switch[0] if switch else float("nan"),
        "s_per_step": float(np.mean([r["time/step"] for r in train])),
        "rollout_s": float(np.mean([r.get("time/rollout", np.nan) for r in train])),
        "train_s": float(np.mean([r.get("time/train", np.nan) for r in train])),
    }


def time_to(rows: list[dict], target: float) -> float:
    """Wall-clock seconds at the first evaluation whose accuracy reaches `target` (NaN: never)."""
    return next((w for s, w, a in evals(rows) if s > 0 and a >= target), float("nan"))


COLUMNS = [("acc0", "acc (start)", ".3f"), ("acc", "acc (end)", ".3f"), ("acc_best", "acc (best eval)", ".3f"),
           ("ops_early", "train OPS, first 1/6", ".4f"), ("ops_late", "train OPS, last 1/6", ".4f"),
           ("ent_early", "entropy, first 1/6", ".3f"), ("ent_late", "entropy, last 1/6", ".3f"),
           ("len_late", "length, last 1/6", ".1f"), ("acceptance", "acceptance", ".3f"),
           ("partial_fraction", "steps in partial", ".2f"), ("switch", "switch step", ".0f"),
           ("s_per_step", "s / step", ".2f"), ("rollout_s", "rollout s / step", ".2f"),
           ("train_s", "train s / step", ".2f"), ("wall", "wall (s)", ".0f")]


def plot(data: dict[str, list[tuple[dict, list[dict]]]], name: str) -> list[str]:
    plt = pyplot(cli=True)

    panels = [("eval/accuracy", "held-out accuracy"), ("policy/entropy", "entropy"),
              ("ops/token_mean", "train-time OPS vs mu"), ("verify/acceptance", "acceptance (cycles that verified)"),
              ("response/length_mean", "response length")]
    fig, grid = plt.subplots(2, 3, figsize=(15, 7.6))
    axes = grid.reshape(-1)  # five panels against steps, the last against wall-clock
    for i, (row, runs) in enumerate(data.items()):
        color, legend = f"C{i}", f"{label(row)} (n={len(runs)})"
        for ax, (key, title) in zip(axes, panels, strict=False):
            curves = []
            for _, rows in runs:
                pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and np.isfinite(r[key])
                       and (key != "verify/acceptance" or r.get("verify/num_verified"))
                       and (key == "eval/accuracy" or "time/step" in r)]
                if pts:
                    curves.append(dict(pts))
            if not curves:
                continue
            steps = sorted(set().union(*curves))
            m = np.array([np.nanmean([c.get(s, np.nan) for c in curves]) for s in steps])
            if key != "eval/accuracy":  # a running mean (10 steps) of the per-step series
                w = min(10, len(m))
                m = np.convolve(np.nan_to_num(m, nan=np.nanmean(m)), np.ones(w) / w, mode="valid")
                steps = steps[w - 1:]
            ax.plot(steps, m, color=color, lw=1.4, marker="o" if key == "eval/accuracy" else None, ms=3,
                    label=legend)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        ax = axes[-1]
        for j, (_, rows) in enumerate(runs):
            ev = evals(rows)
            ax.plot([w for _, w, _ in ev], [a for _, _, a in ev], color=color, alpha=0.6, lw=1, marker="o", ms=2,
                    label=legend if j == 0 else None)
        ax.set_title("held-out accuracy vs wall-clock (each seed)")
        ax.set_xlabel("wall-clock (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fname = f"{name}.png"
    fig.savefig(ARCHIVE.parent / fname, dpi=100)
    plt.close(fig)
    return [fname]


def report(rows_wanted: list[str], steps: int, name: str, reference: str, claims: list[str],
           target: float | None = None) -> str:
    """The tables (and plot) of the archived rows; `target`: the accuracy whose wall-clock is compared (default
    90% of the reference's mean gain)."""
    data = {row: [(m, r) for m, r in load(row) if m["steps"] == steps] for row in rows_wanted}
    data = {row: runs for row, runs in data.items() if runs}
    if reference not in data:
        raise ValueError(f"no archived {reference} runs of {steps} steps under {ARCHIVE}")
    stats = {row: [per_run(r, steps) for _, r in runs] for row, runs in data.items()}
    commits = sorted({m["commit"] for runs in data.values() for m, _ in runs})
    lines = [f"Runs of {steps} steps, archived under `docs/results/phenomenon/` (commits {', '.join(commits)}; "
             "each archive's first line names its commit and command). Mean ± standard error over seeds.", "",
             "| row | runs (seeds) | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "| --- " * (len(COLUMNS) + 2) + "|"]
    for row, vals in stats.items():
        seeds = f"{len(data[row])} ({','.join(str(m['seed']) for m, _ in data[row])})"
        lines.append(f"| {label(row)} | {seeds} | " +
                     " | ".join(cell([v[k] for v in vals], f) for k, _, f in COLUMNS) + " |")
    ref = stats[reference]
    ref_acc = mean_se([v["acc"] for v in ref])[0]
    acc0 = mean_se([v["acc0"] for v in ref])[0]
    why = "given" if target is not None else f"90% of {label(reference)}'s mean gain"
    target = acc0 + 0.9 * (ref_acc - acc0) if target is None else target
    lines += ["", f"Welch's t-test (two-sided) of the final held-out accuracy, each row against {label(reference)}; "
              f"wall-clock to {target:.3f} ({why}, first evaluation that reaches it; runs that never do are left "
              "out and counted):", "",
              "| row | final accuracy: difference (t, p) | wall to target (s) | reached |", "| --- | --- | --- | --- |"]
    for row, vals in stats.items():
        times = [time_to(r, target) for _, r in data[row]]
        reached = sum(np.isfinite(times))
        test = "-" if row == reference else welch([v["acc"] for v in vals], [v["acc"] for v in ref])
        lines.append(f"| {label(row)} | {test} | {cell(times, '.0f')} | {reached}/{len(times)} |")
    for a, _, b in (c.partition(":") for c in claims):
        if a in stats and b in stats:
            lines.append(f"\n{label(a)} against {label(b)}, final accuracy: "
                         f"{welch([v['acc'] for v in stats[a]], [v['acc'] for v in stats[b]])}.")
    lines += ["", *[f"![{f}]({f})" for f in plot(data, name)]]
    return "\n".join(lines) + "\n"


def probes_table(names: list[str]) -> str:
    """One row per archived probe (seed 0): evaluations, train OPS and entropy in its first and last sixth."""
    lines = ["| probe | commit | steps | held-out accuracy by step | train OPS, first → last 1/6 | "
             "entropy, first → last 1/6 | staleness mean (max) | clipped tokens | acceptance | s / step |",
             "| --- " * 10 + "|"]
    for name in names:
        for meta, rows in load(f"probes/{name}"):
            steps = max(r["step"] for r in rows)
            q = max(steps // 6, 1)
            acc = ", ".join(f"{a:.3f} ({s})" for s, _, a in evals(rows))
            cycles = [r["verify/acceptance"] for r in rows if r.get("verify/num_verified")]
            train = [r["time/step"] for r in rows if "time/step" in r]
            ops = [window(rows, "ops/token_mean", lo, hi, True) for lo, hi in ((1, q), (steps - q + 1, steps))]
            ent = [window(rows, "policy/entropy", lo, hi) for lo, hi in ((1, q), (steps - q + 1, steps))]
            stale = [r["staleness/max"] for r in rows if r.get("staleness/max") is not None]
            lines.append(f"| {name} | {meta['commit']} | {steps} | {acc} | " +
                         (" → ".join(f"{x:.4f}" for x in ops) if np.isfinite(ops[0]) else "-") + " | " +
                         " → ".join(f"{x:.3f}" for x in ent) + " | " +
                         f"{window(rows, 'staleness/mean', 1, steps):.1f} ({max(stale, default=0):.0f}) | "
                         f"{window(rows, 'policy/clip_fraction', 1, steps):.4f} | " +
                         (f"{np.mean(cycles):.3f}" if cycles else "-") + f" | {np.mean(train):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the (row, seed) pairs not archived yet")
    r.add_argument("--rows", nargs="+", required=True, metavar="ROW:SEEDS")
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--jobs", type=int, default=2)
    a = sub.add_parser("archive", help="archive one finished workdir (a probe) as <row>/seed<k>.jsonl")
    a.add_argument("--workdir", required=True)
    a.add_argument("--row", required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--steps", type=int, default=150)
    a.add_argument("--commit", required=True, help="the commit the run ran at")
    a.add_argument("--command", required=True, help="the command it ran with")
    t = sub.add_parser("probes", help="print the table of archived probes (docs/results/phenomenon/probes/<name>)")
    t.add_argument("names", nargs="+")
    p = sub.add_parser("report", help="tables and plots from the archive (writes docs/results/<name>.md)")
    p.add_argument("--rows", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--name", default="phenomenon_comparison")
    p.add_argument("--reference", default="onpolicy")
    p.add_argument("--target", type=float, help="the accuracy to time (default: 90%% of the reference's gain)")
    p.add_argument("--claims", nargs="*", default=["rollverify:partial"], metavar="A:B",
                   help="extra Welch tests of final accuracy, row A against row B")
    args = ap.parse_args()
    try:
        if args.cmd == "run":
            todo = [(row, s) for row, s in parse_rows(args.rows) if not archive_path(row, s).is_file()]
            print(f"{len(todo)} runs to do: {todo}", flush=True)
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                for msg in pool.map(lambda p: run_one(*p, args.steps), todo):
                    print(msg, flush=True)
        elif args.cmd == "probes":
            print(probes_table(args.names), end="")
        elif args.cmd == "archive":
            print(archive(Path(args.workdir), archive_path(args.row, args.seed),
                          {"row": args.row, "seed": args.seed, "steps": args.steps, "commit": args.commit,
                           "command": args.command}))
        else:
            out = ARCHIVE.parent / f"{args.name}.md"
            reference = f" --reference {args.reference}" if args.reference != "onpolicy" else ""
            claims = f" --claims {' '.join(args.claims)}" if args.claims else ""
            target = f" --target {args.target}" if args.target is not None else ""
            command = f"python -m rollverify_jax.studies.phenomenon report --rows {' '.join(args.rows)} " \
                      f"--steps {args.steps} --name {args.name}{reference}{claims}{target}"
            out.write_text(f"# {args.name}\n\nCommand: `{command}`\n\n" +
                           report(args.rows, args.steps, args.name, args.reference, args.claims, args.target))
            print(f"wrote {out.relative_to(ROOT)}")
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
