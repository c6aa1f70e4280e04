"""LoRA (models/lora.py): qwix adapters on the policy, adapter-only training on a frozen base shared with the engine,
exact behaviour log-probs, adapter-only publishing, merged and PEFT exports."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import qwix
import torch
import transformers
from flax import nnx
from shared import train_run
from test_train import LENGTH_REWARD, _assert_same_rows, _killed_in_rollout

from rollverify_jax import export
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.infra.transfer import tree_bytes
from rollverify_jax.models import load_pretrained, lora, save_pretrained
from rollverify_jax.models.hf import read_config
from rollverify_jax.models.lora import LoraConfig
from rollverify_jax.models.qwen3 import init_model, model_config
from rollverify_jax.rl import learner, packing
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.publish import WeightPublisher
from rollverify_jax.run import builder
from rollverify_jax.run.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.scale import fit

# A whole run (three launches, two exports): started first under xdist; its launches share a compilation cache.
pytestmark = [pytest.mark.end_to_end, pytest.mark.usefixtures("compilation_cache")]

CFG = LoraConfig(rank=4, alpha=8.0)
PROJECTIONS = {("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    ("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def adapted(model):
    return lora.adapt(model, CFG)


def _moved(model, scale=0.05, seed=0):
    """``model`` with its adapters moved off zero (a trained adapter: ``B A`` no longer 0)."""
    graphdef, trainable, frozen = lora.split_trainable(model)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(trainable))))
    trainable = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), trainable)
    return nnx.merge(graphdef, trainable, frozen)


def _tokens(vocab, batch=2, length=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def test_adapters_cover_every_linear_layer_and_start_at_the_base(model, adapted):
    layers = model.cfg.num_hidden_layers
    assert set(lora.adapted_weights(adapted)) == {("layers", i, *p) for i in range(layers) for p in PROJECTIONS}
    tokens = _tokens(model.cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(model(tokens)))  # B = 0: the base, exactly
    base = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(a is b for a, b in zip(jax.tree.leaves(lora.split_trainable(adapted)[2]), base, strict=True))
    adapters = dict(nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)))
    a, b = adapters[("layers", 0, "mlp", "down_proj_lora_a")], adapters[("layers", 0, "mlp", "down_proj_lora_b")]
    assert a.get_value().shape == (model.cfg.intermediate_size, 4) and b.get_value().shape == (4, model.cfg.hidden_size)
    assert a.get_metadata()["logical_axes"] == ("mlp", None) and b.get_metadata()["logical_axes"] == (None, "embed")
    assert not np.any(np.asarray(b.get_value())) and np.any(np.asarray(a.get_value()))


def test_adapted_forward_is_base_plus_scaled_low_rank_update(adapted):
    moved = _moved(adapted)
    tokens = _tokens(moved.cfg.vocab_size)
    merged = lora.merged_model(moved)  # W + (alpha / rank) A B, a plain model
    assert lora.lora_config_of(merged) is None
    np.testing.assert_allclose(np.asarray(moved(tokens)), np.asarray(merged(tokens)), atol=2e-5)
    attn = moved.layers[1].self_attn  # the merged weight by hand: W + (alpha / rank) A B
    want = attn.v_proj[...] + CFG.alpha / CFG.rank * attn.v_proj_lora_a[...] @ attn.v_proj_lora_b[...]
    np.testing.assert_allclose(np.asarray(merged.layers[1].self_attn.v_proj[...]), np.asarray(want), atol=1e-6)
    with pytest.raises(ValueError, match="merge an adapted one first"):
        save_pretrained(moved, "/nonexistent/never-written")


def test_moe_adapts_attention_and_dense_layers_but_not_experts_or_router():
    cfg = model_config("tiny_moe")
    adapted = lora.adapt(init_model(cfg, seed=0), CFG)
    weights = set(lora.adapted_weights(adapted))
    attention = {("layers", i, "self_attn", p) for i in range(cfg.num_hidden_layers)
                 for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    dense_mlp = {("layers", 0, "mlp", p) for p in ("gate_proj", "up_proj", "down_proj")}  # mlp_only_layers=(0,)
    assert weights == attention | dense_mlp
    moved = _moved(adapted)
    tokens = _tokens(cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(moved(tokens)), np.asarray(lora.merged_model(moved)(tokens)), atol=2e-5)


@pytest.mark.parametrize("preset, target", [("tiny", r"layers/\d+/(self_attn|mlp)"), ("tiny_moe", r"layers/[13]/.*")])
def test_the_adapters_are_the_ones_qwix_creates_in_a_forward(preset, target):
    """The adapters `lora.structure` places without a forward (paths, shapes, dtypes) are those qwix creates when
    it discovers them in one traced forward, and the forward of either runs."""
    cfg, lora_cfg = model_config(preset), LoraConfig(rank=4, alpha=8.0, target_modules=target)

    def discovered():
        base = init_model(cfg, seed=0)
        return qwix.apply_lora_to_model(base, lora._provider(lora_cfg), jnp.zeros((1, 2), jnp.int32),
                                        methods=("hidden_states",), rngs=nnx.Rngs(0))

    def shapes(model):
        return {k: (v.get_value().shape, v.get_value().dtype) for k, v in nnx.to_flat_state(
            nnx.state(model, nnx.LoRAParam))}
    assert shapes(nnx.eval_shape(discovered)) == shapes(lora.structure(cfg, lora_cfg))
    adapted = lora.adapt(init_model(cfg, seed=0), lora_cfg)
    assert np.isfinite(np.asarray(adapted(_tokens(cfg.vocab_size)))).all()


@pytest.mark.parametrize("target, message", [("layers/\\d+/nothing", "matches no module"),
                                              ("layers/(", "not a regular expression")])
def test_a_bad_target_is_one_clear_error(model, target, message):
    with pytest.raises(ValueError, match=message):
        lora.adapt(model, LoraConfig(rank=2, target_modules=target))


def test_adapters_are_sharded_like_the_weights_they_adapt(adapted):
    mesh = mesh_lib.make_mesh((1, 2, 2), devices=jax.devices()[:4])
    run = learner.Learner.create(adapted, learner.LearnerConfig(), learner.OptimizerConfig(), mesh)
    specs = {k: v.spec for k, v in nnx.to_flat_state(run.shardings.params)}
    frozen = {k: v.sharding.spec for k, v in nnx.to_flat_state(run.frozen)}
    q = frozen[("layers", 0, "self_attn", "q_proj")]  # (embed -> fsdp, q_heads -> tensor)
    assert q == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert specs[("layers", 0, "self_attn", "q_proj_lora_a")] == jax.sharding.PartitionSpec("fsdp", None)
    assert specs[("layers", 0, "self_attn", "q_proj_lora_b")] == jax.sharding.PartitionSpec(None, "tensor")


def _batch(model, rows=4, prompt=3, width=12, seed=0):
    rng = np.random.default_rng(seed)
    lengths = prompt + rng.integers(3, width - prompt, rows)
    pos = np.arange(width)[None]
    mask = pos < lengths[:, None]
    tokens = np.where(mask, rng.integers(1, model.cfg.vocab_size, (rows, width)), 0).astype(np.int32)
    graphdef, params, frozen = lora.split_trainable(model)
    logp = np.asarray(learner.compute_logprobs(graphdef, params, tokens, mask, 1.0, frozen))
    return {"tokens": tokens, "loss_mask": ((pos >= prompt) & mask).astype(np.float32),
            "behavior_logp": logp - 0.1 * ((pos >= prompt) & mask),
            "advantages": rng.normal(size=rows).astype(np.float32),
            "attention_mask": mask}


def test_the_learner_trains_the_adapters_on_a_frozen_base(model, adapted):
    mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    cfg = learner.LearnerConfig()
    run = learner.Learner.create(adapted, cfg, learner.OptimizerConfig(learning_rate=1e-2), mesh)
    state = run.init_state(adapted)
    n_adapters = 2 * len(lora.adapted_weights(adapted))
    assert len(jax.tree.leaves(state.params)) == n_adapters  # the train state: adapters and their moments only
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)  # Adam's mu and nu of each adapter
    assert moments == sorted(2 * [x.shape for x in jax.tree.leaves(state.params)])
    base = [np.asarray(x) for x in jax.tree.leaves(run.frozen)]
    batch = packing.pack_for_learner(_batch(adapted), cfg, mesh)
    ref = np.asarray(run.logprob_fn(state.params, batch))  # the initial adapters: the base's log-probs
    graphdef, params = learner.split_params(model)
    want = learner.compute_logprobs(graphdef, params, batch["tokens"], batch["attention_mask"], 1.0)
    np.testing.assert_allclose(ref, np.asarray(want), atol=2e-5)
    new, metrics = run.train_step(state, batch)
    assert float(metrics["grad_norm"]) > 0 and int(new.step) == 1
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(nnx.state(new.params, lambda p, _: "_lora_b" in p[-1])))
    for x, y in zip(base, jax.tree.leaves(run.frozen), strict=True):  # never donated, never moved
        np.testing.assert_array_equal(x, np.asarray(y))
    assert not np.allclose(np.asarray(run.logprob_fn(new.params, batch)), ref, atol=1e-4)


def _sample(engine, n=4, seed=0):
    rng = np.random.default_rng(seed)
    sched = Scheduler(engine)
    sched.submit([Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=5).astype(np.int32), seed=50 + i,
                             max_new_tokens=10) for i in range(n)])
    sched.run()
    return sorted(sched.take_finished(), key=lambda t: t.uid)


def test_a_publish_moves_the_adapters_alone_and_the_engine_samples_the_learners_policy(adapted):
    """The engine keeps its base (the same arrays) and takes the published adapters; it runs them in its forward
    with the learner's einsums, so its behaviour log-probs are the learner's on the adapted model: what makes OPS
    exact under LoRA."""
    engine = Engine(adapted, EngineConfig(num_slots=4, page_size=8, max_seq_len=32, steps_per_dispatch=4),
                    SamplingConfig(temperature=1.0))
    base = jax.tree.leaves(engine.params)
    moved = _moved(adapted)
    graphdef, trainable, frozen = lora.split_trainable(moved)
    publisher = WeightPublisher(engine)
    publisher.stage(trainable, 1)
    metrics = publisher.swap()
    assert metrics["publish/failed"] == 0 and metrics["publish/bytes"] == tree_bytes(trainable)
    assert metrics["publish/bytes"] < tree_bytes(nnx.state(adapted, nnx.Param)) / 5
    kept = [x for x in jax.tree.leaves(engine.params) if any(x is y for y in base)]
    assert len(kept) == len(jax.tree.leaves(frozen))  # the base: the same arrays, never republished
    for t in _sample(engine):
        seq = np.asarray([*t.prompt, *t.tokens], np.int32)[None]
        logp = learner.compute_logprobs(graphdef, trainable, seq, np.ones_like(seq, bool), 1.0, frozen)
        np.testing.assert_allclose(t.logps, np.asarray(logp)[0, len(t.prompt):], atol=2e-5)
        assert t.versions == [1] * t.num_tokens


LORA_RUN = ("LoraConfig.rank = 4", "LoraConfig.alpha = 8.0", "OptimizerConfig.learning_rate = 1e-2",
            "EvalConfig.at_start = False", *LENGTH_REWARD)  # rewards that differ within a group: the loss moves


def _lora_params(workdir, policy, adapted):
    """(step, adapters) of a LoRA run's latest checkpoint (its fingerprint names the base)."""
    fingerprint = builder.config_fingerprint(read_config(policy), LoraConfig(rank=4, alpha=8.0), str(policy))
    with Checkpointer(workdir, CheckpointConfig(async_save=False), model_fingerprint=fingerprint) as ckpt:
        step = ckpt.latest_step()
        mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])  # where the model under test lives
        return step, ckpt.restore_params(step, learner.abstract_params(adapted, mesh))


