"""Decode near the HBM roofline (issue 26 item 2): the TPU kernel on both TensorCores, inactive slots reading one
token instead of their stale KV, and the engine's serving copy of the weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory, paged_cache
from rollverify_jax.rollout import attention as attention_lib
from rollverify_jax.rollout import engine as engine_lib


def _pallas_call(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", None)
            if sub is not None and (found := _pallas_call(sub if hasattr(sub, "eqns") else sub.jaxpr)):
                return found
    return None


def test_megacore_mode_splits_kv_heads_then_slots():
    assert attention_lib.megacore_mode(2, 3) == "kv_head"
    assert attention_lib.megacore_mode(1, 4) == "batch"
    assert attention_lib.megacore_mode(1, 3) is None


@pytest.mark.parametrize("heads, slots, grid", [(2, 4, (2, 4, 1)), (1, 4, (2, 2, 1)), (1, 3, (1, 3, 1))])
def test_tpu_kernel_grid_runs_over_two_cores_with_megacore(heads, slots, grid):
    """The kernel's leading grid dimension ('parallel') is the TensorCore: 2 with megacore, 1 without."""
    q = jnp.zeros((slots, 8, 128), jnp.bfloat16)
    pages = jnp.zeros((heads, 9, 16, 128), jnp.bfloat16)
    lengths, table = jnp.full((slots,), 5, jnp.int32), jnp.ones((slots, 2), jnp.int32)

    def kernel_grid(megacore):
        jaxpr = jax.make_jaxpr(lambda *a: attention_lib.paged_attention(
            *a, impl="pallas_tpu", megacore=megacore, pages_per_compute_block=1))(q, pages, pages, lengths, table)
        eqn = _pallas_call(jaxpr.jaxpr)
        assert eqn.params["compiler_params"].dimension_semantics[0] == "parallel"
        return tuple(eqn.params["grid_mapping"].grid)
    assert kernel_grid(True) == grid
    assert kernel_grid(False) == (1, slots, heads)


def test_megacore_follows_the_device_kind():
    cpu = engine_lib.PoolLayout.for_mesh(mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1]), 4, 2, 4)
    assert not cpu.megacore
    pytest.importorskip("libtpu", reason="deviceless TPU devices need libtpu")
    from rollverify_jax.scale.fit import get_topology_devices

    for topology, two in (("v5p:2x2x1", True), ("v5e:2x2", False), ("v6e:2x2", False)):
        devices = get_topology_devices(topology)
        mesh = mesh_lib.make_mesh((1, len(devices), 1), devices=devices)
        assert engine_lib.PoolLayout.for_mesh(mesh, 8, 2, 4).megacore is two, topology


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu", "chunked"])
def test_inactive_slots_attend_over_one_token_and_active_ones_are_unchanged(impl, monkeypatch, spec_of):
    """Decode attention for 4 slots, two inactive with long stale lengths: the kernel gets length 1 for those
    (at most one page read; 0 would give NaN), the active slots' outputs equal attention over their own
    lengths + 1, and no output is NaN."""
    rng = np.random.default_rng(0)
    hkv, hq, d, size, pps = 2, 4, 32, 4, 6
    num_pages = 4 * pps + 1
    k_pages = jnp.asarray(rng.normal(size=(hkv, num_pages, size, d)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(hkv, num_pages, size, d)), jnp.float32)
    table = jnp.asarray(1 + np.arange(4 * pps).reshape(4, pps), jnp.int32)
    lengths = jnp.asarray([9, 22, 17, 3], jnp.int32)
    active = jnp.asarray([True, False, True, False])
    q, k, v = (jnp.asarray(rng.normal(size=(4, 1, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    layout = engine_lib.PoolLayout.for_mesh(mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1]), 4, hkv, hq)
    seen = []
    real = engine_lib.paged_attention

    def spy(q, k_pages, v_pages, lengths, table, **kw):
        assert kw["impl"] == impl and kw["pages_per_compute_block"] == 2  # the spec's knobs reach the kernel
        jax.debug.callback(lambda x: seen.append(np.asarray(x)), lengths)
        return real(q, k_pages, v_pages, lengths, table, **kw)
    monkeypatch.setattr(engine_lib, "paged_attention", spy)
    # The kernel knobs as a run hands them over: gin bindings -> RunSpec.attention -> the decode attention.
    knobs = spec_of(f"paged_attention.impl = '{impl}'", "paged_attention.interpret = True",
                    "paged_attention.pages_per_compute_block = 2").attention

    def run(q, k, v, kp, vp):
        attn = engine_lib._DecodeAttention(paged_cache.KVPages(k=[kp], v=[vp]), table, lengths, active, layout,
                                           tuple(sorted(knobs.items())))
        return attn(0, q, k, v), attn.k[0], attn.v[0]
    out, kp, vp = jax.jit(run)(q, k, v, k_pages, v_pages)
    jax.effects_barrier()
    np.testing.assert_array_equal(seen[0], [10, 1, 18, 1])
    want = attention_lib.paged_attention_reference(q[:, 0] * d ** -0.5, kp, vp, lengths + 1, table)
    np.testing.assert_allclose(np.asarray(out[:, 0])[[0, 2]], np.asarray(want)[[0, 2]], atol=2e-5)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(kp[:, table[1]]), np.asarray(k_pages[:, table[1]]))  # nothing written


CFG = EngineConfig(num_slots=8, page_size=8, max_seq_len=64, steps_per_dispatch=4)


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=rng.integers(2, 14)).astype(np.int32),
                       seed=100 + i, max_new_tokens=int(rng.integers(6, 30))) for i in range(n)]


