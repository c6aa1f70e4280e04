"""Trajectory filters of the partial-rollout baselines at their boundaries."""

import numpy as np
import pytest

from rollverify_jax.rl.filters import (
    FILTERS,
    FilterConfig,
    FilterInputs,
    apply_filter,
    check_filter,
    ops_keep,
    staleness_keep,
)


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


def _inputs(current_logp, behavior, mask, versions=None, current_version=0):
    calls = []

    def logp():
        calls.append(1)
        return np.asarray(current_logp, np.float32)

    n = len(behavior)
    x = FilterInputs(versions=versions or [[0]] * n, current_version=current_version,
                     behavior_logp=np.asarray(behavior, np.float32), response_mask=np.asarray(mask, bool),
                     current_logp=logp)
    return x, calls


def test_ops_filter_counts_tokens_the_behaviour_policy_was_sure_of():
    """Row 0: tokens with log mu = 0.0 exactly (p = 1 in float32) and no shift, plus one token with OPS
    e^0.2 - 1 = 0.2214: sequence OPS = 0.2214 / 3 = 0.0738 <= 0.1, kept. Masking by `log mu != 0` would see only
    the shifted token (OPS 0.2214) and drop it. Row 1: OPS e^0.1 - 1 = 0.1052 on its one response token, dropped;
    its prompt position (mask False) has a huge shift that must not count."""
    behavior = [[0.0, 0.0, -1.0, 0.0], [-0.5, -2.0, 0.0, 0.0]]
    current = [[0.0, 0.0, -0.8, 0.0], [5.0, -1.9, 0.0, 0.0]]
    mask = [[True, True, True, False], [False, True, False, False]]
    x, calls = _inputs(current, behavior, mask)
    keep = apply_filter(FilterConfig("ops", 0, 0.1), x)
    np.testing.assert_array_equal(keep, [True, False])
    assert calls == [1]  # the current policy's log-probs are computed once, and only for this filter
    np.testing.assert_array_equal(apply_filter(FilterConfig("ops", 0, 0.11), x), [True, True])
    np.testing.assert_array_equal(apply_filter(FilterConfig("ops", 0, 0.07), x), [False, False])


def test_filter_registry_staleness_and_none():
    x, calls = _inputs(np.zeros((3, 2)), np.zeros((3, 2)), np.ones((3, 2)),
                       versions=[[5, 6], [3, 6], [6]], current_version=6)  # staleness 1, 3, 0
    np.testing.assert_array_equal(apply_filter(FilterConfig("staleness", 1, 0.0), x), [True, False, True])
    np.testing.assert_array_equal(apply_filter(FilterConfig("staleness", 3, 0.0), x), [True] * 3)
    np.testing.assert_array_equal(apply_filter(FilterConfig("none", -1, 0.0), x), [True] * 3)
    assert calls == []  # neither needs a forward pass
    assert set(FILTERS) == {"none", "staleness", "ops"}
    for name, fn in FILTERS.items():  # every filter returns a boolean row mask (it indexes and negates rows)
        assert fn(x, 1, 0.1).dtype == bool, name
    assert apply_filter(FilterConfig("none", -1, 0.0), x).dtype == bool
    with pytest.raises(ValueError, match="Unknown filter 'stale'"):
        apply_filter(FilterConfig("stale", 1, 0.1), x)