def test_a_lora_run_resumes_exactly_exports_merged_and_peft_and_refuses_another_base(policy, tmp_path, monkeypatch,
                                                                                     capsys):
    """Killed in step 2's rollout, a LoRA run resumes to the uninterrupted run's metrics and adapters bit for bit;
    its checkpoint holds the adapters and their optimizer state only. The export merges them into the base
    (transformers loads it) or writes them alone (peft loads them onto the base): the same logits either way. A
    resume on a base whose weights changed in place is refused, naming the base's hash."""
    policy = shutil.copytree(policy, tmp_path / "base")  # its weights are replaced at the end
    full = train_run(policy, tmp_path / "full", "rollverify", 2, LORA_RUN)
    assert any(abs(m["loss"]) > 1e-6 for m in full) and full[0]["ops/token_mean"] < 1e-5  # on-policy at step 1
    with _killed_in_rollout(monkeypatch):
        train_run(policy, tmp_path / "split", "rollverify", 2, LORA_RUN)
    resumed = train_run(policy, tmp_path / "split", "rollverify", 2, LORA_RUN)
    _assert_same_rows(full, resumed)
    base = load_pretrained(policy)
    adapted = lora.adapt(base, LoraConfig(rank=4, alpha=8.0))
    (step_a, a), (step_b, b) = _lora_params(tmp_path / "full", policy, adapted), \
        _lora_params(tmp_path / "split", policy, adapted)
    assert step_a == step_b == 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert sum(x.size for x in jax.tree.leaves(a)) < sum(x.size for x in jax.tree.leaves(nnx.state(base))) / 5
    assert all(m["publish/bytes"] == tree_bytes(a) for m in full)  # what the engine took: the adapters alone
    graphdef, _, frozen = lora.split_trainable(adapted)
    adapted = nnx.merge(graphdef, a, frozen)
    tokens = _tokens(base.cfg.vocab_size)
    want = np.asarray(adapted(tokens))
    export.main([f"--checkpoint={tmp_path / 'full'}", f"--out={tmp_path / 'merged'}"])
    export.main([f"--checkpoint={tmp_path / 'full'}", f"--out={tmp_path / 'adapter'}", "--adapter_only"])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        hf = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        for got in (merged, peft_model):
            np.testing.assert_allclose(got(torch.tensor(np.asarray(tokens))).logits.numpy(), want, atol=1e-4)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["base_model_name_or_path"] == str(policy)
    adapted_modules = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(adapted_modules) == len(lora.adapted_weights(adapted))  # every adapted weight, no other

    save_pretrained(init_model(base.cfg, seed=11), policy)  # same path and architecture, other weights
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_run(policy, tmp_path / "full", "rollverify", 3, LORA_RUN)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "lora_base_sha256" in err, err


def test_qwen3_8b_rank_16_trains_half_a_percent_and_publishes_under_one_percent():
    """The issue's estimates, from the abstract adapted 8B (nothing allocated): 43.6M adapters on every linear
    layer, a publish of 87 MB against 16.4 GB, and a train step without the base's weight gradients."""
    cfg = model_config("qwen3_8b", param_dtype="bfloat16", dtype="bfloat16")
    adapted = lora.structure(cfg, LoraConfig(rank=16, alpha=32.0))
    adapters = jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam))
    trainable = sum(x.size for x in adapters)
    assert trainable == 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))  # 43,646,976
    assert trainable / cfg.num_params() < 0.006
    publish, full = tree_bytes(adapters), 2 * cfg.num_params()
    assert publish < 0.01 * full and publish == 2 * trainable  # bfloat16
    full_flops = fit.analytic_train_flops(cfg, 4096, 4096, "none")
    lora_flops = fit.analytic_train_flops(cfg, 4096, 4096, "none", adapter_params=trainable)
    assert 0.6 < lora_flops / full_flops < 0.75  # the base's backward: input gradients only (2N of 4N)
