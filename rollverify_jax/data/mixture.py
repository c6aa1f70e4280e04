"""Weighted mixing of several datasets into one fixed list of records (the ``mixture`` dataset).

The semantic, chosen to be what a verl / Tunix / HF ``interleave_datasets`` user expects of "weights":

* Each source's share of the mixture is its weight's share of the total weight (largest-remainder rounding, so
  the counts add up to the size exactly and differ from the exact shares by less than one record).
* The size is ``size`` when given; by default it is the largest mixture in which no source repeats a record:
  the scarcest source relative to its weight is used whole, the others in proportion (``size =
  min_i(len_i * W / w_i)``, rounded down).
* A source contributes distinct records drawn without replacement; only a source too small for its share
  repeats, in whole passes (each record ``k`` or ``k + 1`` times), never by independent draws.
* The result is shuffled once, so its first records (an eval set's ``eval_size`` slice) already follow the
  shares; the training iterator reshuffles it every epoch, and every epoch goes through the same records.
* Everything is drawn from ``seed``: the same sources, weights, size and seed give the same records in the same
  order (a resume compares their hash).

Each record keeps its own keys, its ``data_source`` among them, so a reward per data source still finds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np


def check_weight(weight: Any, where: str) -> Fraction:
    """A weight as an exact fraction: a finite number > 0 (not a bool)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: weight must be a finite number > 0, got {weight!r}")
    return Fraction(weight)


def mixture_counts(lengths: Sequence[int], weights: Sequence[Fraction], size: int | None = None) -> list[int]:
    """How many records each source gives: shares by weight (largest remainder, ties to the earlier source)
    of ``size``, or of the largest size that repeats nothing."""
    total = sum(weights)
    if size is None:
        size = min(math.floor(n * total / w) for n, w in zip(lengths, weights, strict=True))
        if size < 1:
            raise ValueError(f"the mixture of sources with {list(lengths)} records and weights "
                             f"{[float(w) for w in weights]} has no whole record for its smallest share; pass size=")
    quotas = [size * w / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


def draw(n_records: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` indices into ``n_records``: distinct while they last, then whole fresh passes."""
    indices: list[int] = []
    while len(indices) < count:
        indices.extend(rng.permutation(n_records)[: count - len(indices)].tolist())
    return indices


def mix(parts: Sequence[Sequence[Mapping[str, Any]]], weights: Sequence[Fraction], seed: int = 0,
        size: int | None = None) -> list[dict[str, Any]]:
    """The mixture of ``parts`` (each a list of records) by ``weights``; see the module docstring."""
    if not parts:
        raise ValueError("a mixture needs at least one source")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"mixture size must be an integer >= 1 (or None: the largest without repeats), got {size!r}")
    counts = mixture_counts([len(p) for p in parts], weights, size)
    mixed = []
    for i, (part, count) in enumerate(zip(parts, counts, strict=True)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, i]))
        mixed.extend(dict(part[j]) for j in draw(len(part), count, rng))
    order = np.random.default_rng(np.random.SeedSequence([seed, len(parts)])).permutation(len(mixed))
    return [mixed[j] for j in order]
