"""Train-step time with and without sequence packing, on long-tailed batches like the tiny default's.

Rows are prompt + reference solution of synthetic-task problems, encoded with the tiny policy's tokenizer,
so the length distribution is the one RL sees (median ~75 tokens, tail to ~300). Padded:
`LearnerConfig(pack_sequences=False)`, one sequence per row of the batch's power-of-two bucket. Packed: the
engine's fixed width (`--width`) packed with first-fit decreasing (`rl/packing.py`). Both are the one train step
(`Learner.create`), each compiled for its layout; times are medians after a compile and a warm-up call.

Machine utilization: FLOPs per step from XLA's cost analysis of the compiled step, over the step's time,
against this machine's float32 matmul rate (a plain jitted ``[N, N] @ [N, N]``, measured in the same run).
XLA counts a loop body once, so the FLOPs are those of the same step compiled as one minibatch (the same
forward and backward work; one optimizer update instead of ``num_minibatches``).

Usage: python scripts/bench_train_step.py [--batches 64 128 256] [--iters 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from rollverify_jax.data.synthetic import make_split
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models.hf import load_pretrained
from rollverify_jax.models.tokenizer import Tokenizer
from rollverify_jax.rl import learner, packing
from rollverify_jax.rl.batch import build_batch
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.studies import benchlib

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"


def long_tailed_batch(tokenizer: Tokenizer, n: int, width: int | None) -> dict[str, np.ndarray]:
    """The train loop's batch (`build_batch`) over prompt + reference solution of `n` synthetic problems."""
    task = json.loads((POLICY / "task.json").read_text())
    trajs = []
    for i, r in enumerate(make_split(n, seed=7, split="train", **task)):
        response = tokenizer.encode(r["solution"]) + [tokenizer.eos_ids[0]]
        prompt = np.asarray(tokenizer.encode(r["prompt"]), np.int32)
        trajs.append(Trajectory(uid=i, group_id=i, prompt=prompt, seed=0, max_new_tokens=len(response),
                                tokens=response, logps=[-0.1] * len(response)))
    advantages = np.random.default_rng(0).normal(size=n).astype(np.float32)
    return build_batch(trajs, advantages, max_len=width)


def time_step(step, state, batch, iters: int) -> tuple[float, object]:
    """Median seconds per step (``Learner.train_step``) after a compile + warm-up call, and the updated state."""
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def matmul_peak(n: int = 2048, iters: int = 10) -> float:
    """GFLOP/s of a jitted float32 ``[n, n] @ [n, n]`` (median of ``iters``): the machine's practical peak."""
    a = jax.numpy.ones((n, n), jax.numpy.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def step_flops(model, cfg: learner.LearnerConfig, optimizer_cfg: learner.OptimizerConfig, mesh, state,
               batch) -> float:
    """FLOPs of one step's forward + backward over ``batch`` (XLA cost analysis, compiled as one minibatch)."""
    one = learner.Learner.create(model, dataclasses.replace(cfg, num_minibatches=1), optimizer_cfg, mesh)
    cost = one.step_program.lower(state, batch, one.frozen).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--width", type=int, default=320, help="packed width (the tiny default's max_seq_len)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    model = load_pretrained(POLICY)
    tokenizer = Tokenizer.from_dir(POLICY)
    mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    optimizer_cfg = learner.OptimizerConfig(learning_rate=1e-5)
    cfg = learner.LearnerConfig(num_minibatches=2)  # the tiny default's two updates per step
    padded_cfg = dataclasses.replace(cfg, pack_sequences=False)
    packed_run = learner.Learner.create(model, cfg, optimizer_cfg, mesh)
    padded_run = learner.Learner.create(model, padded_cfg, optimizer_cfg, mesh)
    state = packed_run.init_state(model, seed=0)  # one optimizer: both learners take this state
    rows = ["| sequences | real tokens | padded: shape | padded: step (s) | packed: shape | packed: step (s) | "
            "speed-up | packed GFLOP | packed GFLOP/s | of matmul peak |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    peak_before = matmul_peak()
    results = []
    for n in args.batches:
        padded = packing.pack_for_learner(long_tailed_batch(tokenizer, n, None), padded_cfg, mesh)
        packed = packing.pack_for_learner(long_tailed_batch(tokenizer, n, args.width), cfg, mesh)
        real = int(padded["attention_mask"].sum())
        t_pad, state = time_step(padded_run.train_step, state, padded, args.iters)
        t_pack, state = time_step(packed_run.train_step, state, packed, args.iters)
        flops = step_flops(model, cfg, optimizer_cfg, mesh, state, packed)
        results.append((n, real, padded["packed_tokens"].shape, t_pad, packed["packed_tokens"].shape, t_pack,
                        flops))
    peak = max(peak_before, matmul_peak())  # the less disturbed of two measurements (before and after)
    for n, real, shape_pad, t_pad, shape_pack, t_pack, flops in results:
        rate = flops / t_pack / 1e9
        print(f"{n:4d} sequences, {real} real tokens: padded {shape_pad} {t_pad:.3f} s, packed {shape_pack} "
              f"{t_pack:.3f} s, {t_pad / t_pack:.2f}x; packed {flops / 1e9:.1f} GFLOP, {rate:.1f} GFLOP/s = "
              f"{rate / peak:.1%} of {peak:.0f}")
        rows.append(f"| {n} | {real} | {shape_pad[0]} x {shape_pad[1]} | {t_pad:.3f} | {shape_pack[0]} x "
                    f"{shape_pack[1]} | {t_pack:.3f} | {t_pad / t_pack:.2f}x | {flops / 1e9:.1f} | {rate:.1f} | "
                    f"{rate / peak:.1%} |")
    body = "\n".join(rows) + (
        "\n\nOne GRPO train step (forward + backward + AdamW) of the tiny policy on long-tailed synthetic-task "
        "rows. Padded rows (`pack_sequences=False`: one sequence per row) cost `B x bucket(longest)` tokens; "
        "packed rows cost about the real token count (rows rounded to four sizes per octave), plus attention over "
        "the wider packed rows. One sequence "
        "longer than 256 tokens (the 128- and 256-row batches have one) doubles the padded width to 512, where "
        "padded attention and activations cost most. The losses see the same `[B, T]` log-probs either way "
        "(`tests/test_learner.py::test_packed_step_equals_the_reference_and_the_unpacked_layout`).\n\n"
        "Matmul peak of this machine, measured in the same run (float32 2048^3, the higher of a measurement "
        f"before and one after the steps): {peak:.0f} GFLOP/s. Step FLOPs: XLA's cost analysis of the step "
        "compiled as one minibatch (XLA counts a loop body once); the timed step is the tiny default's (two "
        "minibatches, two AdamW updates).\n")
    benchlib.write_section("Train step: padded vs packed (bench_train_step.py)", body)


if __name__ == "__main__":
    main()
