"""Sequence packing: layout invariants of `pack_batch` (the learner tests check packed = padded steps)."""

import numpy as np
import pytest

from rollverify_jax.rl import packing


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


@pytest.mark.parametrize("n_mini,n_micro,multiple", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 4)])
def test_pack_batch_round_trips_every_token(n_mini, n_micro, multiple):
    rng = np.random.default_rng(0)
    b, t = 16, 32
    lengths = rng.integers(1, t + 1, b)
    lengths[3] = t  # a full-width sequence gets a row of its own
    tokens = np.where(np.arange(t)[None] < lengths[:, None], rng.integers(1, 50, (b, t)), 0).astype(np.int32)
    out = packing.pack_batch(tokens, lengths, n_mini * n_micro, row_multiple=multiple)
    parts = n_mini * n_micro
    rows = out["packed_tokens"].shape[0]
    assert rows % (parts * multiple) == 0 and out["unpack_index"].shape == (b, t)
    p = rows // parts
    for i in range(b):
        mini, micro = i % n_mini, (i // n_mini) % n_micro
        block = np.arange(rows)[(np.arange(rows) % n_mini == mini) & ((np.arange(rows) // n_mini) % n_micro == micro)]
        assert len(block) == p
        flat = {k: out[k][block].reshape(-1) for k in packing.PACKED_KEYS[:3]}
        idx = out["unpack_index"][i, : lengths[i]]
        np.testing.assert_array_equal(flat["packed_tokens"][idx], tokens[i, : lengths[i]])
        np.testing.assert_array_equal(flat["packed_positions"][idx], np.arange(lengths[i]))
        segment = flat["packed_segments"][idx]
        assert (segment == segment[0]).all() and segment[0] > 0
        assert np.all(np.diff(idx) == 1)  # contiguous within one row
        assert idx[0] // t == idx[-1] // t
    # Real tokens are conserved: nothing is dropped or duplicated.
    assert (out["packed_segments"] > 0).sum() == lengths.sum()


def test_skipped_rows_are_not_packed():
    tokens = np.arange(1, 33, dtype=np.int32).reshape(4, 8)
    lengths = np.array([8, 8, 8, 8])
    skip = np.array([False, True, False, True])
    out = packing.pack_batch(tokens, lengths, skip=skip)
    assert out["packed_tokens"].shape == (2, 8)
    assert (out["unpack_index"][skip] == 0).all()
    flat = out["packed_tokens"].reshape(-1)
    for i in (0, 2):
        np.testing.assert_array_equal(flat[out["unpack_index"][i]], tokens[i])
    everything_skipped = packing.pack_batch(tokens, lengths, skip=np.ones(4, bool))
    assert everything_skipped["packed_tokens"].shape == (1, 8) and not everything_skipped["packed_segments"].any()
    # Empty rows (a batch padded to whole batches with rows outside the loss) are fine when skipped, not otherwise.
    padded = packing.pack_batch(tokens, np.array([8, 0, 8, 0]), skip=skip)
    np.testing.assert_array_equal(padded["packed_tokens"], out["packed_tokens"])
    with pytest.raises(ValueError, match="0 allowed on skipped rows"):
        packing.pack_batch(tokens, np.array([8, 0, 8, 0]))


def test_pack_batch_bad_input_is_named():
    tokens = np.zeros((4, 8), np.int32)
    with pytest.raises(ValueError, match="lengths must be 4 integers in"):
        packing.pack_batch(tokens, np.array([1, 2, 9, 3]))
    with pytest.raises(ValueError, match="does not split into 3 parts"):
        packing.pack_batch(tokens, np.array([1, 2, 3, 4]), num_parts=3)
