"""Paged decode attention: reference vs dense attention, and the GPU Pallas kernel in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.models.qwen3 import dot_product_attention
from rollverify_jax.rollout.attention import paged_attention, paged_attention_reference


def _paged_case(seed=0, b=3, hq=8, hkv=2, d=16, page=4, pages_per_seq=4, num_pages=16):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, page * pages_per_seq + 1, size=b).astype(np.int32)
    perm = rng.permutation(np.arange(1, num_pages))[: b * pages_per_seq].reshape(b, pages_per_seq)
    k_pages = rng.normal(size=(hkv, num_pages, page, d)).astype(np.float32)
    v_pages = rng.normal(size=(hkv, num_pages, page, d)).astype(np.float32)
    q = rng.normal(size=(b, hq, d)).astype(np.float32)
    return q, k_pages, v_pages, lengths, perm.astype(np.int32)


def _dense(q, k_pages, v_pages, lengths, table):
    b, _, d = q.shape
    k = np.stack([np.concatenate(list(k_pages[:, table[i]].transpose(1, 0, 2, 3)), axis=1) for i in range(b)])
    v = np.stack([np.concatenate(list(v_pages[:, table[i]].transpose(1, 0, 2, 3)), axis=1) for i in range(b)])
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, T, Hkv, D]
    mask = (np.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, :]
    out = dot_product_attention(jnp.asarray(q)[:, None] * d**0.5, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    return np.asarray(out[:, 0])


def test_reference_matches_dense_attention():
    case = _paged_case()
    got = np.asarray(paged_attention_reference(*map(jnp.asarray, case)))
    np.testing.assert_allclose(got, _dense(*case), atol=1e-5)


@pytest.mark.parametrize("pages_per_seq", [4, 5])  # 5: no block of 2 divides the table; the kernel takes 1s
def test_gpu_pallas_kernel_interpret_matches_reference(pages_per_seq):
    q, k, v, lengths, table = _paged_case(seed=1, b=2, hq=16, hkv=1, d=16, page=4, pages_per_seq=pages_per_seq)
    want = np.asarray(paged_attention_reference(q, k, v, lengths, table))
    got = paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jnp.asarray(table),
                          impl="pallas_gpu", pages_per_compute_block=2, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def test_auto_uses_reference_off_tpu_and_unknown_impl_fails():
    case = tuple(map(jnp.asarray, _paged_case(seed=2)))
    if jax.default_backend() != "tpu":
        np.testing.assert_array_equal(np.asarray(paged_attention(*case)), np.asarray(paged_attention_reference(*case)))
    with pytest.raises(ValueError, match="Unknown paged attention impl"):
        paged_attention(*case, impl="flash")


@pytest.mark.parametrize("float32_query", [False, True])
def test_gpu_pallas_kernel_gets_one_element_type_for_a_float32_query_on_bf16_pages(monkeypatch, float32_query):
    """On a GPU, Triton refuses a float32 query against bf16 pages (the interpreter here would accept it): the
    dispatcher hands the kernel the pages' type, or (gpu_float32_query) keeps the query float32 and passes unit
    K/V scales, with which the kernel casts each K/V block to float32 itself. The result is the query's type;
    the float32 query matches the reference's float32 scores (bf16 query and probabilities do not)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

    real = gpu_kernel.paged_attention

    def strict(q, k_pages, *args, **kwargs):
        scales = kwargs.get("k_scales_pages")
        assert q.dtype == k_pages.dtype or (scales is not None and q.dtype == jnp.float32), (q.dtype, k_pages.dtype)
        if scales is not None:
            np.testing.assert_array_equal(np.asarray(scales), 1.0)
        return real(q, k_pages, *args, **kwargs)
    monkeypatch.setattr(gpu_kernel, "paged_attention", strict)
    q, k, v, lengths, table = _paged_case(seed=1, b=2, hq=16, hkv=1, d=16, page=4, pages_per_seq=4)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    want = np.asarray(paged_attention_reference(jnp.asarray(q), kb, vb, lengths, table))
    got = paged_attention(jnp.asarray(q), kb, vb, jnp.asarray(lengths), jnp.asarray(table), impl="pallas_gpu",
                          pages_per_compute_block=2, interpret=True, gpu_float32_query=float32_query)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 if float32_query else 3e-2)
    if not float32_query:
        assert np.abs(np.asarray(got) - want).max() > 1e-4  # the bf16 path's rounding is visible


