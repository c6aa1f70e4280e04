"""Sequence packing: layout invariants of `pack_minibatches` and the learner's batch (`pack_for_learner`); the learner
tests check that packed, one-per-row and plain padded steps agree."""

import numpy as np
import pytest

from rollverify_jax.rl import packing
from rollverify_jax.schedule_rules import batch_devices


def test_row_bucket_is_few_shapes_with_bounded_waste():
    assert [packing.row_bucket(n) for n in (1, 7, 8, 9, 17, 33)] == [1, 7, 8, 10, 20, 40]
    for n in range(1, 2000):
        assert n <= packing.row_bucket(n) <= max(n * 5 // 4, n + 1)
    assert len({packing.row_bucket(n) for n in range(65, 129)}) == 4  # four shapes per octave


def test_first_fit_fills_rows_without_overflow():
    lengths = [50, 30, 20, 60, 10, 64, 1]
    rows = packing.first_fit(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert len(rows) == 4  # 235 tokens need at least 4 rows of 64; first-fit decreasing finds 4
    with pytest.raises(ValueError, match="more than the packed width 64"):
        packing.first_fit([65], 64)


def _batch(b=16, t=32, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, b)
    lengths[3] = t  # a full-width sequence gets a row of its own
    lengths[5] = 2
    tokens = np.where(np.arange(t)[None] < lengths[:, None], rng.integers(1, 50, (b, t)), 0).astype(np.int32)
    return tokens, lengths


def _block(out, shape, k, micro):
    """Rows of micro-batch `micro` (tail ones from max_micro on) of minibatch k, as the learner's two strided
    splits select them."""
    n, tail = shape.num_minibatches, micro >= shape.max_micro
    keys, most = (packing.TAIL_KEYS, shape.max_tail_micro) if tail else (packing.PACKED_KEYS, shape.max_micro)
    j = micro - shape.max_micro if tail else micro
    rows = out[keys[0]].shape[0]
    pick = np.arange(rows)[(np.arange(rows) % n == k) & ((np.arange(rows) // n) % most == j)]
    assert len(pick) == shape.rows_per_micro
    return [out[key][pick].reshape(-1) for key in keys]


@pytest.mark.parametrize("n_mini,per_micro,tail,multiple", [(1, None, None, 1), (2, None, None, 4), (2, 2, None, 1),
                                                            (1, 3, 12, 1), (2, 2, 16, 1)])
def test_pack_minibatches_round_trips_every_token(n_mini, per_micro, tail, multiple):
    tokens, lengths = _batch()
    b, t = tokens.shape
    out, shape = packing.pack_minibatches(tokens, lengths, n_mini, per_micro, tail, row_multiple=multiple)
    assert {k: v.shape for k, v in out.items()} == shape.shapes(b)
    assert shape.rows_per_micro % multiple == 0
    for i in range(b):
        micro = out["micro_index"][i]
        tok, pos, seg = _block(out, shape, i % n_mini, micro)  # the sequence lies in its own minibatch's block
        idx = out["unpack_index"][i, : lengths[i]]
        np.testing.assert_array_equal(tok[idx], tokens[i, : lengths[i]])
        np.testing.assert_array_equal(pos[idx], np.arange(lengths[i]))
        assert (seg[idx] == seg[idx][0]).all() and seg[idx][0] > 0
        width = len(tok) // shape.rows_per_micro
        assert np.all(np.diff(idx) == 1) and idx[0] // width == idx[-1] // width  # contiguous, one row
    # Real tokens are conserved: nothing dropped or duplicated.
    real = sum((out[k] > 0).sum() for k in ("packed_segments", "tail_segments") if k in out)
    assert real == lengths.sum()


def test_tail_rows_cut_the_positions_computed():
    """A minibatch whose tokens fill a micro-batch of full rows and a little more runs the rest in narrow rows."""
    lengths = [30, 28, 5, 4, 3]  # 70 tokens: two full rows of 32 and 6 tokens left
    full, tail = packing.plan_minibatch(lengths, 32, 2)
    assert len(full) == 3 and tail == []
    full, tail = packing.plan_minibatch(lengths, 32, 2, tail_width=8)
    assert len(full) == 2 and len(tail) == 1  # 2 x 32 + 2 x 8 positions instead of 4 x 32
    assert sorted(i for r in full + tail for i in r) == list(range(5))
    assert all(sum(lengths[i] for i in r) <= 8 for r in tail)
    # No saving: a long sequence cannot go to a tail row, and a full micro-batch is kept.
    assert packing.plan_minibatch([30, 28, 20], 32, 1, tail_width=8) == ([[0], [1], [2]], [])


def test_micro_counts_follow_each_minibatch():
    tokens, lengths = _batch(b=16, t=32)
    lengths[1::2] = 1  # minibatch 1 holds tiny sequences: one micro-batch
    out, shape = packing.pack_minibatches(tokens, lengths, 2, 1)
    full, tail = packing.micro_counts(out["micro_index"], shape)
    assert full[1] == 1 and full[0] > 1 and (tail == 0).all()
    assert shape.max_micro == 8  # one row per sequence at most: the fixed shape for every batch of 16 x 32


def test_skipped_rows_are_not_packed():
    tokens = np.arange(1, 33, dtype=np.int32).reshape(4, 8)
    lengths = np.array([8, 8, 8, 8])
    skip = np.array([False, True, False, True])
    out, _ = packing.pack_minibatches(tokens, lengths, skip=skip)
    assert out["packed_tokens"].shape == (2, 8)
    assert (out["unpack_index"][skip] == 0).all() and (out["micro_index"][skip] == -1).all()
    flat = out["packed_tokens"].reshape(-1)
    for i in (0, 2):
        np.testing.assert_array_equal(flat[out["unpack_index"][i]], tokens[i])
    everything_skipped, _ = packing.pack_minibatches(tokens, lengths, skip=np.ones(4, bool))
    assert everything_skipped["packed_tokens"].shape == (1, 8) and not everything_skipped["packed_segments"].any()
    # Empty rows (a batch padded to whole batches with rows outside the loss) are fine when skipped, not otherwise.
    padded, _ = packing.pack_minibatches(tokens, np.array([8, 0, 8, 0]), skip=skip)
    np.testing.assert_array_equal(padded["packed_tokens"], out["packed_tokens"])
    with pytest.raises(ValueError, match="0 allowed on skipped rows"):
        packing.pack_minibatches(tokens, np.array([8, 0, 8, 0]))


def test_pack_minibatches_bad_input_is_named():
    tokens = np.zeros((4, 8), np.int32)
    with pytest.raises(ValueError, match="lengths must be 4 integers in"):
        packing.pack_minibatches(tokens, np.array([1, 2, 9, 3]))
    with pytest.raises(ValueError, match="does not split into 3 minibatches"):
        packing.pack_minibatches(tokens, np.array([1, 2, 3, 4]), 3)
    with pytest.raises(ValueError, match="tail rows need a fixed number of rows"):
        packing.pack_minibatches(tokens, np.array([1, 2, 3, 4]), tail_width=4)


def test_one_sequence_per_row_is_the_unpacked_layout():
    """`one_per_row` (LearnerConfig.pack_sequences = False): every live sequence in a row of its own, in batch
    order within its minibatch, micro-batches of `rows_per_micro` rows; the same round trip as packed rows."""
    tokens, lengths = _batch()
    out, shape = packing.pack_minibatches(tokens, lengths, 2, 3, one_per_row=True)
    assert shape == packing.fixed_shape(16, 32, 2, 3)
    assert (out["packed_segments"] <= 1).all() and (out["packed_segments"] > 0).any(axis=1).sum() == 16
    for i in range(16):
        tok, pos, seg = _block(out, shape, i % 2, out["micro_index"][i])
        idx = out["unpack_index"][i, : lengths[i]]
        np.testing.assert_array_equal(tok[idx], tokens[i, : lengths[i]])
        assert idx[0] % shape.width == 0  # the row starts with it
    assert out["micro_index"][0::2].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]  # minibatch 0, in order
    with pytest.raises(ValueError, match="tail rows need a fixed number of rows"):
        packing.pack_minibatches(tokens, lengths, 2, 3, tail_width=8, one_per_row=True)


class _Mesh:
    """What `pack_for_learner` reads of a mesh: its shape (packing is host-side numpy; no JAX here)."""

    shape = {"data": 2, "fsdp": 2, "tensor": 1}


def test_pack_for_learner_rounds_rows_to_the_batch_devices_and_skips_filtered_rows():
    from rollverify_jax.rl.learner import LearnerConfig

    tokens, lengths = _batch(b=8, t=32)
    batch = {"tokens": tokens, "attention_mask": np.arange(32)[None] < lengths[:, None],
             "loss_mask": np.ones((8, 32), np.float32)}
    batch["loss_mask"][2] = 0.0  # a filtered trajectory: no forward
    assert batch_devices(_Mesh.shape) == 4
    for cfg in (LearnerConfig(num_minibatches=2), LearnerConfig(num_minibatches=2, pack_sequences=False)):
        out = packing.pack_for_learner(batch, cfg, _Mesh)
        shape = packing.pack_shape(out, cfg)
        assert shape.rows_per_micro % 4 == 0 and out["micro_index"][2] == -1
        assert (out["packed_segments"] > 0).sum() == lengths.sum() - lengths[2]
        assert packing.packing_stats(out, cfg)["train/micro_batches"] == 1.0
    with pytest.raises(ValueError, match="attention_mask"):
        packing.pack_for_learner({k: v for k, v in batch.items() if k != "attention_mask"}, cfg, _Mesh)
    with pytest.raises(ValueError, match="not divisible by LearnerConfig.num_minibatches=3"):
        packing.pack_for_learner(batch, LearnerConfig(num_minibatches=3), _Mesh)
