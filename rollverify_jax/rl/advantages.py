"""Group-relative advantage estimators (GRPO family), selected by name.

Every estimator maps `rewards: float32[num_groups, G]` (the `G` sampled responses of one prompt per row) to
advantages of the same shape. Advantages are computed once per completed group, whatever policy versions
sampled its members (METHOD.md section 5), so these functions see only rewards. They run on the host in numpy
(float32): a few hundred numbers a step, where every jnp operation would be one more compiled program.
"""

from collections.abc import Callable

import numpy as np

AdvantageFn = Callable[[np.ndarray], np.ndarray]

GRPO_STD_EPS = 1e-6


def _check_rewards(rewards: np.ndarray, name: str) -> np.ndarray:
    """Cast to float32 and insist on `[num_groups, G]`: a flat vector would silently mix groups."""
    rewards = np.asarray(rewards, np.float32)
    if rewards.ndim != 2:
        raise ValueError(
            f"advantage '{name}' expects rewards of shape [num_groups, G], got shape {rewards.shape}; "
            "reshape the flat rewards with rewards.reshape(num_groups, G)."
        )
    return rewards


def grpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """GRPO: `(R - group mean) / (group std + 1e-6)` with the population std (ddof=0).

    A group whose rewards are all equal gets zero advantages, so it contributes no gradient.
    """
    rewards = _check_rewards(rewards, "grpo")  # [N, G]
    mean = rewards.mean(axis=-1, keepdims=True)  # [N, 1]
    std = rewards.std(axis=-1, keepdims=True)  # [N, 1]
    return (rewards - mean) / (std + np.float32(GRPO_STD_EPS))


def drgrpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Dr. GRPO: `R - group mean`; no std division, which biases updates toward low-variance prompts."""
    rewards = _check_rewards(rewards, "drgrpo")  # [N, G]
    return rewards - rewards.mean(axis=-1, keepdims=True)


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO: `R_i - mean of the other G-1 rewards`, a baseline independent of the sample it scores.

    Equals `G / (G - 1) * (R_i - group mean)`; needs G >= 2.
    """
    rewards = _check_rewards(rewards, "rloo")  # [N, G]
    group_size = rewards.shape[-1]
    if group_size < 2:
        raise ValueError(f"advantage 'rloo' needs G >= 2 (leave-one-out baseline), got G={group_size}.")
    total = rewards.sum(axis=-1, keepdims=True)  # [N, 1]
    return rewards - (total - rewards) / np.float32(group_size - 1)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """Look up an estimator by its registry name; unknown names list the known ones."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator '{name}'; known: {sorted(ADVANTAGES)}.")
    return ADVANTAGES[name]


def compute_advantages(rewards: np.ndarray, name: str = "grpo") -> np.ndarray:
    """`rewards: [num_groups, G]` -> advantages `[num_groups, G]` with the named estimator."""
    return get_advantage_fn(name)(rewards)
