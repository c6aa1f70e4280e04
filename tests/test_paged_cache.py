"""Page allocator bookkeeping and the K/V scatter into pages."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollverify_jax import schedule_decisions
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
    assert paged_cache.SCRATCH_PAGE not in alloc.free[0]
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        alloc.check_admissible(17)


def test_pool_that_can_never_fit_is_rejected():
    alloc = paged_cache.PageAllocator(num_pages=3, page_size=4, num_slots=2, max_seq_len=64)
    with pytest.raises(ValueError, match="needs 4 pages but the pool has 2 per shard"):
        alloc.check_admissible(16)


def test_sharded_pool_keeps_each_slot_on_its_own_shard():
    """Two shards of 5 pages (scratch pages 0 and 5) and 2 slots each: a slot takes pages only from its
    shard, admission looks for a shard with room, and a release returns pages to the shard they came from."""
    alloc = paged_cache.PageAllocator(num_pages=11, page_size=4, num_slots=4, max_seq_len=16, num_shards=2)
    assert alloc.num_pages == 10 and alloc.capacity == 8 and alloc.shard_capacity == 4
    assert list(alloc.table[:, 0]) == [0, 0, 5, 5]
    alloc.allocate(0, 12)  # shard 0: pages 1, 2, 3
    alloc.allocate(2, 5)  # shard 1: pages 6, 7
    assert list(alloc.table[0, :3]) == [1, 2, 3] and list(alloc.table[2, :2]) == [6, 7]
    assert not alloc.can_allocate(8, slot=1) and alloc.can_allocate(8, slot=3)
    # slot 1 (shard 0) has no room for 8 tokens; slot 3 (shard 1) has, but not with 1 page of headroom per busy slot
    free = [len(f) for f in alloc.free]
    assert schedule_decisions.admit([2], [1, 3], alloc.slots_per_shard, free, [1, 1], headroom=0).slots == (3,)
    assert schedule_decisions.admit([2], [1, 3], alloc.slots_per_shard, free, [1, 1], headroom=1).page_blocked
    assert alloc.grow(2, 16) and list(alloc.table[2]) == [6, 7, 8, 9]
    alloc.release(2)
    assert list(alloc.table[2]) == [5] * 4 and sorted(alloc.free[1]) == [6, 7, 8, 9]
    long = paged_cache.PageAllocator(num_pages=10, page_size=4, num_slots=4, max_seq_len=32, num_shards=2)
    with pytest.raises(ValueError, match="needs 5 pages but the pool has 4 per shard"):
        long.check_admissible(20)
    with pytest.raises(ValueError, match="must divide evenly"):
        paged_cache.PageAllocator(num_pages=11, page_size=4, num_slots=3, max_seq_len=16, num_shards=2)


def test_write_kv_into_one_shard_drops_the_other_shards_tokens():
    pages = jnp.zeros((1, 3, 2, 1))  # this device holds global pages 3, 4, 5
    new = jnp.arange(1, 5, dtype=jnp.float32).reshape(1, 4, 1, 1)
    table = jnp.asarray([[4, 1]], jnp.int32)  # tokens 0-1 on page 4 (held), tokens 2-3 on page 1 (elsewhere)
    out = np.asarray(paged_cache.write_kv(pages, new, jnp.arange(4)[None], table, jnp.ones((1, 4), bool),
                                          page_offset=3))
    np.testing.assert_array_equal(out[0, 1, :, 0], [1, 2])
    assert out[0, 0].sum() == 0 and out[0, 2].sum() == 0


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


# -- property: random admit / grow / release sequences ----------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["allocate", "grow", "release"]), st.integers(0, 7), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, shards=st.sampled_from([1, 2, 4]))
def test_random_page_traffic_never_leaks_or_shares_a_page(ops, shards):
    """Whatever the order of admissions, growth and releases: no page is held twice, every held page is in its
    slot's shard and its table row, free + held = capacity, and a refused request changes nothing."""
    alloc = paged_cache.PageAllocator(num_pages=4 * 6, page_size=4, num_slots=8, max_seq_len=40, num_shards=shards)
    for op, slot, tokens in ops:
        before = (alloc.table.copy(), {s: list(p) for s, p in alloc.owned.items()}, alloc.num_free)
        if op == "allocate" and slot not in alloc.owned:
            if alloc.can_allocate(tokens, slot):
                alloc.allocate(slot, tokens)
            else:
                with pytest.raises(RuntimeError):
                    alloc.allocate(slot, tokens)
        elif op == "grow" and slot in alloc.owned:
            if not alloc.grow(slot, tokens):
                assert (alloc.table == before[0]).all() and alloc.owned == before[1]
        elif op == "release":
            alloc.release(slot)
        held = [p for pages in alloc.owned.values() for p in pages]
        assert len(held) == len(set(held)), "a page is held twice"
        assert alloc.num_free + len(held) == alloc.capacity
        free = [p for f in alloc.free for p in f]
        assert not set(free) & set(held) and len(free) == len(set(free))
        for s, pages in alloc.owned.items():
            shard = alloc.shard_of(s)
            assert all(shard * alloc.pages_per_shard < p < (shard + 1) * alloc.pages_per_shard for p in pages)
            assert list(alloc.table[s, : len(pages)]) == pages
            assert (alloc.table[s, len(pages):] == alloc.scratch(shard)).all()
        for s in set(range(8)) - set(alloc.owned):
            assert (alloc.table[s] == alloc.scratch(alloc.shard_of(s))).all()
