"""avg@k / pass@k of a policy on an eval set: ``python -m rollverify_jax.evaluate --gin_file=... --checkpoint=...``.

``--checkpoint`` is a training workdir (its latest step), a ``<workdir>/checkpoints/<step>`` directory, or an
HF-layout policy directory. Only the params of an orbax checkpoint are read (no optimizer state, no paused
cache), and nothing is created, moved or removed in the run's directory.

How evaluation samples is ``EvalConfig`` (temperature, top-p, samples per problem, response length); its
defaults are training's settings, so evaluation matches the training sampler unless told otherwise. Every
evaluation inside training writes a few of its generations to ``<workdir>/samples/step_<N>.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence

import gin
import jax
import numpy as np

from rollverify_jax import compile_cache, distributed, storage
from rollverify_jax.cli import run_cli
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.rl.partial_rollout import RolloutConfig
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.setup import Run, TrainConfig, build, parse_gin, resolve_checkpoint

EVAL_SEED_OFFSET = 1_000_000_000


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How held-out evaluation samples, apart from training's sampler. Each None keeps training's value, so the
    defaults reproduce the evaluation of earlier versions exactly (same sampler, same seeds)."""

    temperature: float | None = None  # None: SamplingConfig.temperature; 0: greedy
    top_p: float | None = None  # None: SamplingConfig.top_p
    samples_per_problem: int | None = None  # k of avg@k / pass@k; None: TrainConfig.eval_samples
    max_new_tokens: int | None = None  # None: RolloutConfig.max_new_tokens
    at_start: bool = True  # False: a fresh training run skips its step-0 evaluation
    num_samples_logged: int = 16  # generations written per evaluation to samples/step_<N>.jsonl (0: none)

    def __post_init__(self):
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"EvalConfig.temperature={self.temperature} must be >= 0 (0: greedy) or None.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"EvalConfig.top_p={self.top_p} must be in (0, 1] or None.")
        for name in ("samples_per_problem", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EvalConfig.{name}={value} must be >= 1 or None.")
        if self.num_samples_logged < 0:
            raise ValueError(f"EvalConfig.num_samples_logged={self.num_samples_logged} must be >= 0.")

    def sampling(self, train: SamplingConfig) -> SamplingConfig:
        """Training's sampler with this config's temperature / top-p (top-k stays training's)."""
        if self.temperature is None and self.top_p is None:
            return train
        top_p = train.top_p if self.top_p is None else self.top_p
        if self.temperature == 0:
            return dataclasses.replace(train, greedy=True, top_p=top_p)
        if self.temperature is None:
            return dataclasses.replace(train, top_p=top_p)
        return dataclasses.replace(train, temperature=self.temperature, top_p=top_p, greedy=False)


@contextlib.contextmanager
def _sampling(engine: Engine, sampling: SamplingConfig) -> Iterator[None]:
    """The engine samples with ``sampling`` inside the block and with its own sampler again after it (the
    compiled functions specialise on the sampler, so training's stay cached)."""
    saved = engine.sampling
    engine.sampling = sampling
    try:
        yield
    finally:
        engine.sampling = saved


def evaluate_policy(engine: Engine, records: Sequence[dict], encode: Callable[[dict], np.ndarray],
                    decode: Callable[[list[int]], str], scorer: RewardScorer, k: int, max_new_tokens: int,
                    sampling: SamplingConfig | None = None) -> tuple[dict, list[dict]]:
    """Samples k responses per record (fixed seeds, so evaluations at different steps see the same randomness)
    with ``sampling`` (default: the engine's). Returns the metrics (avg@k, pass@k, mean response length) and one
    row per response (problem, sample, prompt, response, answer, reward), problem by problem."""
    sched = Scheduler(engine)
    trajs = []
    for i, rec in enumerate(records):
        prompt = np.asarray(encode(rec), np.int32)
        for j in range(k):
            uid = i * k + j
            trajs.append(Trajectory(uid=uid, group_id=i, prompt=prompt, seed=EVAL_SEED_OFFSET + uid,
                                    max_new_tokens=max_new_tokens))
    t0 = time.perf_counter()
    with _sampling(engine, sampling or engine.sampling):
        sched.submit(trajs)
        sched.run()
    done = sorted(sched.take_finished(), key=lambda t: t.uid)
    texts = [decode(t.tokens) for t in done]
    rewards, _ = scorer.score(texts, [records[t.group_id]["answer"] for t in done], overlong_penalty=False)
    correct = (np.asarray(rewards).reshape(len(records), k) > 0.5)
    metrics = {"eval/accuracy": float(correct.mean()), f"eval/avg@{k}": float(correct.mean()),
               f"eval/pass@{k}": float(correct.any(axis=1).mean()),
               "eval/response_length": float(np.mean([t.num_tokens for t in done])),
               "time/eval": time.perf_counter() - t0}
    rows = [{"problem": t.group_id, "sample": t.uid % k, "prompt": records[t.group_id]["prompt"], "response": text,
             "answer": records[t.group_id]["answer"], "reward": float(r), "num_tokens": t.num_tokens}
            for t, text, r in zip(done, texts, rewards, strict=True)]
    return metrics, rows


def logged_rows(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` rows taking one sample of every problem before a second one, so a small log shows as
    many different problems as it can."""
    return sorted(rows, key=lambda r: (r["sample"], r["problem"]))[:n]


def write_samples(path: storage.PathLike, rows: list[dict], step: int) -> None:
    """JSONL of ``rows`` (with the step), written so that a reader never sees half of it (``storage``)."""
    path = storage.as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_text_atomically(path, "".join(json.dumps({"step": step, **row}) + "\n" for row in rows))


def eval_settings(run: Run) -> tuple[int, int, SamplingConfig]:
    """(samples per problem, max new tokens, sampler) of a run's evaluation: EvalConfig, else training's."""
    cfg = EvalConfig()
    k = cfg.samples_per_problem or run.cfg.eval_samples
    max_new = cfg.max_new_tokens or RolloutConfig().max_new_tokens
    longest = max(len(run.encode(record)) for record in run.eval_records)
    if longest + max_new > run.engine.config.max_seq_len:
        raise ValueError(f"EvalConfig.max_new_tokens={max_new} (else RolloutConfig.max_new_tokens) leaves no room "
                         f"for the longest eval prompt ({longest} tokens) in EngineConfig.max_seq_len="
                         f"{run.engine.config.max_seq_len}.")
    return k, max_new, cfg.sampling(run.engine.sampling)


def evaluate_run(run: Run, samples_path: storage.PathLike | None = None) -> dict:
    """Held-out evaluation of a built run's current policy (eval set from TrainConfig, sampling from EvalConfig).

    ``EvalConfig.num_samples_logged`` generations go to ``samples_path`` (default: the run's
    ``samples/step_<N>.jsonl`` when it has a workdir, else nowhere)."""
    k, max_new, sampling = eval_settings(run)
    metrics, rows = evaluate_policy(run.engine, run.eval_records, run.encode, run.decode, run.scorer, k, max_new,
                                    sampling)
    step = run.engine.version
    if samples_path is None and run.workdir is not None:
        samples_path = run.workdir / "samples" / f"step_{step}.jsonl"
    n = EvalConfig().num_samples_logged
    if samples_path is not None and n and jax.process_index() == 0:  # one writer on several hosts
        write_samples(samples_path, logged_rows(rows, n), step)
    return metrics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[])
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--k", type=int, default=None,
                    help="samples per problem (default: EvalConfig.samples_per_problem, else TrainConfig.eval_samples)")
    ap.add_argument("--num_problems", type=int, default=None)
    ap.add_argument("--samples_out", default=None,
                    help="write EvalConfig.num_samples_logged generations to this JSONL file")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    distributed.add_cli_flags(ap)
    args = ap.parse_args(argv)
    if args.k is not None:  # EvalConfig checks it (0 used to be ignored in silence)
        args.gin_param.append(f"EvalConfig.samples_per_problem = {args.k}")
    run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    # Checked before the evaluation, which can take hours: a bad --samples_out used to fail only after it.
    if args.num_problems is not None and args.num_problems < 1:
        raise ValueError(f"--num_problems={args.num_problems} must be >= 1.")
    if args.samples_out:
        storage.check_writable(args.samples_out, "--samples_out")
    parse_gin(args.gin_file, args.gin_param)
    EvalConfig()  # its values (--k among them) are checked before the policy loads
    distributed.initialize_from_flags(args)
    compile_cache.compilation_cache()
    checkpoint = storage.as_path(args.checkpoint)
    if not (checkpoint / "config.json").exists():
        resolve_checkpoint(checkpoint)  # a mistyped path fails here, before the policy is loaded
    cfg = TrainConfig()
    if args.num_problems is not None:
        cfg = dataclasses.replace(cfg, eval_size=args.num_problems)
    run = build(cfg, checkpoint=checkpoint)
    try:
        result = evaluate_run(run, args.samples_out)
    finally:
        run.close()
    k = next(key for key in result if key.startswith("eval/avg@")).split("@")[1]
    print(f"{args.checkpoint}: {len(run.eval_records)} problems x {k} samples: "
          f"avg@{k} = {result[f'eval/avg@{k}']:.4f}  pass@{k} = {result[f'eval/pass@{k}']:.4f}  "
          f"mean length {result['eval/response_length']:.1f}")
    if args.samples_out:
        print(f"samples: {args.samples_out}")


if __name__ == "__main__":
    main()
