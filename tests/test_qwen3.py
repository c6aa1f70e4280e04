"""Model-level properties that parity tests do not pin down: causality, presets, dtypes, attention swap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollverify_jax.models import init_model, model_config
from rollverify_jax.models.qwen3 import CausalAttention, Qwen3Config, Qwen3ForCausalLM
from rollverify_jax.run.builder import execution_config


@pytest.fixture(scope="module")
def tiny():
    return init_model(model_config("tiny"), seed=0)


def test_output_shape_dtype_and_causality(tiny):
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 64)
    logits = tiny(tokens)
    assert logits.shape == (2, 10, 64) and logits.dtype == jnp.float32
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 64)
    other = tiny(changed)
    np.testing.assert_array_equal(np.asarray(logits[:, :7]), np.asarray(other[:, :7]))
    assert not np.allclose(np.asarray(logits[:, 7:]), np.asarray(other[:, 7:]))


def test_padding_keys_are_masked(tiny):
    """Right padding never changes the logits of the real tokens."""
    tokens = jax.random.randint(jax.random.key(2), (1, 6), 0, 64)
    padded = jnp.concatenate([tokens, jnp.zeros((1, 4), jnp.int32)], axis=1)
    valid = jnp.arange(10)[None] < 6
    a = tiny(tokens)
    b = tiny(padded, attention=CausalAttention(valid=valid))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b[:, :6]), atol=1e-6)


def test_bfloat16_params_and_compute():
    m = init_model(model_config("tiny", param_dtype="bfloat16", dtype="bfloat16"))
    assert m.layers[0].self_attn.q_proj[...].dtype == jnp.bfloat16
    assert m(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.float32


def test_unknown_preset_lists_known(spec_of):
    with pytest.raises(ValueError, match=r"Unknown model preset 'qwen9'.*'tiny'"):
        model_config("qwen9")
    with pytest.raises(ValueError, match="known presets"):
        model_config(**spec_of("model_config.preset = 'nope'").model)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of"):
        Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="Unknown dtype"):
        model_config("tiny", dtype="float8")


def test_param_count_formula():
    from rollverify_jax.models.hf import param_count
    for preset in ("tiny", "tiny_moe"):
        cfg = model_config(preset)
        assert param_count(init_model(cfg)) == cfg.num_params()
    assert 90e6 < model_config("bench_100m").num_params() < 130e6


def test_moe_routed_per_device_equals_the_global_routing():
    """Qwen3-MoE on 8 devices with `mesh`: each device routes its own rows' tokens and computes its share of the
    expert MLPs' inner dimension; logits, router logits and gradients equal the global computation."""
    from rollverify_jax.infra import mesh as mesh_lib

    mesh = mesh_lib.make_mesh((2, 2, 2))
    model = init_model(model_config("tiny_moe", num_hidden_layers=2), seed=4)  # one dense, one MoE layer
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, 64)

    def loss(p, m):
        h, router = nnx.merge(graphdef, p).hidden_states(tokens, mesh=m)
        return jnp.sum(h ** 2) + sum(jnp.sum(r ** 2) for r in router), (h, router)

    # The references are compiled: eager dispatch compiles every op of the forward and backward on its own.
    (want, (h0, r0)), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, None)
    placed = mesh_lib.shard_model(nnx.merge(graphdef, params), mesh)
    (got, (h1, r1)), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(nnx.state(placed), mesh)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=2e-5)
    for a, b in zip(r1, r0, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    _assert_grads_close(g1, g0)


def _assert_grads_close(got, want) -> None:
    """Gradients computed another way (sharded, scanned) sum their float32 terms in another order: the error
    scales with a leaf's largest entries, not with each element (seen: 1.5e-4 on an entry of 0.017 in a leaf
    whose largest is 19)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-4 + 1e-5 * float(np.abs(b).max()), rtol=1e-4)


@pytest.fixture(scope="module")
def replicated_moe():
    """The model the expert-parallel cases shard, its tokens, its loss and the loss's values, router logits and
    gradients on one device: one reference (compiled once) for every layout."""
    model = init_model(model_config("tiny_moe", num_hidden_layers=2), seed=6)
    tokens = jax.random.randint(jax.random.key(3), (4, 7), 0, 64)

    def loss(graphdef, p, m):
        h, router = nnx.merge(graphdef, p).hidden_states(tokens, mesh=m)
        return jnp.sum(h ** 2) + sum(jnp.sum(r ** 2) for r in router), (h, router)

    graphdef, params = nnx.split(model)
    (_, (h0, r0)), g0 = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=(0, 2))(
        graphdef, params, None)
    return model, params, loss, (h0, r0, g0)


@pytest.mark.parametrize("experts_axes, chunk", [
    ("fsdp", 4),                # experts over an axis that splits the rows: all-gather, reduce-scatter, 3 chunks
    ("tensor", 4096),           # over an axis the rows are whole on: outputs summed
    (("fsdp", "tensor"), 5),    # both at once, one expert per device, a padded last chunk
    (("data", "fsdp"), 9),      # over both row axes, with the inner dimension over 'tensor'
])
def test_expert_parallel_moe_equals_the_replicated_experts(experts_axes, chunk, spec_of, replicated_moe):
    """Expert parallelism on 8 devices (experts sharded by the logical-axis rules, each device holding only its
    own) gives the values, router logits and gradients of the model computed on one device."""
    from rollverify_jax.infra import mesh as mesh_lib

    mesh = mesh_lib.make_mesh((2, 2, 2))
    model, params, loss, (h0, r0, g0) = replicated_moe
    rules = tuple((name, experts_axes if name == "experts" else axes) for name, axes in mesh_lib.DEFAULT_RULES)
    # The rules and the chunk as a run gets them: from gin, through the spec, into the model's config.
    spec = spec_of(f"logical_axis_rules.rules = {rules!r}", f"expert_parallel_chunk.tokens = {chunk}")
    assert execution_config(model.cfg, spec).expert_parallel_chunk == chunk
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(execution_config(model.cfg, spec),
                                                                    rngs=nnx.Rngs(0))))
    placed = nnx.state(mesh_lib.shard_model(nnx.merge(graphdef, params), mesh, spec.axis_rules_dict()))
    gate = placed["layers"][1]["mlp"]["gate_proj"][...]
    assert gate.addressable_shards[0].data.shape[0] < gate.shape[0]  # each device holds only its experts
    (_, (h1, r1)), g1 = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=(0, 2))(
        graphdef, placed, mesh)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=2e-5)
    for a, b in zip(r1, r0, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    _assert_grads_close(g1, g0)


@pytest.mark.parametrize("preset, remat", [("tiny", "full"), ("tiny_moe", "none")])
def test_scanned_layers_equal_the_unrolled_ones(preset, remat):
    """Layers run as scans over stacked weights (one scan per run of same-kind layers: tiny_moe has a dense layer,
    then MoE layers routed per device on 8 devices) give the unrolled values, router logits and gradients."""
    from rollverify_jax.infra import mesh as mesh_lib

    mesh = mesh_lib.make_mesh((2, 2, 2)) if preset == "tiny_moe" else None
    model = init_model(model_config(preset, num_hidden_layers=4), seed=5)
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(2), (4, 9), 0, 64)

    def loss(p, scan):
        h, router = nnx.merge(graphdef, p).hidden_states(tokens, remat=remat, mesh=mesh, scan=scan)
        return jnp.sum(h ** 2) + sum(jnp.sum(r ** 2) for r in router), (h, router)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, (h0, r0)), g0 = grad(params, False)
    (got, (h1, r1)), g1 = grad(params, True)
    assert " scan[" in str(jax.make_jaxpr(loss, static_argnums=1)(params, True))  # really a loop
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=2e-5)
    assert len(r1) == len(r0) == (3 if preset == "tiny_moe" else 0)
    for a, b in zip(r1, r0, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    _assert_grads_close(g1, g0)


def test_the_scan_carry_split_by_position_gives_the_same_values_and_gradients():
    """('sequence', 'tensor') in the logical-axis rules: the residual stream the layer scan keeps for the backward
    pass, and each unrolled layer's output, are laid out split by position over 'tensor'
    (configs/qwen3_8b_dapo_lora_v5e8.gin needs it to fit), and the values and gradients are the unconstrained
    scan's. Without the rule no constraint is added."""
    from rollverify_jax.infra import mesh as mesh_lib

    mesh = mesh_lib.make_mesh((1, 2, 4))
    model = init_model(model_config("tiny", num_hidden_layers=2), seed=5)
    graphdef, params = nnx.split(model)
    rules = (*mesh_lib.DEFAULT_RULES[:-1], ("sequence", "tensor"))
    split_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(model.cfg.replace(axis_rules=rules),
                                                                    rngs=nnx.Rngs(0))))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)

    def loss(p, g):
        h, _ = nnx.merge(g, p).hidden_states(tokens, remat="full", mesh=mesh, scan=True)
        return jnp.sum(h ** 2), h

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, h0), g0 = grad(params, graphdef)
    (_, h1), g1 = grad(params, split_def)
    text = str(jax.make_jaxpr(loss, static_argnums=1)(params, split_def))
    assert "sharding_constraint" in text and "'tensor'" in text
    assert "sharding_constraint" not in str(jax.make_jaxpr(loss, static_argnums=1)(params, graphdef))
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=2e-5)
    _assert_grads_close(g1, g0)
    # the unrolled forward (the engine's prefill) splits each layer's output the same way, same values
    unrolled = lambda g: nnx.merge(g, params).hidden_states(tokens, mesh=mesh)[0]  # noqa: E731
    assert "sharding_constraint" in str(jax.make_jaxpr(unrolled, static_argnums=0)(split_def))
    np.testing.assert_allclose(np.asarray(jax.jit(unrolled, static_argnums=0)(split_def)), np.asarray(h0), atol=2e-5)
