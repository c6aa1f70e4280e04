"""Mesh construction, logical-axis rules, and sharded-vs-unsharded equality on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import init_model, model_config

# Golden PartitionSpecs of the tiny MoE preset on a (data=2, fsdp=2, tensor=2) mesh.
GOLDEN = {
    ("embed_tokens",): P("tensor", "fsdp"),
    ("lm_head",): P("fsdp", "tensor"),
    ("norm", "weight"): P(None),
    ("layers", 0, "input_layernorm", "weight"): P(None),
    ("layers", 0, "post_attention_layernorm", "weight"): P(None),
    ("layers", 0, "self_attn", "q_proj"): P("fsdp", "tensor"),
    ("layers", 0, "self_attn", "k_proj"): P("fsdp", "tensor"),
    ("layers", 0, "self_attn", "v_proj"): P("fsdp", "tensor"),
    ("layers", 0, "self_attn", "o_proj"): P("tensor", "fsdp"),
    ("layers", 0, "self_attn", "q_norm", "weight"): P(None),
    ("layers", 0, "self_attn", "k_norm", "weight"): P(None),
    ("layers", 0, "mlp", "gate_proj"): P("fsdp", "tensor"),
    ("layers", 0, "mlp", "up_proj"): P("fsdp", "tensor"),
    ("layers", 0, "mlp", "down_proj"): P("tensor", "fsdp"),
    ("layers", 1, "mlp", "router"): P("fsdp", None),
    ("layers", 1, "mlp", "gate_proj"): P(None, "fsdp", "tensor"),
    ("layers", 1, "mlp", "up_proj"): P(None, "fsdp", "tensor"),
    ("layers", 1, "mlp", "down_proj"): P(None, "tensor", "fsdp"),
}


@pytest.fixture(scope="module")
def mesh222():
    return mesh_lib.make_mesh((2, 2, 2))


def test_make_mesh_shapes():
    assert dict(mesh_lib.make_mesh((1, -1, 2)).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert dict(mesh_lib.make_mesh((-1, 1, 1)).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    mesh = mesh_lib.make_mesh((2, 2, 2), axis_types="explicit")
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    with pytest.raises(ValueError, match="needs 27 devices"):
        mesh_lib.make_mesh((3, 3, 3))
    with pytest.raises(ValueError, match="at most one -1"):
        mesh_lib.make_mesh((-1, -1, 1))
    with pytest.raises(ValueError, match="axis_types"):
        mesh_lib.make_mesh((1, -1, 1), axis_types="magic")


def test_param_specs_match_golden_table(mesh222):
    model = nnx.eval_shape(lambda: init_model(model_config("tiny_moe", tie_word_embeddings=False)))
    specs = dict(nnx.to_flat_state(mesh_lib.param_specs(nnx.state(model), mesh222)))
    for path, want in GOLDEN.items():
        assert specs[path] == want, (path, specs[path], want)
    # Every layer follows layer 0 / layer 1's pattern.
    for path, spec in specs.items():
        if path[0] == "layers" and path[1] > 1:
            ref = ("layers", 1 if len(path) > 3 and path[2] == "mlp" else 0, *path[2:])
            assert spec == specs[ref], path


def test_rules_overridable_from_gin(mesh222, spec_of):
    spec = spec_of("logical_axis_rules.rules = [('embed', None), ('mlp', ('fsdp', 'tensor'))]")
    rules = spec.axis_rules_dict()
    assert mesh_lib.logical_to_spec(("embed", "mlp"), (128, 384), mesh222, rules) == P(None, ("fsdp", "tensor"))
    with pytest.raises(ValueError, match="No logical-axis rule for 'vocab'"):
        mesh_lib.logical_to_spec(("vocab",), (64,), mesh222, rules)


def test_uneven_dimension_is_replicated(mesh222):
    assert mesh_lib.logical_to_spec(("embed", "mlp"), (3, 5), mesh222) == P(None, None)


def test_sharded_forward_equals_unsharded(mesh222):
    model = init_model(model_config("tiny_moe"), seed=1)
    tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 64)
    want = np.asarray(model(tokens))
    mesh_lib.shard_model(model, mesh222)
    assert model.layers[1].mlp.gate_proj[...].sharding.spec == P(None, "fsdp", "tensor")
    got = nnx.jit(lambda m, t: m(t))(model, jax.device_put(tokens, mesh_lib.batch_sharding(mesh222)))
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_batch_sharding(mesh222):
    x = jax.device_put(jnp.zeros((8, 3)), mesh_lib.batch_sharding(mesh222))
    assert x.sharding.spec == P(("data", "fsdp"), None)
