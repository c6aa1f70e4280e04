"""Train-step time with micro-batches of packed rows against one full row per sequence, at the real configs'
length model scaled to a CPU-sized context.

At real scale `LearnerConfig.micro_batch_size` rows make a micro-batch (one per batch device). Before
micro-batches were made of packed rows, each micro-batch held that many *sequences*, each in a full-width
row whatever its length. This runs both on the tiny policy with the same shape ratios as
configs/qwen3_8b_dapo.gin: 16 minibatches of 32 sequences, micro-batches of 4 rows, context `--width`,
lengths from the length model of docs/scale.md (lognormal response, median 2,500 of a 22,528-token context,
sigma 1.0, capped at 20,480, plus a 200-token prompt) scaled by `width / 22,528`:

- one row per sequence (`pack_sequences=False`): every sequence in a full-width row of its own, micro-batches
  of 4;
- packed rows: micro-batches of 4 packed rows, as many per minibatch as its tokens fill;
- packed rows + tail rows of `width / 4` (the shipped 8B setting).

Times are medians after a compile and a warm-up call, all measured in one run (ratios, not absolute times,
are what transfers). The three compiled steps use the same micro-batch of 4 rows, so their activation
memory is the same. Usage: python scripts/bench_packed_micro.py [--width 1024] [--iters 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models.hf import load_pretrained
from rollverify_jax.rl import learner, packing
from rollverify_jax.studies import benchlib

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"
REAL_CONTEXT, REAL_MEDIAN, REAL_CAP, REAL_PROMPT = 22528, 2500, 20480, 200


def length_model_batch(rows: int, width: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """A right-padded batch whose lengths follow the length model scaled to ``width``."""
    rng = np.random.default_rng(seed)
    scale = width / REAL_CONTEXT
    response = np.minimum(np.exp(np.log(REAL_MEDIAN * scale) + rng.standard_normal(rows)), REAL_CAP * scale)
    lengths = np.minimum(np.rint(response).astype(int) + round(REAL_PROMPT * scale), width)
    prompt = round(REAL_PROMPT * scale)
    pos = np.arange(width)[None]
    attention = pos < lengths[:, None]
    tokens = np.where(attention, rng.integers(1, vocab, (rows, width)), 0).astype(np.int32)
    return {"tokens": tokens, "attention_mask": attention,
            "loss_mask": ((pos >= prompt) & attention).astype(np.float32),
            "behavior_logp": np.full((rows, width), -2.0, np.float32) * attention,
            "advantages": rng.normal(size=rows).astype(np.float32)}


def time_steps(step, state, batches: list[dict], iters: int) -> tuple[float, object]:
    """Median seconds per step (``Learner.train_step``) over ``batches`` after a compile + warm-up call."""
    state, m = step(state, batches[0])
    jax.block_until_ready(m)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--minibatches", type=int, default=16)
    ap.add_argument("--per_minibatch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    model = load_pretrained(POLICY)
    mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    optimizer_cfg = learner.OptimizerConfig(learning_rate=1e-6)
    rows = args.minibatches * args.per_minibatch
    batches = [length_model_batch(rows, args.width, model.cfg.vocab_size, seed) for seed in range(args.iters)]
    base = learner.LearnerConfig(num_minibatches=args.minibatches, micro_batch_size=args.micro)
    cases = {"one full row per sequence": dataclasses.replace(base, pack_sequences=False),
             "packed rows": base,
             f"packed rows + tail rows of {args.width // 4}": dataclasses.replace(base, tail_row_width=args.width // 4)}
    learners = {name: learner.Learner.create(model, cfg, optimizer_cfg, mesh) for name, cfg in cases.items()}
    state = learners["packed rows"].init_state(model, seed=0)  # one optimizer: every case takes this state
    results = {}
    for name, cfg in cases.items():
        packed = [packing.pack_for_learner(b, cfg, mesh) for b in batches]
        stats = [packing.packing_stats(b, cfg) for b in packed]
        useful = statistics.fmean(s["train/useful_token_fraction"] for s in stats)
        micro = statistics.fmean(s["train/micro_batches"] for s in stats)
        seconds, state = time_steps(learners[name].train_step, state, packed, args.iters)
        results[name] = (seconds, useful, micro)
        print(f"{name}: {seconds:.2f} s per step, {useful:.1%} of positions useful, {micro:.2f} micro-batches "
              "per update", flush=True)
    slow = results["one full row per sequence"][0]
    table = ["| train step | s per step | useful positions | micro-batches per update | speed-up |",
             "| --- | --- | --- | --- | --- |"]
    table += [f"| {name} | {s:.2f} | {u:.1%} | {m:.2f} | {slow / s:.2f}x |" for name, (s, u, m) in results.items()]
    body = "\n".join(table) + (
        f"\n\n{rows} sequences ({args.minibatches} minibatches of {args.per_minibatch}), micro-batches of "
        f"{args.micro} rows, context {args.width}: the shape ratios of configs/qwen3_8b_dapo.gin on one CPU "
        "device, lengths from docs/scale.md's length model scaled to the context (a different random batch per "
        "timed step). The tiny policy, so absolute times say nothing about a TPU; the ratio of positions "
        "computed does, and the deviceless compile of the 8B reads the same packer at its real shape "
        "(docs/scale.md).\n")
    benchlib.write_section("Train step: micro-batches of packed rows (bench_packed_micro.py)", body)


if __name__ == "__main__":
    main()
