"""Causal attention over a call's own tokens, for training and prefill: one entry, three implementations.

- 'reference': the jnp einsum with a dense mask (CPU, tests), causal by query blocks: block i of
  ``reference_block`` queries scores only the keys up to its own end, so the blocks above the diagonal are
  never computed (a third to a half of the work at 256-512 tokens). Its scores are ``O(T^2)`` memory, which
  at 20K-token rows does not fit any accelerator.
- 'splash': the Pallas TPU splash-attention kernel (flash attention with block sparsity: the causal and
  segment structure skips whole blocks), run per device inside ``shard_map`` because Mosaic kernels cannot be
  partitioned automatically. On CPU it runs in Pallas interpret mode, which is how the tests check it.
- 'cudnn': ``jax.nn.dot_product_attention`` with the cuDNN fused kernel (GPU; bf16/fp16 inputs, float32 ones take
  XLA's implementation of the same call). Packed rows pass their segment structure as a boolean mask.

Inputs follow the model's layout: q [B, T, Hq, D], k/v [B, T, Hkv, D] (grouped-query: Hq a multiple of Hkv),
``segments`` int32[B, T] (a query attends only to keys with its own id; padding gets an id of its own).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

IMPLS = ("auto", "reference", "splash", "cudnn")
_BATCH_AXES = ("data", "fsdp")  # the mesh's batch axes (infra.mesh.BATCH_AXES; models/ must not import it)


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """impl: 'auto' picks 'splash' on TPU, 'cudnn' on GPU and 'reference' elsewhere.
    block_q / block_kv: splash tile sizes (rows are padded to a multiple of their maximum).
    interpret: run the Pallas kernel in interpret mode (CPU; tests).
    reference_block: query rows per block of the reference's block-causal loop (rows up to this length are one
    block)."""

    impl: str = "auto"
    block_q: int = 512
    block_kv: int = 512
    interpret: bool = False
    reference_block: int = 128

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"FlashConfig.impl={self.impl!r}: use one of {IMPLS}.")
        if self.block_q < 128 or self.block_kv < 128 or self.block_q % 128 or self.block_kv % 128:
            raise ValueError(f"FlashConfig.block_q/block_kv must be multiples of 128, got {self.block_q}, "
                             f"{self.block_kv}.")
        if self.reference_block < 1:
            raise ValueError(f"FlashConfig.reference_block={self.reference_block} must be >= 1.")

    def resolved_impl(self, platform: str | None = None) -> str:
        if self.impl != "auto":
            return self.impl
        platform = platform or jax.default_backend()
        return {"tpu": "splash", "gpu": "cudnn"}.get(platform, "reference")


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with an explicit mask. q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; mask:
    bool[B, Tq, Tk] -> [B, Tq, Hq, D]."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # float32 into the PV product: see paged_attention_reference
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)
    return out.reshape(b, tq, hq, d)


def block_causal_reference(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                           block: int) -> jax.Array:
    """Causal (and per-segment) reference attention computed by query blocks: the queries in
    ``[start, start + block)`` score keys ``[0, start + block)`` only, since every later key is masked for them.
    Equal to the dense computation (the skipped scores would get softmax weight exactly 0)."""
    t = q.shape[1]
    mask = causal_mask(t, segments)
    if t <= block:
        return reference_attention(q, k, v, mask)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        outs.append(reference_attention(q[:, start:end], k[:, :end], v[:, :end], mask[:, start:end, :end]))
    return jnp.concatenate(outs, axis=1)


def causal_mask(t: int, segments: jax.Array | None) -> jax.Array:
    """bool[B or 1, T, T]: causal, and within one segment when ``segments`` [B, T] is given."""
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    return mask


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, heads: int, bq: int, bkv: int, interpret: bool):
    """A splash kernel for [heads, t, D] rows (built once per shape: the mask is processed on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * heads)
    with jax.ensure_compile_time_eval():  # its mask arrays are constants, never tracers of the caller's trace
        return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)


def _axes_that_divide(mesh: Mesh, axes: tuple[str, ...], dim: int) -> tuple[str, ...] | None:
    """The mesh axes among ``axes`` (size > 1) if their product divides ``dim``, else None (replicate)."""
    live = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
    size = 1
    for a in live:
        size *= mesh.shape[a]
    return live if live and dim % size == 0 else None


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, cfg: FlashConfig,
                     mesh: Mesh | None) -> jax.Array:
    """Splash attention per device: rows over the batch axes and heads over 'tensor' where they divide."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    b, t, hq, d = q.shape
    lanes = -(-t // 128) * 128  # blocks are multiples of 128; short rows use one block
    bq, bkv = min(cfg.block_q, lanes), min(cfg.block_kv, lanes)
    pad = -t % math.lcm(bq, bkv)
    tp = t + pad
    # Padding positions get an id no real token has, so they never mix with real ones.
    seg = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    qh, kh, vh = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).swapaxes(1, 2) for x in (q * d ** -0.5, k, v))

    def local(qh, kh, vh, seg):
        kernel = _splash_kernel(tp, qh.shape[1], bq, bkv, cfg.interpret)
        return jax.vmap(lambda a, b_, c, s: kernel(a, b_, c, segment_ids=SegmentIds(s, s)))(qh, kh, vh, seg)

    if mesh is not None and mesh.size > 1:
        rows = _axes_that_divide(mesh, _BATCH_AXES, b)
        heads = _axes_that_divide(mesh, ("tensor",), k.shape[2])
        head_spec = PartitionSpec(rows, heads, None, None)
        local = jax.shard_map(local, mesh=mesh, in_specs=(head_spec, head_spec, head_spec, PartitionSpec(rows)),
                              out_specs=head_spec, check_vma=False)
    out = local(qh, kh, vh, seg)  # [B, Hq, Tp, D]
    return out.swapaxes(1, 2)[:, :t].astype(q.dtype)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                    implementation: str | None = "cudnn") -> jax.Array:
    """``jax.nn.dot_product_attention`` (cuDNN's fused kernel on GPU; ``implementation=None`` lets XLA pick,
    which is how CPU tests run the same call)."""
    if segments is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]  # [B, 1, T, T]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


DEFAULT_FLASH = FlashConfig()  # the defaults, for callers given no spec (tests, benchmarks)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, impl: str,
                     cfg: FlashConfig = DEFAULT_FLASH, mesh: Mesh | None = None) -> jax.Array:
    """Causal (and per-segment) attention by ``impl`` ('reference' | 'splash' | 'cudnn'); same result."""
    if impl == "reference":
        return block_causal_reference(q, k, v, segments, cfg.reference_block)
    if impl == "splash":
        if segments is None:
            segments = jnp.zeros(q.shape[:2], jnp.int32)
        return splash_attention(q, k, v, segments, cfg, mesh)
    if impl == "cudnn":  # cuDNN's fused kernel takes fp16/bf16 only; float32 runs XLA's own attention
        return cudnn_attention(q, k, v, segments, "cudnn" if q.dtype in (jnp.bfloat16, jnp.float16) else "xla")
    raise ValueError(f"Unknown attention impl {impl!r}; use one of {IMPLS[1:]}.")
