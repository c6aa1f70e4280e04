"""The middle of a training step, between the rollout phase and the update: ``score`` (rewards, advantages) and
``select`` (the filters, the pi_old ablation, the reference log-probs, packing for the learner)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np

from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.batch import build_batch, pad_rows
from rollverify_jax.rl.buffer import Group
from rollverify_jax.rl.filters import FilterConfig, FilterInputs, apply_filter
from rollverify_jax.verify.ops import token_ops

# (tokens [N, T], attention mask [N, T]) -> log-probs [N, T] on the host
LogProbFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass
class Scored:
    """A phase's training batch with its rewards and advantages."""

    trajs: list  # [N] trajectories, group by group
    advantages: np.ndarray  # [N]
    uniform: np.ndarray  # bool[N]: the trajectory's group has all-equal rewards (zero advantage)
    metrics: dict


def score(groups: Sequence[Group], decode: Callable[[list[int]], str], scorer, advantage: str) -> Scored:
    """Rewards of every trajectory, each graded against its own group's record, then group advantages (whatever
    versions sampled the members). Groups hold ``group_size`` finished members each."""
    pairs = [(g.finished[uid], g.record) for g in groups for uid in sorted(g.finished)]  # (group, uid) order
    trajs = [t for t, _ in pairs]
    rewards, metrics = scorer.score([decode(t.tokens) for t in trajs], [record["answer"] for _, record in pairs],
                                    [t.num_tokens for t in trajs])
    rewards = np.asarray(rewards, np.float64).reshape(len(groups), -1)
    adv = np.asarray(adv_lib.compute_advantages(rewards, advantage)).reshape(-1)
    uniform = np.repeat((rewards == rewards[:, :1]).all(axis=1), rewards.shape[1])  # [N]
    return Scored(trajs, adv, uniform, {**metrics, "reward/mean": float(rewards.mean()),
                                        "reward/uniform_group_fraction": float(uniform.mean())})


def select(scored: Scored, learner: learner_lib.LearnerConfig, filter_cfg: FilterConfig, *, current_version: int,
           rows: int, width: int, mesh, skip_uniform_groups: bool, policy_logp: LogProbFn,
           ref_logp: LogProbFn | None = None) -> tuple[dict, dict]:
    """The learner's batch, with the trajectories the filters drop masked out of the loss: the configured filter
    of the registry, and DAPO's group filter when it is on. ``policy_logp`` scores with the step's starting params
    (the OPS filter and the pi_old ablation share one pass); ``ref_logp`` adds the reference log-probs for the KL.
    ``rows``: B x G (more groups pad to whole batches); ``width``: the packed layout's fixed width."""
    # Packed steps run the model on packed rows only, so the [B, T] layout can be the engine's fixed maximum
    # (one packed width, few compiled shapes); unpacked steps pad to the batch's power-of-two bucket.
    batch = build_batch(scored.trajs, scored.advantages, max_len=width if learner.pack_sequences else None)
    response = batch["loss_mask"] > 0
    step_start_logp = functools.cache(lambda: policy_logp(batch["tokens"], batch["attention_mask"]))
    inputs = FilterInputs(
        versions=[t.versions for t in scored.trajs], current_version=current_version,
        behavior_logp=batch["behavior_logp"], response_mask=response, current_logp=step_start_logp)
    keep = apply_filter(filter_cfg, inputs)
    if skip_uniform_groups:
        keep &= ~scored.uniform
    metrics = {}
    if learner.ratio_against == "step_start":  # the ablation: the ratio against pi_old instead of mu
        pi_old = np.asarray(step_start_logp(), np.float32)
        # The train-time OPS against mu, which the learner's metric (now against pi_old) no longer measures.
        metrics["ops/token_mean"] = float(np.asarray(token_ops(pi_old, batch["behavior_logp"]))[response].mean())
        batch["behavior_logp"] = np.where(response, pi_old, batch["behavior_logp"])
    batch["loss_mask"] *= keep[:, None].astype(np.float32)
    if ref_logp is not None:
        batch["ref_logp"] = ref_logp(batch["tokens"], batch["attention_mask"])
    batch = pad_rows(batch, rows)  # more than B groups: whole batches' shapes
    batch = learner_lib.pack_for_learner(batch, learner, mesh)
    return batch, {**metrics, "filter/kept_fraction": float(keep.mean()),
                   **learner_lib.packing_stats(batch, learner)}
