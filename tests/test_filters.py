"""Trajectory filters of the partial-rollout baselines at their boundaries."""

import numpy as np
import pytest

from rollverify_jax.rl.filters import check_filter, ops_keep, staleness_keep


def test_staleness_counts_from_the_oldest_token():
    versions = [[3, 4], [2, 4, 4], [4], [], [1, 3, 3]]  # staleness at version 4: 1, 2, 0, 0 (no tokens), 3
    np.testing.assert_array_equal(staleness_keep(versions, 4, s_max=1), [True, False, True, True, False])
    np.testing.assert_array_equal(staleness_keep(versions, 4, s_max=0), [False, False, True, True, False])
    np.testing.assert_array_equal(staleness_keep(versions, 4, s_max=3), [True] * 5)


def test_ops_filter_keeps_at_the_threshold_and_drops_above():
    seq_ops = np.asarray([0.0, 0.05, 0.1, np.nextafter(0.1, 1.0), 3.0], np.float64)
    np.testing.assert_array_equal(ops_keep(seq_ops, 0.1), [True, True, True, False, False])
    np.testing.assert_array_equal(ops_keep(np.asarray([np.nan]), 0.1), [False])  # a broken sequence is dropped


@pytest.mark.parametrize("name, s_max, threshold, match", [
    ("stale", 1, 0.1, "Unknown filter 'stale'"),
    ("staleness", -1, 0.1, "s_max >= 0, got -1"),
    ("ops", 1, 0.0, "threshold > 0, got 0.0"),
])
def test_bad_filter_settings(name, s_max, threshold, match):
    with pytest.raises(ValueError, match=match):
        check_filter(name, s_max, threshold)


@pytest.mark.parametrize("name, s_max, threshold", [("none", -5, 0.0), ("staleness", 0, 0.0), ("ops", -1, 1e-9)])
def test_good_filter_settings(name, s_max, threshold):
    check_filter(name, s_max, threshold)  # settings of the other filters are not this filter's business
