"""Tests for rollverify_jax.verify.switching: acceptance window and the one-way switch to on-policy."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollverify_jax.verify import (
    SwitchConfig,
    SwitchState,
    init_switch_state,
    update_switch_state,
    window_mean,
)


def _run(rates, window=8, threshold=0.5, start_step=0):
    state = init_switch_state(window)
    for k, a in enumerate(rates):
        state = update_switch_state(state, a, start_step + k, threshold)
    return state


def test_init_state():
    state = init_switch_state()
    assert state.window == 8 and state.count == 0
    assert not state.on_policy and state.switch_step == -1
    assert window_mean(state) == 1.0


def test_no_switch_before_window_full():
    state = _run([0.0] * 7)
    assert not state.on_policy and state.switch_step == -1 and state.count == 7
    assert window_mean(state) == 0.0


def test_switch_exactly_when_window_fills():
    state = _run([0.0] * 8, start_step=100)
    assert state.on_policy and state.switch_step == 107


def test_switch_at_right_step_with_sliding_window():
    # Window means: 0.75 (step 3), 0.625, 0.5 (not below), then [0.6, 0.4, 0.4, 0.4] -> 0.45 at step 6.
    rates = [0.9, 0.9, 0.6, 0.6, 0.4, 0.4, 0.4, 0.4]
    state = init_switch_state(4)
    for step, a in enumerate(rates):
        state = update_switch_state(state, a, step)
        if step < 6:
            assert not state.on_policy, step
    assert state.on_policy and state.switch_step == 6


def test_threshold_boundary_is_strict():
    assert not _run([0.5] * 8).on_policy
    assert _run([0.5] * 7 + [0.49]).on_policy


def test_never_switches_back():
    state = _run([0.1] * 8, start_step=10)
    assert state.on_policy and state.switch_step == 17
    frozen = state
    for step in range(18, 30):
        state = update_switch_state(state, 1.0, step)
    assert state == frozen and state.on_policy and state.switch_step == 17


def test_window_mean_uses_filled_entries_only():
    state = _run([1.0, 0.5], window=4)
    assert window_mean(state) == pytest.approx(0.75)
    state = _run([1.0, 0.5, 0.0, 0.25, 0.25], window=4, threshold=0.0)
    assert window_mean(state) == pytest.approx(0.25)


def test_state_is_frozen_and_rates_read_only():
    state = _run([0.7, 0.8])
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.on_policy = True
    with pytest.raises(ValueError):
        state.rates[0] = 0.0


def test_update_does_not_mutate_input():
    state = _run([0.7, 0.8])
    snapshot = state.to_dict()
    update_switch_state(state, 0.1, 2)
    assert SwitchState.from_dict(snapshot) == state


@settings(max_examples=50, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 1.0), max_size=20),
    window=st.integers(1, 8),
    threshold=st.floats(0.0, 1.0),
)
def test_to_dict_from_dict_round_trip_exact(rates, window, threshold):
    state = _run(rates, window=window, threshold=threshold)
    d = state.to_dict()
    assert all(isinstance(v, np.ndarray) for v in d.values())
    back = SwitchState.from_dict(d)
    assert back == state and back.to_dict().keys() == d.keys()
    for key in d:
        np.testing.assert_array_equal(back.to_dict()[key], d[key])
    # Checkpoint restores may hand back JAX arrays; those round-trip too.
    assert SwitchState.from_dict({k: jnp.asarray(v) for k, v in d.items()}) == state
    # Continuing from the restored state is identical to continuing the original.
    assert update_switch_state(back, 0.2, 99, threshold) == update_switch_state(state, 0.2, 99, threshold)


@settings(max_examples=50, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30), window=st.integers(1, 6))
def test_switch_matches_reference(rates, window):
    state = _run(rates, window=window)
    want_step = -1
    for k in range(window - 1, len(rates)):
        if np.mean(np.asarray(rates[k - window + 1 : k + 1], np.float32), dtype=np.float64) < 0.5:
            want_step = k
            break
    assert state.switch_step == want_step and state.on_policy == (want_step >= 0)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_raises(window):
    with pytest.raises(ValueError, match="window"):
        init_switch_state(window)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_bad_threshold_raises(threshold):
    with pytest.raises(ValueError, match="threshold"):
        update_switch_state(init_switch_state(), 0.5, 0, threshold)


@pytest.mark.parametrize("acceptance", [-0.1, 1.01, float("nan")])
def test_bad_acceptance_raises(acceptance):
    with pytest.raises(ValueError, match="acceptance"):
        update_switch_state(init_switch_state(), acceptance, 0)


def test_from_dict_missing_key_raises():
    d = init_switch_state().to_dict()
    del d["count"]
    with pytest.raises(ValueError, match="count"):
        SwitchState.from_dict(d)


def test_switch_config_gin_binding(spec_of):
    config = spec_of("SwitchConfig.window = 3", "SwitchConfig.threshold = 0.8").switch
    assert (config.window, config.threshold, config.enabled) == (3, 0.8, True)
    state = config.init()
    assert state.window == 3
    for step in range(3):
        state = config.update(state, 0.75, step)
    assert state.on_policy and state.switch_step == 2


def test_switch_config_disabled_never_switches():
    config = SwitchConfig(window=2, enabled=False)
    state = config.init()
    for step in range(5):
        state = config.update(state, 0.0, step)
    assert not state.on_policy and state.count == 2


def test_switch_config_validates():
    with pytest.raises(ValueError, match="threshold"):
        SwitchConfig(threshold=2.0)
    with pytest.raises(ValueError, match="window"):
        SwitchConfig(window=0)


# --- exact window arithmetic, validation boundaries, and the state's types ----------------------------------


def test_window_mean_is_exact_float64_mean_of_stored_rates():
    # 0.5 and 0.5 - 2^-25 are both float32; their float32 sum rounds to 1.0 (mean 0.5, no switch), but the exact
    # mean is 0.5 - 2^-26 < 0.5, so the window must switch.
    low = 0.5 - 2.0**-25
    state = update_switch_state(init_switch_state(2), 0.5, 0)
    assert window_mean(state) == 0.5 and state.count == 1
    state = update_switch_state(state, low, 1)
    assert window_mean(state) == 0.5 - 2.0**-26
    assert state.on_policy and state.switch_step == 1


def test_window_of_one_switches_on_the_first_low_rate():
    state = update_switch_state(init_switch_state(1), 0.75, 0)
    assert state.window == 1 and state.count == 1 and window_mean(state) == 0.75 and not state.on_policy
    state = update_switch_state(state, 0.25, 1)
    assert window_mean(state) == 0.25 and state.on_policy and state.switch_step == 1


def test_threshold_and_acceptance_boundaries_are_accepted():
    # threshold 1.0: any cycle that rejects anything switches; threshold 0.0 never switches.
    state = update_switch_state(init_switch_state(1), 0.999, 3, threshold=1.0)
    assert state.on_policy and state.switch_step == 3
    assert not update_switch_state(init_switch_state(1), 1.0, 0, threshold=1.0).on_policy
    assert not update_switch_state(init_switch_state(1), 0.0, 0, threshold=0.0).on_policy
    assert SwitchConfig(window=1, threshold=1.0).threshold == 1.0


def test_negative_step_raises():
    with pytest.raises(ValueError, match="step"):
        update_switch_state(init_switch_state(), 0.5, -1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rates": np.zeros((2, 2))},  # a window is 1-D
        {"rates": np.zeros(0)},  # and not empty
        {"count": -1},
        {"count": 3},  # more than the window holds
        {"switch_step": -2},
    ],
)
def test_invalid_state_raises(kwargs):
    fields = {"rates": np.zeros(2, np.float32), "count": 0, "on_policy": False, "switch_step": -1, **kwargs}
    with pytest.raises(ValueError):
        SwitchState(**fields)


def test_state_fields_are_normalized_to_plain_python_and_float32():
    # Checkpoints and metrics hand back numpy scalars; the state must hold plain Python values (JSON-able) and a
    # private float32 copy of the rates.
    source = [0.25, 0.5, 1.0]
    state = SwitchState(rates=source, count=np.int64(2), on_policy=np.bool_(True), switch_step=np.int32(7))
    assert state.rates.dtype == np.float32 and state.rates.shape == (3,)
    assert type(state.count) is int and type(state.on_policy) is bool and type(state.switch_step) is int
    assert json.loads(json.dumps([state.count, state.on_policy, state.switch_step])) == [2, True, 7]
    source[0] = 0.0
    assert state.rates[0] == 0.25


def test_to_dict_dtypes_and_shapes_are_fixed():
    # A checkpoint restore template needs the same dtypes every time: float32 window, int32 scalars.
    state = _run([0.1] * 8, start_step=40)
    d = state.to_dict()
    assert set(d) == {"rates", "count", "on_policy", "switch_step"}
    assert d["rates"].dtype == np.float32 and d["rates"].shape == (8,)
    for key, want in (("count", 8), ("on_policy", 1), ("switch_step", 47)):
        assert d[key].dtype == np.int32 and d[key].shape == () and int(d[key]) == want
    back = SwitchState.from_dict(d)
    assert back.on_policy is True and back.switch_step == 47 and back == state


def test_states_differing_in_one_field_are_unequal():
    base = _run([0.7, 0.8], window=4)
    assert base == _run([0.7, 0.8], window=4)
    assert base != _run([0.7, 0.9], window=4)
    assert base != dataclasses.replace(base, count=3)
    assert base != dataclasses.replace(base, on_policy=True)
    assert base != dataclasses.replace(base, switch_step=5)
    assert base != "not a state"
