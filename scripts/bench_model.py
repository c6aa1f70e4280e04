"""Forward-pass throughput and compile time of the Qwen3 model (tiny default and a ~100M config).

Usage: python scripts/bench_model.py [--presets tiny bench_100m] [--batch 8] [--seq 256] [--iters 5]
"""

from __future__ import annotations

import argparse
import time

import jax
from flax import nnx

from rollverify_jax.models import init_model, model_config
from rollverify_jax.studies import benchlib


def bench(preset: str, batch: int, seq: int, iters: int, dtype: str) -> dict:
    cfg = model_config(preset, param_dtype=dtype, dtype=dtype)
    model = init_model(cfg)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
    t0 = time.perf_counter()
    compiled = fwd.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    compiled(state, tokens).block_until_ready()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        out = compiled(state, tokens)
    out.block_until_ready()
    step_s = (time.perf_counter() - t0) / iters
    return dict(preset=preset, params=cfg.num_params(), dtype=dtype, batch=batch, seq=seq,
                compile_s=compile_s, step_s=step_s, tokens_per_s=batch * seq / step_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["tiny", "bench_100m"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    rows = []
    for p in args.presets:
        r = bench(p, args.batch, args.seq, args.iters, args.dtype)
        print(f"{p:>12}: {r['params'] / 1e6:7.1f}M params  compile {r['compile_s']:6.2f}s  "
              f"{r['step_s'] * 1e3:8.1f} ms/forward  {r['tokens_per_s']:10.0f} tokens/s")
        rows.append(r)
    table = ["| preset | params | dtype | batch x seq | compile (s) | ms / forward | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['batch']} x {r['seq']} | "
              f"{r['compile_s']:.2f} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} |" for r in rows]
    benchlib.write_section("Model forward (bench_model.py)", "\n".join(table) +
                           "\n\nTeacher-forced forward over `int32[batch, seq]` tokens, float32 logits; "
                           "mean of the timed iterations after one warm-up.")


if __name__ == "__main__":
    main()
