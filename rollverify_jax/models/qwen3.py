"""Qwen3 (dense and MoE) in Flax NNX, numerically matching HF transformers' Qwen3/Qwen3-MoE.

Attention is a swappable callable ``attention(layer_idx, q, k, v) -> out`` so the rollout engine can plug
in paged KV-cache attention without touching the model. Every parameter carries ``logical_axes`` metadata;
``rollverify_jax.infra.mesh`` maps those names onto the device mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import flash_attention

Array = jax.Array

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any) -> jnp.dtype:
    """Accepts 'float32' / 'bfloat16' / a jnp dtype; fails with the known names otherwise."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.")
        return _DTYPES[dtype]
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a Qwen3 / Qwen3-MoE causal LM (field names follow HF ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    # MoE (num_experts == 0 means dense everywhere).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Numerics.
    param_dtype: str = "float32"
    dtype: str = "float32"
    # Execution (not architecture; the builder sets them from the run spec): the logical-axis rules the weights
    # are laid out by (``mesh.logical_axis_rules``' pairs; empty: its defaults), and the tokens per device of one
    # expert-parallel exchange (``expert_parallel_chunk``).
    axis_rules: tuple = ()
    expert_parallel_chunk: int = 4096

    def rules(self) -> dict[str, tuple[str, ...]]:
        """The logical-axis rules as ``mesh.logical_to_spec`` takes them."""
        return mesh_lib.logical_axis_rules(self.axis_rules) if self.axis_rules else mesh_lib.logical_axis_rules()

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]."
            )
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        resolve_dtype(self.param_dtype)
        resolve_dtype(self.dtype)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """HF's rule: MoE block unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **kw) -> Qwen3Config:
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * hd + 2 * h
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_hidden_layers):
            if self.is_sparse_layer(i):
                mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp
        return total


PRESETS: dict[str, Qwen3Config] = {
    # The embedded default (~1-2M parameters); the tokenizer under assets/ decides the real vocab size.
    "tiny": Qwen3Config(
        vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "tiny_moe": Qwen3Config(
        vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=(0,),
    ),
    # ~100M parameters, for benchmarks.
    "bench_100m": Qwen3Config(
        vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
    ),
    "qwen3_0_6b": Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3_4b": Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "qwen3_8b": Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    ),
    "qwen3_30b_a3b": Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
}


def model_config(preset: str = "tiny", param_dtype: str = "float32", dtype: str = "float32",
                 **overrides) -> Qwen3Config:
    """A preset architecture by name, with dtype and field overrides (all bindable from gin): the random-init
    policy's (``TrainConfig.policy_path = None``) and the layout a dry run sizes when the checkpoint is absent.

    preset: a name in ``PRESETS`` ('tiny', 'qwen3_4b', 'qwen3_8b', 'qwen3_30b_a3b', ...). param_dtype, dtype: the
    params' and the activations' dtypes. overrides: any ``Qwen3Config`` field, e.g. ``num_hidden_layers``.
    """
    if preset not in PRESETS:
        raise ValueError(f"Unknown model preset {preset!r}; known presets: {sorted(PRESETS)}.")
    return PRESETS[preset].replace(param_dtype=param_dtype, dtype=dtype, **overrides)


# ----------------------------------------------------------------------------------------------------
# Pieces


def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str | None, ...], dtype, std: float = 0.02,
           init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def dense(x: Array, w: Array) -> Array:
    """x [..., I] @ w [I, O] -> [..., O], written as the einsum LoRA's interception (qwix) adapts."""
    return jnp.einsum("...i,io->...o", x, w)


