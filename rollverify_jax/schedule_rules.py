"""The scheduling rules the engine, the scheduler, the switching logic and the simulator must agree on.

One home, so that the discrete-event replay (``rollverify_jax/sim``) cannot drift from what the engine compiles
and the trainer decides: the rollout modes, the power-of-two buckets (prefill lengths and rows), the live
slot and page-table buckets decode compiles for, the switch to on-policy rollout, and the batch devices a
step's rows split over. Pure Python + numpy:
importing this never imports JAX or gin, so the simulator stays JAX-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

MODES = ("on_policy", "partial", "rollverify")  # the synchronous modes (one device group, phases take turns)
ASYNC_MODE = "async"  # rollout and training on disjoint device groups (AsyncConfig); the simulator models it apart
ROLLOUT_MODES = (*MODES, ASYNC_MODE)
BATCH_AXES = ("data", "fsdp")  # the mesh axes a batch's rows split over (infra.mesh's, defined here)

MIN_LIVE_SLOTS = 8  # a live slot bucket holds at least this many slots
MIN_LIVE_PAGES = 4  # a live page-table bucket holds at least this many pages
LIVE_PAGES_FROM = 16  # tables of fewer pages are read whole (one compile; little to save)


def pow2_bucket(n: int, lo: int, hi: int) -> int:
    """Smallest ``lo * 2^j >= n`` (``lo >= 1``), capped at ``hi``: bounded recompiles for prefill lengths and
    rows. Bit length instead of a doubling loop, since the replay asks once per admitted sequence."""
    if lo < 1:
        raise ValueError(f"pow2_bucket: lo={lo} must be >= 1.")
    return min(lo << max(-(-n // lo) - 1, 0).bit_length(), hi)


def batch_devices(mesh_shape: Mapping[str, int]) -> int:
    """Devices a batch's rows split over (data x fsdp) of a mesh's ``shape`` (``Mesh.shape``, an
    ``AbstractMesh``'s, or a dict): a step's rows divide over them and packed rows are a multiple of them."""
    return math.prod(int(mesh_shape[a]) for a in BATCH_AXES)


TRAIN_LENGTH_MIN = 64  # the narrowest unpacked train batch


def train_length_bucket(n: int) -> int:
    """The padded length of an unpacked train batch whose longest sequence has ``n`` tokens: 64 times a power of
    two, so the train step compiles for a handful of shapes (the learner's batch and the replay's)."""
    return pow2_bucket(n, TRAIN_LENGTH_MIN, 1 << 62)


def row_bucket(n: int) -> int:
    """Rows rounded up to four steps per octave (..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...): at most a
    quarter wasted, and a handful of compiled shapes as the batch's token count drifts."""
    step = max(1, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def first_fit(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Sequence indices per row of ``width`` tokens, longest first into the first row with room (first-fit
    decreasing): how the train step packs its batch and the rollout engine packs a prefill."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > width:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the packed width {width}.")
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(width - lengths[i])
    return rows


def ladder(lo: int, hi: int, ratio: int = 2) -> list[int]:
    """``lo, lo * ratio, lo * ratio^2, ...`` below ``hi``, then ``hi``: the buckets of one compiled dimension
    (a finite list, so a run's programs are known before it starts)."""
    if not 1 <= lo <= hi or ratio < 2:
        raise ValueError(f"ladder({lo}, {hi}, ratio={ratio}): need 1 <= lo <= hi and ratio >= 2.")
    out = [lo]
    while out[-1] * ratio < hi:
        out.append(out[-1] * ratio)
    return out if out[-1] == hi else [*out, hi]


def prefill_widths(min_len: int, max_len: int, ratio: int = 2) -> list[int]:
    """The row widths a packed prefill compiles for (``EngineConfig.min_prefill_len`` up to ``max_seq_len``)."""
    return ladder(min(min_len, max_len), max_len, ratio)


def prefill_rows(width: int, num_slots: int, token_budget: int | None = None, ratio: int = 2) -> list[int]:
    """The row counts a packed prefill of ``width`` compiles for: 1 up to the slots (a call prefills at most
    one sequence per slot), or fewer where ``token_budget`` caps rows x width."""
    most = num_slots if token_budget is None else max(1, min(num_slots, token_budget // width))
    return ladder(1, most, ratio)


def live_slot_buckets(num_slots: int, live: bool = True, ratio: int = 2) -> list[int]:
    """The slot counts decode compiles for, ascending: all slots divided by ``ratio`` while at least
    ``MIN_LIVE_SLOTS`` remain (256, ratio 2: 8, 16, ..., 256); all slots only when ``live`` is off (live slots
    disabled, or a pool sharded over devices, where every device decodes its own slots)."""
    out = [num_slots]
    while live and out[-1] // ratio >= MIN_LIVE_SLOTS:
        out.append(out[-1] // ratio)
    return out[::-1]


def live_page_buckets(pages_per_seq: int, live: bool = True, ratio: int = 2) -> list[int]:
    """The page-table widths (pages) decode compiles for, ascending: the whole table divided by ``ratio``
    (rounded up) while at least ``MIN_LIVE_PAGES`` pages remain, for tables of at least ``LIVE_PAGES_FROM``
    pages (20 pages, ratio 2: 5, 10, 20); the whole table only when ``live`` is off or the table is small."""
    out = [pages_per_seq]
    while live and pages_per_seq >= LIVE_PAGES_FROM and out[-1] // ratio >= MIN_LIVE_PAGES:
        out.append(-(-out[-1] // ratio))
    return out[::-1]


def smallest_holding(buckets: Sequence[int], n: int) -> int:
    """The first of ascending ``buckets`` that holds ``n`` (the largest when none does)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def window_mean(rates: Sequence[float]) -> float:
    """Mean of acceptance rates as the switching state stores them (float32), summed in float64; 1.0 when
    empty (nothing rejected yet)."""
    if len(rates) == 0:
        return 1.0
    return float(np.mean(np.asarray(rates, np.float32), dtype=np.float64))


def switch_due(rates: Sequence[float], window: int, threshold: float) -> bool:
    """RollVerify's one-way switch to on-policy rollout: the window of the last ``window`` verifying cycles is
    full and its mean acceptance is below ``threshold`` (strictly)."""
    return len(rates) == window and window_mean(rates) < threshold
