"""Sequence packing for the train step: the model runs on a few dense rows instead of padded ones.

A rollout batch is long-tailed: most sequences are short and the padded width is set by the longest, so
a right-padded `[B, T]` forward spends most of its FLOPs on padding (the packed step is 3x to 13x faster on
the tiny default's batches, `scripts/bench_train_step.py`). Packing puts several sequences into one row of
width `T`, each with its own positions (RoPE restarts at 0) and segment id (attention never crosses
sequences), runs the model on `[P, T]`, and gathers every token's log-prob back to the `[B, T]` layout.
The losses, normalisers, filters and metrics keep working on `[B, T]` unchanged, so packed and padded steps
give the same result up to float rounding.

The packed rows honour the learner's strided split into minibatches and then micro-batches
(`learner._split`). Two strided splits compose into one: with `parts = n_mini * n_micro`, batch row `i` lands
in part `i % parts` at position `i // parts`, and so does packed row `r`. Every part packs only its own
sequences into the same number of rows, so after the split each micro-batch holds its sequences' packed rows
and `unpack_index` indexes into that micro-batch's `[p, T]` block.

Added batch entries (see `pack_batch`):

    packed_tokens     int32[P, T]  sequences laid end to end, 0 after the last one
    packed_positions  int32[P, T]  position of each token within its own sequence
    packed_segments   int32[P, T]  1, 2, ... per sequence in the row; 0 on padding
    unpack_index      int32[B, T]  flat index into the micro-batch's packed block of token t of sequence b
                                   (0 on padding, which the loss mask zeroes)
"""

from __future__ import annotations

import numpy as np

from rollverify_jax.schedule_rules import first_fit, row_bucket

__all__ = ["PACKED_KEYS", "first_fit", "pack_batch", "row_bucket"]

PACKED_KEYS = ("packed_tokens", "packed_positions", "packed_segments", "unpack_index")


def pack_batch(tokens: np.ndarray, lengths: np.ndarray, num_parts: int = 1, row_multiple: int = 1,
               skip: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Packed layout of a right-padded batch.

    Args:
      tokens: int32[B, T] right-padded sequences.
      lengths: int[B] real tokens per row (prompt + response).
      num_parts: minibatches x micro-batches per minibatch of the learner's split; every part gets the
        same number of packed rows.
      row_multiple: packed rows per part are a multiple of this (the batch-sharded device count divided by
        the number of parts, so that `P` shards evenly).
      skip: bool[B], rows left out of the packed layout (their `unpack_index` is 0): rows with an all-zero
        loss mask, which add nothing to the loss, its normaliser or the metrics, so the model need not run
        on them.
    Returns:
      The `PACKED_KEYS` entries, to be added to the batch dict.
    """
    b, t = tokens.shape
    if b % num_parts:
        raise ValueError(f"batch of {b} rows does not split into {num_parts} parts.")
    lengths = np.asarray(lengths, np.int64)
    live = np.ones(b, bool) if skip is None else ~np.asarray(skip, bool)
    # Skipped rows may be empty (a batch padded to whole batches' shapes with rows outside the loss).
    if lengths.shape != (b,) or (lengths[live] < 1).any() or (lengths > t).any() or (lengths < 0).any():
        raise ValueError(f"lengths must be {b} integers in [1, {t}] (0 allowed on skipped rows), got {lengths!r}.")
    parts = [np.flatnonzero(live & (np.arange(b) % num_parts == k)) for k in range(num_parts)]
    layouts = [first_fit([int(lengths[i]) for i in part], t) for part in parts]
    p = row_bucket(max(1, *(len(rows) for rows in layouts)))
    p = -(-p // row_multiple) * row_multiple
    packed = {k: np.zeros((num_parts * p, t), np.int32) for k in PACKED_KEYS[:3]}
    unpack = np.zeros((b, t), np.int32)
    for part_id, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
        for local_row, members in enumerate(layout):
            r = part_id + num_parts * local_row  # the part's local_row-th row after the strided split
            offset = 0
            for segment, j in enumerate(members, start=1):
                i, n = part[j], int(lengths[part[j]])
                packed["packed_tokens"][r, offset: offset + n] = tokens[i, :n]
                packed["packed_positions"][r, offset: offset + n] = np.arange(n)
                packed["packed_segments"][r, offset: offset + n] = segment
                unpack[i, :n] = local_row * t + offset + np.arange(n)
                offset += n
    return {**packed, "unpack_index": unpack}
