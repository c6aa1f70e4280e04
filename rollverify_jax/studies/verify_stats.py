"""Per-step verification and cost statistics of compare.py runs, with Welch t-tests against a reference row.

Reads runs/compare_<runs_name>/<config>_s<seed>/metrics.jsonl (compare.py's layout with several seeds) and prints
a markdown table (mean ± standard error over seeds of per-run values) and Welch's t-test p-values of the held-out
accuracy at the end and of the mean time per step (or of the columns --test names), each config against the first.
Usage: python -m rollverify_jax.studies.verify_stats --runs_name study_verify --seeds 0 1 2 \
           --configs rollverify rollverify_verify_finished rollverify_train_extra [--test acc time/step ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from rollverify_jax.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

# (key, header, format, reducer): each per-run value; "step" = mean over the training steps, "partial" = mean over
# the steps whose batch partial rollout built (before a switch), "cycles" = over the cycles that verified a paused
# trajectory, "sum" = total over the run.
COLUMNS = [
    ("acc", "held-out acc (25)", ".3f", None),
    ("time/step", "s / step", ".2f", "step"),
    ("time/rollout", "rollout s / step", ".2f", "step"),
    ("rollout/prefill_time", "prefill s / step", ".2f", "step"),
    ("time/train", "train s / step", ".2f", "step"),
    ("rollout/prefill_tokens", "prefill tokens / step", ".0f", "step"),
    ("verify/acceptance", "acceptance", ".3f", "cycles"),
    ("switch", "switch step", ".1f", None),
    ("verify/num_verified", "verified / step", ".1f", "step"),
    ("verify/finished_verified", "finished re-verified / step", ".1f", "step"),
    ("verify/finished_cut", "finished cut / step", ".1f", "step"),
    ("verify/num_cut", "cut / step", ".1f", "step"),
    ("verify/num_restarted", "restarted / step", ".1f", "step"),
    ("verify/tokens_removed", "tokens removed / step", ".0f", "step"),
    ("ops/token_mean", "train OPS (partial steps)", ".4f", "partial"),
    ("staleness/mean", "batch staleness (partial steps)", ".2f", "partial"),
    ("batch/groups", "batch groups / step", ".2f", "step"),
]
TESTED = [("acc", "held-out accuracy (25)"), ("time/step", "s / step")]
HEADERS = {key: header for key, header, _, _ in COLUMNS}


def per_run(rows: list[dict]) -> dict[str, float]:
    train = [r for r in rows if r["step"] > 0 and "time/step" in r]
    partial = [r for r in train if r.get("mode/on_policy") == 0]
    cycles = [r for r in train if r.get("verify/num_verified")]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    switch = [r["mode/switch_step"] for r in train if r.get("mode/switch_step") is not None]
    out = {"acc": evals[-1]["eval/accuracy"] if evals else np.nan, "switch": float(switch[0]) if switch else np.nan}
    for key, _, _, how in COLUMNS:
        if how is None:
            continue
        src = {"step": train, "partial": partial, "cycles": cycles, "sum": train}[how]
        vals = [r[key] for r in src if r.get(key) is not None]
        out[key] = (float(np.sum(vals)) if how == "sum" else float(np.mean(vals))) if vals else np.nan
    return out


def cell(vals: list[float], fmt: str) -> str:
    v = np.asarray([x for x in vals if np.isfinite(x)], float)
    if not v.size:
        return "-"
    se = v.std(ddof=1) / np.sqrt(v.size) if v.size > 1 else 0.0
    return f"{v.mean():{fmt}} ± {se:{fmt}}" + (f" ({v.size}/{len(vals)})" if v.size < len(vals) else "")


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    from scipy import stats

    res = stats.ttest_ind(a, b, equal_var=False)
    return float(res.statistic), float(res.pvalue)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs_name", required=True)
    ap.add_argument("--configs", nargs="+", required=True, help="row names (gin stems); the first is the reference")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--test", nargs="+", default=None, metavar="KEY",
                    help=f"columns to test (default: {' '.join(k for k, _ in TESTED)}); any of {' '.join(HEADERS)}")
    args = ap.parse_args()
    unknown = [k for k in args.test or [] if k not in HEADERS]
    if unknown:
        ap.error(f"unknown --test columns {unknown}; use any of {list(HEADERS)}")
    tested = [(k, HEADERS[k]) for k in args.test] if args.test else TESTED
    runs = ROOT / "runs" / f"compare_{args.runs_name}"
    data = {c: [per_run(read_metrics(runs / f"{c}_s{s}" / "metrics.jsonl")) for s in args.seeds] for c in args.configs}
    print("| config | seeds | " + " | ".join(h for _, h, _, _ in COLUMNS) + " |")
    print("| --- " * (len(COLUMNS) + 2) + "|")
    for c, vals in data.items():
        print(f"| {c} | {len(vals)} | " + " | ".join(cell([v[k] for v in vals], f) for k, _, f, _ in COLUMNS) + " |")
    ref = args.configs[0]
    print(f"\nWelch's t-test against {ref} (two-sided, {len(args.seeds)} seeds per row):\n")
    print("| config | " + " | ".join(f"{h}: difference, t, p" for _, h in tested) + " |")
    print("| --- " * (len(tested) + 1) + "|")
    for c in args.configs[1:]:
        parts = []
        for k, _ in tested:
            a, b = [v[k] for v in data[c]], [v[k] for v in data[ref]]
            t, p = welch(a, b)
            parts.append(f"{np.mean(a) - np.mean(b):+.3f}, t = {t:.2f}, p = {p:.3f}")
        print(f"| {c} | " + " | ".join(parts) + " |")


if __name__ == "__main__":
    main()
