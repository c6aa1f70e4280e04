"""rl/sft.py: the tiny policies' supervised warm start. The packer streams examples into fixed first-fit rows
(every example once, in order, each with its own segment and positions from 0), the loss is the weighted NLL of
the targets, and a few steps of the learner's optimizer on a fixed batch bring it down."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rollverify_jax.models import init_model, model_config
from rollverify_jax.rl import learner, sft
from rollverify_jax.schedule_rules import first_fit


def _stream(lengths: list[int], vocab: int = 10_000):
    """next_example over examples of the given lengths; example i's inputs are all i + 1 (so rows can be read back),
    its targets i + 2, and its first two targets carry no loss (a prompt)."""
    it = iter(range(len(lengths)))

    def next_example() -> sft.Example:
        i = next(it)
        n = lengths[i]
        return [(i + 1) % vocab] * n, [(i + 2) % vocab] * n, [0.0, 0.0] + [1.0] * (n - 2)
    return next_example


def test_packer_places_every_example_once_in_order_in_first_fit_rows():
    lengths = [int(x) for x in np.random.default_rng(0).integers(3, 15, size=200)]
    packer = sft.SFTPacker(_stream(lengths), rows=4, width=24)
    seen = []
    for _ in range(6):
        batch = packer.batch()
        assert all(batch[k].shape == (4, 24) for k in sft.BATCH_KEYS)
        ids = []
        for r in range(4):
            segs = batch["segments"][r]
            for s in range(1, segs.max() + 1):
                cols = np.flatnonzero(segs == s)
                assert (np.diff(cols) == 1).all()  # contiguous
                assert (batch["positions"][r, cols] == np.arange(len(cols))).all()
                (token,) = set(batch["inputs"][r, cols].tolist())
                ids.append(token - 1)
                assert len(cols) == lengths[token - 1]
                assert batch["weights"][r, cols].tolist() == [0.0, 0.0] + [1.0] * (len(cols) - 2)
            assert (batch["weights"][r][segs == 0] == 0).all()
        # The batch's examples are the next ones of the stream, and one more would not fit 4 rows.
        assert sorted(ids) == list(range(len(seen), len(seen) + len(ids)))
        assert len(first_fit(lengths[len(seen): len(seen) + len(ids) + 1], 24)) > 4
        seen += ids
    assert packer.used == len(seen) and packer.drawn == len(seen) + 1


def test_packer_refuses_an_example_longer_than_a_row():
    with pytest.raises(ValueError, match="exceeds the packed row width 8"):
        sft.SFTPacker(_stream([5, 9]), rows=2, width=8).batch()


def test_loss_is_the_weighted_nll_of_the_targets_within_each_segment():
    model = init_model(model_config("tiny", vocab_size=32, num_hidden_layers=1), seed=0)
    graphdef, params = learner.split_params(model)
    batch = sft.SFTPacker(_stream([6, 5, 7, 4, 6], vocab=32), rows=2, width=12).batch()
    got = float(jax.jit(functools.partial(sft.sft_loss, graphdef))(params, batch))
    # By hand: each example alone through the model (no packing), its weighted target NLL. Each example gets a row
    # of its own from position 0, right-padded: causal attention keeps the padding out of its logits, and one
    # compiled forward serves all (eager calls compile every op once per example length: seconds each).
    examples = [(batch["inputs"][r, cols], batch["targets"][r, cols], batch["weights"][r, cols])
                for r in range(2) for s in range(1, batch["segments"][r].max() + 1)
                for cols in [np.flatnonzero(batch["segments"][r] == s)]]
    width = max(len(x) for x, _, _ in examples)
    inputs, targets, weights = (np.stack([np.pad(e[i], (0, width - len(e[i]))) for e in examples]) for i in range(3))
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, jnp.asarray(inputs))
    lp = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(targets))
    nll, weight = float(jnp.sum(lp * weights)), float(weights.sum())
    assert got == pytest.approx(nll / weight, rel=1e-5)


def test_sft_steps_with_the_learners_optimizer_learn_a_batch():
    model = init_model(model_config("tiny", vocab_size=32, num_hidden_layers=1), seed=0)
    packer = sft.SFTPacker(_stream([6, 5, 7, 4, 6, 5] * 4, vocab=32), rows=2, width=16)
    batch = packer.batch()
    result = sft.run_sft(model, sft.sft_optimizer(20, lr=3e-3, warmup_frac=0.1, weight_decay=0.01), lambda: batch, 20)
    graphdef, _ = learner.split_params(model)
    after = float(sft.sft_loss(graphdef, result.params, batch))
    assert np.isfinite(result.first_loss) and after < 0.5 * result.first_loss, (result.first_loss, after)
