"""The embedded default's verifiable task: chains of small-integer arithmetic with long-tailed lengths.

A problem is a start value and a list of operations; the solution writes every step out and ends in
``Answer: N``::

    prompt:   "Start 7. +3 *2 -5 +8. Compute."
    solution: " 7+3=10. 10*2=20. 20-5=15. 15+8=23. Answer: 23"
    answer:   "23"

Every intermediate value stays in ``[0, max_value]`` (operations are drawn so they never leave it), so a
tiny character-level model can learn the arithmetic. The number of steps is a lognormal draw clipped to
``[1, max_steps]``: most solutions are short and a few are many times longer, which is the long tail that
partial rollout exists for.

Train and held-out problems are disjoint by construction: a problem belongs to the ``test`` split when a
stable hash of its prompt falls in the held-out bucket, and to ``train`` otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np

PROMPT_PREFIX = "Start "
PROMPT_SUFFIX = " Compute."
ANSWER_PREFIX = "Answer: "
OPS = "+-*"
SPLITS = ("all", "train", "test")
_DIGITS = "0123456789"
_PUNCTUATION = "=. "
_MAX_REJECTIONS = 10_000


def char_vocabulary() -> str:
    """Every character a prompt or solution can contain, sorted, for a char-level tokenizer."""
    chars = set(_DIGITS + OPS + _PUNCTUATION + PROMPT_PREFIX + PROMPT_SUFFIX + ANSWER_PREFIX)
    return "".join(sorted(chars))


def format_prompt(start: int, ops: list[tuple[str, int]]) -> str:
    """`Start 7. +3 *2. Compute.` — the model sees the whole chain, then writes it out."""
    chain = " ".join(f"{op}{operand}" for op, operand in ops)
    return f"{PROMPT_PREFIX}{start}. {chain}.{PROMPT_SUFFIX}"


def format_solution(start: int, ops: list[tuple[str, int]]) -> tuple[str, int]:
    """Step-by-step solution ` 7+3=10. 10*2=20. Answer: 20` and the final value."""
    value, steps = start, []
    for op, operand in ops:
        new = apply_op(value, op, operand)
        steps.append(f" {value}{op}{operand}={new}.")
        value = new
    return "".join(steps) + f" {ANSWER_PREFIX}{value}", value


def apply_op(value: int, op: str, operand: int) -> int:
    """One arithmetic step; no modulo, the sampler keeps values in range instead."""
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    raise ValueError(f"unknown op {op!r}; expected one of {OPS!r}")


def num_ops(prompt: str) -> int:
    """Chain length of a prompt ``Start 7. +3 *2. Compute.``."""
    return len(prompt.split(". ")[1].split())


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (python's hash() is salted per process)."""
    return zlib.crc32(text.encode("utf-8"))


def in_split(prompt: str, split: str, holdout_fraction: float) -> bool:
    """Whether a prompt belongs to ``split``: the held-out bucket of its stable hash is ``test``, the rest
    ``train`` (``all``: every prompt). Disjoint splits by construction, for any task that writes prompts."""
    if split == "all":
        return True
    held_out = stable_hash(prompt) % 10_000 < holdout_fraction * 10_000
    return held_out if split == "test" else not held_out


