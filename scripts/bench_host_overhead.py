"""Main-thread CPU time per decode dispatch: what the host spends to issue one ``generate`` and to record its
tokens, at the 8B config's shape, on CPU (the host-side Python is the same on a TPU or GPU host).

The engine and scheduler of ``configs/qwen3_8b_dapo.gin`` (its slots, steps per dispatch and page size) over a
Qwen3-8B-shaped model: its layer count (36; ``--layers`` also runs others), attention heads, KV heads and head
dim, with the hidden, MLP and vocabulary sizes shrunk and a short context so that the device work fits a CPU.
Every slot runs one request of ``(dispatches + 2) x steps`` tokens (EOS off), all admitted at once. A first
round compiles every shape; the second is measured: per decode dispatch, ``time.thread_time`` (this thread's CPU
time, not the device's) of ``Engine.dispatch_generate`` and of the rest of ``Scheduler.step`` (reading the
tokens, appending them, page growth, slot packing). Each dispatch is waited for right after it is issued, outside
both counts (a thread blocked on the device spins for a while). The step that admits (prefill) is left out.

``--sensitivity MS ...``: instead, the simulator's Qwen3-8B ~20K prediction (on-policy and RollVerify,
``rollverify_jax.studies.sim_scale``'s setting, 700 steps) at each host time per decode step (ms,
``RooflineCosts.decode_host_s``): how much the speed-up depends on it.

Usage: python scripts/bench_host_overhead.py [--layers 36 4] [--dispatches 6] [--write]
       python scripts/bench_host_overhead.py --sensitivity 0 0.1 0.3 1 3 [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import subprocess
import time

import jax
import numpy as np
from flax import nnx

from rollverify_jax.models.qwen3 import Qwen3ForCausalLM, model_config
from rollverify_jax.rollout import Engine, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.run import spec as spec_lib
from rollverify_jax.studies import benchlib

CONFIG = "configs/qwen3_8b_dapo.gin"
SECTION = "Host time per decode dispatch (bench_host_overhead.py)"
SENSITIVITY = "Speed-up against host time per decode step (bench_host_overhead.py --sensitivity)"


def real_config():
    """The 8B config's engine settings and model preset (parsed from its gin file, nothing loaded)."""
    spec_lib.parse_gin([CONFIG], [])
    spec = spec_lib.RunSpec.from_gin()
    return spec.engine, spec.model["preset"]


def build(layers: int, args) -> tuple[Engine, int]:
    """An engine of the 8B config's slots / steps / page size over a shrunk 8B-shaped model of ``layers``."""
    engine_cfg, preset = real_config()
    cfg = model_config(preset, num_hidden_layers=layers, hidden_size=args.hidden, intermediate_size=args.hidden,
                       vocab_size=args.vocab)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    steps = engine_cfg.steps_per_dispatch
    max_new = steps * (args.dispatches + 2)
    ecfg = dataclasses.replace(engine_cfg, max_seq_len=args.prompt + max_new, kv_memory_bytes=None,
                               kv_dtype="float32", serving_layout="train", min_prefill_len=8,
                               logits_chunk=None, dispatch_ahead=args.dispatch_ahead)
    return Engine(model, ecfg, SamplingConfig(temperature=1.0), eos_ids=()), max_new


def requests(n: int, prompt: int, max_new: int, vocab: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=prompt).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=max_new) for i in range(n)]


def measure(engine: Engine, reqs: list[Trajectory]) -> list[tuple[float, float]]:
    """(dispatch, rest of the step) thread seconds of every decode step that admitted nothing. Each dispatch is
    waited for right after it is issued, outside both counts: a thread blocked on the device may spin, and the
    CPU it burns grows with the device's time, not with the host's work."""
    spent = [0.0, 0.0]  # dispatching, waiting for the device
    dispatch = engine.dispatch_generate

    @functools.wraps(dispatch)
    def timed():
        t0 = time.thread_time()
        pending = dispatch()
        t1 = time.thread_time()
        jax.block_until_ready(pending.out)
        spent[0] += t1 - t0
        spent[1] += time.thread_time() - t1
        return pending

    engine.dispatch_generate = timed
    sched = Scheduler(engine)
    sched.submit(reqs)
    out = []
    try:
        while not sched.idle:
            admitted, spent[:] = sched.stats.prefill_sequences, [0.0, 0.0]
            t0 = time.thread_time()
            sched.step()
            total = time.thread_time() - t0
            if sched.stats.prefill_sequences == admitted and spent[0] > 0:
                out.append((spent[0], total - spent[0] - spent[1]))
        sched.run()
    finally:
        del engine.dispatch_generate
    return out


