"""The GRPO learner: sharding invariance, exact micro-batch accumulation, minibatches, learning, donation, and the
train step against a reference written out here (full padded batch, one gradient per minibatch)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models.flash_attention import DEFAULT_FLASH, FlashConfig
from rollverify_jax.models.qwen3 import init_model, model_config, token_logprobs
from rollverify_jax.rl import learner, losses, packing
from rollverify_jax.rl.losses import LossConfig

MODEL_CFG = model_config("tiny", hidden_size=64, num_hidden_layers=2, intermediate_size=128, head_dim=16)
# A large Adam eps keeps the first update smooth in the gradient (no sign flips of near-zero gradients from
# float noise), so "equal within 1e-5" compares the gradients rather than luck.
OPT_CFG = learner.OptimizerConfig(learning_rate=1e-3, eps=1e-4)
OPT = learner.make_optimizer(OPT_CFG)
B, T, PROMPT = 8, 16, 4
RESPONSE_LENGTHS = (3, 11, 6, 12, 2, 9, 5, 7)
DROPPED_ROW = 5  # a trajectory a filter removed from the loss: all-zero loss_mask row

_STEPS: dict = {}


@pytest.fixture(scope="module")
def model():
    return init_model(MODEL_CFG, seed=0)


@pytest.fixture(scope="module")
def mesh1():
    return mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def batch_and_noise(model):
    """Right-padded prompt+response rows; behaviour log-probs = current policy's + noise (off-policy)."""
    rng = np.random.default_rng(0)
    pos = np.arange(T)[None, :]
    ends = PROMPT + np.asarray(RESPONSE_LENGTHS)[:, None]
    attention_mask = pos < ends
    tokens = np.where(attention_mask, rng.integers(1, MODEL_CFG.vocab_size, (B, T)), 0).astype(np.int32)
    loss_mask = ((pos >= PROMPT) & attention_mask).astype(np.float32)
    loss_mask[DROPPED_ROW] = 0.0
    graphdef, params = learner.split_params(model)
    logp = np.asarray(learner.compute_logprobs(graphdef, params, tokens, attention_mask, 1.0))
    noise = (rng.normal(0.0, 0.3, (B, T)) * loss_mask).astype(np.float32)
    batch = {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "behavior_logp": logp + noise,
        "advantages": rng.normal(size=B).astype(np.float32),
        "attention_mask": attention_mask,
    }
    return batch, noise


def _learner(model, mesh, cfg: learner.LearnerConfig, flash: FlashConfig = DEFAULT_FLASH) -> learner.Learner:
    """One learner (its compiled programs) per (model config, mesh, config), shared across tests to keep compiles
    few."""
    key = (model.cfg, tuple(mesh.devices.shape), cfg, flash)
    if key not in _STEPS:
        _STEPS[key] = learner.Learner.create(model, cfg, OPT_CFG, mesh, flash)
    return _STEPS[key]


def _train(model, mesh, cfg, batch, steps=1, flash=DEFAULT_FLASH):
    """`steps` train steps from the model's params on `batch`, packed here unless it already is."""
    run = _learner(model, mesh, cfg, flash)
    batch = batch if "micro_index" in batch else packing.pack_for_learner(batch, cfg, mesh)
    state = run.init_state(model, seed=0)
    history = []
    for _ in range(steps):
        state, metrics = run.train_step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def _reference(model, cfg: learner.LearnerConfig, batch):
    """The train step written out plainly: per minibatch (rows k, k + n, ...) the loss of its whole right-padded
    rows at once, its gradient and one optimizer update, for each epoch -> (params, per-update metrics)."""
    graphdef, params = learner.split_params(model)
    loss_fn, opt_state = losses.get_loss_fn(cfg.loss_name), OPT.init(params)

    def loss(p, mb):
        logp, entropy = learner._policy_logp(graphdef, p, mb["tokens"], mb["attention_mask"], cfg.logit_temperature)
        mask = mb["loss_mask"].at[:, 0].set(0.0)
        return loss_fn(logp, mb["behavior_logp"], mb["advantages"], mask, cfg.loss, ref_logp=mb.get("ref_logp"),
                       entropy=entropy)

    grad, history = jax.jit(jax.grad(loss, has_aux=True)), []
    for _ in range(cfg.ppo_epochs):
        for k in range(cfg.num_minibatches):
            g, metrics = grad(params, {key: jnp.asarray(v[k::cfg.num_minibatches]) for key, v in batch.items()})
            updates, opt_state = OPT.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
            history.append({key: float(v) for key, v in metrics.items()})
    return params, history


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])


