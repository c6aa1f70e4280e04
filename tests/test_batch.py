"""rl/batch.py: completed groups into the learner's batch, and padding a batch to whole batches' shapes."""

import jax
import numpy as np

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rl import packing
from rollverify_jax.rl.batch import build_batch, pad_rows
from rollverify_jax.rl.learner import LearnerConfig
from rollverify_jax.rollout.trajectory import Trajectory


def _trajs(n):
    return [Trajectory(uid=i, group_id=i, prompt=np.arange(4, 7, dtype=np.int32), seed=i, max_new_tokens=8,
                       tokens=[5] * (i + 2), logps=[-0.5] * (i + 2), versions=[0] * (i + 2)) for i in range(n)]


def test_build_batch_lays_out_prompt_and_response():
    batch = build_batch(_trajs(2), np.array([1.0, -1.0]), max_len=16)
    assert batch["tokens"].shape == (2, 16) and batch["tokens"][1, :7].tolist() == [4, 5, 6, 5, 5, 5, 0]
    assert batch["loss_mask"][1].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 10
    assert batch["attention_mask"].sum(axis=1).tolist() == [5, 6]


def test_padded_rows_are_empty_outside_the_loss_and_packing_skips_them():
    """More than B groups: the batch is padded to a multiple of B x G rows; the packed step runs only the real
    sequences (the padding rows have no tokens, so they cost nothing and change no normaliser)."""
    batch = build_batch(_trajs(3), np.array([1.0, -1.0, 0.5]), max_len=16)
    padded = pad_rows(batch, 4)
    assert padded["tokens"].shape == (4, 16) and padded["advantages"].tolist() == [1.0, -1.0, 0.5, 0.0]
    assert not padded["loss_mask"][3].any() and not padded["attention_mask"][3].any()
    assert pad_rows(padded, 4) is padded  # already whole
    mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    packed = packing.pack_for_learner(padded, LearnerConfig(), mesh)
    assert (packed["packed_segments"] > 0).sum() == batch["attention_mask"].sum()
    assert (packed["unpack_index"][3] == 0).all()
