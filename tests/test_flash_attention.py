"""Training/prefill attention: splash (Pallas interpret mode) and the dot_product_attention path equal the
jnp reference at every real position, for packed segments and for right padding, on one and on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import flash_attention as fa
from rollverify_jax.models.qwen3 import CausalAttention

B, T, HQ, HKV, D = 4, 200, 4, 2, 16  # T is not a multiple of the 128 block: the kernel path pads it
SPLASH = fa.FlashConfig(impl="splash", block_q=128, block_kv=128, interpret=True)


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, HQ, D))
    k = jax.random.normal(keys[1], (B, T, HKV, D))
    v = jax.random.normal(keys[2], (B, T, HKV, D))
    lengths = np.asarray([T, 150, 61, 7])
    segments = np.zeros((B, T), np.int32)  # packed rows: segments of different lengths, then padding (0)
    for b, n in enumerate(lengths):
        cuts = np.sort(np.random.default_rng(b).choice(np.arange(1, n), size=2, replace=False))
        segments[b, :n] = 1 + np.searchsorted(cuts, np.arange(n), side="right")
    return q, k, v, jnp.asarray(segments), lengths


def _real(x, segments):
    return np.asarray(x)[np.asarray(segments) > 0]


@pytest.mark.parametrize("devices", [1, 8])
def test_splash_equals_the_reference_on_packed_rows(qkv, devices):
    q, k, v, segments, _ = qkv
    want = fa.causal_attention(q, k, v, segments, "reference")
    mesh = mesh_lib.make_mesh((1, -1, 1) if devices == 8 else (1, 1, 1), devices=jax.devices()[:devices])
    got = jax.jit(lambda *a: fa.causal_attention(*a, "splash", SPLASH, mesh))(q, k, v, segments)
    np.testing.assert_allclose(_real(got, segments), _real(want, segments), atol=2e-5)


def test_splash_gradients_equal_the_reference(qkv):
    q, k, v, segments, _ = qkv
    weights = (segments > 0)[..., None, None].astype(jnp.float32)

    def loss(q, k, v, impl, cfg=fa.DEFAULT_FLASH):
        return jnp.sum(weights * fa.causal_attention(q, k, v, segments, impl, cfg) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))  # compiled: eager is slow
    want = grad(q, k, v, "reference")
    got = grad(q, k, v, "splash", SPLASH)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5)


def test_dot_product_attention_path_equals_the_reference(qkv):
    """The cuDNN entry point, run here with XLA's implementation (the cuDNN kernel itself needs a GPU)."""
    q, k, v, segments, _ = qkv
    want = fa.causal_attention(q, k, v, segments, "reference")
    got = fa.cudnn_attention(q, k, v, segments, implementation=None)
    np.testing.assert_allclose(_real(got, segments), _real(want, segments), atol=2e-5)
    plain = fa.cudnn_attention(q, k, v, None, implementation=None)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(fa.causal_attention(q, k, v, None, "reference")),
                               atol=2e-5)


def test_right_padding_is_masked_alike(qkv):
    """The model's padded-row attention (``valid``) agrees between the reference and splash at real tokens."""
    q, k, v, _, lengths = qkv
    valid = jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]
    want = CausalAttention(valid=valid)(0, q, k, v)
    got = CausalAttention(valid=valid, impl="splash", flash=SPLASH)(0, q, k, v)
    np.testing.assert_allclose(_real(got, valid), _real(want, valid), atol=2e-5)


def test_auto_picks_the_platform_kernel_and_bad_settings_fail():
    assert fa.FlashConfig().resolved_impl("tpu") == "splash"
    assert fa.FlashConfig().resolved_impl("gpu") == "cudnn"
    assert fa.FlashConfig().resolved_impl("cpu") == "reference"
    assert fa.FlashConfig(impl="reference").resolved_impl("tpu") == "reference"
    with pytest.raises(ValueError, match="FlashConfig.impl='flash'"):
        fa.FlashConfig(impl="flash")
    with pytest.raises(ValueError, match="multiples of 128"):
        fa.FlashConfig(block_q=100)


@pytest.mark.parametrize("block", [32, 64, 128, 256])
def test_block_causal_reference_equals_the_dense_mask(qkv, block):
    """T = 200: blocks of 32 and 64 leave a short last block, 128 two unequal ones, 256 a single block."""
    q, k, v, segments, _ = qkv
    dense = fa.reference_attention(q, k, v, fa.causal_mask(T, segments))
    got = jax.jit(fa.block_causal_reference, static_argnums=4)(q, k, v, segments, block)  # eager: an op at a time
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=2e-6, rtol=2e-6)


def test_cudnn_impl_takes_xla_attention_for_float32(qkv):
    """cuDNN's kernel refuses float32: the 'cudnn' impl runs float32 rows through XLA's implementation (which is
    what runs here on CPU), equal to the reference at every real position."""
    q, k, v, segments, _ = qkv
    want = fa.causal_attention(q, k, v, segments, "reference")
    got = fa.causal_attention(q, k, v, segments, "cudnn")
    np.testing.assert_allclose(_real(got, segments), _real(want, segments), atol=2e-5, rtol=2e-5)
