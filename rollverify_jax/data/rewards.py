"""Reward functions (a string registry) and a batch scorer that isolates slow, crashing or greedy graders.

A reward function maps ``(response, answer) -> float``; verl's ``compute_score`` and TRL's batch reward functions
are taken too, from a module or a file (``plugins``: how each is called). The scorer grades each response against
its own record (``score(..., records=...)``: data_source, extra_info, prompt), with the reward its data source
picks (``RewardScorer.by_data_source``) or the default one. Symbolic graders (``math``: math_verify over
sympy) can hang, crash or eat memory on adversarial model output, so ``RewardScorer`` runs the ones registered
with ``isolated=True`` in a pebble process pool (spawn context: the parent may hold JAX and threads). Each
worker is limited: its address space (``memory_limit_mb``; a grader past it gets a MemoryError, not the host's
OOM killer, which might pick the trainer), each item's CPU time and wall time. A grade that times out or fails
gives reward 0 and is counted in ``reward/grader_timeouts`` / ``reward/grader_errors``; so is a grade that is
not a finite number (NaN would otherwise reach the advantages and the loss).

Timeouts work at two levels: inside the worker a SIGALRM timer (wall) and RLIMIT_CPU's SIGXCPU (CPU time)
interrupt Python-level loops (the usual sympy hang) and the worker survives; in the parent pebble's deadline
(``timeout_s + hard_timeout_grace_s``) catches a worker stuck in C code with signals blocked, and kills and
replaces that worker alone; a worker that dies is replaced alone too, and its item retried once. Workers ignore
SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM to every process is the trainer's to handle (it finishes its
step, which needs the graders); the scorer kills its workers with SIGKILL.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import pickle
import re
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import pebble

from rollverify_jax.data.plugins import (
    CallStyle,
    Grader,
    call_style,
    data_source_of,
    is_plugin,
    load_plugin,
    missing_columns,
    split_grade,
)
from rollverify_jax.infra import distributed

RewardFn = Callable[[str, str], float]

_ANSWER_LINE = re.compile(r"Answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


# ----------------------------------------------------------------------------------------------------------
# Answer extraction.


def extract_answer_line(text: str) -> str | None:
    """Value after the last ``Answer:`` (DAPO's format), to the end of its line; None if absent."""
    matches = _ANSWER_LINE.findall(text)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with nested braces balanced; None if absent or unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        content = _balanced(text, start)
        if content is not None:
            return content.strip()
    return None


def _balanced(text: str, start: int) -> str | None:
    """Text from ``start`` up to the brace that closes the one just before it."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """DAPO ``Answer:`` line if present, else the last ``\\boxed{}``; a boxed value in the line is unboxed."""
    line = extract_answer_line(text)
    if line:
        boxed = extract_boxed(line)
        return _strip_math_delimiters(boxed if boxed is not None else line)
    boxed = extract_boxed(text)
    return _strip_math_delimiters(boxed) if boxed is not None else None


def _strip_math_delimiters(value: str) -> str:
    """Drop surrounding ``$``/``\\(\\)`` and a final period so the value parses as one expression."""
    value = value.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(value) >= len(left) + len(right) and value.startswith(left) and value.endswith(right):
            value = value[len(left) : len(value) - len(right)].strip()
    return value


# ----------------------------------------------------------------------------------------------------------
# Reward functions.


def exact_reward(response: str, answer: str) -> float:
    """1.0 when the last ``Answer:`` value equals the answer after stripping whitespace (synthetic task)."""
    value = extract_answer_line(response)
    return float(value is not None and value.strip() == str(answer).strip())


def math_equal(prediction: str, gold: str) -> bool:
    """Symbolic equivalence via math_verify; both sides are parsed as the content of a ``\\boxed{}``.

    math_verify's own signal timeouts are off (they would cancel the worker's timer); run this through
    ``RewardScorer`` to bound its time.
    """
    from math_verify import parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{prediction}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_reward(response: str, answer: str) -> float:
    """1.0 when the extracted answer (``Answer:`` line, else last ``\\boxed{}``) equals the gold answer."""
    prediction = extract_answer(response)
    if not prediction:
        return 0.0
    return float(math_equal(prediction, _strip_math_delimiters(str(answer))))


# DAPO's rule-based math reward, for results that compare with other frameworks' DAPO recipes: the last
# ``Answer:`` line within the response's final 300 characters, normalised as in Minerva (Lewkowycz et al.,
# 2022: units, \text{}, $...$, shorthand \frac/\sqrt and thousands separators), equal as strings to the
# normalised gold answer; +1 when correct, -1 otherwise. Written here from that published rule (it is a
# handful of string edits, not worth a dependency on a whole RL framework).
_DAPO_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_MINERVA_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
                 ",\\!", "{,}", '"', "\\dots")
_MINERVA_UNWRAP = tuple(re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})",
                                                  r"(\\overline\{)(.*?)(\})", r"(\\boxed\{)(.*)(\})"))


def minerva_normalize(answer: str) -> str:
    """A final answer in Minerva's canonical string form (the right side of any ``=``, units and markup off)."""
    answer = answer.split("=")[-1]
    for before, after in _MINERVA_REPLACE:
        answer = answer.replace(before, after)
    for junk in _MINERVA_DROP:
        answer = answer.replace(junk, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for wrapper in _MINERVA_UNWRAP:
        answer = wrapper.sub("\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math_reward(response: str, answer: str) -> float:
    """DAPO's reward: +1 when the last ``Answer:`` of the response's tail matches the gold answer after Minerva
    normalisation, -1 otherwise (a missing answer included)."""
    found = _DAPO_ANSWER.findall(response[-_DAPO_TAIL_CHARS:])
    prediction = minerva_normalize(found[-1]) if found else None
    return 1.0 if prediction == minerva_normalize(str(answer)) else -1.0


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A reward: the function, whether it must run isolated in the grader pool, and how it is called
    (``plugins.CallStyle``: rollverify's ``(response, answer)``, verl's ``compute_score`` or a TRL function)."""

    fn: Callable[..., Any]
    isolated: bool
    style: CallStyle = CallStyle()

    @property
    def grader(self) -> Grader:
        """What a grader worker receives and calls as ``grader(response, answer, context)``."""
        return Grader(self.fn, self.style)


_REGISTRY: dict[str, RewardSpec] = {}
REWARDS: dict[str, Callable[..., Any]] = {}


def register_reward(name: str, fn: Callable[..., Any], isolated: bool = True) -> Callable[..., Any]:
    """Add a reward to the registry: ``fn(response, answer)``, a verl ``compute_score`` or a TRL reward function
    (``plugins``). ``fn`` must be a module-level function (it is pickled by reference)."""
    _REGISTRY[name] = RewardSpec(fn=fn, isolated=isolated, style=call_style(fn, name))
    REWARDS[name] = fn
    return fn


def get_reward_spec(name: str) -> RewardSpec:
    """A registered reward, or a plug-in: ``'package.module:function'``, ``'/path/to/file.py:function'`` (verl's
    ``custom_reward_function``; ``'/path/to/file.py'`` alone means ``compute_score``).

    A plug-in is ``fn(response: str, answer: str) -> float`` (the decoded response without the prompt, the
    record's gold answer as a string), verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)`` or a TRL reward function ``(prompts, completions, **kwargs)`` (``plugins`` says how each is
    called); a reward > 0.5 counts as correct in evaluation. Plug-ins run isolated in the grader pool, with its
    timeout, since their cost is unknown."""
    if is_plugin(name):
        shipped, fn = load_plugin(name)
        return RewardSpec(fn=shipped, isolated=True, style=call_style(fn, name))
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(_REGISTRY)}, or a plug-in "
                         "'package.module:function' or '/path/to/file.py:function'")
    return _REGISTRY[name]


def get_reward_fn(name: str) -> Callable[..., Any]:
    """The reward function registered under ``name`` (ValueError listing the known names otherwise)."""
    return get_reward_spec(name).fn


register_reward("math", math_reward, isolated=True)
register_reward("exact", exact_reward, isolated=False)
register_reward("dapo", dapo_math_reward, isolated=False)


# ----------------------------------------------------------------------------------------------------------
# DAPO overlong penalty.


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 up to L - Lc, linear down to -1 at L, -1 beyond L."""
    if buffer <= 0:
        return 0.0 if length <= max_length else -1.0
    threshold = max_length - buffer
    if length <= threshold:
        return 0.0
    if length <= max_length:
        return (threshold - length) / buffer
    return -1.0


# ----------------------------------------------------------------------------------------------------------
# Worker side.


class GraderTimeout(BaseException):
    """Raised by the worker's alarm or CPU-time limit; a BaseException so graders' ``except Exception`` cannot
    swallow it."""


def _raise_timeout(signum, frame) -> None:
    raise GraderTimeout()


_START_BARRIER = None
_INIT_ERROR: BaseException | None = None
_KILL_AFTER_S = 0.2  # from pebble's SIGTERM (ignored by the workers) to its SIGKILL


# The record a grader's warm-up grade sees (a verl or TRL function reads these keys; a multi-turn reward such as
# ReTool's reads extra_info["num_turns"], which a single-turn response has as 2: plugins.with_interaction).
_WARMUP_CONTEXT = {"data_source": "warmup", "extra_info": {"num_turns": 2, "tool_calls": 0}, "prompt": "What is 1/2?",
                   "messages": None}


def _init_worker(barrier, memory_limit_bytes: int, graders_bytes: bytes, warmup_s: float) -> None:
    """Runs in every worker pebble starts (the first ones and each replacement): signals, limits, and one grade
    per reward off the clock. Unpickling the graders imports their modules (a file plug-in loads its file on the
    warm-up call), and one grade loads what a grader builds lazily (math_verify's sympy/antlr tables take
    seconds), so a fresh worker's first item does not time out. An error here is kept for ``_worker_ready`` to
    report, rather than a worker that dies and is restarted forever."""
    global _START_BARRIER, _INIT_ERROR
    _START_BARRIER = barrier
    _ignore_stop_signals()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.signal(signal.SIGXCPU, _raise_timeout)
    try:
        if memory_limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
        graders = pickle.loads(graders_bytes)
    except Exception as e:  # noqa: BLE001  (reported by the start-up check)
        _INIT_ERROR = e
        return
    # Not real grades: a grader that rejects this sample input is still asked (and charged) for real items.
    for grader in graders:
        signal.setitimer(signal.ITIMER_REAL, warmup_s)
        try:
            grader("Answer: 1/2", "0.5", _WARMUP_CONTEXT)
        except (Exception, GraderTimeout):  # noqa: BLE001
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _ignore_stop_signals() -> None:
    """A Ctrl-C (SIGINT to the foreground process group) or a scheduler's SIGTERM to every process of the job
    (SLURM, a container stop) is the trainer's to handle: it finishes its step, which needs the graders. So both
    are ignored here, for the whole process (a disposition, not a thread's mask: libraries start threads
    before this runs); the scorer stops a worker with SIGKILL, as pebble does ``_KILL_AFTER_S`` after its
    SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_ready(timeout_s: float) -> bool:
    """Start-up check, one per worker (the barrier makes each run on its own): the worker's initialiser worked."""
    if _INIT_ERROR is not None:
        raise _INIT_ERROR
    _START_BARRIER.wait(timeout=timeout_s)
    return True


def _grade_in_worker(grader: Grader, response: str, answer: str, timeout_s: float, cpu_limit_s: float,
                     context: Mapping[str, Any] | None = None) -> tuple[float, dict[str, float]]:
    """One grade under a wall-clock timer (SIGALRM) and a CPU-time limit (RLIMIT_CPU's soft limit, set to the
    worker's CPU time so far plus ``cpu_limit_s``, raises SIGXCPU); the pool runs tasks in the main thread."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limit = math.ceil(usage.ru_utime + usage.ru_stime + cpu_limit_s)
    resource.setrlimit(resource.RLIMIT_CPU, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        score, extras = split_grade(grader(response, answer, context))
        return float(score), extras
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


# ----------------------------------------------------------------------------------------------------------
# Parent side.


_COUNT_KEYS = ("timeouts", "errors", "nonfinite", "worker_restarts", "pool_restarts")


@dataclasses.dataclass
class _GradeNotes:
    """What one batch's grading saw besides the grades: the first error's text (for the warning) and the numeric
    extras a verl reward returns in its dict (``reward/extra/<key>``: the mean over the responses that returned
    the key; on several processes, over process 0's share)."""

    first_error: str | None = None
    extras: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def error(self, e: BaseException) -> None:
        if self.first_error is None:
            self.first_error = f"{type(e).__name__}: {e}"[:300]

    def add(self, extras: Mapping[str, float]) -> None:
        for key, value in extras.items():
            self.extras.setdefault(key, []).append(value)

    def extra_metrics(self) -> dict[str, float]:
        return {f"reward/extra/{key}": float(np.mean(values)) for key, values in sorted(self.extras.items())}


@dataclasses.dataclass(frozen=True)
class _Job:
    """One response to grade: its reward, the response, the gold answer and the record's context (data_source,
    extra_info, prompt, messages; None for a rollverify-style reward, which reads none of it)."""

    spec: RewardSpec
    response: str
    answer: str
    context: dict | None = None


def _context(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a verl or TRL reward function may read of a record."""
    record = record or {}
    return {"data_source": data_source_of(record), "extra_info": record.get("extra_info"),
            "prompt": record.get("prompt", ""), "messages": record.get("messages")}


class RewardScorer:
    """Scores a batch of responses; isolated rewards run in a pool of limited worker processes.

    Args:
      name: registered reward name (``math``, ``dapo``, ``exact``) or a plug-in ``'package.module:function'`` /
        ``'/path/to/file.py:function'`` (rollverify's ``(response, answer)``, verl's ``compute_score`` or a TRL
        reward function: ``plugins``); it grades every record whose data_source ``by_data_source`` does not name.
      timeout_s: per-item grading time limit; a timed-out item gets reward 0.
      num_workers: grader processes (only for isolated rewards).
      overlong_buffer: DAPO ``Lc``; 0 turns the overlong penalty off.
      max_response_length: DAPO ``L`` in tokens; required when ``overlong_buffer > 0``.
      hard_timeout_grace_s: extra time before the parent kills a worker that ignores its alarm.
      startup_timeout_s: limit for starting the pool (process spawn + imports + warm-up).
      mp_context: ``spawn`` or ``forkserver``; never ``fork`` (the parent may run JAX threads).
      memory_limit_mb: each worker's address space (RLIMIT_AS); a grade past it fails with a MemoryError and is
        scored 0 as an error. 0: no limit. A worker that imported math_verify maps about 0.5 GB.
      cpu_limit_s: each item's CPU time (RLIMIT_CPU; None: ``timeout_s``): bounds a grader that runs threads,
        whose CPU time outgrows the wall clock.
      by_data_source: a reward per data source, ``{data_source: reward name or plug-in}`` (e.g.
        ``{'openai/gsm8k': 'math', 'my_source': '/path/reward.py:compute_score'}``): a record's ``data_source``
        picks its reward, ``name`` grades the rest. Each runs in the pool or inline as its registration says
        (plug-ins: the pool). Needs the records in ``score(..., records=...)``.
    """

    def __init__(
        self,
        name: str = "math",
        timeout_s: float = 5.0,
        num_workers: int = 4,
        overlong_buffer: int = 0,
        max_response_length: int | None = None,
        hard_timeout_grace_s: float = 2.0,
        startup_timeout_s: float = 120.0,
        mp_context: str = "spawn",
        memory_limit_mb: int = 4096,
        cpu_limit_s: float | None = None,
        by_data_source: Mapping[str, str] | None = None,
    ):
        self.spec = get_reward_spec(name)
        self.name = name
        self.by_data_source = dict(by_data_source or {})
        self.source_specs = {source: self._source_spec(source, reward)
                             for source, reward in self.by_data_source.items()}
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(
                f"RewardScorer needs timeout_s > 0 and num_workers >= 1, got {timeout_s}, {num_workers}"
            )
        if overlong_buffer > 0 and (max_response_length is None or max_response_length < overlong_buffer):
            raise ValueError(
                f"RewardScorer.overlong_buffer={overlong_buffer} needs max_response_length >= the buffer "
                f"(got {max_response_length}); bind RewardScorer.max_response_length to the rollout's limit"
            )
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"RewardScorer.mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        if memory_limit_mb < 0 or (cpu_limit_s is not None and cpu_limit_s <= 0):
            raise ValueError(f"RewardScorer needs memory_limit_mb >= 0 (0: no limit) and cpu_limit_s > 0 or None, "
                             f"got {memory_limit_mb}, {cpu_limit_s}")
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.overlong_buffer = int(overlong_buffer)
        self.max_response_length = max_response_length
        self.hard_timeout_grace_s = float(hard_timeout_grace_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.mp_context = mp_context
        self.memory_limit_mb = int(memory_limit_mb)
        self.cpu_limit_s = float(cpu_limit_s if cpu_limit_s is not None else timeout_s)
        self.totals: collections.Counter[str] = collections.Counter()
        self._pool: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        self._warned_no_records = False
        self._warned_failures = self._warned_mostly_failing = False
        self._notes = _GradeNotes()

    @staticmethod
    def _source_spec(source: Any, reward: Any) -> RewardSpec:
        """The reward of one ``by_data_source`` entry; a bad entry names itself."""
        if not isinstance(source, str) or not source or not isinstance(reward, str) or not reward:
            raise ValueError(f"RewardScorer.by_data_source maps a data_source (a non-empty string) to a reward name "
                             f"or plug-in (a non-empty string); got {source!r}: {reward!r}")
        try:
            return get_reward_spec(reward)
        except ValueError as e:
            raise ValueError(f"RewardScorer.by_data_source[{source!r}]: {e}") from None

    # -- public API ----------------------------------------------------------------------------------------

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        response_lengths: Sequence[int] | None = None,
        overlong_penalty: bool = True,
        records: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Rewards ``float32[N]`` (base reward + overlong penalty) and metrics for one batch.

        ``overlong_penalty=False`` scores correctness alone (evaluation: accuracy is not a training signal).
        ``records`` (one per response: its prompt's dataset record) give the reward its ``data_source``,
        ``extra_info`` and prompt, and pick the reward of ``by_data_source``; with two data sources or more (or
        ``by_data_source`` set) the metrics add ``reward/<data_source>/mean``."""
        if len(responses) != len(answers):
            raise ValueError(f"score got {len(responses)} responses but {len(answers)} answers")
        if records is not None and len(records) != len(responses):
            raise ValueError(f"score got {len(responses)} responses but {len(records)} records")
        if response_lengths is not None and len(response_lengths) != len(responses):
            raise ValueError(f"score got {len(responses)} responses but {len(response_lengths)} lengths")
        if overlong_penalty and self.overlong_buffer > 0 and response_lengths is None:
            raise ValueError(
                "RewardScorer.overlong_buffer > 0 needs response_lengths (token counts) in score()"
            )
        start = time.perf_counter()
        jobs = self._jobs(responses, answers, records)

        def grade(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            with self._lock:
                self._notes = _GradeNotes()
                base, counts = self._grade_jobs([jobs[i] for i in indices])
            return base, np.asarray([counts[k] for k in _COUNT_KEYS], np.float64)

        # Several processes: each grades its share and all receive every grade, so each trajectory is graded
        # once and every host sees the same rewards (a grade that times out on one host only cannot diverge).
        base, summed = distributed.share_across_processes(grade, len(responses))
        base = base.astype(np.float32)
        counts = collections.Counter({k: int(v) for k, v in zip(_COUNT_KEYS, summed, strict=True) if v})
        if counts["nonfinite"]:
            print(f"warning: reward {self.name!r} returned a non-finite grade (NaN or inf) for {counts['nonfinite']} "
                  f"of {len(responses)} responses; they are scored 0 and counted in reward/grader_errors: a grade "
                  "must be a finite number (fix the reward function)", file=sys.stderr, flush=True)
        self._warn_failures(counts, len(responses))
        penalties = self._penalties(response_lengths if overlong_penalty else None, len(responses))
        rewards = (base + penalties).astype(np.float32)
        self.totals.update(counts)
        metrics = self._metrics(rewards, base, penalties, counts, time.perf_counter() - start)
        return rewards, {**metrics, **self._source_metrics(rewards, records), **self._notes.extra_metrics()}

    def _warn_failures(self, counts: collections.Counter, n: int) -> None:
        """A reward that cannot grade (it raises, hangs, or returns no number) scores 0 in silence otherwise: one
        warning the first time, and again whenever most of a batch fails (a broken reward, not a bad response)."""
        failed = counts["errors"] - counts["nonfinite"] + counts["timeouts"]
        mostly = failed >= 0.5 * max(n, 1)
        if not mostly:
            self._warned_mostly_failing = False
        if not failed or (self._warned_failures and (not mostly or self._warned_mostly_failing)):
            return
        self._warned_failures, self._warned_mostly_failing = True, mostly
        first = f"; the first: {self._notes.first_error}" if self._notes.first_error else ""
        advice = ("most of the batch failed: the reward function itself is likely broken (call it on one response "
                  "by hand)") if mostly else "check the reward function on such responses"
        errors = counts["errors"] - counts["nonfinite"]
        print(f"warning: reward {self.name!r} could not grade {failed} of {n} responses ({errors} errors, "
              f"{counts['timeouts']} timeouts past RewardScorer.timeout_s="
              f"{self.timeout_s}){first}. They are scored 0 and counted in reward/grader_errors and "
              f"reward/grader_timeouts; {advice}.", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the grader processes (idempotent)."""
        self._kill_pool()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- grading -------------------------------------------------------------------------------------------

    def spec_for(self, record: Mapping[str, Any] | None) -> RewardSpec:
        """The reward of a record: ``by_data_source``'s for its data_source, else the default (``name``)."""
        if record is None or not self.source_specs:
            return self.spec
        return self.source_specs.get(data_source_of(record), self.spec)

    def _jobs(self, responses: Sequence[str], answers: Sequence[str],
              records: Sequence[Mapping[str, Any]] | None) -> list[_Job]:
        """Each response with its reward and context; a TRL function missing a column it requires is refused here,
        before anything is graded (on every host alike), rather than scored 0 item by item."""
        if records is None and self.by_data_source and not self._warned_no_records:
            self._warned_no_records = True
            print(f"warning: RewardScorer.by_data_source is set but score() got no records: every response is graded "
                  f"by {self.name!r} (pass records=... so each is graded by its data source's reward)",
                  file=sys.stderr, flush=True)
        jobs = []
        for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
            record = records[i] if records is not None else None
            spec = self.spec_for(record)
            context = _context(record) if spec.style.style != "rollverify" else None
            missing = missing_columns(spec.style, str(answer), context or {})
            if missing:
                raise ValueError(f"reward {self._name_of(spec)!r} (a TRL reward function) needs the column(s) "
                                 f"{missing}, which record {i} (data_source {data_source_of(record)!r}) does not "
                                 "give: a TRL function receives answer, ground_truth, data_source, extra_info and "
                                 "the keys of extra_info; give the parameter a default or use a dataset that has it")
            jobs.append(_Job(spec, response, str(answer), context))
        return jobs

    def _name_of(self, spec: RewardSpec) -> str:
        names = [source for source, s in self.source_specs.items() if s is spec]
        return f"by_data_source[{names[0]!r}]" if names else self.name

    def _grade_jobs(self, jobs: list[_Job]) -> tuple[np.ndarray, collections.Counter]:
        """Isolated rewards' items in the pool, the others inline, each item's grade at its own index."""
        scores, counts = np.zeros(len(jobs), np.float32), collections.Counter()
        for isolated in (True, False):
            chosen = [i for i, job in enumerate(jobs) if job.spec.isolated is isolated]
            if chosen:
                part, part_counts = (self._grade_pooled if isolated else self._grade_inline)([jobs[i] for i in chosen])
                scores[chosen] = part
                counts.update(part_counts)
        return scores, counts

    def _grade_inline(self, jobs: list[_Job]) -> tuple[np.ndarray, collections.Counter]:
        """Cheap rewards (string match) in process; an exception is a grader error, not a crash."""
        scores, counts = np.zeros(len(jobs), np.float32), collections.Counter()
        for i, job in enumerate(jobs):
            try:
                value, extras = split_grade(job.spec.grader(job.response, job.answer, job.context))
            except Exception as e:
                counts["errors"] += 1
                self._notes.error(e)
                continue
            self._record(scores, counts, i, value)
            self._notes.add(extras)
        return scores, counts

    def _record(self, scores: np.ndarray, counts: collections.Counter, index: int, value) -> None:
        """A grade as the float32 reward it becomes; one that is not a number (text, None) or not finite there
        (NaN, inf, past float32's range) is a grader error, scored 0: it would turn the group's advantages and
        the loss into NaN."""
        try:
            with np.errstate(over="ignore"):  # past float32's range is inf, refused below
                grade = np.float32(value)
        except (TypeError, ValueError, OverflowError):
            counts["errors"] += 1
            self._notes.error(TypeError(f"the reward returned {value!r:.60} ({type(value).__name__}), not a number"))
            return
        if np.isfinite(grade):
            scores[index] = grade
        else:
            counts["errors"] += 1
            counts["nonfinite"] += 1

    def _grade_pooled(self, jobs: list[_Job]) -> tuple[np.ndarray, collections.Counter]:
        """Every item is scheduled at once; pebble starts an item's clock when a worker takes it, kills and
        replaces a worker stuck past the deadline, and names the item a dead worker held.

        An item whose worker died is retried once (a worker can be killed for another reason, e.g. the OOM
        killer, while it holds an item); dying again, it is an error. A pool that breaks (pebble gives up when a
        worker dies with nothing in flight) is replaced and its unfinished items rescheduled, uncharged.
        """
        scores, counts = np.zeros(len(jobs), np.float32), collections.Counter()
        deaths = collections.Counter()
        todo = list(range(len(jobs)))
        while todo:
            pool = self._live_pool(counts)
            futures = {}
            with contextlib.suppress(RuntimeError):  # the pool broke while scheduling: the rest retry below
                for i in todo:
                    job = jobs[i]
                    futures[i] = pool.schedule(
                        _grade_in_worker, (job.spec.grader, job.response, job.answer, self.timeout_s, self.cpu_limit_s,
                                           job.context),
                        timeout=self.timeout_s + self.hard_timeout_grace_s)
            todo = [i for i in todo if i not in futures]
            pending = set(futures.values())
            while pending and pool.active:
                _, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for i, future in futures.items():
                if not future.done():  # the pool broke: tasks it had not dispatched never finish
                    todo.append(i)
                    continue
                try:
                    value = future.result()
                except GraderTimeout:  # the worker's alarm or CPU limit: the worker lives on
                    counts["timeouts"] += 1
                except cf.TimeoutError as e:  # past the deadline: pebble killed the worker and started another
                    counts["timeouts"] += 1
                    counts["worker_restarts"] += e.args[:1] == ("Task timeout",)  # not a grader's own
                except pebble.ProcessExpired:  # the worker died on this item; pebble started another
                    counts["worker_restarts"] += 1
                    deaths[i] += 1
                    if deaths[i] > 1:
                        counts["errors"] += 1
                    else:
                        todo.append(i)
                except BrokenProcessPool:  # pebble's, for every task of a pool that broke
                    todo.append(i)
                except Exception as e:
                    counts["errors"] += 1
                    self._notes.error(e)
                else:
                    score, extras = value
                    self._record(scores, counts, i, score)
                    self._notes.add(extras)
            if todo and not pool.active:
                self._kill_pool()
                counts["pool_restarts"] += 1
            todo.sort()
        return scores, counts

    # -- pool lifecycle ------------------------------------------------------------------------------------

    def _live_pool(self, counts: collections.Counter) -> pebble.ProcessPool:
        """The running pool; one that broke since (a worker died while none was busy) is replaced."""
        if self._pool is not None and not self._pool.active:
            self._kill_pool()
            counts["pool_restarts"] += 1
        return self._ensure_pool()

    def _ensure_pool(self) -> pebble.ProcessPool:
        """Start the pool and wait until every worker has imported the grader, so no clock counts startup."""
        if self._pool is not None:
            return self._pool
        ctx = mp.get_context(self.mp_context)
        barrier = ctx.Barrier(self.num_workers)
        # pebble stops a worker (past its deadline, or at shutdown) with SIGTERM, then SIGKILL after
        # CONSTS.term_timeout (its documented setting, 3 s by default); the workers ignore SIGTERM.
        pebble.CONSTS.term_timeout = min(pebble.CONSTS.term_timeout, _KILL_AFTER_S)
        pool = pebble.ProcessPool(
            max_workers=self.num_workers, context=ctx, initializer=_init_worker,
            initargs=(barrier, self.memory_limit_mb * 2**20, pickle.dumps(self._isolated_graders()),
                      self.startup_timeout_s))
        self._pool = pool
        ready = [pool.schedule(_worker_ready, (self.startup_timeout_s,)) for _ in range(self.num_workers)]
        done, not_done = cf.wait(ready, timeout=self.startup_timeout_s)
        failed = [f for f in done if f.exception() is not None]
        if not_done or failed:
            self._kill_pool()
            cause = failed[0].exception() if failed else f"timed out after {self.startup_timeout_s}s"
            raise RuntimeError(
                f"RewardScorer({self.name!r}) could not start {self.num_workers} grader processes: "
                f"{cause!r}. The reward function must be importable at module level, and a script that "
                "scores needs an `if __name__ == '__main__':` guard (spawned workers re-import "
                "the main module); otherwise lower num_workers, raise startup_timeout_s or memory_limit_mb."
            )
        return pool

    def _isolated_graders(self) -> tuple[Grader, ...]:
        """The pool's rewards, each warmed up once in every worker (the same function once)."""
        specs = [self.spec, *self.source_specs.values()]
        graders = [spec.grader for spec in specs if spec.isolated]
        return tuple(g for i, g in enumerate(graders) if g not in graders[:i])

    def worker_pids(self) -> list[int]:
        """The pool's worker processes now (none before the first isolated grade)."""
        return [p.pid for p in self._worker_processes()]

    def _worker_processes(self) -> list:
        # pebble keeps its workers in the pool manager (pid -> Process); there is no public handle.
        if self._pool is None:
            return []
        manager = getattr(self._pool, "_pool_manager", None)
        return list(getattr(getattr(manager, "worker_manager", None), "workers", {}).values())

    def _kill_pool(self) -> None:
        """Kill workers outright (a hung one never returns, so a polite shutdown could wait), then stop the
        pool's threads."""
        processes, pool, self._pool = self._worker_processes(), self._pool, None
        if pool is None:
            return
        for process in processes:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
        pool.stop()
        with contextlib.suppress(Exception):
            pool.join(timeout=10.0)

    # -- rewards and metrics -------------------------------------------------------------------------------

    def _penalties(self, lengths: Sequence[int] | None, n: int) -> np.ndarray:
        if self.overlong_buffer <= 0 or lengths is None:
            return np.zeros(n, np.float32)
        return np.array(
            [overlong_penalty(int(x), self.max_response_length, self.overlong_buffer) for x in lengths],
            np.float32,
        )

    def _source_metrics(self, rewards: np.ndarray, records: Sequence[Mapping[str, Any]] | None) -> dict[str, float]:
        """``reward/<data_source>/mean`` per data source, when the batch mixes sources or they pick rewards."""
        if records is None or not len(rewards):
            return {}
        sources = np.asarray([data_source_of(r) for r in records], dtype=object)
        names = sorted(set(sources))
        if len(names) < 2 and not self.by_data_source:
            return {}
        return {f"reward/{name}/mean": float(rewards[sources == name].mean()) for name in names}

    def _metrics(self, rewards, base, penalties, counts, seconds) -> dict[str, float]:
        n = max(len(rewards), 1)
        return {
            "reward/mean": float(rewards.mean()) if len(rewards) else 0.0,
            "reward/correct_fraction": float((base > 0).sum() / n),
            "reward/overlong_fraction": float((penalties < 0).sum() / n),
            "reward/overlong_penalty_mean": float(penalties.sum() / n),
            "reward/grader_timeouts": float(counts["timeouts"]),
            "reward/grader_errors": float(counts["errors"]),
            "reward/grader_nonfinite": float(counts["nonfinite"]),
            "reward/grader_worker_restarts": float(counts["worker_restarts"]),
            "reward/grader_pool_restarts": float(counts["pool_restarts"]),
            "time/grading": seconds,
        }
