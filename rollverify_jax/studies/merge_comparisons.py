"""Puts comparisons run at different commits side by side: one table row and one plot colour per comparison.

Usage: python -m rollverify_jax.studies.merge_comparisons --name rollverify_fixes \
           --runs rollverify_before rollverify_after
Reads runs/compare_<run>/<mode>_s<seed>/metrics.jsonl (as rollverify_jax.studies.compare left them); writes
docs/results/<name>_vs_{step,wall}.png and prints the markdown table (mean ± standard error over seeds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.studies.compare import plot, summarize, table

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--runs", nargs="+", required=True, help="comparison names (runs/compare_<name>)")
    ap.add_argument("--mode", default="rollverify")
    args = ap.parse_args()
    results = {}
    for run in args.runs:
        dirs = sorted((ROOT / "runs" / f"compare_{run}").glob(f"{args.mode}_s*"))
        if not dirs:
            raise SystemExit(f"no runs/compare_{run}/{args.mode}_s* directories; "
                             "run rollverify_jax.studies.compare first")
        results[run] = [read_metrics(d / "metrics.jsonl") for d in dirs]
    plot(results, ROOT / "docs" / "results", args.name)
    print("\n".join(table({f"{run} ({len(rs)} seeds)": [summarize(r) for r in rs] for run, rs in results.items()},
                           "run")))

if __name__ == "__main__":
    main()
