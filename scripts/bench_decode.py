"""Per-token decode, two engine settings interleaved in one run: attention over live pages only vs over the whole
page table (``--compare live_pages``), or decode n + 1 dispatched before n is read vs in turn
(``--compare dispatch_ahead``, ``EngineConfig.dispatch_ahead``).

The fixed-length workload of the peer comparison: the embedded tiny policy (``assets/tiny_policy``), N
concurrent sequences of synthetic prompts, each forced to exactly ``--new`` tokens (EOS off), sampled at T = 1.
Both engines run the same requests round after round (order alternating), after a warm-up that compiles every
shape; tokens/s is generated tokens over the wall-clock of the whole rollout (admission, prefill, decode).

Usage: python scripts/bench_decode.py [--compare live_pages|dispatch_ahead] [--concurrent 64 256] [--new 128]
[--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rollverify_jax.models import load_pretrained
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.studies import benchlib

POLICY = "assets/tiny_policy"


def requests(n: int, new: int, seed: int, vocab: int = 40) -> list[Trajectory]:
    """Random in-vocabulary prompts (ids 4 and up: the tiny policy's special tokens are 0-3)."""
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(24, 33)).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=new) for i in range(n)]


def rollout(engine: Engine, reqs: list[Trajectory]) -> tuple[float, int, dict]:
    """(seconds, tokens, the scheduler's time split) to generate every request to its length."""
    sched = Scheduler(engine)
    t0 = time.perf_counter()
    sched.submit(reqs)
    sched.run()
    finished = sched.take_finished()
    wall = time.perf_counter() - t0
    assert len(finished) == len(reqs)
    st = sched.stats
    return wall, sum(t.num_tokens for t in finished), {"host": st.host_time / wall, "decode": st.decode_time / wall}


SETTINGS = {  # --compare: (EngineConfig field, label when on, label when off)
    "live_pages": ("live_pages", "live pages", "whole table"),
    "dispatch_ahead": ("dispatch_ahead", "dispatch ahead", "in turn"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--compare", choices=sorted(SETTINGS), default="live_pages")
    ap.add_argument("--concurrent", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-dispatch", type=int, default=8)
    args = ap.parse_args()
    field, on_name, off_name = SETTINGS[args.compare]
    model = load_pretrained(POLICY)
    rows = [f"| concurrent | {on_name} tokens/s | {off_name} tokens/s | {on_name} / {off_name} (median of paired "
            f"ratios) | host share ({on_name} / {off_name}) | decode share ({on_name} / {off_name}) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for n in args.concurrent:
        engines = {}
        for on in (True, False):
            cfg = EngineConfig(num_slots=n, page_size=16, max_seq_len=320, steps_per_dispatch=args.steps_per_dispatch,
                               **{field: on})
            engines[on] = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=())
            engines[on].warmup()
            rollout(engines[on], requests(n, args.new, seed=999))  # warm: every live-page bucket compiled
        rates: dict[bool, list[float]] = {True: [], False: []}
        shares: dict[bool, list[dict]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                seconds, tokens, split = rollout(engines[on], requests(n, args.new, seed=r))
                rates[on].append(tokens / seconds)
                shares[on].append(split)
        ratio = statistics.median(a / b for a, b in zip(rates[True], rates[False], strict=True))
        on_rate, off_rate = statistics.median(rates[True]), statistics.median(rates[False])
        share = {k: {on: statistics.median(x[k] for x in shares[on]) for on in (True, False)}
                 for k in ("host", "decode")}
        print(f"{n} concurrent: {on_name} {on_rate:.0f} tok/s, {off_name} {off_rate:.0f} tok/s, ratio {ratio:.2f}x; "
              f"host share {share['host'][True]:.3f} / {share['host'][False]:.3f}")
        rows.append(f"| {n} | {on_rate:.0f} | {off_rate:.0f} | {ratio:.2f}x | {share['host'][True]:.3f} / "
                    f"{share['host'][False]:.3f} | {share['decode'][True]:.3f} / {share['decode'][False]:.3f} |")
    body = "\n".join(rows) + (
        f"\n\nFixed-length workload: {args.new} new tokens per sequence (EOS off), prompts of 24-32 tokens, "
        f"`{POLICY}`, T = 1, {args.steps_per_dispatch} decode steps per dispatch, page size 16, context 320; "
        f"medians of {args.rounds} interleaved rounds. Host share: the scheduler's bookkeeping outside device calls "
        "over the wall-clock (RolloutStats.host_time); decode share: time in generate dispatches and waiting for "
        "their outputs. " + NOTES[args.compare])
    title = ("Decode: attention over live pages (bench_decode.py)" if args.compare == "live_pages"
             else "Decode: dispatching ahead (bench_decode.py --compare dispatch_ahead)")
    benchlib.write_section(title, body)


NOTES = {
    "live_pages": ("`EngineConfig.live_pages` on: decode attention reads the page-table columns some slot holds, "
                   "rounded up to a bucket (halvings of the table: 5, 10 or 20 columns); off: all 20 columns."),
    "dispatch_ahead": ("`EngineConfig.dispatch_ahead` on: the scheduler dispatches decode n + 1, then reads decode "
                       "n's outputs and does its bookkeeping while the device runs n + 1; off: dispatch, wait, read, "
                       "in turn. Every sequence here starts together and ends together, so no slot waits for a "
                       "refill either way."),
}


if __name__ == "__main__":
    main()
