"""Verification overhead: the two-stage verifier's cost alone at several [N, L] sizes, and, from a training
run's metrics, verification time (scan + bookkeeping) as a fraction of step time.

Usage: python scripts/bench_verify.py [--run runs/tiny_rollverify] [--sizes 64x256 512x4096 512x20480]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.studies import benchlib
from rollverify_jax.verify import two_stage_verify


def time_verifier(n: int, length: int, iters: int = 5) -> float:
    rng = np.random.default_rng(0)
    behavior = rng.normal(-1.0, 0.5, (n, length)).astype(np.float32)
    new = behavior + rng.normal(0, 0.02, (n, length)).astype(np.float32)
    versions = np.repeat(np.arange(4), -(-length // 4))[None, :length].repeat(n, 0).astype(np.int32)
    lengths = rng.integers(1, length + 1, n).astype(np.int32)
    args = [jax.device_put(x) for x in (new, behavior, versions, lengths)]
    two_stage_verify(*args, 0.01, 2.0).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = two_stage_verify(*args, 0.01, 2.0)
    out.block_until_ready()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", default=None, help="a training workdir whose metrics.jsonl to read")
    ap.add_argument("--sizes", nargs="+", default=["64x256", "512x4096", "512x20480"])
    args = ap.parse_args()
    rows = ["| trajectories x max cached tokens | verifier time (ms) | ns / token |", "| --- | --- | --- |"]
    for size in args.sizes:
        n, length = map(int, size.split("x"))
        s = time_verifier(n, length)
        print(f"{n:5d} x {length:6d}: {s * 1e3:8.2f} ms ({s / (n * length) * 1e9:.2f} ns/token)")
        rows.append(f"| {n} x {length} | {s * 1e3:.2f} | {s / (n * length) * 1e9:.2f} |")
    body = "\n".join(rows) + "\n\nThe jitted two-stage verifier alone (cumulative ops over padded arrays), on " \
        "device-resident inputs; it is O(N L).\n"
    if args.run:
        ms = [m for m in read_metrics(f"{args.run}/metrics.jsonl") if m["step"] > 0]
        verify = sum(m["time/verify"] for m in ms)
        step = sum(m["time/step"] for m in ms)
        verified = [m for m in ms if m.get("verify/num_verified")]
        frac = verify / step
        print(f"{args.run}: verification {verify:.3f}s of {step:.1f}s step time = {frac:.4f} "
              f"({len(verified)} of {len(ms)} steps verified cached trajectories)")
        body += (f"\nIn training (`{args.run}`, {len(ms)} steps): verification (scan + host bookkeeping inside the "
                 f"resume's keep function) took {verify:.3f} s of {step:.1f} s step time = **{frac * 100:.2f}%** "
                 f"(target <= 2%). The log-probs it verifies come from the resume prefill that resuming needs "
                 f"anyway, so no extra forward pass is counted or spent.\n")
    benchlib.write_section("Verification overhead (bench_verify.py)", body)


if __name__ == "__main__":
    main()