def test_sharded_step_equals_single_device(model, mesh1, batch_and_noise):
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig()
    one, m_one = _train(model, mesh1, cfg, batch)
    many, m_many = _train(model, mesh_lib.make_mesh((2, 2, 2)), cfg, batch)
    start = _flat(learner.split_params(model)[1])
    assert np.abs(_flat(one.params) - start).max() > 1e-4  # the step moved the params
    np.testing.assert_allclose(_flat(many.params), _flat(one.params), atol=1e-5)
    for k in ("loss", "grad_norm", "ops/token_mean", "policy/entropy", "policy/clip_fraction"):
        np.testing.assert_allclose(m_many[0][k], m_one[0][k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert m_one[0]["learning_rate"] == pytest.approx(1e-3)
    assert m_one[0]["train/loss_tokens"] == sum(RESPONSE_LENGTHS) - RESPONSE_LENGTHS[DROPPED_ROW]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_accumulation_is_exact(model, mesh1, batch_and_noise, aggregation):
    """Micro-batches {0,4}, {1,5}, ... hold different token and live-sequence counts, so an unweighted
    average of micro-batch gradients would differ; the normaliser-share weighting must not."""
    batch, _ = batch_and_noise
    loss = LossConfig(aggregation=aggregation)
    full, m_full = _train(model, mesh1, learner.LearnerConfig(loss=loss), batch)
    micro, m_micro = _train(model, mesh1, learner.LearnerConfig(loss=loss, micro_batch_size=2), batch)
    np.testing.assert_allclose(_flat(micro.params), _flat(full.params), atol=1e-5)
    for k in ("loss", "grad_norm", "ops/token_mean", "policy/entropy", "policy/ratio_mean"):
        np.testing.assert_allclose(m_micro[0][k], m_full[0][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_minibatches_and_epochs_make_several_updates(model, mesh1, batch_and_noise):
    batch, noise = batch_and_noise
    one, _ = _train(model, mesh1, learner.LearnerConfig(), batch)
    two, m_two = _train(model, mesh1, learner.LearnerConfig(num_minibatches=2, ppo_epochs=2), batch)
    assert int(one.step) == 1 and int(two.step) == 4  # 2 minibatches x 2 epochs
    assert m_two[0]["train/num_updates"] == 4
    assert m_two[0]["train/loss_tokens"] == batch["loss_mask"].sum()  # counted once, not once per epoch
    assert np.abs(_flat(two.params) - _flat(one.params)).max() > 1e-4
    # Train-time OPS is that of the first minibatch (rows 0, 2, 4, 6) under the initial params, where
    # log pi - log mu = -noise exactly.
    rows, mask = slice(0, None, 2), batch["loss_mask"][0::2]
    want = (np.abs(np.exp(-noise[rows]) - 1.0) * mask).sum() / mask.sum()
    np.testing.assert_allclose(m_two[0]["ops/token_mean"], want, rtol=1e-4)


def test_compute_logprobs_aligns_with_the_model(model, batch_and_noise):
    """Entry t scores tokens[t] with the logits at t - 1, at the given temperature; padding is 0."""
    batch, _ = batch_and_noise
    graphdef, params = learner.split_params(model)
    got = np.asarray(learner.compute_logprobs(graphdef, params, batch["tokens"], batch["attention_mask"], 0.7))
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, batch["tokens"])  # eager: an op at a time
    want = np.asarray(token_logprobs(logits[:, :-1], batch["tokens"][:, 1:], 0.7))
    valid = batch["attention_mask"][:, 1:]
    np.testing.assert_allclose(got[:, 1:][valid], want[valid], atol=1e-5)
    assert np.all(got[:, 0] == 0) and np.all(got[:, 1:][~valid] == 0)


def test_positive_advantages_raise_logprob(model, mesh1, batch_and_noise):
    """On-policy batch with A = +1: OPS starts at 0 and the log-prob of the sampled responses goes up."""
    batch, noise = batch_and_noise
    graphdef, params = learner.split_params(model)
    mask = batch["loss_mask"]
    on_policy = dict(batch, behavior_logp=batch["behavior_logp"] - noise, advantages=np.ones(B, np.float32))
    state, history = _train(model, mesh1, learner.LearnerConfig(), on_policy, steps=5)
    assert history[0]["ops/token_mean"] < 1e-5 and history[0]["policy/clip_fraction"] == 0.0
    assert history[0]["loss"] == pytest.approx(-1.0, abs=1e-5)  # -mean(r A) with r = 1
    losses = [h["loss"] for h in history]
    assert losses[1] < losses[0] - 0.05 and losses[2] < losses[1]
    # With A = 1 the clipped surrogate is bounded by -(1 + eps_high); once there most tokens are clipped.
    assert min(losses) >= -1.28 - 1e-4 and history[-1]["policy/clip_fraction"] > 0.5

    def mean_logp(p):
        logp = np.asarray(learner.compute_logprobs(graphdef, p, batch["tokens"], batch["attention_mask"], 1.0))
        return (logp * mask).sum() / mask.sum()

    assert mean_logp(state.params) > mean_logp(params) + 0.05


def test_state_is_donated_and_step_compiles_once(model, mesh1, batch_and_noise):
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig()
    run = _learner(model, mesh1, cfg)
    step, batch = run.step_program, packing.pack_for_learner(batch, cfg, mesh1)
    state = run.init_state(model)
    new_state, _ = step(state, batch, run.frozen)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(learner.split_params(model)[1]))  # model not aliased
    new_state, _ = step(new_state, batch, run.frozen)
    assert int(new_state.step) == 2
    assert step._cache_size() == 1


def test_bad_loss_name_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; known: \['grpo', 'gspo'"):
        learner.LearnerConfig(loss_name="nope")


def test_schedules_and_config_errors():
    cos = learner.make_schedule(learner.OptimizerConfig(
        learning_rate=1.0, warmup_steps=10, schedule="cosine", total_steps=110, end_lr_ratio=0.1))
    # The warmup's update k uses lr (k + 1) / (W + 1): the first update learns (a ramp from 0 wasted it).
    assert [float(cos(k)) for k in (0, 4, 9)] == pytest.approx([1 / 11, 5 / 11, 10 / 11])
    assert float(cos(10)) == pytest.approx(1.0) and float(cos(110)) == pytest.approx(0.1)
    const = learner.make_schedule(learner.OptimizerConfig(learning_rate=2.0, warmup_steps=4))
    assert [float(const(k)) for k in (0, 2)] == pytest.approx([2 / 5, 6 / 5])
    assert float(const(4)) == pytest.approx(2.0) and float(const(100)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs total_steps"):
        learner.OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="schedule 'linear' is unknown"):
        learner.OptimizerConfig(schedule="linear")
    with pytest.raises(ValueError, match="num_minibatches"):
        learner.LearnerConfig(num_minibatches=0)


def _packed(batch, mesh, cfg):
    packed = packing.pack_for_learner(batch, cfg, mesh)
    assert packed["packed_tokens"].shape[0] <= batch["tokens"].shape[0]
    if cfg == learner.LearnerConfig() and mesh.size == 1:
        assert packed["packed_tokens"].shape[0] == 5  # 78 tokens of 7 live rows in 5 rows of 16, not 8
    return packed


# Configs are built inside the test, not at import: collection must not run the code under test.
PACKED_CASES = {"plain": {}, "micro": {"aggregation": "seq-mean-token-mean", "micro_batch_size": 2},
                "minibatches": {"num_minibatches": 2, "ppo_epochs": 2},
                # 74 live tokens (16, 15, 11, 10 + 6, 9 + 7 in five rows of 16): two micro-batches of two full
                # rows and one of two tail rows of 12 (88 positions) instead of three of full rows (96)
                "tail": {"aggregation": "seq-mean-token-sum-norm", "micro_batch_size": 2, "tail_row_width": 12}}


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_step_equals_the_reference_and_the_unpacked_layout(model, mesh1, batch_and_noise, case):
    """Packing changes the FLOPs, not the result: the step on packed rows, and on one sequence per row
    (pack_sequences=False), gives the parameters and metrics of the plain padded reference."""
    kw = dict(PACKED_CASES[case])
    if "aggregation" in kw:
        kw["loss"] = LossConfig(aggregation=kw.pop("aggregation"))
    cfg = learner.LearnerConfig(**kw)
    batch, _ = batch_and_noise
    want, m_want = _reference(model, cfg, batch)
    packed_batch = _packed(batch, mesh1, cfg)
    if case == "tail":
        stats = packing.packing_stats(packed_batch, cfg)
        assert stats["train/micro_batches"] == 3
        assert stats["train/useful_token_fraction"] == pytest.approx(74 / 88)
    unpacked_cfg = dataclasses.replace(cfg, pack_sequences=False, tail_row_width=None)
    unpacked_batch = packing.pack_for_learner(batch, unpacked_cfg, mesh1)
    assert (unpacked_batch["packed_segments"] <= 1).all()  # one sequence per row
    for got_cfg, got_batch in ((cfg, packed_batch), (unpacked_cfg, unpacked_batch)):
        got, m_got = _train(model, mesh1, got_cfg, got_batch)
        np.testing.assert_allclose(_flat(got.params), _flat(want), atol=1e-5)
        for k in ("loss", "policy/entropy", "policy/ratio_mean"):
            np.testing.assert_allclose(m_got[0][k], np.mean([m[k] for m in m_want]), rtol=1e-5, atol=1e-6,
                                       err_msg=k)
        assert m_got[0]["train/loss_tokens"] == batch["loss_mask"].sum()


@pytest.mark.parametrize("kw", [{}, {"micro_batch_size": 4, "tail_row_width": 8}])
def test_packed_step_sharded_equals_single_device(model, mesh1, batch_and_noise, kw):
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig(**kw)
    mesh8 = mesh_lib.make_mesh((2, 2, 2))
    one, _ = _train(model, mesh1, cfg, batch)
    packed8 = _packed(batch, mesh8, cfg)
    assert packed8["packed_tokens"].shape[0] % 4 == 0  # data x fsdp devices
    many, _ = _train(model, mesh8, cfg, packed8)
    np.testing.assert_allclose(_flat(many.params), _flat(one.params), atol=1e-5)


def test_packed_step_with_splash_attention_equals_the_reference(model, mesh1, batch_and_noise):
    """The TPU splash kernel (Pallas interpret mode here), per device inside shard_map on 8 devices, trains to
    the same parameters as the jnp reference attention: packed segments stay apart, gradients agree."""
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig()
    mesh8 = mesh_lib.make_mesh((2, 2, 2))
    one, m_one = _train(model, mesh1, cfg, batch)
    splash = FlashConfig(impl="splash", block_q=128, block_kv=128, interpret=True)
    many, m_many = _train(model, mesh8, cfg, _packed(batch, mesh8, cfg), flash=splash)
    np.testing.assert_allclose(_flat(many.params), _flat(one.params), atol=1e-5)
    for k in ("loss", "grad_norm", "policy/entropy"):
        np.testing.assert_allclose(m_many[0][k], m_one[0][k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_packing_off_is_one_sequence_per_row(mesh1, batch_and_noise):
    """pack_sequences=False lays each live sequence in a row of its own (the unpacked batch, same train path);
    the filtered row is skipped like in a packed batch."""
    batch, _ = batch_and_noise
    out = packing.pack_for_learner(batch, learner.LearnerConfig(pack_sequences=False), mesh1)
    segments = out["packed_segments"]
    assert segments.max() == 1 and sorted((segments > 0).sum(axis=1).tolist())[-7:] == sorted(
        PROMPT + n for i, n in enumerate(RESPONSE_LENGTHS) if i != DROPPED_ROW)
    assert out["micro_index"][DROPPED_ROW] == -1 and (np.delete(out["micro_index"], DROPPED_ROW) == 0).all()


def test_an_unpacked_batch_is_refused_with_the_fix(model, mesh1, batch_and_noise):
    batch, _ = batch_and_noise
    run = _learner(model, mesh1, learner.LearnerConfig())
    with pytest.raises(ValueError, match="packing.pack_for_learner"):
        run.train_step(run.init_state(model), batch)


def test_abstract_batch_is_the_layout_a_packed_batch_has(model, mesh1, batch_and_noise):
    """What the deviceless compile lowers the train step for (`Learner.abstract_batch`) is the batch the run feeds
    it: the same entries, shapes and dtypes, so the lowered program is the one that runs (one compile)."""
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig(micro_batch_size=2, tail_row_width=12)
    run = _learner(model, mesh1, cfg)
    packed = packing.pack_for_learner(batch, cfg, mesh1)
    abstract = run.abstract_batch(B, T)
    assert {k: (v.shape, np.dtype(v.dtype)) for k, v in abstract.items()} == {
        k: (np.shape(v), np.asarray(v).dtype) for k, v in packed.items()}
    lowered = run.lower_train_step(B, T).compile()
    state, metrics = lowered(run.init_state(model), packed, run.frozen)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


def test_learner_scores_at_the_sampler_temperature():
    LearnerConfig = learner.LearnerConfig
    assert LearnerConfig().for_sampler(0.7).temperature == 0.7  # None follows the sampler
    assert LearnerConfig().logit_temperature == 1.0  # used alone
    assert LearnerConfig(temperature=0.7).for_sampler(0.7).temperature == 0.7
    with pytest.raises(ValueError, match="differs from the sampler's log-prob temperature 1.0"):
        LearnerConfig(temperature=0.7).for_sampler(1.0)


def test_bfloat16_params_train_with_float32_moments(mesh1, batch_and_noise):
    """Mixed precision: bf16 params and compute train (the update loop used to fail to trace, bf16 moments in
    and float32 moments out of the minibatch scan); moments are float32, params stay bf16 and move, and the
    checkpoint restore target describes exactly that state."""
    batch, _ = batch_and_noise
    bf16 = init_model(MODEL_CFG.replace(param_dtype="bfloat16", dtype="bfloat16"), seed=0)
    state, history = _train(bf16, mesh1, learner.LearnerConfig(num_minibatches=2), batch, steps=2)
    params = jax.tree.leaves(state.params)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1]
    assert {x.dtype for x in params} == {jax.numpy.dtype("bfloat16")}
    assert moments and {x.dtype for x in moments} == {jax.numpy.dtype("float32")}
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["grad_norm"]) for h in history)
    start = _flat(learner.split_params(bf16)[1]).astype(np.float32)
    assert np.abs(_flat(state.params).astype(np.float32) - start).max() > 0
    # The restore target, from the model and from an abstract model (nnx.eval_shape: what a real-scale
    # dry run has), describes exactly this state.
    shapeless = nnx.eval_shape(lambda: init_model(MODEL_CFG.replace(param_dtype="bfloat16", dtype="bfloat16")))
    want = [(a.shape, a.dtype) for a in jax.tree.leaves(state)]
    for source in (bf16, shapeless):
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(learner.abstract_train_state(source, OPT, mesh1))] == want
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(learner.abstract_params(source, mesh1))] == [
            (a.shape, a.dtype) for a in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("chunk", [4, 64])  # 4 does not divide T - 1 = 15; 64 is one padded chunk
def test_chunked_logprobs_equal_the_full_logits(model, chunk):
    """Log-probs, entropy and their gradient, computed `chunk` positions at a time from the hidden states,
    equal those of the full [B, T, V] logits."""
    rng = np.random.default_rng(1)
    tokens = jax.numpy.asarray(rng.integers(0, MODEL_CFG.vocab_size, (3, T)), jax.numpy.int32)
    graphdef, params = learner.split_params(model)
    weights = jax.numpy.asarray(rng.normal(size=(3, T)), jax.numpy.float32)

    def objective(p, c):
        logp, entropy = learner._policy_logp(graphdef, p, tokens, None, 0.7, c)
        return jax.numpy.sum(weights * logp), (logp, entropy)

    grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=1)  # compiled: eager is slow
    (want, (logp, ent)), g_want = grad(params, None)
    (got, (logp_c, ent_c)), g_got = grad(params, chunk)
    np.testing.assert_allclose(np.asarray(logp_c), np.asarray(logp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent_c), np.asarray(ent), atol=1e-5)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(_flat(g_got), _flat(g_want), atol=1e-5)


