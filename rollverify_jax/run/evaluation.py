"""Held-out evaluation of a policy: avg@k / pass@k on an eval set with fixed seeds, and a few generations logged.

How evaluation samples is ``EvalConfig`` (temperature, top-p, samples per problem, response length); its
defaults are training's settings, so evaluation matches the training sampler unless told otherwise. Every
evaluation inside training writes a few of its generations to ``<workdir>/samples/step_<N>.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.infra import storage
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from rollverify_jax.run.builder import Policy

EVAL_SEED_OFFSET = 1_000_000_000


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


def eval_settings(policy: Policy) -> tuple[int, int, SamplingConfig]:
    """(samples per problem, max new tokens, sampler) of a policy's evaluation: EvalConfig, else training's."""
    spec = policy.spec
    cfg = spec.eval
    k = cfg.samples_per_problem or spec.train.eval_samples
    max_new = cfg.max_new_tokens or spec.rollout.max_new_tokens
    longest = max(len(policy.encode(record)) for record in policy.eval_records)
    if longest + max_new > policy.engine.config.max_seq_len:
        raise ValueError(f"EvalConfig.max_new_tokens={max_new} (else RolloutConfig.max_new_tokens) leaves no room "
                         f"for the longest eval prompt ({longest} tokens) in EngineConfig.max_seq_len="
                         f"{policy.engine.config.max_seq_len}.")
    return k, max_new, cfg.sampling(policy.engine.sampling)


def evaluate_run(policy: Policy, workdir: storage.PathLike | None = None,
                 samples_path: storage.PathLike | None = None) -> dict:
    """Held-out evaluation of a built policy as its engine holds it (eval set from TrainConfig, sampling from
    EvalConfig).

    ``EvalConfig.num_samples_logged`` generations go to ``samples_path`` (default: the run's
    ``samples/step_<N>.jsonl`` under ``workdir`` when there is one, else nowhere)."""
    k, max_new, sampling = eval_settings(policy)
    metrics, rows = evaluate_policy(policy.engine, policy.eval_records, policy.encode, policy.decode, policy.scorer,
                                    k, max_new, sampling)
    step = policy.engine.version
    if samples_path is None and workdir is not None:
        samples_path = storage.as_path(workdir) / "samples" / f"step_{step}.jsonl"
    n = policy.spec.eval.num_samples_logged
    if samples_path is not None and n and jax.process_index() == 0:  # one writer on several hosts
        write_samples(samples_path, logged_rows(rows, n), step)
    return metrics
