"""Per-token decode: attention over live pages only vs over the whole page table, interleaved in one run.

The fixed-length workload of the peer comparison: the embedded tiny policy (``assets/tiny_policy``), N
concurrent sequences of synthetic prompts, each forced to exactly ``--new`` tokens (EOS off), sampled at T = 1.
Both engines run the same requests round after round (order alternating), after a warm-up that compiles every
shape; tokens/s is generated tokens over the wall-clock of the whole rollout (admission, prefill, decode).

Usage: python scripts/bench_decode.py [--concurrent 64 256] [--new 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchlib
import numpy as np

from rollverify_jax.models import load_pretrained
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory

POLICY = "assets/tiny_policy"


def requests(n: int, new: int, seed: int, vocab: int = 40) -> list[Trajectory]:
    """Random in-vocabulary prompts (ids 4 and up: the tiny policy's special tokens are 0-3)."""
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(24, 33)).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=new) for i in range(n)]


def rollout(engine: Engine, reqs: list[Trajectory]) -> tuple[float, int]:
    """(seconds, tokens) to generate every request to its length through the scheduler."""
    sched = Scheduler(engine)
    t0 = time.perf_counter()
    sched.submit(reqs)
    sched.run()
    finished = sched.take_finished()
    assert len(finished) == len(reqs)
    return time.perf_counter() - t0, sum(t.num_tokens for t in finished)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrent", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-dispatch", type=int, default=8)
    args = ap.parse_args()
    model = load_pretrained(POLICY)
    rows = ["| concurrent | live pages tokens/s | whole table tokens/s | live / whole (median of paired ratios) |",
            "| --- | --- | --- | --- |"]
    for n in args.concurrent:
        engines = {}
        for live in (True, False):
            cfg = EngineConfig(num_slots=n, page_size=16, max_seq_len=320, steps_per_dispatch=args.steps_per_dispatch,
                               live_pages=live)
            engines[live] = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=())
            engines[live].warmup()
            rollout(engines[live], requests(n, args.new, seed=999))  # warm: every live-page bucket compiled
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for live in ((True, False) if r % 2 == 0 else (False, True)):
                seconds, tokens = rollout(engines[live], requests(n, args.new, seed=r))
                rates[live].append(tokens / seconds)
        ratio = statistics.median(a / b for a, b in zip(rates[True], rates[False], strict=True))
        live, whole = statistics.median(rates[True]), statistics.median(rates[False])
        print(f"{n} concurrent: live pages {live:.0f} tok/s, whole table {whole:.0f} tok/s, ratio {ratio:.2f}x")
        rows.append(f"| {n} | {live:.0f} | {whole:.0f} | {ratio:.2f}x |")
    body = "\n".join(rows) + (
        f"\n\nFixed-length workload: {args.new} new tokens per sequence (EOS off), prompts of 24-32 tokens, "
        f"`{POLICY}`, T = 1, {args.steps_per_dispatch} decode steps per dispatch, page size 16, context 320; "
        f"medians of {args.rounds} interleaved rounds. `EngineConfig.live_pages` on: decode attention reads the "
        "page-table columns some slot holds, rounded up to a bucket (halvings of the table: 5, 10 or 20 "
        "columns); off: all 20 columns.")
    benchlib.write_section("Decode: attention over live pages (bench_decode.py)", body)


if __name__ == "__main__":
    main()
