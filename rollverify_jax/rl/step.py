"""The middle of a training step, between the rollout phase and the update: ``score`` (rewards, advantages) and
``select`` (the filters, the pi_old ablation, the reference log-probs, packing for the learner)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollverify_jax.data.plugins import with_interaction
from rollverify_jax.infra import distributed
from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl import packing
from rollverify_jax.rl.batch import build_batch, pad_rows
from rollverify_jax.rl.buffer import Group
from rollverify_jax.rl.filters import FilterConfig, FilterInputs, apply_filter
from rollverify_jax.verify.ops import token_ops

# The learner's batch (padded to whole batches, packed by `packing.pack_for_learner`) -> log-probs [N, T] on the
# host: `learner.make_logprob_fn`'s pass, the train step's packed forward
LogProbFn = Callable[[dict], np.ndarray]


def on_host(logprob_fn: Callable[[Any, dict], Any], params: Any) -> LogProbFn:
    """``logprob_fn`` (``learner.make_logprob_fn``: (params, packed batch) -> log-probs [N, T] on the mesh) of
    ``params``, its log-probs fetched to the host (every host holds the whole array): what ``select`` scores the
    step-start and the reference policy with."""
    def logp(batch: dict) -> np.ndarray:
        return distributed.fetch(logprob_fn(params, batch))
    return logp


@dataclasses.dataclass
class Scored:
    """A phase's training batch with its rewards and advantages."""

    trajs: list  # [N] trajectories, group by group
    advantages: np.ndarray  # [N]
    uniform: np.ndarray  # bool[N]: the trajectory's group has all-equal rewards (zero advantage)
    metrics: dict
    rewards: np.ndarray | None = None  # [N], overlong penalty included
    records: list | None = None  # [N] each trajectory's group record (prompt, answer, data_source, ...)


def score(groups: Sequence[Group], decode: Callable[[list[int]], str], scorer, advantage: str, *,
          multi_turn: bool = False) -> Scored:
    """Rewards of every trajectory, each graded against its own group's record (the reward sees the whole record:
    its answer, data_source, extra_info and prompt; and the whole interaction: the response with its tool calls and
    replies, and in a multi-turn rollout ``num_turns`` and ``tool_calls`` in extra_info, ``plugins.with_interaction``),
    then group advantages (whatever versions sampled the members). Groups hold ``group_size`` finished members each.
    ``multi_turn``: the rollout runs tools for every record."""
    pairs = [(g.finished[uid], g.record) for g in groups for uid in sorted(g.finished)]  # (group, uid) order
    trajs = [t for t, _ in pairs]
    records = [record for _, record in pairs]
    graded = [with_interaction(record, t.env_spans, t.num_tokens, multi_turn) for t, record in pairs]
    rewards, metrics = scorer.score([decode(t.tokens) for t in trajs], [record["answer"] for record in records],
                                    [t.num_tokens for t in trajs], records=graded)
    rewards = np.asarray(rewards, np.float64).reshape(len(groups), -1)
    adv = np.asarray(adv_lib.compute_advantages(rewards, advantage)).reshape(-1)
    uniform = np.repeat((rewards == rewards[:, :1]).all(axis=1), rewards.shape[1])  # [N]
    return Scored(trajs, adv, uniform, {**metrics, "reward/mean": float(rewards.mean()),
                                        "reward/uniform_group_fraction": float(uniform.mean())},
                  rewards=rewards.reshape(-1), records=records)


def select(scored: Scored, learner: learner_lib.LearnerConfig, filter_cfg: FilterConfig, *, current_version: int,
           rows: int, width: int, mesh, skip_uniform_groups: bool, policy_logp: LogProbFn,
           ref_logp: LogProbFn | None = None) -> tuple[dict, dict]:
    """The learner's batch, with the trajectories the filters drop masked out of the loss: the configured filter
    of the registry, and DAPO's group filter when it is on. ``policy_logp`` scores with the step's starting params
    (the OPS filter and the pi_old ablation share one pass); ``ref_logp`` adds the reference log-probs for the KL.
    Both score the learner's own packed layout (every trajectory with a response for the step-start pass, the kept
    ones for the reference), so each costs the train step's forward, not an unpacked pass at full context.
    ``rows``: B x G (more groups pad to whole batches); ``width``: the packed layout's fixed width."""
    # Packed steps run the model on packed rows only, so the [B, T] layout can be the engine's fixed maximum
    # (one packed width, few compiled shapes); unpacked steps pad to the batch's power-of-two bucket.
    batch = build_batch(scored.trajs, scored.advantages, max_len=width if learner.pack_sequences else None)
    response = batch["loss_mask"] > 0
    n = len(scored.trajs)
    step_start_logp = functools.cache(
        lambda: policy_logp(packing.pack_for_learner(pad_rows(batch, rows), learner, mesh))[:n])
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
    batch = pad_rows(batch, rows)  # more than B groups: whole batches' shapes
    batch = packing.pack_for_learner(batch, learner, mesh)
    if ref_logp is not None:  # on the packed rows of the kept trajectories (0 on the skipped ones: outside the loss)
        batch["ref_logp"] = np.asarray(ref_logp(batch), np.float32)
    return batch, {**metrics, "filter/kept_fraction": float(keep.mean()),
                   **packing.packing_stats(batch, learner)}
