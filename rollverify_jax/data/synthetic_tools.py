"""The tool variant of the synthetic task: arithmetic chains whose big steps pay for a calculator call.

A problem mixes *inline* steps (``+d``, ``-d`` with one digit, which a tiny char-level model learns to write out)
and *tool* steps (``*m`` and ``//m`` with ``m`` of two or three digits, on values up to ``max_value`` = 99999,
which it cannot compute reliably but can copy from a tool reply)::

    prompt:   "Start 7. +3 *523 -8 //37. Compute."
    solution: " 7+3=10. <calculator>10*523</calculator><tool_response>5230</tool_response> 5230-8=5222."
              " <calculator>5222//37</calculator><tool_response>141</tool_response> Answer: 141"  (one line)
    answer:   "141"

The ``<tool_response>...</tool_response>`` spans are written by the environment (the rollout's ``ToolEnvironment``),
not the policy: ``SyntheticToolTask.demonstration`` marks them, so SFT can mask them out of its loss. Every
problem holds at least one tool step (a policy that never calls the tool mostly fails) and at most
``max_tool_steps`` (within ``ToolUseConfig.max_calls``). The reward is the base task's: exact match of
``Answer: N`` (``exact_reward``).

Step counts are the base task's lognormal, clipped to ``[1, max_steps]`` (the long tail partial rollout needs),
and train/test are split by a stable hash of the prompt, as in ``synthetic``.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from rollverify_jax.data.synthetic import (
    ANSWER_PREFIX,
    PROMPT_PREFIX,
    PROMPT_SUFFIX,
    SPLITS,
    in_split,
    lognormal_steps,
)
from rollverify_jax.tools.calculator import CalculatorTool
from rollverify_jax.tools.calls import format_tool_output

TOOL_NAME = "calculator"
CALL_START = f"<{TOOL_NAME}>"
CALL_END = f"</{TOOL_NAME}>"  # the rollout's stop token: ToolUseConfig.call_end_token
REPLY_PREFIX = "<tool_response>"
REPLY_SUFFIX = "</tool_response>"
TOOL_TAGS = (CALL_START, CALL_END, REPLY_PREFIX, REPLY_SUFFIX)  # one token each in the tool policy's tokenizer
INLINE_OPS = ("+", "-")
TOOL_OPS = ("*", "//")
MIN_QUOTIENT = 10  # `//m` leaves at least two digits: a quotient of 1 would be guessable without the tool
_MAX_REJECTIONS = 10_000

Segment = tuple[str, bool]  # (text, written by the environment)


def char_vocabulary() -> str:
    """Printable ASCII and newline, sorted: the task's text and anything a calculator reply can hold (its errors
    quote the policy's expression, which is over this alphabet again), so every reply encodes."""
    return "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))


def apply_op(value: int, op: str, operand: int) -> int:
    """One step, as the calculator computes it (``//`` floors)."""
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    if op == "//":
        return value // operand
    raise ValueError(f"unknown op {op!r}; expected one of {INLINE_OPS + TOOL_OPS}")


def format_prompt(start: int, ops: list[tuple[str, int]]) -> str:
    """`Start 7. +3 *523 //37. Compute.`: the base task's prompt with tool ops among the inline ones."""
    chain = " ".join(f"{op}{operand}" for op, operand in ops)
    return f"{PROMPT_PREFIX}{start}. {chain}.{PROMPT_SUFFIX}"


def parse_ops(prompt: str) -> list[tuple[str, int]]:
    """The ops of a prompt written by ``format_prompt`` (inverse of its chain part)."""
    chain = prompt.removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX).split(". ", 1)[1].removesuffix(".")
    return [(word[:2], int(word[2:])) if word.startswith("//") else (word[0], int(word[1:])) for word in chain.split()]


def num_tool_steps(prompt: str) -> int:
    """Tool steps of a prompt: the calls its demonstration makes."""
    return sum(op in TOOL_OPS for op, _ in parse_ops(prompt))


def tool_reply(expression: str) -> str:
    """The reply body the rollout's ToolEnvironment renders for a calculator call (``format_tool_output(..., tag='')``),
    computed by the same tool, so demonstrations read exactly what rollouts will."""
    return format_tool_output(CalculatorTool().call(expression), tag="")


