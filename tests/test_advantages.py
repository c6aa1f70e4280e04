"""Tests for rollverify_jax.rl.advantages against loop-based numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.rl import advantages as adv_lib

REWARDS = np.array(
    [
        [1.0, 0.0, 0.0, 1.0],
        [0.0, 0.0, 0.0, 0.0],  # all equal: no learning signal
        [0.5, 1.0, 0.25, 0.0],
    ],
    np.float32,
)


def _np_grpo(rewards):
    out = np.zeros_like(rewards, dtype=np.float64)
    for g, row in enumerate(rewards.astype(np.float64)):
        mean = sum(row) / len(row)
        std = (sum((x - mean) ** 2 for x in row) / len(row)) ** 0.5
        out[g] = [(x - mean) / (std + 1e-6) for x in row]
    return out


def _np_rloo(rewards):
    out = np.zeros_like(rewards, dtype=np.float64)
    for g, row in enumerate(rewards.astype(np.float64)):
        for i in range(len(row)):
            others = [row[j] for j in range(len(row)) if j != i]
            out[g, i] = row[i] - sum(others) / len(others)
    return out


def test_grpo_matches_numpy():
    got = adv_lib.grpo_advantages(REWARDS)
    np.testing.assert_allclose(np.asarray(got), _np_grpo(REWARDS), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.zeros(4))
    # Binary rewards 1,0,0,1: mean 0.5, std 0.5 -> +-1 (up to the 1e-6 guard).
    np.testing.assert_allclose(np.asarray(got[0]), [1.0, -1.0, -1.0, 1.0], rtol=1e-5)


def test_drgrpo_is_mean_centred_without_std():
    got = np.asarray(adv_lib.drgrpo_advantages(REWARDS))
    want = REWARDS - REWARDS.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_rloo_matches_leave_one_out_loop():
    got = np.asarray(adv_lib.rloo_advantages(REWARDS))
    np.testing.assert_allclose(got, _np_rloo(REWARDS), rtol=1e-5, atol=1e-6)
    # Identity: RLOO = G/(G-1) * Dr. GRPO.
    np.testing.assert_allclose(got, 4.0 / 3.0 * np.asarray(adv_lib.drgrpo_advantages(REWARDS)), atol=1e-6)


def test_rloo_needs_two_members():
    with pytest.raises(ValueError, match="G >= 2"):
        adv_lib.rloo_advantages(np.ones((3, 1), np.float32))


@pytest.mark.parametrize("name", sorted(adv_lib.ADVANTAGES))
def test_registry_shapes_dtype_and_host_arrays(name):
    """On the host in numpy (no compiled program): float32 of the rewards' shape, from numpy or device rewards."""
    fn = adv_lib.get_advantage_fn(name)
    eager = fn(REWARDS)
    assert isinstance(eager, np.ndarray) and eager.shape == REWARDS.shape and eager.dtype == np.float32
    np.testing.assert_allclose(fn(jax.numpy.asarray(REWARDS)), eager, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(adv_lib.compute_advantages(REWARDS, name)), np.asarray(eager))


def test_compute_advantages_defaults_to_grpo():
    np.testing.assert_allclose(
        np.asarray(adv_lib.compute_advantages(REWARDS)), np.asarray(adv_lib.grpo_advantages(REWARDS))
    )


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*drgrpo.*grpo.*rloo"):
        adv_lib.get_advantage_fn("ppo")


def test_flat_rewards_rejected():
    with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
        adv_lib.grpo_advantages(np.zeros(8, np.float32))


@pytest.mark.parametrize("name", sorted(adv_lib.ADVANTAGES))
def test_low_precision_rewards_give_float32_advantages(name):
    got = adv_lib.compute_advantages(jnp.asarray(REWARDS, jnp.bfloat16), name)
    assert got.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(adv_lib.ADVANTAGES))
def test_flat_rewards_error_names_the_estimator(name):
    with pytest.raises(ValueError, match=rf"advantage '{name}' expects rewards of shape \[num_groups, G\]"):
        adv_lib.compute_advantages(np.zeros(8, np.float32), name)


def test_grpo_std_guard_is_added():
    """A tiny spread shows the guard: (R - mean) / (std + 1e-6), with std = 5e-6 here."""
    got = np.asarray(adv_lib.grpo_advantages(np.asarray([[0.0, 1e-5]], np.float32)))
    np.testing.assert_allclose(got, [[-5e-6 / 6e-6, 5e-6 / 6e-6]], rtol=1e-3)


def test_rloo_with_two_members():
    np.testing.assert_allclose(np.asarray(adv_lib.rloo_advantages(np.asarray([[1.0, 0.0]], np.float32))),
                               [[1.0, -1.0]])