def run(layers: int, args) -> dict:
    engine, max_new = build(layers, args)
    n = engine.config.num_slots
    t0 = time.perf_counter()
    measure(engine, requests(n, args.prompt, max_new, args.vocab, seed=1))  # compiles every shape
    t1 = time.perf_counter()
    steps = measure(engine, requests(n, args.prompt, max_new, args.vocab, seed=2))
    print(f"{layers} layers: first round {t1 - t0:.0f} s, measured round {time.perf_counter() - t1:.0f} s", flush=True)
    disp = statistics.median(d for d, _ in steps) * 1e3
    rest = statistics.median(r for _, r in steps) * 1e3
    total = statistics.median(d + r for d, r in steps) * 1e3
    row = {"layers": layers, "slots": n, "steps": engine.config.steps_per_dispatch, "dispatches": len(steps),
           "dispatch_ms": disp, "bookkeeping_ms": rest, "total_ms": total, "per_256_ms": total * 256 / n}
    print(f"{layers} layers: dispatch {disp:.2f} ms + bookkeeping {rest:.2f} ms = {total:.2f} ms per dispatch "
          f"({row['per_256_ms']:.2f} ms per 256 slots; median of {len(steps)} dispatches)", flush=True)
    return row


def sensitivity(host_ms: list[float], steps: int | None, write: bool) -> None:
    """On-policy and RollVerify device-days of the Qwen3-8B ~20K setting at each host time per decode step."""
    from rollverify_jax.studies import sim_scale

    _, _, files, params = next(s for s in sim_scale.SETTINGS if s[0] == "Qwen3-8B" and s[1] == 20480)
    rows = ["| host time per decode step (ms) | on-policy (device-days) | RollVerify (device-days) | speed-up |",
            "| --- | --- | --- | --- |"]
    for ms in host_ms:
        on, rv = sim_scale.predict(files, [*params, f"RooflineCosts.decode_host_s = {ms / 1e3!r}"],
                                   ("on_policy", "rollverify"), steps)
        ratio = on["device_days"] / rv["device_days"]
        print(f"{ms} ms a step: on-policy {on['device_days']:.2f}, RollVerify {rv['device_days']:.2f} "
              f"device-days ({ratio:.3f}x)", flush=True)
        rows.append(f"| {ms:g} | {on['device_days']:.2f} | {rv['device_days']:.2f} | {ratio:.3f}x |")
    if write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        span = f"{steps} steps" if steps else "all the config's steps"
        benchlib.write_section(SENSITIVITY, "\n".join(rows) + (
            f"\n\nCommit {commit}. The simulator's prediction of Qwen3-8B at ~20K (`configs/qwen3_8b_dapo.gin` + "
            "`configs/sim/qwen3_8b_v5p.gin`, sim_scale's setting, the paper-shaped acceptance, "
            f"{span}) with `RooflineCosts.decode_host_s` bound to each value: the host's time "
            "per decode step, added to every step's device time (no overlap: an upper bound for "
            "`EngineConfig.dispatch_ahead`, which overlaps it with the device's). The shipped value is the "
            "measured host time per dispatch over its steps (section above)."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[36, 4])
    ap.add_argument("--dispatches", type=int, default=6, help="measured decode dispatches per layer count")
    ap.add_argument("--hidden", type=int, default=16, help="hidden and MLP size (shrunk: the device work on CPU)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--dispatch-ahead", action="store_true", help="EngineConfig.dispatch_ahead on")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    ap.add_argument("--sensitivity", type=float, nargs="+", default=None, metavar="MS",
                    help="instead: the simulated Qwen3-8B ~20K speed-up at these host ms per decode step")
    ap.add_argument("--sim-steps", type=int, default=None, help="--sensitivity's steps (default: the config's)")
    args = ap.parse_args()
    if args.sensitivity:
        return sensitivity(args.sensitivity, args.sim_steps, args.write)
    rows = [run(layers, args) for layers in args.layers]
    if not args.write:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    table = ["| layers | code | dispatch (ms) | bookkeeping (ms) | total (ms) | per 256 slots (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['layers']} | `{commit}` | {r['dispatch_ms']:.2f} | {r['bookkeeping_ms']:.2f} | "
              f"{r['total_ms']:.2f} | {r['per_256_ms']:.2f} |" for r in rows]
    benchlib.write_section(SECTION, "\n".join(table) + "\n\n" + NOTE)


NOTE = ("Main-thread CPU time (`time.thread_time`) per decode dispatch, median over the measured dispatches: "
        "dispatch = `Engine.dispatch_generate` (building the call's arguments, jit's cache lookup, enqueueing); "
        "bookkeeping = the rest of `Scheduler.step` (fetching and recording the tokens, page growth, slot packing). "
        "The model is Qwen3-8B's layers, heads, KV heads and head dim with hidden and MLP sizes shrunk; the slots, "
        "steps per dispatch and page size are `configs/qwen3_8b_dapo.gin`'s.")


if __name__ == "__main__":
    main()