class RMSNorm(nnx.Module):
    """y = w * x / rms(x), computed in float32 and rounded to the compute dtype once.

    HF rounds x / rms(x) first and multiplies in the compute dtype (two roundings); XLA kept or dropped the middle
    rounding depending on the shape it fused, so in bf16 the prefill ([n, T]) and decode ([S, 1]) of the same
    tokens got different norms, one cause of the gap between a resume's log pi and the recorded log mu
    (tests/gpu/bench_ops_floor.py). One rounding is the same in every fusion; float32 is unchanged."""

    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = _param(rngs, (dim,), ("norm",), param_dtype, init="ones")

    def __call__(self, x: Array) -> Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * x32).astype(dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """positions: int32[B, T] -> cos, sin: float32[B, T, head_dim] (HF's non-interleaved layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [B, T, H, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class AttentionFn(Protocol):
    """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] (rotated) -> out [B, T, Hq, D]."""

    def __call__(self, layer_idx: int, q: Array, k: Array, v: Array) -> Array: ...


@dataclasses.dataclass
class CausalAttention:
    """Dense causal attention over the call's own tokens (training, prefill, teacher-forced scoring).

    ``valid``: bool[B, T] masks padding keys. ``segments``: int32[B, T] for packed rows (several sequences
    per row, ids 1, 2, ..., 0 on padding): a query attends only to keys of its own segment. ``impl`` picks the
    implementation (`flash_attention.IMPLS`: the jnp reference, Pallas splash on TPU, cuDNN on GPU); the
    kernels run per device on ``mesh``. Every implementation gives the same outputs at real positions.
    """

    valid: Array | None = None
    segments: Array | None = None
    impl: str = "reference"
    flash: flash_attention.FlashConfig = flash_attention.DEFAULT_FLASH
    mesh: Any = None

    def __call__(self, layer_idx: int, q: Array, k: Array, v: Array) -> Array:
        segments = self.segments
        if self.valid is not None:  # padding keys become a segment of their own, which real queries never see
            base = jnp.ones(q.shape[:2], jnp.int32) if segments is None else segments
            segments = jnp.where(self.valid, base, -2)
        return flash_attention.causal_attention(q, k, v, segments, self.impl, self.flash, self.mesh)


dot_product_attention = flash_attention.reference_attention


class Attention(nnx.Module):
    DENSE_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the weights it applies with `dense` (LoRA's targets)

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        h, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.cfg = cfg
        self.q_proj = _param(rngs, (h, nq * hd), ("embed", "q_heads"), pd)
        self.k_proj = _param(rngs, (h, nkv * hd), ("embed", "kv_heads"), pd)
        self.v_proj = _param(rngs, (h, nkv * hd), ("embed", "kv_heads"), pd)
        self.o_proj = _param(rngs, (nq * hd, h), ("q_heads", "embed"), pd)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (nq * hd,), ("q_heads",), pd, init="zeros")
            self.k_bias = _param(rngs, (nkv * hd,), ("kv_heads",), pd, init="zeros")
            self.v_bias = _param(rngs, (nkv * hd,), ("kv_heads",), pd, init="zeros")
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)

    def _project(self, x: Array, name: str, heads: int) -> Array:
        dt = x.dtype
        y = dense(x, getattr(self, f"{name}_proj")[...].astype(dt))
        if self.cfg.attention_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dt)
        return y.reshape(*x.shape[:2], heads, self.cfg.head_dim)

    def __call__(self, layer_idx: int, x: Array, cos: Array, sin: Array, attention: AttentionFn) -> Array:
        cfg = self.cfg
        q = apply_rope(self.q_norm(self._project(x, "q", cfg.num_attention_heads)), cos, sin)
        k = apply_rope(self.k_norm(self._project(x, "k", cfg.num_key_value_heads)), cos, sin)
        v = self._project(x, "v", cfg.num_key_value_heads)
        out = attention(layer_idx, q, k, v)
        return dense(out.reshape(*x.shape[:2], -1), self.o_proj[...].astype(x.dtype))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    DENSE_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # the weights it applies with `dense` (LoRA's targets)

    def __init__(self, hidden: int, inner: int, *, param_dtype, rngs: nnx.Rngs):
        self.gate_proj = _param(rngs, (hidden, inner), ("embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (hidden, inner), ("embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (inner, hidden), ("mlp", "embed"), param_dtype)

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        h = jax.nn.silu(dense(x, self.gate_proj[...].astype(dt))) * dense(x, self.up_proj[...].astype(dt))
        return dense(h, self.down_proj[...].astype(dt))


def expert_parallel_chunk(tokens: int = 4096) -> int:
    """Tokens per device per expert-parallel exchange (gin: ``expert_parallel_chunk.tokens``). Each exchange
    all-gathers ``tokens`` x the expert-parallel size rows and sorts them x top-k: the chunk bounds that buffer at
    any sequence length."""
    if tokens < 1:
        raise ValueError(f"expert_parallel_chunk.tokens must be >= 1, got {tokens}.")
    return tokens


class SparseMoE(nnx.Module):
    """Qwen3-MoE block: softmax router, top-k experts, optional renormalised top-k weights.

    Tokens are sorted by expert and run through ``jax.lax.ragged_dot`` so compute scales with top-k,
    not with the number of experts. Dropless everywhere (no capacity factor): a dropped token would change pi
    against mu, the quantity verification measures.
    """

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = _param(rngs, (h, e), ("embed", "experts"), pd)
        self.gate_proj = _param(rngs, (e, h, i), ("experts", "embed", "expert_mlp"), pd)
        self.up_proj = _param(rngs, (e, h, i), ("experts", "embed", "expert_mlp"), pd)
        self.down_proj = _param(rngs, (e, i, h), ("experts", "expert_mlp", "embed"), pd)

    def __call__(self, x: Array, mesh=None) -> tuple[Array, Array]:
        """x: [B, T, H] -> (out [B, T, H], router_logits float32[B, T, E]).

        With a ``mesh`` the block runs in ``shard_map``: each device routes its own rows' tokens. The expert
        weights keep the layout the logical-axis rules give them (``mesh.logical_axis_rules``):
        - 'expert_mlp' over 'tensor' (the default): each device computes its share of every expert's inner
          dimension; the outputs are summed after the down projection;
        - 'experts' over mesh axes (expert parallelism, e.g. ``('experts', 'fsdp')``): each device holds
          E / n experts and never gathers the others. Over an axis that also splits the rows, a chunk of each
          device's tokens is all-gathered along it, every device runs the tokens routed to its own experts, and
          the outputs are reduce-scattered back to the rows they came from; over an axis that does not split
          the rows, the tokens are already there and the outputs are summed. Exact: no token is dropped.
        Without a mesh the token sort is global, which XLA cannot split: at real scale every device would hold
        every token.
        """
        dt = x.dtype
        weights = (self.router[...].astype(dt), self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt),
                   self.down_proj[...].astype(dt))
        if mesh is None or mesh.size == 1:
            flat = x.reshape(-1, x.shape[-1])
            logits, top_e, top_w = self._routing(flat, weights[0])
            out = _expert_mlps(flat, top_e, top_w, *weights[1:], first_expert=0)
            return out.reshape(x.shape), logits.reshape(*x.shape[:2], -1)
        gate_spec = mesh_lib.logical_to_spec(self.gate_proj.get_metadata()["logical_axes"],
                                             self.gate_proj.shape, mesh, self.cfg.rules())
        ep, inner = _as_axes(gate_spec[0]), _as_axes(gate_spec[2])
        rows = _axes_dividing(mesh, mesh_lib.BATCH_AXES, x.shape[0]) or ()
        gathered = tuple(a for a in ep if a in rows)  # tokens split here: all-gather, then reduce-scatter
        summed = tuple(a for a in ep if a not in rows) + inner  # tokens already whole here: sum the outputs
        chunk = expert_parallel_chunk(self.cfg.expert_parallel_chunk)

        def local(x, router, gate, up, down):
            b, t, h = x.shape
            flat = x.reshape(-1, h)
            logits, top_e, top_w = self._routing(flat, router)
            first = jax.lax.axis_index(ep) * gate.shape[0] if ep else 0
            if gathered:
                out = _exchanged_expert_mlps(flat, top_e, top_w, gate, up, down, first, gathered, chunk)
            else:
                out = _expert_mlps(flat, top_e, top_w, gate, up, down, first_expert=first)
            if summed:
                out = jax.lax.psum(out, summed)
            return out.reshape(b, t, h), logits.reshape(b, t, -1)

        P = jax.sharding.PartitionSpec
        row = P(rows or None, None, None)
        ep_spec, inner_spec = ep or None, inner or None
        return jax.shard_map(
            local, mesh=mesh,
            in_specs=(row, P(), P(ep_spec, None, inner_spec), P(ep_spec, None, inner_spec),
                      P(ep_spec, inner_spec, None)),
            out_specs=(row, row), check_vma=False)(x, *weights)

    def _routing(self, flat: Array, router: Array) -> tuple[Array, Array, Array]:
        """flat [N, H] -> (router logits float32[N, E], top-k experts int32[N, k], their weights [N, k])."""
        cfg = self.cfg
        router_logits = (flat @ router).astype(jnp.float32)
        probs = jax.nn.softmax(router_logits, axis=-1)
        top_w, top_e = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        if cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        return router_logits, top_e, top_w.astype(flat.dtype)


def _expert_mlps(flat: Array, top_e: Array, top_w: Array, gate_w: Array, up_w: Array, down_w: Array,
                 first_expert) -> Array:
    """The routed SwiGLU MLPs of the experts held here, ``first_expert`` .. + len(gate_w), summed per token with
    the router's weights: flat [N, H], top_e/top_w [N, k] -> [N, H]. Assignments to other experts sort last,
    beyond the ragged groups, and contribute nothing."""
    n, k = top_e.shape
    held = gate_w.shape[0]
    local = top_e.reshape(-1) - first_expert  # [N*k]
    mine = (local >= 0) & (local < held)
    key = jnp.where(mine, local, held)
    order = jnp.argsort(key, stable=True)
    token_of = order // k
    xs = flat[token_of]  # [N*k, H] sorted by expert
    sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    gate = jax.lax.ragged_dot(xs, gate_w, sizes)
    up = jax.lax.ragged_dot(xs, up_w, sizes)
    ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_w, sizes)
    ys = ys * jnp.where(mine, top_w.reshape(-1), 0).astype(ys.dtype)[order][:, None]
    return jnp.zeros_like(flat).at[token_of].add(ys)


def _exchanged_expert_mlps(flat: Array, top_e: Array, top_w: Array, gate_w: Array, up_w: Array, down_w: Array,
                           first_expert, axes: tuple[str, ...], chunk: int) -> Array:
    """Expert parallelism across ``axes``, which split the tokens: chunk by chunk, every device's tokens (and
    their routing) are all-gathered, each device runs those routed to its experts, and the partial outputs are
    reduce-scattered back to their own device. flat [N, H] -> [N, H]. Each chunk is rematerialised, so the
    backward pass keeps only the chunk inputs."""
    n, h = flat.shape
    c = min(chunk, n)
    pad = -n % c

    def split(a):
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(-1, c, *a.shape[1:])

    @jax.checkpoint
    def one_chunk(_, xs):
        xc, ec, wc = (jax.lax.all_gather(a, axes, tiled=True) for a in xs)
        yc = _expert_mlps(xc, ec, wc, gate_w, up_w, down_w, first_expert)
        return None, jax.lax.psum_scatter(yc, axes, scatter_dimension=0, tiled=True)

    _, out = jax.lax.scan(one_chunk, None, (split(flat), split(top_e), split(top_w)))  # zero-weight padding
    return out.reshape(-1, h)[:n]


def _as_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry as a tuple of mesh axes (None: ())."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _axes_dividing(mesh, axes: tuple[str, ...], dim: int) -> tuple[str, ...] | None:
    """The mesh axes among ``axes`` (size > 1) if their product divides ``dim``, else None (replicated)."""
    live = tuple(a for a in axes if mesh.shape[a] > 1)
    size = 1
    for a in live:
        size *= mesh.shape[a]
    return live if live and dim % size == 0 else None


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int, *, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.is_sparse = cfg.is_sparse_layer(layer_idx)
        if self.is_sparse:
            self.mlp = SparseMoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, param_dtype=pd, rngs=rngs)

    def __call__(self, x, cos, sin, attention: AttentionFn, mesh=None) -> tuple[Array, Array | None]:
        x = x + self.self_attn(self.layer_idx, self.input_layernorm(x), cos, sin, attention)
        h = self.post_attention_layernorm(x)
        if self.is_sparse:
            h, router_logits = self.mlp(h, mesh)
        else:
            h, router_logits = self.mlp(h), None
        return x + h, router_logits


class Qwen3ForCausalLM(nnx.Module):
    """``model(tokens int32[B, T]) -> logits float32[B, T, V]`` (causal, teacher-forced)."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)

    def hidden_states(self, tokens: Array, positions: Array | None = None, attention: AttentionFn | None = None,
                      remat: str = "none", mesh=None, scan: bool = False) -> tuple[Array, list[Array]]:
        """tokens: int32[B, T] -> (final-normed hidden [B, T, H], router logits of the MoE layers).

        remat: what each decoder layer keeps for the backward pass (`REMAT_POLICIES`): 'none' keeps every
        activation; 'full' keeps only the layer's input and recomputes the rest; 'dots' keeps the matmul
        outputs that have no batch dimension. Values and gradients are the same; memory and FLOPs are not.
        mesh: the device mesh the call is sharded on; MoE layers then route each device's own tokens.
        scan: run each run of identical consecutive layers as one ``lax.scan`` over their stacked weights
            instead of unrolled. Same values; it bounds what XLA keeps live to one layer: unrolled, the scheduler
            hoists every layer's weight all-gathers and rematerialised activations to the start of the backward
            pass. Only for attention that ignores the layer index (training's ``CausalAttention``); the
            rollout engine indexes its KV pages by layer and runs unrolled.
        """
        cfg = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        attention = attention if attention is not None else CausalAttention()
        x = self.embed_tokens[...][tokens].astype(resolve_dtype(cfg.dtype))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        router_logits = []
        if remat not in REMAT_POLICIES:
            raise ValueError(f"Unknown remat policy {remat!r}; known: {list(REMAT_POLICIES)}.")

        def run_layer(layer, x):
            return layer(x, cos, sin, attention, mesh)

        carry = _carry_sharding(mesh, cfg.rules(), x.shape)
        if scan:
            for run in _runs_of_identical_layers(self.layers):
                x, rls = _scan_layers(run, x, run_layer, REMAT_POLICIES[remat], carry)
                router_logits.extend(rls)
            return self.norm(x), router_logits
        if remat != "none":
            run_layer = nnx.remat(run_layer, policy=REMAT_POLICIES[remat])
        for layer in self.layers:
            x, rl = run_layer(layer, x)
            if carry is not None:  # the engine's forward: each layer's output split like the scan's carry
                x = jax.lax.with_sharding_constraint(x, carry)
            if rl is not None:
                router_logits.append(rl)
        return self.norm(x), router_logits

    def output_weights(self) -> Array:
        """The [H, V] matrix that turns final hidden states into logits (tied to the embedding or not)."""
        return self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits_from_hidden(self, h: Array) -> Array:
        return logits_from_hidden(h, self.output_weights())

    def __call__(self, tokens: Array, positions: Array | None = None, attention: AttentionFn | None = None,
                 return_router_logits: bool = False, remat: str = "none"):
        h, router_logits = self.hidden_states(tokens, positions, attention, remat)
        logits = self.logits_from_hidden(h)
        return (logits, router_logits) if return_router_logits else logits


