"""Paged KV cache: per-layer K/V page pools on device, and a host-side page allocator.

Pools are laid out ``[kv_heads, num_pages, page_size, head_dim]`` per layer, the layout of JAX's Pallas
paged-attention kernels. Page 0 is never handed out: it is the scratch page that padded rows write into,
so a masked write never lands on a live sequence.
"""

from __future__ import annotations

import dataclasses
import math

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


def write_kv(pages: jax.Array, new: jax.Array, positions: jax.Array, page_table: jax.Array,
             valid: jax.Array, page_offset: jax.Array | int = 0) -> jax.Array:
    """Scatters ``new`` [B, T, Hkv, D] at token ``positions`` [B, T] into ``pages`` [Hkv, P, S, D].

    ``page_table`` [B, pages_per_seq] maps a sequence's page slots to global pool pages; ``pages`` holds the
    pool's pages ``[page_offset, page_offset + P)`` (the whole pool, or one device's shard of it). Invalid
    tokens, and tokens whose page is held elsewhere, are dropped.
    """
    size = pages.shape[2]
    page = jnp.take_along_axis(page_table, jnp.clip(positions // size, 0, page_table.shape[1] - 1), axis=1)
    return write_kv_at(pages, new, page, positions % size, valid, page_offset)


def write_kv_at(pages: jax.Array, new: jax.Array, page: jax.Array, slot: jax.Array, valid: jax.Array,
                page_offset: jax.Array | int = 0) -> jax.Array:
    """Scatters ``new`` [B, T, Hkv, D] to global pool page ``page`` [B, T], position ``slot`` [B, T] in it: a packed
    prefill row holds several sequences, each token with its own sequence's page. Invalid tokens, and tokens
    whose page is held elsewhere, are dropped."""
    held = pages.shape[1]
    local = page - page_offset
    keep = valid & (local >= 0) & (local < held)
    local = jnp.where(keep, local, held)  # out of range: the scatter drops it
    vals = new.astype(pages.dtype)

    def per_head(pages, vals):
        # One scatter per KV head on TPU: a single scatter across heads makes XLA:TPU pick a heads-minor layout
        # for the result and copy the whole pool back to the attention kernel's layout (with 2+ heads per chip, a
        # second copy of every layer's pages in the decode dispatch; per head, none).
        for h in range(pages.shape[0]):
            pages = pages.at[h, local, slot].set(vals[:, :, h], mode="drop")
        return pages

    def all_heads(pages, vals):
        # Elsewhere one scatter for every head: on GPU each scatter is a kernel launch, and a decode step's small
        # kernels cost their launch more than their work (heads x layers x 2 of them per step, per head).
        return pages.at[:, local, slot].set(jnp.moveaxis(vals, 2, 0), mode="drop")

    # Resolved at lowering for the platform compiled for (a deviceless TPU compile takes the TPU branch).
    return jax.lax.platform_dependent(pages, vals, tpu=per_head, default=all_heads)


class PageAllocator:
    """Host-side free lists and page table. Pages are granted per slot as its sequence grows (``grow``);
    ``release`` returns them all when the sequence finishes, pauses or is preempted.

    With ``num_shards`` > 1 the pool and the slots are split into equal contiguous shards, one per device
    along the mesh's batch axes: slot ``s`` lives on shard ``s // slots_per_shard`` and takes pages only from
    that shard's range, so a device's decode attention reads only the pages it holds. Each shard's first page
    is its scratch page. The table holds global page ids; `local_page_table` gives each device its own.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_seq_len: int, num_shards: int = 1):
        if num_slots % num_shards:
            raise ValueError(f"num_slots={num_slots} must divide evenly over {num_shards} page-pool shards.")
        self.pages_per_shard = num_pages // num_shards
        if self.pages_per_shard < 2:
            raise ValueError(f"num_pages={num_pages} over {num_shards} shards: each shard needs its scratch page "
                             "plus at least one page.")
        self.page_size = page_size
        self.num_shards = num_shards
        self.num_pages = self.pages_per_shard * num_shards
        self.slots_per_shard = num_slots // num_shards
        self.max_seq_len = max_seq_len
        self.pages_per_seq = math.ceil(max_seq_len / page_size)
        # pop() yields low pages first
        self.free: list[list[int]] = [list(range(self.scratch(s) + self.pages_per_shard - 1, self.scratch(s), -1))
                                      for s in range(num_shards)]
        self.table = np.repeat(self.scratch(np.arange(num_slots) // self.slots_per_shard)[:, None],
                               self.pages_per_seq, axis=1).astype(np.int32)
        self.owned: dict[int, list[int]] = {}

    def scratch(self, shard):
        """The scratch page of ``shard`` (padded and inactive rows point there)."""
        return shard * self.pages_per_shard

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the scratch pages)."""
        return self.num_shards * self.shard_capacity

    @property
    def shard_capacity(self) -> int:
        """The most pages one sequence can ever hold (a sequence lives on one shard)."""
        return self.pages_per_shard - 1

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def check_admissible(self, num_tokens: int) -> None:
        """Raises if a sequence of ``num_tokens`` could never fit, however long it waits."""
        if num_tokens > self.max_seq_len:
            raise ValueError(
                f"A sequence of {num_tokens} tokens (prompt + max new tokens) exceeds the context of "
                f"{self.max_seq_len}; shorten the prompt or lower max_new_tokens."
            )
        if self.pages_needed(num_tokens) > self.shard_capacity:
            raise ValueError(
                f"A sequence of {num_tokens} tokens needs {self.pages_needed(num_tokens)} pages but the pool "
                f"has {self.shard_capacity} per shard; raise the KV memory budget."
            )

    def can_allocate(self, num_tokens: int, slot: int = 0) -> bool:
        """Whether ``slot``'s shard has the pages for ``num_tokens``."""
        return self.pages_needed(num_tokens) <= len(self.free[self.shard_of(slot)])

    def allocate(self, slot: int, num_tokens: int) -> None:
        """Pages for a newly admitted sequence of ``num_tokens``."""
        if slot in self.owned:
            raise RuntimeError(f"Slot {slot} already holds pages.")
        if not self.grow(slot, num_tokens):
            raise RuntimeError(f"Need {self.pages_needed(num_tokens)} pages, "
                               f"{len(self.free[self.shard_of(slot)])} free.")

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Extends ``slot``'s pages to cover ``num_tokens``; False (and nothing changes) when too few are free."""
        free = self.free[self.shard_of(slot)]
        have = self.owned.get(slot, [])
        n = self.pages_needed(num_tokens)
        extra = n - len(have)
        if extra > len(free):
            return False
        if extra > 0:
            new = [free.pop() for _ in range(extra)]
            self.table[slot, len(have): n] = new
            self.owned[slot] = have + new
        return True

    def move(self, src: int, dst: int) -> None:
        """Hands ``src``'s pages (and its table row) to the free slot ``dst`` of the same shard."""
        if dst in self.owned or self.shard_of(src) != self.shard_of(dst):
            raise RuntimeError(f"Cannot move slot {src} to slot {dst}: it is taken or on another shard.")
        if src in self.owned:
            self.owned[dst] = self.owned.pop(src)
        self.table[dst] = self.table[src]
        self.table[src] = self.scratch(self.shard_of(src))

    def release(self, slot: int) -> None:
        shard = self.shard_of(slot)
        pages = self.owned.pop(slot, [])
        self.free[shard].extend(reversed(pages))
        self.table[slot, :] = self.scratch(shard)

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self.free)
