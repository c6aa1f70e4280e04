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


def test_gpu_pallas_kernel_gets_one_element_type_for_a_float32_query_on_bf16_pages(monkeypatch):
    """On a GPU, Triton refuses a float32 query against bf16 pages (the interpreter here would accept it): the
    dispatcher hands the kernel the pages' type and returns the query's."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

    real = gpu_kernel.paged_attention

    def strict(q, k_pages, *args, **kwargs):
        assert q.dtype == k_pages.dtype, (q.dtype, k_pages.dtype)
        return real(q, k_pages, *args, **kwargs)
    monkeypatch.setattr(gpu_kernel, "paged_attention", strict)
    q, k, v, lengths, table = _paged_case(seed=1, b=2, hq=16, hkv=1, d=16, page=4, pages_per_seq=4)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    want = np.asarray(paged_attention_reference(jnp.asarray(q), kb, vb, lengths, table))
    got = paged_attention(jnp.asarray(q), kb, vb, jnp.asarray(lengths), jnp.asarray(table), impl="pallas_gpu",
                          pages_per_compute_block=2, interpret=True)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-2)
