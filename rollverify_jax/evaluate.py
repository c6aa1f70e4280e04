"""avg@k / pass@k of a policy on an eval set: ``python -m rollverify_jax.evaluate --gin_file=... --checkpoint=...``.

``--checkpoint`` is a training workdir (its latest step), a ``<workdir>/checkpoints/<step>`` directory, or an
HF-layout policy directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from rollverify_jax.cli import run_cli
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.rl.partial_rollout import RolloutConfig
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.setup import Run, TrainConfig, build, parse_gin

EVAL_SEED_OFFSET = 1_000_000_000


def evaluate_policy(engine: Engine, records: Sequence[dict], encode: Callable[[dict], np.ndarray],
                    decode: Callable[[list[int]], str], scorer: RewardScorer, k: int, max_new_tokens: int) -> dict:
    """Samples k responses per record with the engine's sampling config (fixed seeds, so evaluations at
    different steps see the same randomness) and returns avg@k, pass@k and the mean response length."""
    sched = Scheduler(engine)
    trajs = []
    for i, rec in enumerate(records):
        prompt = np.asarray(encode(rec), np.int32)
        for j in range(k):
            uid = i * k + j
            trajs.append(Trajectory(uid=uid, group_id=i, prompt=prompt, seed=EVAL_SEED_OFFSET + uid,
                                    max_new_tokens=max_new_tokens))
    t0 = time.perf_counter()
    sched.submit(trajs)
    sched.run()
    done = sorted(sched.take_finished(), key=lambda t: t.uid)
    rewards, _ = scorer.score([decode(t.tokens) for t in done], [records[t.group_id]["answer"] for t in done],
                              overlong_penalty=False)
    correct = (np.asarray(rewards).reshape(len(records), k) > 0.5)
    return {"eval/accuracy": float(correct.mean()), f"eval/avg@{k}": float(correct.mean()),
            f"eval/pass@{k}": float(correct.any(axis=1).mean()),
            "eval/response_length": float(np.mean([t.num_tokens for t in done])),
            "time/eval": time.perf_counter() - t0}


def evaluate_run(run: Run) -> dict:
    """Held-out evaluation of a built run's current policy (its gin settings: eval set, k, response length)."""
    return evaluate_policy(run.engine, run.eval_records, run.encode, run.decode, run.scorer, run.cfg.eval_samples,
                           RolloutConfig().max_new_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[])
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--k", type=int, default=None, help="samples per problem (default: TrainConfig.eval_samples)")
    ap.add_argument("--num_problems", type=int, default=None)
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    args = ap.parse_args(argv)
    run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    parse_gin(args.gin_file, args.gin_param)
    cfg = TrainConfig()
    if args.k:
        cfg = dataclasses.replace(cfg, eval_samples=args.k)
    if args.num_problems:
        cfg = dataclasses.replace(cfg, eval_size=args.num_problems)
    run = build(cfg, checkpoint=Path(args.checkpoint))
    try:
        result = evaluate_run(run)
    finally:
        run.close()
    k = cfg.eval_samples
    print(f"{args.checkpoint}: {len(run.eval_records)} problems x {k} samples: "
          f"avg@{k} = {result[f'eval/avg@{k}']:.4f}  pass@{k} = {result[f'eval/pass@{k}']:.4f}  "
          f"mean length {result['eval/response_length']:.1f}")


if __name__ == "__main__":
    main()
