"""Training rollouts as a person reads them: every ``MetricsConfig.rollout_samples_every`` steps, a few of the
step's trajectories go to ``<workdir>/samples/rollout_step_<N>.jsonl`` with their prompt, response, reward,
advantage, the policy versions that sampled them and what pausing and verification did to them (``history``).

Evaluation generations show what the policy does now; these show what it trained on, where partial rollout's
effects live: a response that spans several versions, a cut and its regeneration.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from rollverify_jax.infra import storage
from rollverify_jax.rl.step import Scored
from rollverify_jax.run.evaluation import write_samples


def write_rollout_samples(workdir: storage.PathLike, step: int, scored: Scored, decode: Callable[[list[int]], str],
                          every: int, n: int) -> None:
    """``n`` rows of step ``step``'s batch to ``samples/rollout_step_<step>.jsonl`` when ``every`` divides the step
    (0: never); one writer on several hosts."""
    if every and n and step % every == 0 and jax.process_index() == 0:
        write_samples(storage.as_path(workdir) / "samples" / f"rollout_step_{step}.jsonl",
                      rollout_rows(scored, decode, n), step)


def rollout_rows(scored: Scored, decode: Callable[[list[int]], str], n: int) -> list[dict]:
    """``n`` of the batch's trajectories, one per group before a second from any group (the batch's order is
    group by group), each as a JSON-ready row."""
    trajs = scored.trajs
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    order = sorted(range(len(trajs)), key=lambda i: (groups[trajs[i].group_id].index(i), i))[:n]
    rows = []
    for i in order:
        t, record = trajs[i], scored.records[i]
        rows.append({
            "group": t.group_id, "uid": t.uid, "prompt": record["prompt"], "response": decode(t.tokens),
            "answer": record["answer"], **({"data_source": record["data_source"]} if "data_source" in record else {}),
            "reward": float(scored.rewards[i]), "advantage": float(scored.advantages[i]), "num_tokens": t.num_tokens,
            "versions": [min(t.versions), max(t.versions)] if t.versions else [],
            "draws": t.draws, "history": list(t.history)})
    return rows
