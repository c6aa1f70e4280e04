"""How the rollout engine should run a LoRA policy: the adapters in its forward, or merged into a serving copy.

Two engines on the same adapted policy, interleaved round after round in one process:
- **adapters in the forward** (what the engine does, `models/lora.py`): the engine's weights are the frozen base and
  the adapters; a publish moves the adapters alone; every projection adds ``(x A) B``;
- **merged**: a plain engine whose weights are ``W + (alpha / rank) A B``; a publish moves the adapters and then
  merges them into a serving copy of every adapted weight (its cost is timed here: the jitted merge).
Each round decodes the same fixed-length requests on both (EOS off); tokens/s is generated tokens over the whole
rollout. Also printed: the bytes each publish moves and holds, and how far the merged engine's log-probs are from
the learner's on the adapted model (the adapted engine's are equal up to float rounding: tests/test_lora.py).

Usage: python scripts/bench_lora.py [--hidden 512] [--layers 4] [--rank 16] [--concurrent 64] [--new 96]
[--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from rollverify_jax.infra.transfer import tree_bytes
from rollverify_jax.models import lora
from rollverify_jax.models.qwen3 import init_model, model_config
from rollverify_jax.rl import learner
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.studies import benchlib


def requests(n: int, new: int, seed: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(24, 33)).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=new) for i in range(n)]


def rollout(engine: Engine, reqs: list[Trajectory]) -> tuple[float, list[Trajectory]]:
    sched = Scheduler(engine)
    t0 = time.perf_counter()
    sched.submit(reqs)
    sched.run()
    finished = sorted(sched.take_finished(), key=lambda t: t.uid)
    return time.perf_counter() - t0, finished


def trained(model, cfg: lora.LoraConfig, scale: float):
    """``model`` adapted by ``cfg`` with its adapters moved off zero, as after training."""
    graphdef, adapters, frozen = lora.split_trainable(lora.adapt(model, cfg))
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    return nnx.merge(graphdef, adapters, frozen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    vocab = 256
    model_cfg = model_config("tiny", vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=args.hidden // 8, param_dtype=args.dtype, dtype=args.dtype)
    cfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    adapted = trained(init_model(model_cfg, seed=0), cfg, scale=0.02)
    graphdef, adapters, frozen = lora.split_trainable(adapted)
    merge = jax.jit(lambda a, f: lora.merged_weights(nnx.merge(graphdef, a, f)))
    merged = nnx.merge(nnx.split(lora.structure(model_cfg))[0], merge(adapters, frozen))
    engine_cfg = EngineConfig(num_slots=args.concurrent, page_size=16, max_seq_len=160, steps_per_dispatch=8)
    engines = {"adapters in the forward": Engine(adapted, engine_cfg, SamplingConfig(temperature=1.0)),
               "merged": Engine(merged, engine_cfg, SamplingConfig(temperature=1.0))}
    for e in engines.values():
        e.warmup()
        rollout(e, requests(args.concurrent, args.new, 999, vocab))  # every bucket compiled
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            seconds, done = rollout(engines[name], requests(args.concurrent, args.new, r, vocab))
            rates[name].append(sum(t.num_tokens for t in done) / seconds)
    ratio = statistics.median(a / b for a, b in zip(*rates.values(), strict=True))
    jax.block_until_ready(merge(adapters, frozen))
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        jax.block_until_ready(merge(adapters, frozen))
    merge_s = (time.perf_counter() - t0) / args.rounds
    _, done = rollout(engines["merged"], requests(8, 16, 7, vocab))  # the merged engine's log mu vs the learner's
    gaps = []
    for t in done:
        seq = np.asarray([*t.prompt, *t.tokens], np.int32)[None]
        logp = learner.compute_logprobs(graphdef, adapters, seq, np.ones_like(seq, bool), 1.0, frozen)
        gaps.append(np.abs(np.asarray(logp)[0, len(t.prompt):] - np.asarray(t.logps)).max())
    adapter_bytes, weight_bytes = tree_bytes(adapters), tree_bytes(frozen)
    adapted_weight_bytes = sum(tree_bytes(frozen[p[0]][p[1]][p[2]][p[3]]) for p in lora.adapted_weights(adapted))
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = ["| engine | tokens/s (median) | publish moves | serving copy held besides the base | per publish on "
            "the engine | max abs(log mu - learner log pi) |", "| --- | --- | --- | --- | --- | --- |",
            f"| adapters in the forward | {med['adapters in the forward']:.0f} | {adapter_bytes / 2**20:.2f} MiB "
            f"(adapters) | 0 | nothing | float rounding (tests/test_lora.py: < 2e-5) |",
            f"| merged W + BA | {med['merged']:.0f} | {adapter_bytes / 2**20:.2f} MiB (adapters) | "
            f"{adapted_weight_bytes / 2**20:.1f} MiB (every adapted weight) | merge {merge_s * 1e3:.1f} ms | "
            f"{max(gaps):.1e} |"]
    body = "\n".join(rows) + (
        f"\n\nAdapters in the forward / merged tokens/s: **{ratio:.2f}x** (median of {args.rounds} paired, "
        f"interleaved rounds). Model: {args.layers} layers, hidden {args.hidden}, {args.dtype}, "
        f"{weight_bytes / 2**20:.1f} MiB of weights; LoRA rank {args.rank} on every linear layer "
        f"({adapter_bytes / weight_bytes:.2%} of the weights' bytes); {args.concurrent} sequences x {args.new} new "
        "tokens, 8 decode steps per dispatch, CPU. Chosen: adapters in the forward. Its log-probs are the learner's "
        "(the same einsums on the same weights), so OPS and verification stay exact; no serving copy of the "
        "adapted weights is held (on one v5e-8 host that copy is 2 GiB per chip, room the KV pool needs); a "
        "publish moves and installs the adapters alone. The price is the adapter matmuls' time in decode.")
    print(body)
    benchlib.write_section("LoRA: adapters in the engine's forward vs merged weights (bench_lora.py)", body)


if __name__ == "__main__":
    main()
