"""Paged KV cache: per-layer K/V page pools on device, and a host-side page allocator.

Pools are laid out ``[kv_heads, num_pages, page_size, head_dim]`` per layer, the layout of JAX's Pallas
paged-attention kernels. Page 0 is never handed out: it is the scratch page that padded rows write into,
so a masked write never lands on a live sequence.
"""

from __future__ import annotations

import dataclasses
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np

from rollverify_jax.models.qwen3 import Qwen3Config, resolve_dtype

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """k, v: one ``[kv_heads, num_pages, page_size, head_dim]`` array per layer."""

    k: list[jax.Array]
    v: list[jax.Array]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]


def kv_bytes_per_page(cfg: Qwen3Config, page_size: int, dtype) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * page_size * cfg.head_dim * \
        jnp.dtype(resolve_dtype(dtype)).itemsize


@gin.configurable
def num_pages_for_budget(cfg: Qwen3Config, page_size: int, memory_bytes: int = 64 * 2**20,
                         dtype: str = "float32") -> int:
    """How many pages (scratch page included) a KV memory budget of ``memory_bytes`` holds."""
    n = memory_bytes // kv_bytes_per_page(cfg, page_size, dtype)
    if n < 2:
        raise ValueError(
            f"KV memory budget of {memory_bytes} bytes holds {n} pages of {page_size} tokens; raise "
            f"num_pages_for_budget.memory_bytes to at least {2 * kv_bytes_per_page(cfg, page_size, dtype)}."
        )
    return int(n)


def init_pages(cfg: Qwen3Config, num_pages: int, page_size: int, dtype, sharding=None) -> KVPages:
    shape = (cfg.num_key_value_heads, num_pages, page_size, cfg.head_dim)
    dt = resolve_dtype(dtype)

    def zeros():
        return jnp.zeros(shape, dt, device=sharding)
    return KVPages(k=[zeros() for _ in range(cfg.num_hidden_layers)],
                   v=[zeros() for _ in range(cfg.num_hidden_layers)])


def write_kv(pages: jax.Array, new: jax.Array, positions: jax.Array, page_table: jax.Array,
             valid: jax.Array) -> jax.Array:
    """Scatters ``new`` [B, T, Hkv, D] at token ``positions`` [B, T] into ``pages`` [Hkv, P, S, D].

    ``page_table`` [B, pages_per_seq] maps a sequence's page slots to pool pages; invalid tokens go to the
    scratch page.
    """
    size = pages.shape[2]
    page = jnp.take_along_axis(page_table, jnp.clip(positions // size, 0, page_table.shape[1] - 1), axis=1)
    page = jnp.where(valid, page, SCRATCH_PAGE)
    offset = jnp.where(valid, positions % size, 0)
    vals = jnp.moveaxis(new, 2, 0).astype(pages.dtype)  # [Hkv, B, T, D]
    return pages.at[:, page, offset].set(vals)


class PageAllocator:
    """Host-side free list and page table. Pages are granted per slot as its sequence grows (``grow``);
    ``release`` returns them all when the sequence finishes, pauses or is preempted."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_seq_len: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page plus at least one page.")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.pages_per_seq = math.ceil(max_seq_len / page_size)
        self.free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() yields low pages first
        self.table = np.full((num_slots, self.pages_per_seq), SCRATCH_PAGE, np.int32)
        self.owned: dict[int, list[int]] = {}

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.num_pages - 1

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def check_admissible(self, num_tokens: int) -> None:
        """Raises if a sequence of ``num_tokens`` could never fit, however long it waits."""
        if num_tokens > self.max_seq_len:
            raise ValueError(
                f"A sequence of {num_tokens} tokens (prompt + max new tokens) exceeds the context of "
                f"{self.max_seq_len}; shorten the prompt or lower max_new_tokens."
            )
        if self.pages_needed(num_tokens) > self.capacity:
            raise ValueError(
                f"A sequence of {num_tokens} tokens needs {self.pages_needed(num_tokens)} pages but the pool "
                f"has {self.capacity}; raise the KV memory budget."
            )

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) <= len(self.free)

    def allocate(self, slot: int, num_tokens: int) -> None:
        """Pages for a newly admitted sequence of ``num_tokens``."""
        if slot in self.owned:
            raise RuntimeError(f"Slot {slot} already holds pages.")
        if not self.grow(slot, num_tokens):
            raise RuntimeError(f"Need {self.pages_needed(num_tokens)} pages, {len(self.free)} free.")

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Extends ``slot``'s pages to cover ``num_tokens``; False (and nothing changes) when too few are free."""
        have = self.owned.get(slot, [])
        n = self.pages_needed(num_tokens)
        extra = n - len(have)
        if extra > len(self.free):
            return False
        if extra > 0:
            new = [self.free.pop() for _ in range(extra)]
            self.table[slot, len(have): n] = new
            self.owned[slot] = have + new
        return True

    def release(self, slot: int) -> None:
        pages = self.owned.pop(slot, [])
        self.free.extend(reversed(pages))
        self.table[slot, :] = SCRATCH_PAGE

    @property
    def num_free(self) -> int:
        return len(self.free)
