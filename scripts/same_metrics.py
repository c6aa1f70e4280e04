"""Whether two runs logged the same metrics, timings aside: the check that a refactor changed no behaviour.

    python scripts/same_metrics.py runs/before runs/after

Compares every row of the two workdirs' metrics.jsonl key by key, exactly (rewards, losses and log-prob-derived
metrics of a fixed seed are bitwise reproducible on one machine), leaving out the keys that measure time
(``time/*``, ``*_time``, ``*time_share``, ``*wait_s``, ``*tokens_per_s``), and the logged generations
(``samples/step_<N>.jsonl``: prompts, responses, rewards) file by file. Exit status 0 when they agree, 1 with
the differences listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def is_timing(key: str) -> bool:
    return key.startswith("time/") or key.endswith(("_time", "time_share", "wait_s", "tokens_per_s"))


def rows(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: no metrics.jsonl in {workdir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(a: list[dict], b: list[dict]) -> list[str]:
    out = []
    if [r.get("step") for r in a] != [r.get("step") for r in b]:
        out.append(f"steps differ: {[r.get('step') for r in a]} vs {[r.get('step') for r in b]}")
    for ra, rb in zip(a, b, strict=False):
        for key in sorted((set(ra) | set(rb)) - {k for k in set(ra) | set(rb) if is_timing(k)}):
            if ra.get(key) != rb.get(key):
                out.append(f"step {ra.get('step')}: {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    return out


def sample_differences(a: Path, b: Path) -> list[str]:
    names = sorted({p.name for d in (a, b) for p in (d / "samples").glob("*.jsonl")})
    return [f"samples/{n} differs" for n in names
            if not (a / "samples" / n).is_file() or not (b / "samples" / n).is_file()
            or (a / "samples" / n).read_bytes() != (b / "samples" / n).read_bytes()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    a, b = rows(args.before), rows(args.after)
    diffs = differences(a, b) + sample_differences(args.before, args.after)
    compared = sum(len([k for k in r if not is_timing(k)]) for r in a)
    samples = len(list((args.before / "samples").glob("*.jsonl")))
    if diffs:
        print("\n".join(diffs))
        print(f"{len(diffs)} differences over {len(a)} rows")
        sys.exit(1)
    print(f"same: {len(a)} rows, {compared} values (timings left out) and {samples} sample files identical")


if __name__ == "__main__":
    main()
