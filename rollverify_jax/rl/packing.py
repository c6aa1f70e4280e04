"""Sequence packing for the train step: micro-batches made of packed rows, not of sequences.

A rollout batch is long-tailed: most sequences are short and the padded width is set by the longest, so a
right-padded `[B, T]` forward spends most of its FLOPs on padding. Packing puts several sequences into one
row of width `T`, each with its own positions (RoPE restarts at 0) and segment id (attention never crosses
sequences), runs the model on the packed rows and gathers every token's log-prob back to the `[B, T]` layout.
The losses, normalisers, filters and metrics keep working on `[B, T]` unchanged, so packed and padded steps
give the same result up to float rounding.

Micro-batches are built from packed rows: each minibatch (the learner's strided split: minibatch `k` holds
batch rows `k, k + n, ...`) packs its own sequences into rows, and `rows_per_micro` rows make one micro-batch
(one row per batch device at real scale). The train step runs as many micro-batches as each minibatch needs
(a loop with a data-dependent trip count: one compiled program for every batch), so its cost follows the
batch's tokens, not its row count. Every sequence lies in one micro-batch, so the loss normalisers stay exact.
With `tail_width`, a minibatch's last micro-batches may use rows of that narrower width: a minibatch that
would leave most of a micro-batch of full rows empty puts its shorter sequences in narrow rows instead
(`plan_minibatch` picks the split that computes the fewest positions).

Batch entries added by `pack_minibatches` (`M` / `Mt`: the most micro-batches of full / tail rows a minibatch
can need, `r = rows_per_micro`, `W = tail_width`):

    packed_tokens     int32[n * M * r, T]   full rows; row i of micro-batch j of minibatch k at k + n * (j + M * i)
    packed_positions  int32[n * M * r, T]   position of each token within its own sequence
    packed_segments   int32[n * M * r, T]   1, 2, ... per sequence in the row; 0 on padding
    tail_tokens, tail_positions, tail_segments   int32[n * Mt * r, W]   the same for tail rows (with tail_width)
    unpack_index      int32[B, T]   flat index of token t of sequence b into its micro-batch's [r, width] block
                                    (0 on padding, which the loss mask zeroes)
    micro_index       int32[B]      the micro-batch of its minibatch that holds sequence b: j for full micro-batch
                                    j, M + j for tail micro-batch j; -1 for a skipped sequence

The row index of the full rows composes two strided splits (the learner's `_split`): splitting by `n` gives
minibatch `k`, splitting that by `M` gives micro-batch `j` with its `r` rows, each device keeping its own rows.

The train step has this one layout: a batch that is not packed (`LearnerConfig.pack_sequences = False`) is laid
out the same way with one sequence per row (`pack_for_learner`). Everything here is host-side numpy (no JAX), so
the simulator plans the learner's rows with the very code the run packs them with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rollverify_jax.schedule_rules import batch_devices, first_fit, row_bucket


class PackingConfig(Protocol):
    """What packing reads of ``rl.learner.LearnerConfig`` (a structural type: the learner imports this module)."""

    num_minibatches: int
    micro_batch_size: int | None
    tail_row_width: int | None
    pack_sequences: bool

__all__ = ["PACKED_KEYS", "TAIL_KEYS", "PackShape", "first_fit", "pack_for_learner", "pack_minibatches",
           "pack_shape", "packing_stats", "plan_minibatch", "row_bucket"]

PACKED_KEYS = ("packed_tokens", "packed_positions", "packed_segments")
TAIL_KEYS = ("tail_tokens", "tail_positions", "tail_segments")
INDEX_KEYS = ("unpack_index", "micro_index")
ALL_KEYS = (*PACKED_KEYS, *TAIL_KEYS, *INDEX_KEYS)

Rows = list[list[int]]  # sequence indices per packed row


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The static layout of a packed batch, which fixes the train step's compiled shapes."""

    num_minibatches: int
    rows_per_micro: int  # r
    max_micro: int  # M: micro-batches of full rows a minibatch may run
    width: int  # T
    tail_width: int | None = None  # W
    max_tail_micro: int = 0  # Mt

    def shapes(self, batch_rows: int) -> dict[str, tuple[int, ...]]:
        """Shape of every entry `pack_minibatches` adds."""
        n, r = self.num_minibatches, self.rows_per_micro
        out = {k: (n * self.max_micro * r, self.width) for k in PACKED_KEYS}
        if self.tail_width is not None:
            out.update({k: (n * self.max_tail_micro * r, self.tail_width) for k in TAIL_KEYS})
        return {**out, "unpack_index": (batch_rows, self.width), "micro_index": (batch_rows,)}

    def positions(self, micro: int, tail_micro: int) -> int:
        """Token positions a minibatch of `micro` full and `tail_micro` tail micro-batches computes."""
        return self.rows_per_micro * (micro * self.width + tail_micro * (self.tail_width or 0))


