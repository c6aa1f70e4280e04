"""Page allocator bookkeeping and the K/V scatter into pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.models import model_config
from rollverify_jax.rollout import paged_cache


def test_allocate_release_and_admission():
    alloc = paged_cache.PageAllocator(num_pages=9, page_size=4, num_slots=3, max_seq_len=16)
    assert alloc.capacity == 8 and alloc.pages_per_seq == 4
    alloc.allocate(0, 10)  # 3 pages
    assert alloc.num_free == 5 and list(alloc.table[0]) == [1, 2, 3, paged_cache.SCRATCH_PAGE]
    assert alloc.can_allocate(16) and not alloc.can_allocate(4 * 6)
    alloc.allocate(1, 16)
    assert not alloc.can_allocate(5)  # 1 page left: waits
    with pytest.raises(RuntimeError, match="already holds"):
        alloc.allocate(0, 1)
    alloc.release(0)
    alloc.release(1)
    assert alloc.num_free == alloc.capacity
    assert (alloc.table == paged_cache.SCRATCH_PAGE).all()
    assert paged_cache.SCRATCH_PAGE not in alloc.free
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        alloc.check_admissible(17)


def test_pool_that_can_never_fit_is_rejected():
    alloc = paged_cache.PageAllocator(num_pages=3, page_size=4, num_slots=2, max_seq_len=64)
    with pytest.raises(ValueError, match="needs 4 pages but the pool has 2"):
        alloc.check_admissible(16)


def test_budget_to_pages():
    cfg = model_config("tiny")
    per_page = paged_cache.kv_bytes_per_page(cfg, 16, "float32")
    assert per_page == 2 * 4 * 2 * 16 * 32 * 4
    assert paged_cache.num_pages_for_budget(cfg, 16, 10 * per_page + 7) == 10
    with pytest.raises(ValueError, match="memory_bytes"):
        paged_cache.num_pages_for_budget(cfg, 16, per_page)


def test_write_kv_places_tokens_and_masks_padding():
    pages = jnp.zeros((2, 5, 4, 3))  # [Hkv, P, S, D]
    new = jnp.arange(1, 1 + 2 * 6 * 2 * 3, dtype=jnp.float32).reshape(2, 6, 2, 3)  # [B, T, Hkv, D]
    table = jnp.asarray([[3, 1], [2, 4]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    valid = jnp.asarray([[True] * 6, [True] * 3 + [False] * 3])
    out = np.asarray(paged_cache.write_kv(pages, new, positions, table, valid))
    new = np.asarray(new)
    for t in range(6):
        np.testing.assert_array_equal(out[:, [3, 1][t // 4], t % 4], new[0, t])
    for t in range(3):
        np.testing.assert_array_equal(out[:, 2, t], new[1, t])
    assert not out[:, 4].any()  # padded tokens of row 1 never reach its second page