def test_train_step_with_chunked_logprobs_equals_the_full_one(model, mesh1, batch_and_noise):
    batch, _ = batch_and_noise
    full, m_full = _train(model, mesh1, learner.LearnerConfig(), batch)
    chunked, m_chunked = _train(model, mesh1, learner.LearnerConfig(logits_chunk=4), batch)
    np.testing.assert_allclose(_flat(chunked.params), _flat(full.params), atol=1e-6)
    for k in ("loss", "grad_norm", "policy/entropy", "ops/token_mean"):
        np.testing.assert_allclose(m_chunked[0][k], m_full[0][k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_rematerialised_layers_give_the_same_values_and_gradients(model, remat):
    rng = np.random.default_rng(2)
    tokens = jax.numpy.asarray(rng.integers(0, MODEL_CFG.vocab_size, (2, T)), jax.numpy.int32)
    graphdef, params = learner.split_params(model)

    def objective(p, policy):
        return jax.numpy.sum(learner._policy_logp(graphdef, p, tokens, None, 1.0, None, policy)[0])

    want, g_want = jax.value_and_grad(objective)(params, "none")
    got, g_got = jax.value_and_grad(objective)(params, remat)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(_flat(g_got), _flat(g_want), atol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.grad(objective), static_argnums=1)(params, remat))
    assert "remat" in jaxpr or "checkpoint" in jaxpr  # the layers really are rematerialised
    with pytest.raises(ValueError, match="LearnerConfig.remat='some'"):
        learner.LearnerConfig(remat="some")


def test_a_nonfinite_update_is_skipped(model, mesh1, batch_and_noise):
    """A NaN in one minibatch's loss skips that update only (reported in the metrics); the other applies."""
    batch, _ = batch_and_noise
    cfg = learner.LearnerConfig(num_minibatches=2)
    poisoned = {**batch, "advantages": batch["advantages"].copy()}
    poisoned["advantages"][0] = np.nan  # row 0 is in minibatch 0 (rows 0, 2, 4, 6)
    state, history = _train(model, mesh1, cfg, poisoned)
    m = history[0]
    assert m["train/skipped_updates"] == 1 and m["train/nonfinite_loss"] == 1 and m["train/num_updates"] == 2
    params = _flat(state.params)
    assert np.isfinite(params).all()
    assert np.abs(params - _flat(learner.split_params(model)[1])).max() > 1e-4  # minibatch 1's update applied
    all_nan = {**batch, "advantages": np.full_like(batch["advantages"], np.nan)}
    state, history = _train(model, mesh1, cfg, all_nan)
    assert history[0]["train/skipped_updates"] == 2
    np.testing.assert_array_equal(_flat(state.params), _flat(learner.split_params(model)[1]))


def _kl_case(model, mesh1, batch_and_noise):
    """A reference that differs from the policy, a kl_coef > 0 config with micro-batches, tail rows and chunked
    logits, and its log-prob pass."""
    batch, _ = batch_and_noise
    graphdef, params = learner.split_params(model)
    rng = np.random.default_rng(3)
    ref = jax.tree.map(lambda x: x + (0.05 * rng.normal(size=x.shape)).astype(x.dtype), params)
    cfg = learner.LearnerConfig(loss=LossConfig(kl_coef=0.5), micro_batch_size=2, tail_row_width=12, logits_chunk=4)
    return batch, graphdef, params, ref, cfg, _logprob_fn(model, mesh1, cfg)


def _logprob_fn(model, mesh, cfg: learner.LearnerConfig):
    """The learner's log-prob pass (`Learner.logprob_fn`), shared across tests like its train step."""
    return _learner(model, mesh, cfg).logprob_fn


def test_logprob_pass_equals_the_unpacked_one(model, mesh1, batch_and_noise):
    """The packed, micro-batched, chunked log-prob pass (the reference's and the step start's) gives the unpacked
    compute_logprobs values on every scored token; 0 on token 0, padding and the rows the packing skipped."""
    batch, graphdef, params, ref, cfg, logprob = _kl_case(model, mesh1, batch_and_noise)
    packed = packing.pack_for_learner(batch, cfg, mesh1)
    want = np.asarray(learner.compute_logprobs(graphdef, ref, batch["tokens"], batch["attention_mask"], 1.0))
    got = np.asarray(logprob(ref, packed))
    live = batch["loss_mask"].sum(axis=1) > 0  # the dropped row is skipped by the packing
    scored = batch["attention_mask"] & live[:, None]
    scored[:, 0] = False
    np.testing.assert_allclose(got[scored], want[scored], atol=1e-5)
    assert np.all(got[~scored] == 0) and np.abs(got[scored]).min() > 0
    # Unpacked (pack_sequences=False): one sequence per row, micro-batches of 4 rows, the same values.
    flat = learner.LearnerConfig(pack_sequences=False, micro_batch_size=4, logits_chunk=4)
    unpacked = _logprob_fn(model, mesh1, flat)
    np.testing.assert_allclose(np.asarray(unpacked(ref, packing.pack_for_learner(batch, flat, mesh1)))[scored],
                               want[scored], atol=1e-5)


def test_kl_step_on_the_packed_reference_equals_the_unpacked_one(model, mesh1, batch_and_noise):
    """select with the OPS filter and kl_coef > 0, each pass on the packed batch: the filter keeps what the
    unpacked step-start pass keeps, and the step trained on the packed reference log-probs equals the step trained
    on the unpacked ones (the old path): only the cost changed."""
    from rollverify_jax.rl import step as step_lib
    from rollverify_jax.rl.filters import FilterConfig
    from rollverify_jax.rollout.trajectory import Trajectory
    from rollverify_jax.verify.ops import sequence_ops, token_ops

    batch, graphdef, params, ref, cfg, logprob = _kl_case(model, mesh1, batch_and_noise)
    ends = batch["attention_mask"].sum(axis=1)
    trajs = [Trajectory(uid=i, group_id=0, prompt=batch["tokens"][i, :PROMPT], seed=i, max_new_tokens=T,
                        tokens=batch["tokens"][i, PROMPT:ends[i]].tolist(),
                        logps=batch["behavior_logp"][i, PROMPT:ends[i]].tolist(), versions=[0] * (ends[i] - PROMPT))
             for i in range(B)]
    old_policy, old_ref = (np.asarray(learner.compute_logprobs(graphdef, p, batch["tokens"], batch["attention_mask"],
                                                               1.0)) for p in (params, ref))
    response = batch["attention_mask"] & (np.arange(T)[None] >= PROMPT)
    seq_ops = np.sort(np.asarray(sequence_ops(token_ops(old_policy, batch["behavior_logp"]), response)))
    threshold = float(seq_ops[3:5].mean())  # halfway between two sequences' OPS: the filter drops four
    scored = step_lib.Scored(trajs, batch["advantages"], np.zeros(B, bool), {})
    packed, metrics = step_lib.select(
        scored, cfg, FilterConfig(name="ops", ops_threshold=threshold), current_version=0, rows=B, width=T,
        mesh=mesh1, skip_uniform_groups=False, policy_logp=lambda b: np.asarray(logprob(params, b)),
        ref_logp=lambda b: np.asarray(logprob(ref, b)))
    assert metrics["filter/kept_fraction"] == 0.5
    old_keep = np.asarray(sequence_ops(token_ops(old_policy, batch["behavior_logp"]), response)) <= threshold
    np.testing.assert_array_equal(packed["loss_mask"].sum(axis=1) > 0, old_keep)
    new, m_new = _train(model, mesh1, cfg, packed)
    old, m_old = _train(model, mesh1, cfg, {**packed, "ref_logp": np.where(response, old_ref, 0.0)})
    np.testing.assert_allclose(_flat(new.params), _flat(old.params), atol=1e-6)
    assert m_new[0]["policy/kl"] > 1e-3
    for k in ("loss", "policy/kl", "grad_norm", "policy/pg_loss", "ops/token_mean"):
        np.testing.assert_allclose(m_new[0][k], m_old[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