def _runs_of_identical_layers(layers) -> list[list[DecoderLayer]]:
    """Consecutive layers of the same kind (dense or MoE): each run has one structure and can be scanned."""
    runs: list[list[DecoderLayer]] = []
    for layer in layers:
        if runs and runs[-1][0].is_sparse == layer.is_sparse:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _carry_sharding(mesh, rules: dict[str, tuple[str, ...]], shape: tuple[int, ...]) -> NamedSharding | None:
    """The layout of the residual stream between layers when the rules split 'sequence' (its positions) over a
    mesh axis, else None (XLA's choice, replicated over 'tensor'). Split, each layer's saved input (the train
    step's scan) and each layer's output the unrolled forward keeps (the engine's prefill) take 1/tensor of the
    [rows, T, hidden] a chip held: at 22,528 tokens 22 MiB a layer instead of 176 on a tensor axis of 8."""
    if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh) or not rules.get("sequence"):
        return None
    spec = mesh_lib.logical_to_spec(("batch", "sequence", None), shape, mesh, rules)
    # positions that do not divide over the axis (a decode step's one) stay as XLA lays them out
    return NamedSharding(mesh, spec) if any(spec) else None


def _scan_layers(layers: list[DecoderLayer], x: Array, run_layer, policy,
                 carry: NamedSharding | None = None) -> tuple[Array, list[Array]]:
    """``run_layer`` over ``layers`` as one scan over their stacked weights (each step rematerialised under
    ``policy`` when given) -> (x, the router logits of each MoE layer). ``carry``: the layout of ``x`` between
    layers (what the backward pass keeps of each layer; None: unconstrained). Same values either way."""
    graphdef, first = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), first, *(nnx.split(layer)[1] for layer in layers[1:]))

    def layer(x, state):
        return run_layer(nnx.merge(graphdef, state), x)

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    if carry is None:
        body = layer
    else:
        def body(x, state):
            # Laid out before the rematerialised layer: its input, what the backward pass keeps, is the split one.
            y, rl = layer(jax.lax.with_sharding_constraint(x, carry), state)
            return jax.lax.with_sharding_constraint(y, carry), rl
    x, rls = jax.lax.scan(body, x, stacked)
    return x, [] if rls is None else list(rls)


REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def logits_from_hidden(h: Array, w: Array) -> Array:
    """h [..., H] @ w [H, V] -> float32 logits [..., V] (accumulated in float32 whatever the compute dtype)."""
    return jnp.einsum("...h,hv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def init_model(cfg: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(params=seed))


def token_logprobs(logits: Array, targets: Array, temperature: float = 1.0) -> Array:
    """log softmax(logits / T)[targets]. logits: float32[..., V]; targets: int32[...] -> float32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]



def at_tokens(x: Array, targets: Array) -> Array:
    """``x[..., targets]`` for x [..., V] and targets int[...] -> [...]. A masked sum rather than a gather: it
    partitions cleanly over a sharded vocab axis, and, unlike a one-hot matmul, stays exact float32 on TPU (no bf16
    matmul passes)."""
    return jnp.sum(jnp.where(targets[..., None] == jnp.arange(x.shape[-1], dtype=targets.dtype), x, 0.0), axis=-1)


def score_tokens(z: Array, targets: Array) -> tuple[Array, Array]:
    """z float32[..., V] (logits / T), targets int32[...] -> (log-prob of each target, entropy of pi) [...].

    The entropy is a metric only, so it is computed on stop-gradient'ed logits and adds no backward cost.
    """
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = at_tokens(z, targets) - lse
    zs, lses = jax.lax.stop_gradient(z), jax.lax.stop_gradient(lse)
    entropy = lses - jnp.sum(jax.nn.softmax(zs, axis=-1) * zs, axis=-1)
    return logp, entropy


def chunked_scores(hidden: Array, w: Array, targets: Array, temperature: float, chunk: int) -> tuple[Array, Array]:
    """`score_tokens` of the logits ``hidden`` [B, N, H] @ ``w`` [H, V] for ``targets`` [B, N], ``chunk``
    positions at a time: each chunk's [B, chunk, V] logits are rematerialised in the backward pass, so no
    [B, N, V] array is ever live (at real vocabularies and lengths it would not fit). -> ([B, N], [B, N])."""
    b, n, _ = hidden.shape
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n_chunks, chunk, -1).swapaxes(0, 1)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(xs):
        hc, yc = xs
        return score_tokens(logits_from_hidden(hc, w) / temperature, yc)

    logp, entropy = jax.lax.map(one, (h, y))  # [n_chunks, B, chunk]
    return tuple(x.swapaxes(0, 1).reshape(b, -1)[:, :n] for x in (logp, entropy))
