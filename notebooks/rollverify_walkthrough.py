# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # RollVerify, step by step
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/rollverify/rollverify_jax/blob/main/notebooks/rollverify_walkthrough.ipynb)
#
# This notebook walks through one RollVerify cycle on the embedded tiny policy (CPU, about two minutes):
# a long-tailed rollout, the pause when a batch is ready, the Off-Policy Shift (OPS) of the cached tokens
# after one policy update, the verifier's cuts, and two RollVerify training steps with their metrics.
# Inside a checkout it runs as is (from the repository root or from `notebooks/`); on Colab or any fresh
# machine the first cell clones the project and installs it with pip (Python 3.11 to 3.13).

# %%
# Fetch and install the project unless this runs inside a checkout (Colab: about a minute).
import os
import subprocess
import sys
from pathlib import Path

REPO = os.environ.get("ROLLVERIFY_REPO", "https://github.com/rollverify/rollverify_jax")
if not (Path("rollverify_jax").is_dir() or Path("../rollverify_jax").is_dir()):
    if not Path("rollverify_jax_repo").is_dir():
        subprocess.run(["git", "clone", "--depth=1", REPO, "rollverify_jax_repo"], check=True)
    os.chdir("rollverify_jax_repo")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[plot]"], check=True)

# %%
if Path.cwd().name == "notebooks":
    os.chdir("..")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gin
import matplotlib.pyplot as plt
import numpy as np

from rollverify_jax import train
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.batch import build_batch
from rollverify_jax.run import builder
from rollverify_jax.run.spec import RunSpec, parse_gin
from rollverify_jax.verify import token_ops, two_stage_verify

gin.clear_config()
parse_gin(["configs/tiny_rollverify.gin"], [
    "TrainConfig.eval_size = 16", "TrainConfig.eval_samples = 2",
    "RolloutConfig.batch_groups = 4", "RolloutConfig.group_size = 4",
    "EngineConfig.num_slots = 32", "CheckpointConfig.async_save = False",
])
spec = RunSpec.from_gin()  # every setting of the run, read from gin once
workdir = Path("runs/notebook_walkthrough")
if workdir.exists():
    import shutil

    shutil.rmtree(workdir)
run = builder.build_trainer(spec, workdir)
print(f"policy: {run.serving.model.cfg.num_params() / 1e6:.2f}M parameters, vocab {run.serving.tokenizer.vocab_size}")

# %% [markdown]
# ## 1. A long-tailed rollout, paused when the batch is ready
# One rollout phase keeps all 32 decode slots busy. It ends as soon as 4 groups (of 4 samples each) have all
# their members finished; everything still running is paused into the cache with its tokens, behaviour
# log-probs `log mu` and the policy version that sampled each token.

# %%
phase = run.rollout()
finished = [t for g in phase.groups for t in g.finished.values()]
paused = [t for t in run.manager.cache.paused if t.num_tokens > 0]
print(f"batch: {len(finished)} finished trajectories in {len(phase.groups)} groups; "
      f"paused: {len(paused)} unfinished; slot utilization {phase.metrics['rollout/slot_utilization']:.2f}")
print("example:", repr(run.serving.tokenizer.decode(finished[0].tokens)))
fig, ax = plt.subplots(figsize=(6, 3))
ax.hist([t.num_tokens for t in finished], bins=20, alpha=0.7, label="finished (batch)")
ax.hist([t.num_tokens for t in paused], bins=20, alpha=0.7, label="paused (long tail, so far)")
ax.set_xlabel("response tokens")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. One GRPO update, then the OPS of the cached tokens
# The batch trains the policy (version 0 -> 1). The paused tokens were sampled by version 0, so under the
# new policy their importance ratio `pi/mu` drifts from 1: that drift is the OPS, `|pi/mu - 1|` per token.

# %%
scored = run.score(phase.groups)  # rewards and group advantages
batch, _ = run.select(scored)  # the filters (none in this config) and the learner's batch layout
m = run.learn(batch)  # one update; the engine now samples with version 1
print(f"reward {scored.metrics['reward/mean']:.3f}, loss {m['loss']:.4f}, train-time OPS {m['ops/token_mean']:.4f}")

cached = build_batch(paused, np.zeros(len(paused)))
new_logp = np.asarray(learner_lib.compute_logprobs(run.graphdef, run.train_state.params, cached["tokens"],
                                                   cached["attention_mask"], 1.0))
starts = [len(t.prompt) for t in paused]
lengths = np.asarray([t.num_tokens for t in paused], np.int32)
width = lengths.max()
new_r = np.zeros((len(paused), width), np.float32)
beh_r, ver_r = np.zeros_like(new_r), np.zeros((len(paused), width), np.int32)
for i, (t, s) in enumerate(zip(paused, starts, strict=True)):
    new_r[i, : t.num_tokens] = new_logp[i, s: s + t.num_tokens]
    beh_r[i, : t.num_tokens] = t.logps
    ver_r[i, : t.num_tokens] = t.versions
ops = np.asarray(token_ops(new_r, beh_r))
valid = np.arange(width)[None] < lengths[:, None]
print(f"cached tokens: {valid.sum()}, OPS mean {ops[valid].mean():.4f}, max {ops[valid].max():.3f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.hist(ops[valid], bins=40, log=True)
ax.axvline(2.0, color="r", ls="--", label="dt = 2.0 (token stage)")
ax.set_xlabel("token OPS after one update")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. The verifier's cuts
# Two-stage verification (segment mean OPS >= `ds` = 0.01 cuts at that segment's start; then any token with
# OPS >= `dt` = 2.0 cuts at that token) gives each trajectory a keep length. In training this runs on the
# log-probs of the resume prefill itself, so it costs no extra forward pass.

# %%
keep = np.asarray(two_stage_verify(new_r, beh_r, ver_r, lengths, 0.01, 2.0))
for i in np.argsort(keep / lengths, kind="stable")[:8]:  # the most-cut first
    print(f"trajectory {paused[i].uid:4d}: {lengths[i]:4d} cached tokens -> keep {int(keep[i]):4d}")
print(f"acceptance (tokens kept / cached): {keep.sum() / lengths.sum():.3f}")

# %% [markdown]
# ## 4. Two RollVerify steps
# Each step: resume (prefill + verify + truncate) the cache first, fill the free slots with new groups, stop
# at B complete groups, pause the rest, train. The acceptance window drives the switch to on-policy.

# %%
rows = []
for _ in range(2):
    m = train.train_one_step(run)
    rows.append({k: m[k] for k in ("reward/mean", "verify/acceptance", "verify/acceptance_window",
                                   "ops/token_mean", "staleness/mean", "rollout/slot_utilization",
                                   "time/rollout", "time/verify", "time/train", "mode/on_policy")})
for i, r in enumerate(rows, start=2):
    print(f"step {i}: " + "  ".join(f"{k}={v:.3g}" for k, v in r.items()))
run.close()
