"""Held-out evaluation of a policy: avg@k, pass@k and maj@k on one or more eval sets with fixed seeds, and a few
generations logged. An ``Evaluator`` holds what it takes, each part typed (the engine, the prompt renderer, the
reward scorer, the tool runner, the eval sets and settings); nothing here reads the run's spec.

How evaluation samples is ``EvalConfig`` (temperature, top-p, samples per problem, response length); its
defaults are training's settings, so evaluation matches the training sampler unless told otherwise. The eval
sets are ``TrainConfig.eval_dataset`` (metrics ``eval/...``) and each of ``TrainConfig.eval_sets`` (metrics
``eval/<name>/...``). Every evaluation inside training writes a few generations of each set to
``<workdir>/samples/step_<N>.jsonl`` (each row names its set).

With n samples per problem, c of them correct:
- avg@n is the mean correctness (``eval/accuracy`` is avg@n);
- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator of "one of k samples is correct" (Chen et al.,
  2021); any-of-n for k = n, so earlier pass@n values are unchanged;
- maj@k: the most frequent extracted answer of the first k samples (ties: the one that appears first) is
  correct; samples with no extractable answer do not vote. Answers are extracted as the ``math`` reward does
  (the last ``Answer:`` line, else the last ``\\boxed{}``).
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

from rollverify_jax.data.plugins import with_interaction
from rollverify_jax.data.rewards import RewardScorer, extract_answer
from rollverify_jax.infra import storage
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.environment import Environment
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.trajectory import Trajectory

if TYPE_CHECKING:  # only a type here: reading a spec (which imports EvalConfig) loads no dataset code
    from rollverify_jax.data.prompts import PromptRenderer

EVAL_SEED_OFFSET = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How held-out evaluation samples, apart from training's sampler. Each None keeps training's value, so the
    defaults reproduce the evaluation of earlier versions exactly (same sampler, same seeds)."""

    temperature: float | None = None  # None: SamplingConfig.temperature; 0: greedy (one sample per problem)
    top_p: float | None = None  # None: SamplingConfig.top_p
    samples_per_problem: int | None = None  # k of avg@k / pass@k; None: TrainConfig.eval_samples
    max_new_tokens: int | None = None  # None: RolloutConfig.max_new_tokens
    at_start: bool = True  # False: a fresh training run skips its step-0 evaluation
    num_samples_logged: int = 16  # generations written per set and evaluation to samples/step_<N>.jsonl (0: none)
    # The k of pass@k and maj@k besides the samples per problem n (always reported); each must be <= n.
    at_k: tuple[int, ...] = ()

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
        if any(not isinstance(k, int) or k < 1 for k in self.at_k):
            raise ValueError(f"EvalConfig.at_k={self.at_k} must hold integers >= 1.")
        if self.temperature == 0 and ((self.samples_per_problem or 1) > 1 or any(k > 1 for k in self.at_k)):
            raise ValueError(f"EvalConfig.temperature=0 is greedy: every sample of a problem is the same response, "
                             f"so samples_per_problem={self.samples_per_problem} and at_k={self.at_k} would grade it "
                             "again at their cost; leave them unset (greedy evaluation draws one sample) or set a "
                             "temperature > 0.")

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


def pass_at_k(n: int, correct: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per problem from ``correct`` [P] correct samples out of n: 1 - C(n-c, k) / C(n, k), as the
    product 1 - prod_{i=n-c+1..n} (1 - k / i), which stays exact where the binomials would overflow."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per problem.")
    out = np.ones(len(correct), np.float64)
    for p, c in enumerate(np.asarray(correct, np.int64)):
        if n - c >= k:
            out[p] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
    return out


def majority_correct(answers: Sequence[Sequence[str | None]], correct: np.ndarray, k: int) -> np.ndarray:
    """bool[P]: the most frequent answer among each problem's first k samples is a correct one. ``answers`` [P][n]
    are the extracted answers (None: none found, no vote); ``correct`` [P, n] the samples' grades."""
    out = np.zeros(len(answers), bool)
    for p, row in enumerate(answers):
        votes: dict[str, list[int]] = {}
        for j, answer in enumerate(row[:k]):
            if answer is not None:
                votes.setdefault(answer, []).append(j)
        if votes:
            winner = max(votes.values(), key=len)  # dicts keep insertion order: a tie goes to the first seen
            out[p] = bool(correct[p, winner[0]])
    return out