def lognormal_steps(rng: np.random.Generator, median: float, sigma: float, max_steps: int) -> int:
    """A lognormal step count clipped to [1, max_steps]: the long tail of the synthetic tasks."""
    return int(np.clip(round(rng.lognormal(mean=math.log(median), sigma=sigma)), 1, max_steps))


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """Generator of arithmetic-chain problems; example ``i`` depends only on the fields and ``i``.

    Attributes:
      max_steps: upper clip of the step count (bounds the longest solution).
      length_median: median number of steps of the lognormal draw.
      length_sigma: lognormal sigma; larger makes the length tail heavier.
      max_value: every start and intermediate value lies in ``[0, max_value]``.
      max_operand: largest operand of ``+`` and ``-``.
      max_multiplier: largest operand of ``*`` (``*`` is drawn only when the product stays in range).
      seed: base seed; different seeds give different problem streams.
      split: ``all``, ``train`` or ``test``; train and test problems never share a prompt.
      holdout_fraction: fraction of the problem space that belongs to ``test``.
    """

    max_steps: int = 32
    length_median: float = 4.0
    length_sigma: float = 0.75
    max_value: int = 99
    max_operand: int = 9
    max_multiplier: int = 3
    seed: int = 0
    split: str = "all"
    holdout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"SyntheticTask.max_steps must be >= 1, got {self.max_steps}")
        if self.length_median <= 0 or self.length_sigma < 0:
            raise ValueError(
                f"SyntheticTask needs length_median > 0 and length_sigma >= 0, got "
                f"{self.length_median} and {self.length_sigma}"
            )
        if self.max_value < 1 or self.max_operand < 1 or self.max_multiplier < 1:
            raise ValueError("SyntheticTask.max_value, max_operand and max_multiplier must be >= 1")
        if self.split not in SPLITS:
            raise ValueError(f"SyntheticTask.split must be one of {SPLITS}, got {self.split!r}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"SyntheticTask.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")

    def rng(self, index: int) -> np.random.Generator:
        """Generator of example ``index``, seeded by (seed, index) only: any order gives the same data."""
        return np.random.default_rng([self.seed, index])

    def sample(self, rng_or_index: int | np.random.Generator) -> dict[str, str]:
        """One problem as ``dict(prompt, answer, solution)``; an int index is deterministic."""
        rng = self.rng(rng_or_index) if isinstance(rng_or_index, int | np.integer) else rng_or_index
        for _ in range(_MAX_REJECTIONS):
            start, ops = self._draw(rng)
            prompt = format_prompt(start, ops)
            if self.in_split(prompt):
                solution, value = format_solution(start, ops)
                return {"prompt": prompt, "answer": str(value), "solution": solution}
        raise RuntimeError(f"SyntheticTask found no {self.split!r} problem in {_MAX_REJECTIONS} draws")

    def in_split(self, prompt: str) -> bool:
        """Whether a prompt belongs to this task's split (hash bucket of the prompt text)."""
        return in_split(prompt, self.split, self.holdout_fraction)

    def num_steps(self, rng: np.random.Generator) -> int:
        """Lognormal step count clipped to [1, max_steps]: the source of the long tail."""
        return lognormal_steps(rng, self.length_median, self.length_sigma, self.max_steps)

    def length_bounds(self) -> tuple[int, int]:
        """Upper bounds (prompt chars, solution chars + EOS) over every problem this task can draw, so fixed
        shapes built from them (a packed SFT row, the tiny configs' max_new_tokens) never truncate the tail."""
        dv, do = len(str(self.max_value)), len(str(max(self.max_operand, self.max_multiplier)))
        prompt = len(PROMPT_PREFIX) + dv + len(". ") + self.max_steps * (1 + do + 1) - 1 + len(".") + len(PROMPT_SUFFIX)
        solution = self.max_steps * (4 + 2 * dv + do) + 1 + len(ANSWER_PREFIX) + dv + 1
        return prompt, solution

    def _draw(self, rng: np.random.Generator) -> tuple[int, list[tuple[str, int]]]:
        start = int(rng.integers(0, self.max_value + 1))
        value, ops = start, []
        for _ in range(self.num_steps(rng)):
            op, operand = self._draw_op(rng, value)
            ops.append((op, operand))
            value = apply_op(value, op, operand)
        return start, ops

    def _draw_op(self, rng: np.random.Generator, value: int) -> tuple[str, int]:
        """An op and operand that keep the value in [0, max_value]; + or - is always possible."""
        limits = {
            "+": min(self.max_operand, self.max_value - value),
            "-": min(self.max_operand, value),
            "*": min(self.max_multiplier, self.max_value // value) if value > 0 else 0,
        }
        lows = {"+": 1, "-": 1, "*": 2}
        allowed = [op for op in OPS if limits[op] >= lows[op]]
        op = allowed[int(rng.integers(len(allowed)))]
        return op, int(rng.integers(lows[op], limits[op] + 1))


def make_split(n: int, seed: int, split: str = "all", **task_kwargs) -> list[dict[str, str]]:
    """``n`` problems from the task with this seed and split (train and test prompts never overlap).

    Use different seeds for different sets (e.g. 0 for SFT, 1 for RL prompts) and ``split="test"`` for
    held-out evaluation.
    """
    if n < 0:
        raise ValueError(f"make_split needs n >= 0, got {n}")
    task = SyntheticTask(seed=seed, split=split, **task_kwargs)
    return [task.sample(i) for i in range(n)]