def fixed_shape(batch_rows: int, width: int, num_minibatches: int, rows_per_micro: int,
                tail_width: int | None = None) -> PackShape:
    """The layout with `rows_per_micro` rows per micro-batch: the same for every batch of `batch_rows` x `width`
    (a minibatch of S sequences needs at most one row per sequence, so ceil(S / r) micro-batches of each kind)."""
    if batch_rows % num_minibatches:
        raise ValueError(f"batch of {batch_rows} rows does not split into {num_minibatches} minibatches.")
    if tail_width is not None and not 0 < tail_width <= width:
        raise ValueError(f"tail_width={tail_width} must be in [1, {width}] (the packed width).")
    most = -(-(batch_rows // num_minibatches) // rows_per_micro)
    return PackShape(num_minibatches, rows_per_micro, most, width, tail_width, most if tail_width else 0)


def largest_shape(batch_rows: int, width: int, num_minibatches: int, rows_per_micro: int | None,
                  tail_width: int | None = None, row_multiple: int = 1) -> PackShape:
    """The largest layout `pack_minibatches` gives a batch of `batch_rows` x `width`: the fixed one with
    `rows_per_micro`, else every sequence in a row of its own (what a deviceless compile must prove fits)."""
    if rows_per_micro is not None:
        return fixed_shape(batch_rows, width, num_minibatches, rows_per_micro, tail_width)
    rows = row_bucket(max(1, batch_rows // num_minibatches))
    return PackShape(num_minibatches, -(-rows // row_multiple) * row_multiple, 1, width)


def _capped_first_fit(lengths: Sequence[int], width: int, max_rows: int) -> tuple[Rows, list[int]]:
    """First-fit decreasing into at most `max_rows` rows; the sequences that find no room are returned."""
    rows: Rows = []
    free: list[int] = []
    over: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, room in enumerate(free) if lengths[i] <= room), None)
        if r is not None:
            rows[r].append(i)
            free[r] -= lengths[i]
        elif len(rows) < max_rows and lengths[i] <= width:
            rows.append([i])
            free.append(width - lengths[i])
        else:
            over.append(i)
    return rows, over


def plan_minibatch(lengths: Sequence[int], width: int, rows_per_micro: int,
                   tail_width: int | None = None) -> tuple[Rows, Rows]:
    """(full rows, tail rows) of one minibatch: sequence indices per row, the split into full micro-batches of
    `rows_per_micro` rows of `width` and tail micro-batches of rows of `tail_width` that computes the fewest
    positions (ties: fewer tail micro-batches). Without `tail_width`, first-fit decreasing into full rows."""
    full = first_fit(lengths, width)
    r = rows_per_micro

    def cost(f: Rows, t: Rows) -> int:
        return -(-len(f) // r) * r * width + -(-len(t) // r) * r * (tail_width or 0)

    best = (cost(full, []), full, [])
    if tail_width is None:
        return full, []
    for micro in range(-(-len(full) // r) - 1, -1, -1):
        rows, over = _capped_first_fit(lengths, width, micro * r)
        if any(lengths[i] > tail_width for i in over):
            break  # fewer full rows leave even more long sequences without one
        tail = [[over[j] for j in row] for row in first_fit([lengths[i] for i in over], tail_width)]
        if cost(rows, tail) < best[0]:
            best = (cost(rows, tail), rows, tail)
    return best[1], best[2]


def plan_batch(lengths: np.ndarray, num_minibatches: int, width: int, rows_per_micro: int | None,
               tail_width: int | None = None, live: np.ndarray | None = None,
               one_per_row: bool = False) -> list[tuple[np.ndarray, Rows, Rows]]:
    """Per minibatch: (its batch rows, full rows, tail rows), rows holding batch-row indices. `rows_per_micro`
    None: every full row of a minibatch in one micro-batch (no tail). `one_per_row`: each sequence in a full row
    of its own, in batch order (an unpacked batch, `LearnerConfig.pack_sequences = False`)."""
    b = len(lengths)
    live = np.ones(b, bool) if live is None else live
    out = []
    for k in range(num_minibatches):
        members = np.flatnonzero(live & (np.arange(b) % num_minibatches == k))
        sub = [int(lengths[i]) for i in members]
        r = rows_per_micro or max(1, len(sub))
        if one_per_row:
            full, tail = [[j] for j in range(len(sub))], []
        else:
            full, tail = plan_minibatch(sub, width, r, tail_width if rows_per_micro else None)
        out.append((members, [[int(members[j]) for j in row] for row in full],
                    [[int(members[j]) for j in row] for row in tail]))
    return out


def plan_shape(plans, batch_rows: int, width: int, num_minibatches: int, rows_per_micro: int | None,
               tail_width: int | None = None, row_multiple: int = 1) -> PackShape:
    """The layout of a planned batch (`plan_batch`): the fixed one with `rows_per_micro`, else one micro-batch
    of the largest minibatch's rows (a `row_bucket`, a multiple of `row_multiple`)."""
    if rows_per_micro is not None:
        return fixed_shape(batch_rows, width, num_minibatches, rows_per_micro, tail_width)
    most = row_bucket(max(1, *(len(full) for _, full, _ in plans)))
    return PackShape(num_minibatches, -(-most // row_multiple) * row_multiple, 1, width)


def planned_positions(plans, shape: PackShape) -> tuple[int, int, int]:
    """(full-row positions, tail-row positions, micro-batches) a planned batch computes in the train step."""
    full = tail = micro = 0
    r = shape.rows_per_micro
    for _, full_rows, tail_rows in plans:
        n_full, n_tail = -(-len(full_rows) // r), -(-len(tail_rows) // r)
        full += n_full * r * shape.width
        tail += n_tail * r * (shape.tail_width or 0)
        micro += n_full + n_tail
    return full, tail, micro


def pack_minibatches(tokens: np.ndarray, lengths: np.ndarray, num_minibatches: int = 1,
                     rows_per_micro: int | None = None, tail_width: int | None = None, row_multiple: int = 1,
                     skip: np.ndarray | None = None,
                     one_per_row: bool = False) -> tuple[dict[str, np.ndarray], PackShape]:
    """Packed layout of a right-padded batch and the `PackShape` it has.

    Args:
      tokens: int32[B, T] right-padded sequences.
      lengths: int[B] real tokens per row (prompt + response).
      num_minibatches: the learner's minibatches (strided split).
      rows_per_micro: packed rows per micro-batch (fixed shapes for every batch). None: one micro-batch per
        minibatch holding all its rows, their number a `row_bucket` rounded up to `row_multiple` (so the rows
        shard evenly), the largest minibatch's.
      tail_width: width of the optional narrower rows (needs `rows_per_micro`).
      skip: bool[B], rows left out of the packed layout (`micro_index` -1): rows with an all-zero loss mask,
        which add nothing to the loss, its normaliser or the metrics, so the model need not run on them.
      one_per_row: every sequence in a row of its own (no tail rows): the unpacked layout.
    """
    b, t = tokens.shape
    lengths = np.asarray(lengths, np.int64)
    live = np.ones(b, bool) if skip is None else ~np.asarray(skip, bool)
    # Skipped rows may be empty (a batch padded to whole batches' shapes with rows outside the loss).
    if lengths.shape != (b,) or (lengths[live] < 1).any() or (lengths > t).any() or (lengths < 0).any():
        raise ValueError(f"lengths must be {b} integers in [1, {t}] (0 allowed on skipped rows), got {lengths!r}.")
    if b % num_minibatches:
        raise ValueError(f"batch of {b} rows does not split into {num_minibatches} minibatches.")
    if tail_width is not None and (rows_per_micro is None or one_per_row):
        raise ValueError("tail rows need a fixed number of rows per micro-batch (LearnerConfig.micro_batch_size) "
                         "and packing (LearnerConfig.pack_sequences).")
    plans = plan_batch(lengths, num_minibatches, t, rows_per_micro, tail_width, live, one_per_row)
    shape = plan_shape(plans, b, t, num_minibatches, rows_per_micro, tail_width, row_multiple)
    out = {k: np.zeros(s, np.int32) for k, s in shape.shapes(b).items()}
    out["micro_index"][:] = -1
    n, r = num_minibatches, shape.rows_per_micro
    for k, (_, full, tail) in enumerate(plans):
        for keys, rows, first, most in ((PACKED_KEYS, full, 0, shape.max_micro),
                                        (TAIL_KEYS, tail, shape.max_micro, shape.max_tail_micro)):
            for row_id, members in enumerate(rows):
                j, i = divmod(row_id, r)
                flat_row = k + n * (j + most * i)  # row i of micro-batch j of minibatch k
                width = out[keys[0]].shape[1]
                offset = 0
                for segment, seq in enumerate(members, start=1):
                    m = int(lengths[seq])
                    cols = slice(offset, offset + m)
                    out[keys[0]][flat_row, cols] = tokens[seq, :m]
                    out[keys[1]][flat_row, cols] = np.arange(m)
                    out[keys[2]][flat_row, cols] = segment
                    out["unpack_index"][seq, :m] = i * width + offset + np.arange(m)
                    out["micro_index"][seq] = first + j
                    offset += m
    return out, shape


def micro_counts(micro_index: np.ndarray, shape: PackShape) -> tuple[np.ndarray, np.ndarray]:
    """(full, tail) micro-batches each minibatch runs, int[num_minibatches] each (what the train step loops)."""
    per_mini = np.asarray(micro_index).reshape(-1, shape.num_minibatches).T  # [n, S]: minibatch k = rows k, k+n
    full = np.where(per_mini < shape.max_micro, per_mini, -1).max(axis=1) + 1
    tail = np.where(per_mini >= shape.max_micro, per_mini - shape.max_micro, -1).max(axis=1) + 1
    return full, tail


# ---------------------------------------------------------------------------------------------------------
# The learner's batch (host side, before the train step)
# ---------------------------------------------------------------------------------------------------------


def pack_for_learner(batch: Mapping[str, Any], cfg: PackingConfig, mesh: Any) -> dict[str, Any]:
    """The batch plus its packed layout (`pack_minibatches`): what the train step and the log-prob pass take.

    Each minibatch of the learner's strided split packs its own sequences into micro-batches of
    `cfg.micro_batch_size` rows (None: one micro-batch of all its rows, their number a multiple of the batch
    devices of `mesh` so that they shard evenly). With `cfg.pack_sequences` False every sequence gets a row of
    its own (the unpacked layout, same result). Rows with an all-zero loss mask (filtered trajectories) are
    skipped: they need no forward.
    """
    if "attention_mask" not in batch:
        raise ValueError("packing needs batch['attention_mask'] (True on real tokens) to find each length.")
    tokens = np.asarray(batch["tokens"])
    if tokens.shape[0] % cfg.num_minibatches:
        raise ValueError(f"batch size {tokens.shape[0]} is not divisible by LearnerConfig.num_minibatches="
                         f"{cfg.num_minibatches}.")
    lengths = np.asarray(batch["attention_mask"]).astype(bool).sum(axis=1)
    skip = np.asarray(batch["loss_mask"]).sum(axis=1) == 0  # filtered trajectories: no forward needed
    packed, _ = pack_minibatches(tokens, lengths, cfg.num_minibatches, cfg.micro_batch_size, cfg.tail_row_width,
                                 row_multiple=batch_devices(mesh.shape), skip=skip,
                                 one_per_row=not cfg.pack_sequences)
    return {**batch, **packed}


def pack_shape(batch: Mapping[str, Any], cfg: PackingConfig) -> PackShape:
    """The `PackShape` of a packed batch, read from its array shapes (static under jit)."""
    n = cfg.num_minibatches
    rows, width = batch["packed_tokens"].shape
    r = cfg.micro_batch_size or rows // n
    tail = batch.get("tail_tokens")
    if rows % (n * r) or (tail is not None and tail.shape[0] % (n * r)):
        raise ValueError(f"packed rows ({rows}, tail {None if tail is None else tail.shape[0]}) do not split into "
                         f"{n} minibatches of micro-batches of {r} rows; pack the batch with pack_for_learner and "
                         "the same LearnerConfig.")
    return PackShape(n, r, rows // (n * r), width, None if tail is None else tail.shape[1],
                     0 if tail is None else tail.shape[0] // (n * r))


def packing_stats(batch: Mapping[str, Any], cfg: PackingConfig) -> dict[str, float]:
    """Host metrics of a packed batch: the share of the train step's token positions that hold a real token
    (`train/useful_token_fraction`) and the micro-batches it runs per optimizer update."""
    if "micro_index" not in batch:
        return {}
    shape = pack_shape(batch, cfg)
    full, tail = micro_counts(np.asarray(batch["micro_index"]), shape)
    positions = sum(shape.positions(int(f), int(t)) for f, t in zip(full, tail, strict=True))
    useful = sum(int((np.asarray(batch[k]) > 0).sum()) for k in ("packed_segments", "tail_segments") if k in batch)
    return {"train/useful_token_fraction": useful / max(positions, 1),
            "train/micro_batches": float((full + tail).mean())}
