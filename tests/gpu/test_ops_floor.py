"""OPS noise floor: with unchanged weights, a resume's log pi must match decode's recorded log mu far below the
segment threshold ds, or verification cuts on-policy tokens (bench_ops_floor.py here measures it at length)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollverify_jax.models import init_model, model_config
from rollverify_jax.models.qwen3 import CausalAttention
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig
from rollverify_jax.rollout import engine as engine_lib

SLOTS, NEW, CHUNK = 8, 48, 16


@pytest.fixture(scope="module")
def floor():
    import bench_ops_floor  # a sibling harness module (tests/gpu/ is on sys.path under pytest)

    return bench_ops_floor


def _measure(floor, param: str, compute: str, kv: str) -> dict:
    model = init_model(model_config("tiny", param_dtype=param, dtype=compute), seed=0)
    return floor.measure(model, kv, SLOTS, NEW, (None, CHUNK))


def test_float32_floor_is_rounding_noise(floor):
    res = _measure(floor, "float32", "float32", "float32")
    for chunk in (None, CHUNK):
        assert res[chunk]["tokens"] == SLOTS * NEW
        assert res[chunk]["token_max"] < 1e-4, res[chunk]


@pytest.mark.parametrize("param,compute,kv,bound", [
    ("bfloat16", "bfloat16", "bfloat16", 1e-3),  # the shipped configs' dtypes: ds / 10
    ("float32", "float32", "bfloat16", 1e-4),  # the prefill attends over the K/V rounded as decode reads them
])
def test_bf16_floor_far_below_ds(floor, param, compute, kv, bound):
    res = _measure(floor, param, compute, kv)
    for chunk in (None, CHUNK):
        assert res[chunk]["segment_mean"] < bound, res[chunk]
        assert res[chunk]["segments_cut"] == 0


def _teacher_forced(model, compute_dtype: str, trajs, width: int) -> list[np.ndarray]:
    """log-probs of each trajectory's tokens from one full causal forward of ``model``'s (bf16) params with
    ``compute_dtype`` activations, K/V rounded to bf16 as the engine's cache stores them."""
    graphdef, dense = engine_lib.rollout_graphdef(model, compute_dtype), CausalAttention()

    def attention(layer, q, k, v):
        return dense(layer, q, k.astype(jnp.bfloat16).astype(k.dtype), v.astype(jnp.bfloat16).astype(v.dtype))
    fwd = jax.jit(lambda state, x: jax.nn.log_softmax(nnx.merge(graphdef, state)(x, attention=attention), -1))
    out = []
    for t in trajs:
        seq = np.zeros((1, width), np.int32)
        seq[0, : len(t.prompt) + t.num_tokens] = np.concatenate([t.prompt, t.tokens])
        logp = np.asarray(fwd(nnx.state(model), seq)[0])
        out.append(logp[len(t.prompt) - 1 + np.arange(t.num_tokens), t.tokens])
    return out


def test_float32_rollout_activations_over_bf16_weights(floor):
    """EngineConfig.compute_dtype = 'float32' on a bf16 model (the shipped configs' params and KV): the weights
    and the KV cache stay bf16, the engine's programs run float32 activations, and the floor falls from bf16's
    (< ds / 10 above) to float32-activation noise. Decode's log mu is a float32-activation teacher-forced forward's
    (the bf16-activation one is far off)."""
    with pytest.raises(ValueError, match=r"EngineConfig.compute_dtype='fp32'.*'float32', 'bfloat16'"):
        EngineConfig(compute_dtype="fp32")
    model = init_model(model_config("tiny", param_dtype="bfloat16", dtype="bfloat16"), seed=0)
    reqs = floor.requests(SLOTS, NEW, model.cfg.vocab_size)
    width = -(-(max(len(r.prompt) for r in reqs) + NEW) // 64) * 64  # measure()'s context
    cfg = EngineConfig(num_slots=SLOTS, page_size=16, max_seq_len=width, steps_per_dispatch=8, kv_dtype="bfloat16",
                       compute_dtype="float32")
    engine = Engine(model, cfg, SamplingConfig(temperature=1.0))
    assert engine.compute_dtype == "float32" and model.cfg.dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    assert engine.state.pages.k[0].dtype == jnp.bfloat16
    trajs = floor.decode(engine, reqs)
    res = floor.summarize(floor.resume_ops(engine, trajs))
    assert res["tokens"] == SLOTS * NEW and res["segment_mean"] < 1e-4, res
    err = {dtype: max(np.abs(np.asarray(t.logps) - ref).max()
                      for t, ref in zip(trajs, _teacher_forced(model, dtype, trajs, width), strict=True))
           for dtype in ("float32", "bfloat16")}
    assert err["float32"] < 5e-4 and err["bfloat16"] > 10 * err["float32"], err