def sample_metrics(correct: np.ndarray, answers: Sequence[Sequence[str | None]], at_k: Sequence[int],
                   prefix: str = "eval/") -> dict[str, float]:
    """avg@n (``accuracy``), pass@k and maj@k for k in ``at_k`` and n, from ``correct`` bool[P, n]."""
    n = correct.shape[1]
    too_big = [k for k in at_k if k > n]
    if too_big:
        raise ValueError(f"EvalConfig.at_k={tuple(at_k)} asks for k = {too_big} but each problem has {n} samples "
                         "(EvalConfig.samples_per_problem, else TrainConfig.eval_samples); lower at_k or raise n.")
    counts = correct.sum(axis=1)
    out = {f"{prefix}accuracy": float(correct.mean()), f"{prefix}avg@{n}": float(correct.mean())}
    for k in sorted({*at_k, n}):
        out[f"{prefix}pass@{k}"] = float(pass_at_k(n, counts, k).mean())
        out[f"{prefix}maj@{k}"] = float(majority_correct(answers, correct, k).mean())
    return out


def vote_key(response: str) -> str | None:
    """The answer a response votes for in maj@k (whitespace-normalised); None when it gives none."""
    answer = extract_answer(response)
    return " ".join(answer.split()) if answer else None


def evaluate_policy(engine: Engine, records: Sequence[dict], encode: Callable[[dict], np.ndarray],
                    decode: Callable[[list[int]], str], scorer: RewardScorer, k: int, max_new_tokens: int,
                    sampling: SamplingConfig | None = None, at_k: Sequence[int] = (),
                    prefix: str = "eval/", tools: Environment | None = None) -> tuple[dict, list[dict]]:
    """Samples k responses per record (fixed seeds, so evaluations at different steps see the same randomness)
    with ``sampling`` (default: the engine's). Returns the metrics (avg@k, pass@k, maj@k, mean response length,
    named ``prefix...``) and one row per response (problem, sample, prompt, response, answer, reward), problem by
    problem. ``tools``: multi-turn tool use, as in training."""
    sched = Scheduler(engine, tools)
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
    # The reward sees the whole interaction: num_turns and tool_calls of a multi-turn trajectory, as in training.
    graded = [with_interaction(records[t.group_id], t.env_spans, t.num_tokens, tools is not None) for t in done]
    rewards, graded_metrics = scorer.score(texts, [r["answer"] for r in graded], overlong_penalty=False,
                                           records=graded)
    correct = np.asarray(rewards).reshape(len(records), k) > 0.5
    votes = [[vote_key(texts[i * k + j]) for j in range(k)] for i in range(len(records))]
    metrics = {**sample_metrics(correct, votes, at_k, prefix),
               f"{prefix}response_length": float(np.mean([t.num_tokens for t in done])),
               # an accuracy of 0 with grader errors is a broken reward, not a policy that knows nothing
               f"{prefix}grader_errors": graded_metrics["reward/grader_errors"],
               f"{prefix}grader_timeouts": graded_metrics["reward/grader_timeouts"],
               "time/eval": time.perf_counter() - t0}
    if tools is not None:
        metrics[f"{prefix}tool_calls"] = float(np.mean([t.tool_calls for t in done]))
    rows = [{"problem": t.group_id, "sample": t.uid % k, "prompt": records[t.group_id]["prompt"], "response": text,
             "answer": records[t.group_id]["answer"], "reward": float(r), "num_tokens": t.num_tokens,
             **({"tool_calls": t.tool_calls} if t.tool_calls else {})}
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


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One eval set: ``name`` ("" for the primary one, ``TrainConfig.eval_dataset``, metrics ``eval/...``; else a
    ``TrainConfig.eval_sets`` key, metrics ``eval/<name>/...``), its records, and its own samples per problem
    (``TrainConfig.eval_sets[name]['k']``; None: the evaluator's)."""

    name: str
    records: list[dict]
    k: int | None = None


@dataclasses.dataclass
class Evaluator:
    """Held-out evaluation of the policy its engine holds, on every eval set, sampling as ``config`` says.

    The engine samples (with the tool runner in a multi-turn run), ``prompts`` encodes the records and its tokenizer
    decodes the responses, the scorer grades them. ``samples_per_problem`` and ``max_new_tokens`` are training's
    (``TrainConfig.eval_samples``, ``RolloutConfig.max_new_tokens``), used where ``config`` sets neither."""

    engine: Engine
    prompts: PromptRenderer
    scorer: RewardScorer
    sets: tuple[EvalSet, ...]  # the primary set first, then TrainConfig.eval_sets in order
    config: EvalConfig
    samples_per_problem: int
    max_new_tokens: int
    tools: Environment | None = None

    def samples(self, eval_set: EvalSet) -> int:
        """n of a set: its own ``k``, else ``EvalConfig.samples_per_problem``, else training's; one under a greedy
        sampler, which draws the same response every time (as verl's greedy validation draws one)."""
        if self.config.sampling(self.engine.sampling).greedy:
            return 1
        return eval_set.k or self.config.samples_per_problem or self.samples_per_problem

    def settings(self) -> tuple[int, SamplingConfig]:
        """(max new tokens, sampler) of the evaluation: EvalConfig's, else training's; checked against every set
        (each n holds every k of ``at_k``, the response length leaves room for the longest prompt), so a bad
        setting fails when the run is built, not after hours of training or sampling."""
        cfg = self.config
        max_new = cfg.max_new_tokens or self.max_new_tokens
        max_seq_len = self.engine.config.max_seq_len
        for eval_set in self.sets:
            name, n = eval_set.name, self.samples(eval_set)
            where = f"eval set {name!r}" if name else "the primary eval set"
            too_big = [a for a in cfg.at_k if a > n]
            if too_big:
                source = f"TrainConfig.eval_sets[{name!r}]['k']" if eval_set.k else \
                    "EvalConfig.samples_per_problem, else TrainConfig.eval_samples"
                raise ValueError(f"EvalConfig.at_k={tuple(cfg.at_k)} asks for k = {too_big} but {where} has "
                                 f"{n} samples per problem ({source}); lower at_k or raise the samples.")
            longest = max(len(self.prompts.encode(record)) for record in eval_set.records)
            if longest + max_new > max_seq_len:
                label = f"eval set {name!r}" if name else "eval"
                raise ValueError(f"EvalConfig.max_new_tokens={max_new} (else RolloutConfig.max_new_tokens) leaves "
                                 f"no room for the longest {label} prompt ({longest} tokens) in "
                                 f"EngineConfig.max_seq_len={max_seq_len}.")
        return max_new, cfg.sampling(self.engine.sampling)

    def run(self, workdir: storage.PathLike | None = None, samples_path: storage.PathLike | None = None) -> dict:
        """The metrics of every set, with the engine's params as it holds them. ``time/eval`` is the whole
        evaluation's time.

        ``EvalConfig.num_samples_logged`` generations of each set go to ``samples_path`` (default: the run's
        ``samples/step_<N>.jsonl`` under ``workdir`` when there is one, else nowhere); rows of a named set carry
        ``eval_set``."""
        max_new, sampling = self.settings()
        metrics, logged = {"time/eval": 0.0}, []
        n = self.config.num_samples_logged
        decode = self.prompts.tokenizer.decode
        for eval_set in self.sets:
            name = eval_set.name
            prefix = f"eval/{name}/" if name else "eval/"
            result, rows = evaluate_policy(self.engine, eval_set.records, self.prompts.encode, decode, self.scorer,
                                           self.samples(eval_set), max_new, sampling, self.config.at_k, prefix,
                                           self.tools)
            metrics["time/eval"] += result.pop("time/eval")
            metrics.update(result)
            logged += [{"eval_set": name, **row} if name else row for row in logged_rows(rows, n)]
        step = self.engine.version
        if samples_path is None and workdir is not None:
            samples_path = storage.as_path(workdir) / "samples" / f"step_{step}.jsonl"
        if samples_path is not None and n and jax.process_index() == 0:  # one writer on several hosts
            write_samples(samples_path, logged, step)
        return metrics