def _numpy_attention(q, k_pages, v_pages, lengths, table):
    """float64 ground truth: each sequence's first ``lengths[b]`` tokens gathered from its pages, GQA groups."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    out = np.zeros((b, hq, d))
    for i in range(b):
        k = k_pages[:, table[i]].reshape(hkv, -1, d)[:, : lengths[i]]  # [Hkv, L, D]
        v = v_pages[:, table[i]].reshape(hkv, -1, d)[:, : lengths[i]]
        qg = q[i].reshape(hkv, hq // hkv, d)
        s = np.einsum("hgd,hld->hgl", qg, k)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (np.einsum("hgl,hld->hgd", p, v) / p.sum(-1)[..., None]).reshape(hq, d)
    return out


# b, hq, hkv, d, page, pages_per_seq: MHA, GQA 4:1 (the kernel pads a group's 4 heads to 16), GQA 3:1, one
# page per sequence, tables whose width no block of 2 or 4 divides.
SHAPES = [(3, 8, 8, 16, 4, 4), (4, 8, 2, 32, 8, 6), (2, 12, 4, 16, 16, 5), (5, 4, 1, 64, 16, 1), (3, 16, 2, 16, 4, 7)]


def _hard_case(shape, seed=0):
    """A _paged_case with the edges: one full table, one sequence of 1 token, one ending inside a page, and an
    inactive slot (1 token, its whole table on the scratch page 0, as the engine leaves a free slot)."""
    b, hq, hkv, d, page, pps = shape
    q, k, v, lengths, table = _paged_case(seed, b, hq, hkv, d, page, pps, num_pages=b * pps + 1)
    lengths[0] = page * pps
    lengths[-1] = 1
    if b > 2:
        lengths[1] = max(1, page * pps - page // 2 - 1)
    if b > 3:
        table[2], lengths[2] = 0, 1
    return q * d ** -0.5, k, v, lengths, table


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_and_gpu_kernel_equal_the_reference(shape, dtype):
    """'chunked' (blocks of 2 pages: some tables end in a partial block) and the Pallas GPU kernel (interpret
    mode) against the reference, at float32 and bf16 pages; both against float64 truth."""
    q, k, v, lengths, table = _hard_case(shape)
    kd, vd = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    args = (jnp.asarray(q), kd, vd, jnp.asarray(lengths), jnp.asarray(table))
    ref = np.asarray(paged_attention_reference(*args))
    truth = _numpy_attention(q, np.asarray(kd, np.float32), np.asarray(vd, np.float32), lengths, table)
    chunked = np.asarray(paged_attention(*args, impl="chunked", chunk_tokens=2 * shape[4]))
    gpu = np.asarray(paged_attention(*args, impl="pallas_gpu", pages_per_compute_block=2, interpret=True))
    np.testing.assert_allclose(chunked, ref, atol=2e-6)
    np.testing.assert_allclose(chunked, truth, atol=2e-6)
    # A float32 query stays float32 (gpu_float32_query): the kernel's scores and probabilities are the
    # reference's up to summation order, whatever the pages' type.
    np.testing.assert_allclose(gpu, ref, atol=1e-5)
    np.testing.assert_allclose(gpu, truth, atol=1e-5)


def test_auto_picks_the_reference_on_short_gpu_tables_and_a_kernel_that_never_gathers_on_long_ones():
    from rollverify_jax.rollout.attention import resolve_impl

    # platform, head_dim, page size, table pages -> impl (GPU threshold: 512 tokens per sequence)
    assert resolve_impl("auto", "gpu", 128, 16, 32, 512) == "reference"
    assert resolve_impl("auto", "gpu", 128, 16, 33, 512) == "pallas_gpu"
    assert resolve_impl("auto", "gpu", 96, 16, 64, 512) == "chunked"  # Triton tiles powers of two only
    assert resolve_impl("auto", "gpu", 128, 24, 64, 512) == "chunked"
    assert resolve_impl("auto", "tpu", 128, 16, 4, 512) == "pallas_tpu"
    assert resolve_impl("auto", "tpu", 64, 16, 4, 512) == "reference"
    assert resolve_impl("auto", "cpu", 128, 16, 4096, 512) == "reference"
    assert resolve_impl("chunked", "tpu", 128, 16, 4, 512) == "chunked"
    case = _hard_case((3, 8, 2, 16, 4, 4))
    args = tuple(map(jnp.asarray, case))
    short = paged_attention(*args, platform="gpu", interpret=True)  # 16 tokens a sequence: the reference
    np.testing.assert_array_equal(np.asarray(short), np.asarray(paged_attention_reference(*args)))
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(*map(jnp.asarray, _hard_case((2, 4, 1, 24, 4, 2))), impl="pallas_gpu", interpret=True)


@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_gpu_default_decodes_a_22k_context_equal_to_float64(impl):
    """The GPU default at a real context (22,528 tokens: 352 pages of 64) on tiny dims, Pallas interpret mode:
    the Pallas GPU kernel, and 'chunked'. One full sequence, one 37 tokens short (inside its last page), one
    inactive slot (1 token on the scratch page), against float64 numpy."""
    context, page, d = 22_528, 64, 16
    pps = context // page
    rng = np.random.default_rng(3)
    num_pages = 2 * pps + 1
    table = np.zeros((3, pps), np.int32)
    table[:2] = rng.permutation(np.arange(1, num_pages)).reshape(2, pps)
    lengths = np.array([context, context - 37, 1], np.int32)
    k = rng.normal(size=(1, num_pages, page, d)).astype(np.float32)
    v = rng.normal(size=(1, num_pages, page, d)).astype(np.float32)
    q = (rng.normal(size=(3, 16, d)) * 2 * d ** -0.5).astype(np.float32)  # 16 q heads on 1 KV head
    if impl == "auto":
        from rollverify_jax.rollout.attention import resolve_impl

        assert resolve_impl(impl, "gpu", d, page, pps, 512) == "pallas_gpu"
    got = paged_attention(*map(jnp.asarray, (q, k, v, lengths, table)), impl=impl, platform="gpu", interpret=True,
                          pages_per_compute_block=8)
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(q, k, v, lengths, table), atol=2e-5)
