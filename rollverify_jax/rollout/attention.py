"""Paged decode attention: a pure-jnp reference, a chunked online-softmax one, and the Pallas kernels.

All implementations take ``q`` already scaled by ``head_dim ** -0.5``, as the Pallas kernels expect. The
reference gathers every listed page of every sequence at once (``[Hkv, B, T, D]`` for K and for V, per layer):
fast on short tables, out of memory at a real context. 'chunked' and the Pallas kernels never hold more than
a block of pages per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "chunked", "pallas_tpu", "pallas_gpu")


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


def megacore_mode(num_kv_heads: int, batch: int) -> str | None:
    """How the TPU kernel splits over a chip's two TensorCores: by KV head when they divide by 2, else by
    sequence (None: neither divides; one core)."""
    return "kv_head" if num_kv_heads % 2 == 0 else "batch" if batch % 2 == 0 else None


def _pallas_tpu(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block, megacore=False):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    mode = megacore_mode(k_pages.shape[0], q.shape[0]) if megacore else None
    return paged_attention(q, k_pages, v_pages, lengths, page_table,
                           pages_per_compute_block=pages_per_compute_block, megacore_mode=mode)


def paged_attention_chunked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                            page_table: jax.Array, chunk_tokens: int = 2048) -> jax.Array:
    """The reference's result (up to float32 summation order) one block of pages at a time, with a running max
    and sum (online softmax, as flash decoding): O(B x block) memory instead of the whole gathered table.
    Shapes as the reference; ``chunk_tokens``: tokens per block (whole pages, at least one)."""
    b, hq, d = q.shape
    hkv, _, size, _ = k_pages.shape
    pages = page_table.shape[1]
    block = max(1, min(pages, chunk_tokens // size))
    n = -(-pages // block)
    # Padding columns point at page 0 (the scratch page) and lie past every length: masked.
    table = jnp.pad(page_table, ((0, 0), (0, n * block - pages))).reshape(b, n, block).transpose(1, 0, 2)
    qg = q.reshape(b, hkv, hq // hkv, d)
    low = jnp.finfo(jnp.float32).min

    def body(carry, xs):
        m, s, acc = carry  # running max [B, Hkv, G], sum [B, Hkv, G], numerator [B, Hkv, G, D] (float32)
        i, cols = xs
        k = k_pages[:, cols].reshape(hkv, b, block * size, d)
        v = v_pages[:, cols].reshape(hkv, b, block * size, d)
        scores = jnp.einsum("bhgd,hbtd->bhgt", qg, k, preferred_element_type=jnp.float32)
        mask = i * block * size + jnp.arange(block * size)[None, :] < lengths[:, None]  # [B, T]
        scores = jnp.where(mask[:, None, None], scores, low)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bhgt,hbtd->bhgd", p, v, preferred_element_type=jnp.float32)
        return (m_new, s * corr + p.sum(-1), acc * corr[..., None] + pv), None

    g = hq // hkv
    init = (jnp.full((b, hkv, g), low, jnp.float32), jnp.zeros((b, hkv, g), jnp.float32),
            jnp.zeros((b, hkv, g, d), jnp.float32))
    (_, s, acc), _ = jax.lax.scan(body, init, (jnp.arange(n), table))
    return (acc / s[..., None]).astype(q.dtype).reshape(b, hq, d)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gpu_kernel_fits(head_dim: int, page_size: int) -> bool:
    """Whether the Pallas GPU (Triton) kernel takes these shapes: Triton blocks are powers of two, and its
    matrix products need 16 or more along each side (head_dim; page_size x the block of pages)."""
    return _pow2(head_dim) and head_dim >= 16 and _pow2(page_size)


def _pallas_gpu(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block, block_tokens, interpret,
                float32_query):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    hkv, _, size, d = k_pages.shape
    if not gpu_kernel_fits(d, size):
        raise ValueError(f"The Pallas GPU paged attention needs head_dim a power of two >= 16 and a power-of-two "
                         f"page size; got head_dim={d}, page_size={size}. Use impl='chunked' (or 'auto').")
    pages = page_table.shape[1]
    # The kernel needs the table's width to be a multiple of its block (and of the splits), and Triton's blocks
    # are powers of two: the largest power of two up to the configured block (in pages, and in tokens: Triton
    # holds a block's K and V, and the next one's, in shared memory) that divides it (a 5-page live bucket runs
    # 5 x 1-page blocks).
    most = max(1, min(pages_per_compute_block, block_tokens // size, pages))
    block = max(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= most and pages % b == 0)
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages % (s * block) == 0)
    block_h = max(16, q.shape[1] // hkv)
    block_h = 1 << (block_h - 1).bit_length()  # a power of two (the kernel pads the q heads of a group to it)
    scales = {}
    if float32_query and q.dtype == jnp.float32 and k_pages.dtype != jnp.float32:
        # Unit K/V scales make the kernel cast each K/V block to the query's float32 before its products (its
        # path for quantized pages), so scores and probabilities stay float32 as in the reference and the
        # resume prefill: a bf16 query and bf16 probabilities put the OPS noise floor of the tiny policy at
        # 5e-3, half of ds (tests/gpu/check_gpu.py ops_floor, interpret mode). Cost: the scales' reads (4 bytes a
        # token per head against K's 2 x head_dim) and one [Hkv, P, S] float32 broadcast per step.
        ones = jnp.ones(k_pages.shape[:3], jnp.float32)
        scales = {"k_scales_pages": ones, "v_scales_pages": ones}
    else:  # Triton's products take one element type (it refuses a float32 query on bf16 pages)
        q = q.astype(k_pages.dtype)
    return paged_attention(q, k_pages, v_pages, page_table, lengths, **scales, block_h=block_h,
                           pages_per_compute_block=block, k_splits=k_splits, interpret=interpret)


def resolve_impl(impl: str, platform: str, head_dim: int, page_size: int, table_pages: int,
                 gpu_reference_max_tokens: int) -> str:
    """The implementation ``impl='auto'`` runs: on TPU the Pallas kernel (head_dim a multiple of 128, as in
    every Qwen3); on GPU the reference while the table holds at most ``gpu_reference_max_tokens`` tokens per
    sequence, then the Pallas GPU kernel (or 'chunked' for shapes Triton cannot tile); elsewhere (CPU) the
    reference."""
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "pallas_tpu" if head_dim % 128 == 0 else "reference"
    if platform == "gpu" and table_pages * page_size > gpu_reference_max_tokens:
        return "pallas_gpu" if gpu_kernel_fits(head_dim, page_size) else "chunked"
    return "reference"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, impl: str = "auto", pages_per_compute_block: int = 4,
                    interpret: bool = False, platform: str | None = None, megacore: bool = False,
                    gpu_reference_max_tokens: int = 512, gpu_block_tokens: int = 64,
                    gpu_float32_query: bool = True, chunk_tokens: int = 2048) -> jax.Array:
    """Dispatches paged decode attention. ``impl='auto'``: ``resolve_impl`` (the Pallas kernel on TPU; on GPU
    the reference on tables of at most ``gpu_reference_max_tokens`` tokens per sequence, where gathering them
    is cheap, and the Pallas GPU kernel above, which never gathers the table; the reference on CPU).
    ``gpu_block_tokens``: the most tokens in a block of the GPU kernel (64: the block that ran on an H200, 4 pages
    of 16 at head_dim 128); ``pages_per_compute_block`` caps it in pages too. ``gpu_float32_query``: a float32
    query stays float32 in the GPU kernel (K/V blocks cast up; False: everything in the pages' type, the
    kernel's fastest path). ``chunk_tokens``: the block of impl='chunked'. ``platform``: the one the program
    is compiled for (default: JAX's default backend; a deviceless TPU compile passes 'tpu'). ``megacore``: the
    chip has two TensorCores (v4, v5p) and the TPU kernel runs on both (``megacore_mode``); without it the
    kernel's grid runs on one of them."""
    if impl not in IMPLS:
        raise ValueError(f"Unknown paged attention impl {impl!r}; use one of {IMPLS}.")
    impl = resolve_impl(impl, platform or jax.default_backend(), q.shape[-1], k_pages.shape[2], page_table.shape[1],
                        gpu_reference_max_tokens)
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, lengths, page_table)
    if impl == "chunked":
        return paged_attention_chunked(q, k_pages, v_pages, lengths, page_table, chunk_tokens)
    # The kernels' matrix products take one element type (Triton refuses a float32 query on bf16 pages).
    qk = q.astype(k_pages.dtype)
    if impl == "pallas_tpu":
        out = _pallas_tpu(qk, k_pages, v_pages, lengths, page_table, pages_per_compute_block, megacore)
    else:
        out = _pallas_gpu(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block, gpu_block_tokens,
                          interpret, gpu_float32_query)
    return out.astype(q.dtype)
