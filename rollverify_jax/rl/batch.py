"""Turns completed groups into the learner's fixed-shape batch."""

from __future__ import annotations

import numpy as np

from rollverify_jax import schedule_rules
from rollverify_jax.rl.buffer import Group
from rollverify_jax.rollout.trajectory import Trajectory


def length_bucket(n: int) -> int:
    """The padded length of an unpacked train batch (``schedule_rules.train_length_bucket``)."""
    return schedule_rules.train_length_bucket(n)


def flatten_groups(groups: list[Group]) -> list[Trajectory]:
    """Trajectories in (group, uid) order."""
    return [g.finished[uid] for g in groups for uid in sorted(g.finished)]


def build_batch(trajs: list[Trajectory], advantages: np.ndarray, max_len: int | None = None) -> dict[str, np.ndarray]:
    """tokens = prompt + response (right padded); behavior_logp[t] = log mu(tokens[t]) on response tokens;
    loss_mask = 1 on the response tokens the policy sampled (``Trajectory.policy_mask``), 0 on environment replies
    (the filters then zero the rows they drop); the train-time OPS and entropy read the same mask."""
    longest = max(len(t.prompt) + t.num_tokens for t in trajs)
    width = max_len or length_bucket(longest)
    n = len(trajs)
    tokens = np.zeros((n, width), np.int32)
    behavior = np.zeros((n, width), np.float32)
    mask = np.zeros((n, width), np.float32)
    valid = np.zeros((n, width), bool)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt), t.num_tokens
        tokens[i, :p] = t.prompt
        tokens[i, p: p + r] = t.tokens
        behavior[i, p: p + r] = t.logps
        mask[i, p: p + r] = t.policy_mask()
        valid[i, : p + r] = True
    return {"tokens": tokens, "behavior_logp": behavior, "loss_mask": mask, "attention_mask": valid,
            "advantages": np.asarray(advantages, np.float32)}


def pad_rows(batch: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Rows appended (all zeros: no tokens, outside the loss) up to a multiple of ``multiple``, so a batch of
    more than B groups keeps the shapes of whole batches (packing skips the empty rows: they cost no compute)."""
    n = len(batch["advantages"])
    extra = -n % multiple
    if not extra:
        return batch
    return {k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
