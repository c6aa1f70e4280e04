"""Paged decode attention: a pure-jnp reference (CPU/GPU) and the Pallas kernels (TPU, optional GPU).

All implementations take ``q`` already scaled by ``head_dim ** -0.5``, as the Pallas kernels expect.
"""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                              page_table: jax.Array) -> jax.Array:
    """q: [B, Hq, D]; k/v_pages: [Hkv, P, S, D]; lengths: int32[B]; page_table: int32[B, pages_per_seq].

    Gathers each sequence's pages and attends over its first ``lengths[b]`` tokens -> [B, Hq, D] in q's dtype.
    """
    b, hq, d = q.shape
    hkv, _, size, _ = k_pages.shape
    k = k_pages[:, page_table].reshape(hkv, b, -1, d)  # [Hkv, B, T, D]
    v = v_pages[:, page_table].reshape(hkv, b, -1, d)
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,hbtd->bhgt", qg, k, preferred_element_type=jnp.float32)
    mask = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, T]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    # float32 probabilities into the PV product, as the prefill's reference: rounding them to bf16 is one more
    # rounding per key, where the two paths' float32 sums (over different key counts) round apart.
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgt,hbtd->bhgd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(b, hq, d)


def _pallas_tpu(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, k_pages, v_pages, lengths, page_table,
                           pages_per_compute_block=pages_per_compute_block)


def _pallas_gpu(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block, interpret):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pages = page_table.shape[1]
    # The kernel needs the table's width to be a multiple of its block (and of the splits): the largest block
    # up to the configured one that divides it (a 5-page live bucket runs 5 x 1-page blocks).
    block = max(b for b in range(1, min(pages_per_compute_block, pages) + 1) if pages % b == 0)
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages % (s * block) == 0)
    block_h = max(16, q.shape[1] // k_pages.shape[0])
    return paged_attention(q, k_pages, v_pages, page_table, lengths, block_h=block_h,
                           pages_per_compute_block=block, k_splits=k_splits, interpret=interpret)


@gin.configurable
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, impl: str = "auto", pages_per_compute_block: int = 4,
                    interpret: bool = False, platform: str | None = None) -> jax.Array:
    """Dispatches paged decode attention. ``impl='auto'``: the Pallas kernel on TPU (head_dim a multiple of
    128, as in every Qwen3), the reference elsewhere (the GPU Pallas kernel is opt-in with
    ``impl='pallas_gpu'``). ``platform``: the one the program is compiled for (default: JAX's default
    backend; a deviceless TPU compile passes 'tpu')."""
    if impl not in IMPLS:
        raise ValueError(f"Unknown paged attention impl {impl!r}; use one of {IMPLS}.")
    if impl == "auto":  # the TPU kernel tiles head_dim by 128 lanes; other head sizes take the reference
        tpu = (platform or jax.default_backend()) == "tpu" and q.shape[-1] % 128 == 0
        impl = "pallas_tpu" if tpu else "reference"
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, lengths, page_table)
    # The kernels' matrix products take one element type (Triton refuses a float32 query on bf16 pages).
    qk = q.astype(k_pages.dtype)
    if impl == "pallas_tpu":
        out = _pallas_tpu(qk, k_pages, v_pages, lengths, page_table, pages_per_compute_block)
    else:
        out = _pallas_gpu(qk, k_pages, v_pages, lengths, page_table, pages_per_compute_block, interpret)
    return out.astype(q.dtype)