def format_segments(start: int, ops: list[tuple[str, int]]) -> tuple[list[Segment], int]:
    """The demonstration as (text, env) segments and the final value: inline steps ` 7+3=10.`, tool steps
    ` <calculator>10*523</calculator>` followed by the environment's `<tool_response>5230</tool_response>`."""
    value, segments = start, []
    for op, operand in ops:
        new = apply_op(value, op, operand)
        if op in TOOL_OPS:
            expression = f"{value}{op}{operand}"
            segments.append((f" {CALL_START}{expression}{CALL_END}", False))
            segments.append((f"{REPLY_PREFIX}{tool_reply(expression)}{REPLY_SUFFIX}", True))
        else:
            segments.append((f" {value}{op}{operand}={new}.", False))
        value = new
    segments.append((f" {ANSWER_PREFIX}{value}", False))
    return _merge(segments), value


def _merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments of the same writer joined, so policy and environment alternate."""
    out: list[Segment] = []
    for text, env in segments:
        if out and out[-1][1] == env:
            out[-1] = (out[-1][0] + text, env)
        else:
            out.append((text, env))
    return out


@dataclasses.dataclass(frozen=True)
class SyntheticToolTask:
    """Generator of tool-use arithmetic problems; example ``i`` depends only on the fields and ``i``.

    Attributes:
      max_steps: upper clip of the step count (bounds the longest solution).
      length_median: median number of steps of the lognormal draw.
      length_sigma: lognormal sigma; larger makes the length tail heavier.
      max_value: every start and intermediate value lies in ``[1, max_value]``.
      max_start: largest start value (starts are small: the values grow through the tool steps).
      max_operand: largest operand of the inline ``+`` and ``-``.
      min_factor: smallest operand of the tool ops ``*`` and ``//`` (two digits: not worth doing inline).
      max_factor: largest operand of the tool ops (``//`` also keeps a quotient of at least ``MIN_QUOTIENT``).
      tool_fraction: chance that a step is a tool step (at least one per problem, whatever the draw).
      max_tool_steps: most tool steps per problem; keep it within the rollout's ``ToolUseConfig.max_calls``.
      seed: base seed; different seeds give different problem streams.
      split: ``all``, ``train`` or ``test``; train and test problems never share a prompt.
      holdout_fraction: fraction of the problem space that belongs to ``test``.
    """

    max_steps: int = 16
    length_median: float = 3.0
    length_sigma: float = 0.75
    max_value: int = 99_999
    max_start: int = 99
    max_operand: int = 9
    min_factor: int = 11
    max_factor: int = 999
    tool_fraction: float = 0.4
    max_tool_steps: int = 8
    seed: int = 0
    split: str = "all"
    holdout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_tool_steps < 1:
            raise ValueError("SyntheticToolTask.max_steps and max_tool_steps must be >= 1")
        if self.length_median <= 0 or self.length_sigma < 0:
            raise ValueError(
                f"SyntheticToolTask needs length_median > 0 and length_sigma >= 0, got "
                f"{self.length_median} and {self.length_sigma}"
            )
        if self.max_operand < 1 or not 1 <= self.max_start <= self.max_value:
            raise ValueError("SyntheticToolTask needs max_operand >= 1 and 1 <= max_start <= max_value")
        if not 2 <= self.min_factor <= self.max_factor or self.max_value < self.min_factor * (
            MIN_QUOTIENT * self.min_factor - 1
        ):
            # then a value too big for `*min_factor` (> max_value // min_factor) has `//min_factor` >= MIN_QUOTIENT
            raise ValueError(
                f"SyntheticToolTask needs 2 <= min_factor <= max_factor and max_value >= min_factor * "
                f"({MIN_QUOTIENT} * min_factor - 1), so a tool step always fits; got {self.min_factor}, "
                f"{self.max_factor}, {self.max_value}"
            )
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"SyntheticToolTask.tool_fraction must be in [0, 1], got {self.tool_fraction}")
        if self.split not in SPLITS:
            raise ValueError(f"SyntheticToolTask.split must be one of {SPLITS}, got {self.split!r}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"SyntheticToolTask.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")

    def rng(self, index: int) -> np.random.Generator:
        """Generator of example ``index``, seeded by (seed, index) only: any order gives the same data."""
        return np.random.default_rng([self.seed, index])

    def sample(self, rng_or_index: int | np.random.Generator) -> dict[str, str]:
        """One problem as ``dict(prompt, answer, solution)``; the solution includes the tool replies."""
        prompt, segments, value = self.demonstration(rng_or_index)
        return {"prompt": prompt, "answer": str(value), "solution": "".join(text for text, _ in segments)}

    def demonstration(self, rng_or_index: int | np.random.Generator) -> tuple[str, list[Segment], int]:
        """(prompt, solution segments marking the environment's, answer) of one problem of this split."""
        rng = self.rng(rng_or_index) if isinstance(rng_or_index, int | np.integer) else rng_or_index
        for _ in range(_MAX_REJECTIONS):
            start, ops = self._draw(rng)
            prompt = format_prompt(start, ops)
            if self.in_split(prompt):
                segments, value = format_segments(start, ops)
                return prompt, segments, value
        raise RuntimeError(f"SyntheticToolTask found no {self.split!r} problem in {_MAX_REJECTIONS} draws")

    def in_split(self, prompt: str) -> bool:
        """Whether a prompt belongs to this task's split (hash bucket of the prompt text)."""
        return in_split(prompt, self.split, self.holdout_fraction)

    def length_bounds(self) -> tuple[int, int]:
        """Upper bounds in tokens of the tool policy's tokenizer (a character each, a tag one token) of (prompt,
        solution + EOS) over every problem this task can draw, so fixed shapes never truncate the long tail."""
        dv, ds, do, df = (len(str(n)) for n in (self.max_value, self.max_start, self.max_operand, self.max_factor))
        op = max(len(max(TOOL_OPS, key=len)) + df, 1 + do)
        prompt = len("Start ") + ds + len(". ") + self.max_steps * (op + 1) - 1 + len(".") + len(" Compute.")
        tool_step = 1 + 1 + (dv + len(max(TOOL_OPS, key=len)) + df) + 1 + 1 + dv + 1  # " <c>expr</c><r>value</r>"
        inline_step = 1 + dv + 1 + do + 1 + dv + 1  # " a-b=c."
        tools = min(self.max_tool_steps, self.max_steps)
        solution = tools * tool_step + (self.max_steps - tools) * inline_step + 1 + len(ANSWER_PREFIX) + dv + 1
        return prompt, solution

    def num_steps(self, rng: np.random.Generator) -> int:
        """Lognormal step count clipped to [1, max_steps]: the source of the long tail."""
        return lognormal_steps(rng, self.length_median, self.length_sigma, self.max_steps)

    def _draw(self, rng: np.random.Generator) -> tuple[int, list[tuple[str, int]]]:
        n = self.num_steps(rng)
        tool = rng.random(n) < self.tool_fraction
        if not tool.any():
            tool[rng.integers(n)] = True
        if tool.sum() > self.max_tool_steps:
            keep = rng.choice(np.flatnonzero(tool), self.max_tool_steps, replace=False)
            tool[:] = False
            tool[keep] = True
        start = int(rng.integers(1, self.max_start + 1))
        value, ops = start, []
        for is_tool in tool:
            op, operand = self._draw_op(rng, value, TOOL_OPS if is_tool else INLINE_OPS)
            ops.append((op, operand))
            value = apply_op(value, op, operand)
        return start, ops

    def _draw_op(self, rng: np.random.Generator, value: int, kinds: tuple[str, ...]) -> tuple[str, int]:
        """An op of ``kinds`` and an operand that keep the value in [1, max_value]. Some op of each kind always
        fits (``__post_init__``'s bounds): ``+`` below max_value, else ``-``; ``*`` up to max_value // min_factor,
        else ``//``."""
        limits = {
            "+": min(self.max_operand, self.max_value - value),
            "-": min(self.max_operand, value - 1),
            "*": min(self.max_factor, self.max_value // value),
            "//": min(self.max_factor, value // MIN_QUOTIENT),
        }
        lows = {"+": 1, "-": 1, "*": self.min_factor, "//": self.min_factor}
        allowed = [op for op in kinds if limits[op] >= lows[op]]
        if not allowed:
            raise RuntimeError(f"no {kinds} step fits value {value} in {self}")
        op = allowed[int(rng.integers(len(allowed)))]
        return op, int(rng.integers(lows[op], limits[op] + 1))


def make_split(n: int, seed: int, split: str = "all", **task_kwargs) -> list[dict[str, str]]:
    """``n`` problems from the task with this seed and split (train and test prompts never overlap)."""
    if n < 0:
        raise ValueError(f"make_split needs n >= 0, got {n}")
    task = SyntheticToolTask(seed=seed, split=split, **task_kwargs)
    return [task.sample(i) for i in range(n)]