def _run(engine, trajs):
    sched = Scheduler(engine)
    sched.submit(trajs)
    sched.run()
    return sorted(sched.take_finished(), key=lambda t: t.uid)


def test_serving_layout_copy_decodes_the_same_tokens(model):
    """'tensor': the engine's weights split over 'tensor' only, whole on every fsdp device (no spec names a batch
    axis), a copy of the train layout's, remade at update_params; same tokens and log mu as the train layout."""
    mesh = mesh_lib.make_mesh((1, 4, 2))
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    train = Engine(model, CFG, sampling, eos_ids=(3,), mesh=mesh)
    serving = Engine(model, dataclasses.replace(CFG, serving_layout="tensor"), sampling, eos_ids=(3,), mesh=mesh)
    gate = serving.params["layers"][0]["mlp"]["gate_proj"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert train.params["layers"][0]["mlp"]["gate_proj"][...].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", "tensor")
    for spec in jax.tree.leaves(jax.tree.map(lambda a: a.sharding.spec, serving.params)):
        assert not {"data", "fsdp"} & set(jax.tree.leaves(tuple(spec))), spec
    a, b = _run(train, _requests(6, seed=3)), _run(serving, _requests(6, seed=3))
    assert [t.tokens for t in a] == [t.tokens for t in b] and sum(len(t.tokens) for t in b) > 40
    np.testing.assert_allclose(np.concatenate([t.logps for t in a]), np.concatenate([t.logps for t in b]), atol=1e-4)
    serving.update_params(train.params, version=1)  # from the train layout: laid out for serving again
    assert serving.params["layers"][0]["mlp"]["gate_proj"][...].sharding.spec == gate.sharding.spec
    assert serving.version == 1


def test_serving_layout_keeps_experts_over_fsdp():
    """Expert parallelism stays: expert weights keep their 'fsdp' split, everything else drops it."""
    from flax import nnx

    from rollverify_jax.models import Qwen3ForCausalLM, model_config

    mesh = mesh_lib.make_mesh((1, 4, 2))
    rules = mesh_lib.logical_axis_rules(tuple((n, "fsdp") if n == "experts" else (n, a)
                                              for n, a in mesh_lib.DEFAULT_RULES))
    state = nnx.state(nnx.eval_shape(lambda: Qwen3ForCausalLM(model_config("tiny_moe"), rngs=nnx.Rngs(0))))
    specs = mesh_lib.serving_specs(state, mesh, rules)
    moe = specs["layers"][1]["mlp"]
    assert moe["gate_proj"] == jax.sharding.PartitionSpec("fsdp", None, "tensor")
    assert moe["router"] == jax.sharding.PartitionSpec(None, None)
    assert specs["layers"][0]["mlp"]["gate_proj"] == jax.sharding.PartitionSpec(None, "tensor")


def test_unknown_serving_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="serving_layout"):
        EngineConfig(serving_layout="fsdp")
