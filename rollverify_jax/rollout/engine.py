"""Decode engine with JetStream's interface shape: ``prefill``, ``insert``, ``generate``.

All device work is in three jitted functions. The decode state (KV pages and per-slot metadata) is donated
to every call, so pages are updated in place. ``generate`` runs ``steps_per_dispatch`` decode steps per
call and returns, for every generated token, its id, its behaviour log-prob and the policy version.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollverify_jax import schedule_rules
from rollverify_jax.infra import distributed, transfer
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import lora
from rollverify_jax.models.flash_attention import DEFAULT_FLASH, FlashConfig
from rollverify_jax.models.qwen3 import (
    CausalAttention,
    Qwen3ForCausalLM,
    chunked_scores,
    logits_from_hidden,
    resolve_dtype,
)
from rollverify_jax.rollout import paged_cache
from rollverify_jax.rollout.attention import paged_attention
from rollverify_jax.rollout.sampling import SamplingConfig, logp_and_samples, sample_tokens

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # EngineConfig.compute_dtype's values besides None
SERVING_LAYOUTS = ("train", "tensor")  # EngineConfig.serving_layout
MEGACORE_KINDS = ("TPU v4", "TPU v5", "TPU v5p")  # device kinds with two TensorCores per JAX device
PALLAS_TPU_BLOCK = 4  # paged_attention's default pages_per_compute_block


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """num_slots: concurrent sequences; max_seq_len: prompt + response context per slot;
    kv_memory_bytes: page-pool budget of the whole mesh, split evenly over the data x fsdp devices with the
    slots (None: enough for every slot at max_seq_len); compute_dtype: the activation dtype of the engine's
    prefill, insert and decode programs (None: the model's own ``Qwen3Config.dtype``). The params keep their
    dtype in memory and the KV cache stays in ``kv_dtype``; 'float32' over bf16 weights and KV takes the gap
    between the resume's log pi and decode's log mu from bf16 noise down to float32-activation noise
    (docs/benchmarks.md, OPS noise floor). The learner is unaffected.
    serving_layout: how the engine's weights lie on the mesh. 'train': the train state's arrays (no copy; FSDP over
    the batch axes, so every decode step all-reduces each layer's activations over them); 'tensor': a copy split
    over 'tensor' only, whole on every data x fsdp device (experts stay where the rules put them), made at every
    ``update_params`` and held beside the train state (docs/scale.md, decode against the HBM roofline).
    dispatch_ahead: the scheduler dispatches decode n + 1 before it reads decode n's outputs, so the host's work
    between dispatches overlaps the device's; a slot that finishes in n is refilled one dispatch later
    (``Scheduler``; samples are unchanged, when requests start is not).
    decode_stop_finished: a dispatch of up to ``steps_per_dispatch`` steps returns early, after the step at which
    this many of its slots have finished (a ``while_loop``; the outputs keep their ``[steps, slots]`` shape, the
    steps not run emitting nothing), so freed slots are refilled sooner; 0 runs every step (a ``scan``). Samples
    are unchanged; when requests start is not."""

    num_slots: int = 16
    page_size: int = 16  # tokens per KV page
    max_seq_len: int = 512
    steps_per_dispatch: int = 8  # decode steps per generate dispatch (the host reads tokens between dispatches)
    kv_memory_bytes: int | None = None
    kv_dtype: str = "float32"
    min_prefill_len: int = 32  # the narrowest prefill row (widths grow by bucket_ratio up to max_seq_len)
    bucket_ratio: int = 2  # step of every shape ladder: prefill widths and rows, live slots and pages (shape_plan)
    prefill_token_budget: int | None = None  # most tokens (rows x width) in one prefill call (None: no cap)
    page_reservation: str = "incremental"  # 'incremental': pages as sequences grow; 'full': prompt + max new
    logits_chunk: int | None = None  # resume prefill scores log-probs this many positions at a time (None: all)
    live_pages: bool = True  # decode attends over the page-table columns some slot holds (a bucket), not all
    live_slots: bool = True  # decode runs over the slots up to the highest running one (a bucket), not all
    compute_dtype: str | None = None  # activations of prefill/insert/decode (None: the model's Qwen3Config.dtype)
    serving_layout: str = "train"  # the engine's weights: 'train' (the train state's arrays) | 'tensor' (a copy)
    megacore: bool = True  # the TPU paged-attention kernel on both TensorCores of a v4 / v5p chip
    dispatch_ahead: bool = False  # the scheduler dispatches decode n + 1 before reading n's outputs (Scheduler)
    decode_stop_finished: int = 0  # a dispatch returns once this many slots finished in it (0: runs all its steps)

    def __post_init__(self):
        if self.page_reservation not in ("incremental", "full"):
            raise ValueError(f"EngineConfig.page_reservation={self.page_reservation!r}: use 'incremental' or 'full'.")
        if self.serving_layout not in SERVING_LAYOUTS:
            raise ValueError(f"EngineConfig.serving_layout={self.serving_layout!r}: use one of "
                             f"{', '.join(map(repr, SERVING_LAYOUTS))}.")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"EngineConfig.compute_dtype={self.compute_dtype!r}: use None (the model's own "
                             f"Qwen3Config.dtype) or one of {', '.join(map(repr, COMPUTE_DTYPES))}.")
        if self.bucket_ratio < 2:
            raise ValueError(f"EngineConfig.bucket_ratio={self.bucket_ratio} must be >= 2 (each bucket this many "
                             "times the one below it).")
        if self.prefill_token_budget is not None and self.prefill_token_budget < self.max_seq_len:
            raise ValueError(f"EngineConfig.prefill_token_budget={self.prefill_token_budget} must hold one row of "
                             f"max_seq_len={self.max_seq_len} tokens (or be None).")
        for name in ("num_slots", "page_size", "max_seq_len", "steps_per_dispatch", "min_prefill_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.decode_stop_finished < 0:
            raise ValueError(f"EngineConfig.decode_stop_finished={self.decode_stop_finished} must be >= 0 (0: off).")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-slot decode state (S slots). ``tokens`` holds each slot's last sampled token, not yet in cache."""

    pages: paged_cache.KVPages
    page_table: jax.Array  # int32[S, pages_per_seq]
    tokens: jax.Array  # int32[S]
    lengths: jax.Array  # int32[S]  tokens whose K/V are cached
    generated: jax.Array  # int32[S]  response tokens emitted so far
    max_new: jax.Array  # int32[S]
    seeds: jax.Array  # uint32[S]
    active: jax.Array  # bool[S]
    version: jax.Array  # int32[]  policy version of the current parameters


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedPrefill:
    """One prefill call's input: several sequences laid end to end in rows of width W (first-fit), each token
    with its position in its own sequence, its segment (1, 2, ... per row; 0 on padding), the KV page slot it is
    written to and the token after it (what log pi scores). A sequence's last token is not prefilled: it is the
    slot's pending token, which the first decode step writes and samples after, so admitting samples nothing and
    every program's shape is fixed by (R, W). Sequences that repeat another's prompt (a group's members) are not
    prefilled: their pages get a copy of its pages (``copy_src`` -> ``copy_dst``, ``num_copies`` of the
    capacity C in use). Per-sequence arrays have one entry per slot (n = S)."""

    tokens: jax.Array  # int32[R, W]
    positions: jax.Array  # int32[R, W]
    segments: jax.Array  # int32[R, W]
    pages: jax.Array  # int32[R, W]  global pool page of each token
    page_slots: jax.Array  # int32[R, W]  position inside that page
    targets: jax.Array  # int32[R, W]  the next token of each position's sequence
    row: jax.Array  # int32[n]
    start: jax.Array  # int32[n]
    prompt_lens: jax.Array  # int32[n]
    copy_src: jax.Array  # int32[C]  C = S x pages of a row
    copy_dst: jax.Array  # int32[C]
    num_copies: jax.Array  # int32[]


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Where the decode state lives on the mesh. The KV page pool is split over ``pool_axes`` (the mesh's batch
    axes, when the slots divide over them) along its page axis, and the slots with it: each device holds its
    slots' pages, so decode attention runs per device (``shard_map``; the Pallas kernels cannot be partitioned
    automatically). KV heads go over 'tensor' when they divide. Nothing is replicated that need not be."""

    mesh: Mesh
    pool_axes: tuple[str, ...] = ()
    heads_axis: str | None = None
    use_megacore: bool = True

    @classmethod
    def for_mesh(cls, mesh: Mesh, num_slots: int, num_kv_heads: int, num_q_heads: int,
                 megacore: bool = True) -> PoolLayout:
        axes = tuple(a for a in mesh_lib.BATCH_AXES if mesh.shape[a] > 1)
        if num_slots % max(1, math.prod(mesh.shape[a] for a in axes)):
            axes = ()
        tensor = mesh.shape["tensor"]
        heads = "tensor" if tensor > 1 and num_kv_heads % tensor == 0 and num_q_heads % tensor == 0 else None
        return cls(mesh, axes, heads, megacore)

    @property
    def platform(self) -> str:
        """The mesh's platform ('cpu', 'gpu', 'tpu'), which picks the kernels (a deviceless TPU mesh: 'tpu')."""
        return self.mesh.devices.flat[0].platform

    @property
    def megacore(self) -> bool:
        """Whether the attention kernel splits over two TensorCores per chip (``EngineConfig.megacore``, on a chip
        that has two: TPU v4 and v5p, 'TPU v4' and 'TPU v5'; not v5e 'TPU v5 lite' nor v6e 'TPU v6 lite')."""
        return (self.use_megacore and self.platform == "tpu"
                and self.mesh.devices.flat[0].device_kind in MEGACORE_KINDS)

    @property
    def num_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.pool_axes)

    @property
    def _slots(self):
        return self.pool_axes or None

    def pages_spec(self) -> PartitionSpec:  # [Hkv, P, page, D]
        return PartitionSpec(self.heads_axis, self._slots, None, None)

    def slots_spec(self, ndim: int = 1) -> PartitionSpec:  # [S, ...]
        return PartitionSpec(self._slots, *([None] * (ndim - 1)))

    def heads_spec(self, slots: bool) -> PartitionSpec:  # [S or n, T, H, D]
        return PartitionSpec(self._slots if slots else None, None, self.heads_axis, None)

    def shard_offset(self, pages_per_device: int) -> jax.Array:
        """Global id of this device's first page (inside ``shard_map``)."""
        if not self.pool_axes:
            return jnp.zeros((), jnp.int32)
        return jax.lax.axis_index(self.pool_axes).astype(jnp.int32) * pages_per_device

    def shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


class _PrefillAttention:
    """Dense causal attention within each packed sequence that also writes each layer's K/V into the
    sequences' pages (each device writes the tokens whose pages it holds)."""

    def __init__(self, pages: paged_cache.KVPages, packed: PackedPrefill, kernel: dict, layout: PoolLayout):
        self.k, self.v = list(pages.k), list(pages.v)
        self.packed, self.layout = packed, layout
        self.dense = CausalAttention(valid=packed.segments > 0, segments=packed.segments, **kernel)

    def __call__(self, layer_idx, q, k, v):
        lay, packed = self.layout, self.packed

        def write(kp, vp, k, v, page, slot, valid):
            offset = lay.shard_offset(kp.shape[1])
            return (paged_cache.write_kv_at(kp, k, page, slot, valid, offset),
                    paged_cache.write_kv_at(vp, v, page, slot, valid, offset))

        rows = lay.heads_spec(slots=False)
        write = lay.shard_map(write, (lay.pages_spec(), lay.pages_spec(), rows, rows, PartitionSpec(),
                                      PartitionSpec(), PartitionSpec()), (lay.pages_spec(), lay.pages_spec()))
        self.k[layer_idx], self.v[layer_idx] = write(self.k[layer_idx], self.v[layer_idx], k, v, packed.pages,
                                                     packed.page_slots, packed.segments > 0)
        kv = self.k[layer_idx].dtype  # attend over the K/V decode reads back: rounded to the pages' dtype
        return self.dense(layer_idx, q, k.astype(kv).astype(k.dtype), v.astype(kv).astype(v.dtype))


class _DecodeAttention:
    """One new token per slot: write its K/V at ``lengths``, then paged attention over lengths + 1, per device
    over the slots and pages it holds. An inactive slot (finished, preempted, free) attends over its first
    token only: its output is discarded, and its stale length would have the kernel read its old KV."""

    def __init__(self, pages: paged_cache.KVPages, page_table, lengths, active, layout: PoolLayout,
                 knobs: tuple[tuple[str, Any], ...] = ()):
        self.knobs = knobs  # paged_attention's kernel knobs (impl, pages_per_compute_block, ...)
        self.k, self.v = list(pages.k), list(pages.v)
        self.page_table, self.lengths, self.active, self.layout = page_table, lengths, active, layout

    def __call__(self, layer_idx, q, k, v):
        lay = self.layout
        scale = q.shape[-1] ** -0.5

        def local(q, k, v, kp, vp, table, lengths, active):
            offset = lay.shard_offset(kp.shape[1])
            pos, valid = lengths[:, None], active[:, None]
            kp = paged_cache.write_kv(kp, k, pos, table, valid, offset)
            vp = paged_cache.write_kv(vp, v, pos, table, valid, offset)
            # A slot is never longer than its table's pages; an inactive one reads one token (0 gives NaN).
            seen = jnp.where(active, jnp.minimum(lengths + 1, table.shape[1] * kp.shape[2]), 1)
            # Scaled in float32: the prefill scales its float32 scores, and a bf16 q * scale rounds q again.
            qs = q[:, 0].astype(jnp.float32) * scale
            out = paged_attention(qs, kp, vp, seen, table - offset, platform=lay.platform, megacore=lay.megacore,
                                  **dict(self.knobs))
            return out[:, None].astype(q.dtype), kp, vp

        rows = lay.heads_spec(slots=True)
        local = lay.shard_map(local, (rows, rows, rows, lay.pages_spec(), lay.pages_spec(), lay.slots_spec(2),
                                      lay.slots_spec(), lay.slots_spec()), (rows, lay.pages_spec(), lay.pages_spec()))
        out, self.k[layer_idx], self.v[layer_idx] = local(q, k, v, self.k[layer_idx], self.v[layer_idx],
                                                          self.page_table, self.lengths, self.active)
        return out


@dataclasses.dataclass(frozen=True)
class EngineStatic:
    """Everything the compiled functions specialise on. Engines with equal ``EngineStatic`` share compiled code."""

    graphdef: nnx.GraphDef
    sampling: SamplingConfig
    eos_ids: tuple[int, ...]
    layout: PoolLayout
    logits_chunk: int | None = None
    flash: FlashConfig = DEFAULT_FLASH
    attention: tuple[tuple[str, Any], ...] = ()  # paged_attention's kernel knobs, sorted (name, value) pairs

    def __hash__(self) -> int:
        # jit hashes its static arguments at every call, and hashing the model's GraphDef walks every node of it
        # (1.6 ms at 36 layers): computed once per object. Engines keep one object per sampler (``Engine._static``).
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # str hashes differ between processes

    def __eq__(self, other) -> bool:
        if self is other:  # the engine's own cached object: no walk over two GraphDefs
            return True
        if not isinstance(other, EngineStatic):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))

    def kernel(self) -> dict:
        """CausalAttention's implementation for prefill (splash on TPU, cuDNN on GPU, the reference on CPU)."""
        return {"impl": self.flash.resolved_impl(self.layout.platform), "flash": self.flash, "mesh": self.layout.mesh}


def _copy_pages(pages: jax.Array, src: jax.Array, dst: jax.Array, count: jax.Array, block: int) -> jax.Array:
    """Copies pool pages ``src[:count]`` to ``dst[:count]`` (``block`` at a time; the loop runs as many blocks as
    ``count`` needs, so a call that copies nothing costs nothing whatever its capacity)."""
    blocks = src.shape[0] // block

    def body(i, pages):
        s_ = jax.lax.dynamic_slice_in_dim(src, i * block, block)
        d_ = jax.lax.dynamic_slice_in_dim(dst, i * block, block)
        d_ = jnp.where(i * block + jnp.arange(block) < count, d_, pages.shape[1])  # past count: dropped
        return pages.at[:, d_].set(pages[:, s_], mode="drop")
    return jax.lax.fori_loop(0, jnp.minimum(-(-count // block), blocks), body, pages)


def _prefill_fn(static: EngineStatic, params, state: DecodeState, packed: PackedPrefill, with_logp: jax.Array,
                coupled: tuple[jax.Array, jax.Array] | None = None):
    """Writes the packed sequences' K/V into their pages (and copies shared prompts' pages), and with
    ``with_logp`` (a runtime flag: one program serves new prompts and resumes) returns each sequence's
    response log pi at the sampling temperature: float32[n, W], entry j = response token j (else zeros).
    ``coupled`` = (seeds uint32[R, W], token index int32[R, W]) of each packed position's target (the coupled
    verification rule; None: not computed, the program is the two-stage rule's): it also returns bool[n, W],
    entry j = whether the current params, with token j's own Gumbel noise, would have sampled response token j
    (``sampling.sampled_argmax``), computed from the same chunks of logits as the log-probs."""
    model = nnx.merge(static.graphdef, params)
    tokens = packed.tokens
    attn = _PrefillAttention(state.pages, packed, static.kernel(), static.layout)
    hidden, _ = model.hidden_states(tokens, positions=packed.positions, attention=attn, mesh=static.layout.mesh)
    block = packed.row.shape[0]

    def copy(pages):
        return _copy_pages(pages, packed.copy_src, packed.copy_dst, packed.num_copies, block)
    state = dataclasses.replace(state, pages=paged_cache.KVPages(k=[copy(k) for k in attn.k],
                                                                 v=[copy(v) for v in attn.v]))
    n, width = packed.row.shape[0], tokens.shape[1]
    temperature = static.sampling.logp_temperature

    def scores(hidden):
        # Response token j of sequence i is predicted at its position prompt_len + j - 1.
        idx = jnp.clip((packed.start + packed.prompt_lens - 1)[:, None] + jnp.arange(width)[None], 0, width - 1)
        if coupled is not None:  # log pi and the check from one pass over each position's logits
            token_logp, match = _logp_and_match(hidden, model.output_weights(), packed.targets, *coupled,
                                                static.sampling, static.logits_chunk)
            return token_logp[packed.row[:, None], idx], match[packed.row[:, None], idx]
        if static.logits_chunk is None:
            logp_all = jax.nn.log_softmax(model.logits_from_hidden(hidden) / temperature, axis=-1)
            token_logp = jnp.take_along_axis(logp_all, packed.targets[..., None], axis=-1)[..., 0]  # [R, W]
        else:  # never the whole [R, W, V] logits: at a real vocabulary and length they do not fit
            token_logp = chunked_scores(hidden, model.output_weights(), packed.targets, temperature,
                                        static.logits_chunk)[0]
        return token_logp[packed.row[:, None], idx]  # past a sequence's end: ignored
    if coupled is None:
        response_logp = jax.lax.cond(with_logp, scores, lambda h: jnp.zeros((n, width), jnp.float32), hidden)
        return state, response_logp
    return state, scores(hidden)


def _logp_and_match(hidden: jax.Array, w: jax.Array, targets: jax.Array, seeds: jax.Array, index: jax.Array,
                    sampling: SamplingConfig, chunk: int | None) -> tuple[jax.Array, jax.Array]:
    """(log pi float32[R, W], match bool[R, W]) of the logits ``hidden`` [R, W, H] @ ``w`` [H, V] at ``targets``
    [R, W] with the noise of (seeds, index) [R, W] (``sampling.logp_and_samples``), ``chunk`` positions at a time
    (None: all), so no [R, W, V] array is live where the log-probs avoid one; the logits are float32
    (``logits_from_hidden``) as in decode."""
    def one(h, y, s, i):
        return logp_and_samples(logits_from_hidden(h, w), y, s, i, sampling)
    if chunk is None:
        return one(hidden, targets, seeds, index)
    r, n, _ = hidden.shape
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def split(x):
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(r, n_chunks, chunk, *x.shape[2:]).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: one(*xs), (split(hidden), split(targets), split(seeds), split(index)))
    return tuple(x.swapaxes(0, 1).reshape(r, -1)[:, :n] for x in out)


@functools.partial(jax.jit, donate_argnums=(0,))
def _activate_fn(state: DecodeState, slots, pending, lengths, generated, max_new, seeds, page_rows,
                 valid) -> DecodeState:
    """Slots ``slots`` [n] decode on from their pending token ``pending`` with ``lengths`` tokens cached and
    ``generated`` response tokens so far (rows not ``valid`` are padding, dropped)."""
    slot = jnp.where(valid, slots, state.tokens.shape[0])

    def put(arr, val):
        return arr.at[slot].set(val.astype(arr.dtype), mode="drop")
    return dataclasses.replace(
        state, page_table=put(state.page_table, page_rows), tokens=put(state.tokens, pending),
        lengths=put(state.lengths, lengths), generated=put(state.generated, generated),
        max_new=put(state.max_new, max_new), seeds=put(state.seeds, seeds), active=put(state.active, valid))


def _activate_slots(static: EngineStatic, state: DecodeState, tok, slots, lengths, gen_index, seeds, max_new,
                    page_rows, row_valid) -> DecodeState:
    """Slots ``slots`` [n] decode on from their sampled token ``tok`` with ``lengths`` tokens cached (rows not
    ``row_valid`` are padding, dropped); one that sampled a stop token or reached its cap stays inactive."""
    done = jnp.isin(tok, jnp.asarray(static.eos_ids, jnp.int32)) | (gen_index + 1 >= max_new)
    slot = jnp.where(row_valid, slots, state.tokens.shape[0])  # out-of-range rows are dropped

    def put(arr, val):
        return arr.at[slot].set(val.astype(arr.dtype), mode="drop")
    return dataclasses.replace(
        state, page_table=put(state.page_table, page_rows), tokens=put(state.tokens, tok),
        lengths=put(state.lengths, lengths), generated=put(state.generated, gen_index + 1),
        max_new=put(state.max_new, max_new), seeds=put(state.seeds, seeds), active=put(state.active, ~done),
    )


class _ExtendAttention:
    """New tokens appended to sequences whose history is cached in their slot's pages (a tool reply): each row's
    tokens are written into its pages at their positions, then attend over those pages up to their own position
    (the history, then the reply so far), so the history is never prefilled again. Each device attends over the
    pages it holds; over a pool split between devices the partial softmaxes (max, sum, weighted values) are
    combined across them, so a row may live on any device."""

    def __init__(self, pages: paged_cache.KVPages, page_rows, positions, valid, layout: PoolLayout):
        self.k, self.v = list(pages.k), list(pages.v)
        self.page_rows, self.positions, self.valid, self.layout = page_rows, positions, valid, layout

    def __call__(self, layer_idx, q, k, v):
        lay = self.layout

        def local(q, k, v, kp, vp, table, positions, valid):
            offset = lay.shard_offset(kp.shape[1])
            kp = paged_cache.write_kv(kp, k, positions, table, valid, offset)
            vp = paged_cache.write_kv(vp, v, positions, table, valid, offset)
            out = _attend_own_pages(q.astype(jnp.float32) * q.shape[-1] ** -0.5, kp, vp, table - offset, positions,
                                    lay.pool_axes)
            return out.astype(q.dtype), kp, vp

        rows = lay.heads_spec(slots=False)
        rep = PartitionSpec()
        local = lay.shard_map(local, (rows, rows, rows, lay.pages_spec(), lay.pages_spec(), rep, rep, rep),
                              (rows, lay.pages_spec(), lay.pages_spec()))
        out, self.k[layer_idx], self.v[layer_idx] = local(q, k, v, self.k[layer_idx], self.v[layer_idx],
                                                          self.page_rows, self.positions, self.valid)
        return out


EXTEND_BLOCK_TOKENS = 2048  # keys per block of the extend attention: its memory is O(rows x reply x block)


def _attend_own_pages(q, k_pages, v_pages, table, positions, pool_axes: tuple[str, ...]):
    """q: float32[n, W, Hq, D] (scaled); k/v_pages: [Hkv, P, S, D], the pages this device holds; table: int32[n, pps]
    local page ids (outside [0, P): held elsewhere); positions: int32[n, W]. Each query attends over its row's
    keys at positions <= its own -> float32[n, W, Hq, D], one block of pages at a time with a running max and sum
    (flash decoding's online softmax: never the whole gathered context, which at a real length does not fit).
    With ``pool_axes`` the per-device partial softmaxes are merged the same way, so the result does not depend
    on where the pages lie."""
    n, w, hq, d = q.shape
    hkv, held, size, _ = k_pages.shape
    pps = table.shape[1]
    block = max(1, min(pps, EXTEND_BLOCK_TOKENS // size))
    blocks = -(-pps // block)
    table = jnp.pad(table, ((0, 0), (0, blocks * block - pps)), constant_values=-1)  # padding: held nowhere
    table = table.reshape(n, blocks, block).transpose(1, 0, 2)  # [blocks, n, block]
    qg = q.reshape(n, w, hkv, hq // hkv, d)

    def body(carry, xs):
        m, s, acc = carry  # running max, sum [n, W, Hkv, G] and numerator [n, W, Hkv, G, D]
        i, cols = xs
        owned = (cols >= 0) & (cols < held)  # [n, block]
        idx = jnp.where(owned, cols, 0)
        k = k_pages[:, idx].reshape(hkv, n, block * size, d).astype(jnp.float32)
        v = v_pages[:, idx].reshape(hkv, n, block * size, d).astype(jnp.float32)
        key_pos = i * block * size + jnp.arange(block * size)
        visible = jnp.repeat(owned, size, axis=1)[:, None, :] & (key_pos[None, None, :] <= positions[:, :, None])
        visible = visible[:, :, None, None, :]  # [n, W, 1, 1, T]
        scores = jnp.where(visible, jnp.einsum("nwhgd,hntd->nwhgt", qg, k), -jnp.inf)
        m_new = jnp.maximum(m, scores.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key seen yet: nothing to rescale
        p = jnp.where(visible, jnp.exp(scores - safe[..., None]), 0.0)
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
        acc = acc * corr[..., None] + jnp.einsum("nwhgt,hntd->nwhgd", p, v)
        return (m_new, s * corr + p.sum(-1), acc), None

    g = hq // hkv
    init = (jnp.full((n, w, hkv, g), -jnp.inf, jnp.float32), jnp.zeros((n, w, hkv, g), jnp.float32),
            jnp.zeros((n, w, hkv, g, d), jnp.float32))
    (m, s, acc), _ = jax.lax.scan(body, init, (jnp.arange(blocks), table))
    if pool_axes:  # -inf where this device holds no key of the row
        top = jax.lax.pmax(m, pool_axes)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        s = jax.lax.psum(s * scale, pool_axes)
        acc = jax.lax.psum(acc * scale[..., None], pool_axes)
    return (acc / jnp.maximum(s, jnp.finfo(jnp.float32).tiny)[..., None]).reshape(n, w, hq, d)


def _extend_fn(static: EngineStatic, params, state: DecodeState, tokens, positions, valid, sample_at, slots,
               gen_index, seeds, max_new, page_rows, row_valid):
    """Appends ``tokens`` [n, W] (valid where ``valid``) to the sequences of ``slots`` at ``positions`` (each row
    continues its slot's cache), then each samples its next token from its last appended position (``sample_at``
    [n]) and decodes on from there. What a tool reply costs: its own tokens, not the history's."""
    model = nnx.merge(static.graphdef, params)
    attn = _ExtendAttention(state.pages, page_rows, positions, valid, static.layout)
    hidden, _ = model.hidden_states(tokens, positions=positions, attention=attn, mesh=static.layout.mesh)
    state = dataclasses.replace(state, pages=paged_cache.KVPages(k=attn.k, v=attn.v))
    rows = jnp.arange(tokens.shape[0])
    tok, logp = sample_tokens(model.logits_from_hidden(hidden[rows, sample_at]), seeds, gen_index, static.sampling)
    state = _activate_slots(static, state, tok, slots, positions[rows, sample_at] + 1, gen_index, seeds, max_new,
                            page_rows, row_valid)
    return state, (tok, logp)


_SLOT_FIELDS = ("page_table", "tokens", "lengths", "generated", "max_new", "seeds", "active")


def _generate_fn(static: EngineStatic, params, state: DecodeState, num_steps: int, live_pages: int | None = None,
                 live_slots: int | None = None, stop_finished: int | None = None):
    """``num_steps`` decode steps. ``live_pages``: no slot holds more pages than this during the dispatch, so
    attention reads only those columns of the page table (a bucket; None: all of them). ``live_slots``: every
    running slot is below this (the scheduler packs them to the front), so the steps run over those slots
    only (None: all); the outputs are ``[num_steps, live_slots]``. ``stop_finished`` (``EngineConfig``'s
    ``decode_stop_finished``): the loop returns after the step at which that many slots have finished in this
    dispatch (or every running one has), so the host can refill them without waiting for the other steps; the
    steps not run emit nothing (token and log-prob 0). The steps that run sample what the fixed loop samples
    (each token's key is its request's seed and index)."""
    whole = state
    if live_slots is not None:
        state = dataclasses.replace(state, **{f: getattr(state, f)[:live_slots] for f in _SLOT_FIELDS})
    table = state.page_table if live_pages is None else state.page_table[:, :live_pages]

    def step(state: DecodeState, _):
        # Merged inside the loop body: an adapted model's forward (qwix) writes to its modules, which must belong
        # to the trace that runs it.
        model = nnx.merge(static.graphdef, params)
        attn = _DecodeAttention(state.pages, table, state.lengths, state.active, static.layout, static.attention)
        hidden, _ = model.hidden_states(state.tokens[:, None], positions=state.lengths[:, None], attention=attn,
                                        mesh=static.layout.mesh)
        logits = model.logits_from_hidden(hidden[:, 0])
        tok, logp = sample_tokens(logits, state.seeds, state.generated, static.sampling)
        emit = state.active
        done = jnp.isin(tok, jnp.asarray(static.eos_ids, jnp.int32)) | (state.generated + 1 >= state.max_new)
        inc = emit.astype(jnp.int32)
        new_state = dataclasses.replace(
            state, pages=paged_cache.KVPages(k=attn.k, v=attn.v),
            tokens=jnp.where(emit, tok, state.tokens), lengths=state.lengths + inc,
            generated=state.generated + inc, active=emit & ~done,
        )
        return new_state, (tok, logp, emit)

    if stop_finished is None:
        state, (tokens, logps, emitted) = jax.lax.scan(step, state, None, length=num_steps)
    else:
        state, (tokens, logps, emitted) = _decode_until(step, state, num_steps, stop_finished)
    if live_slots is not None:  # the other slots are idle: their fields are unchanged
        state = dataclasses.replace(state, **{f: getattr(whole, f).at[:live_slots].set(getattr(state, f))
                                              for f in _SLOT_FIELDS})
    return state, (tokens, logps, emitted)


def _decode_until(step, state: DecodeState, num_steps: int, stop_finished: int):
    """Up to ``num_steps`` of ``step`` (the decode scan's body) in a ``while_loop`` that stops once
    ``stop_finished`` slots (at most the running ones) have finished since it began; outputs ``[num_steps, S]``
    as the scan's, the steps not run emitting nothing."""
    shapes = jax.eval_shape(lambda s: step(s, None)[1], state)
    outs = tuple(jnp.zeros((num_steps, *x.shape), x.dtype) for x in shapes)
    need = jnp.minimum(stop_finished, jnp.sum(state.active))  # fewer running: when they have all ended

    def cond(carry):
        i, state, finished, _ = carry
        return (i < num_steps) & (finished < need)

    def body(carry):
        i, state, finished, outs = carry
        new_state, out = step(state, None)
        finished = finished + jnp.sum(out[2] & ~new_state.active)  # emitted its last token at this step
        return i + 1, new_state, finished, tuple(o.at[i].set(x) for o, x in zip(outs, out, strict=True))

    _, state, _, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.int32(0), outs))
    return state, outs


@functools.partial(jax.jit, donate_argnums=(0,))
def _move_slots_fn(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Moves running slots ``src`` to free slots ``dst``: their metadata and page-table rows (the pages stay
    where they are); the sources are left inactive. Both padded to the slot count with an out-of-range slot
    (dropped), so one program serves every move."""
    moved = {f: getattr(state, f).at[dst].set(getattr(state, f)[jnp.minimum(src, state.tokens.shape[0] - 1)],
                                              mode="drop") for f in _SLOT_FIELDS}
    moved["active"] = moved["active"].at[src].set(False, mode="drop")
    return dataclasses.replace(state, **moved)


# XLA may skip a bf16 rounding it finds between float32 ops, or not, depending on how it fuses each shape: the
# prefill ([n, T]) and decode ([S, 1]) of the same tokens then round differently and a resume's log pi misses
# the recorded log mu (bench_ops_floor.py). Every rounding as written keeps the two paths in step.
_EXACT = {"xla_allow_excess_precision": False}
_prefill_jit = jax.jit(_prefill_fn, static_argnums=(0,), donate_argnums=(2,), compiler_options=_EXACT)
_generate_jit = jax.jit(_generate_fn, static_argnums=(0, 3, 4, 5, 6), donate_argnums=(2,), compiler_options=_EXACT)
_extend_jit = jax.jit(_extend_fn, static_argnums=(0,), donate_argnums=(2,), compiler_options=_EXACT)


def compiled_programs() -> int:
    """How many programs the engine's prefill, insert and decode functions hold compiled, over every engine in
    the process: benchmarks read it before and after a run to count recompiles."""
    return sum(f._cache_size() for f in (_prefill_jit, _activate_fn, _generate_jit, _extend_jit))


def _zeros_like(abstract: DecodeState) -> DecodeState:
    """The decode state, zeroed, in one program (array by array it would be one program per dtype and shape)."""
    def _zero_decode_state():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    return jax.jit(_zero_decode_state, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()


@functools.partial(jax.jit, donate_argnums=(0,))
def _deactivate_fn(state: DecodeState, mask: jax.Array) -> DecodeState:
    return dataclasses.replace(state, active=state.active & ~mask)


def _pad(x, n: int, dtype) -> np.ndarray:
    out = np.zeros((n,), dtype)
    out[: len(x)] = x
    return out


def rollout_graphdef(model: Qwen3ForCausalLM, compute_dtype: str | None = None) -> nnx.GraphDef:
    """The graph the engine's programs merge their params into: ``model``'s, its activations in
    ``compute_dtype`` (None: the model's own ``Qwen3Config.dtype``). Only the activation dtype differs, so the
    params of ``model`` (and of every later update, in their own dtype) merge into it unchanged. Works on an
    abstract model (``nnx.eval_shape``) too."""
    graphdef, _ = nnx.split(model)
    if compute_dtype is None or compute_dtype == model.cfg.dtype:
        return graphdef
    cfg = dataclasses.replace(model.cfg, dtype=compute_dtype)
    return nnx.split(lora.structure(cfg, lora.lora_config_of(model)))[0]


def serving_param_shardings(params: nnx.State, mesh: Mesh, serving_layout: str = "train",
                            rules: dict[str, tuple[str, ...]] | None = None) -> nnx.State:
    """The shardings the engine holds its weights in (``EngineConfig.serving_layout``; ``rules``: the model's
    logical-axis rules, ``Qwen3Config.rules()``)."""
    if serving_layout == "tensor":
        return mesh_lib.serving_shardings(params, mesh, rules)
    return mesh_lib.param_shardings(params, mesh, rules)


def pool_pages(model_cfg, config: EngineConfig, num_shards: int = 1) -> int:
    """Pages in the KV pool, a multiple of ``num_shards``: the budget's worth (``kv_memory_bytes``, the whole
    mesh's), or enough for every slot at ``max_seq_len`` plus each shard's scratch page."""
    if config.kv_memory_bytes is None:
        per_seq = -(-config.max_seq_len // config.page_size)
        return config.num_slots * per_seq + num_shards
    pages = paged_cache.num_pages_for_budget(model_cfg, config.page_size, config.kv_memory_bytes, config.kv_dtype)
    return pages - pages % num_shards


def abstract_decode_state(model_cfg, config: EngineConfig, layout: PoolLayout, num_pages: int) -> DecodeState:
    """The decode state as ``jax.ShapeDtypeStruct``s with their shardings (the engine allocates exactly this;
    the AOT compile lowers against it without allocating)."""
    s, pps = config.num_slots, -(-config.max_seq_len // config.page_size)
    pool_shape = (model_cfg.num_key_value_heads, num_pages, config.page_size, model_cfg.head_dim)
    pool = jax.ShapeDtypeStruct(pool_shape, resolve_dtype(config.kv_dtype),
                                sharding=NamedSharding(layout.mesh, layout.pages_spec()))

    def slots(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(layout.mesh, layout.slots_spec(len(shape))))
    layers = model_cfg.num_hidden_layers
    return DecodeState(
        pages=paged_cache.KVPages(k=[pool] * layers, v=[pool] * layers),
        page_table=slots((s, pps), jnp.int32), tokens=slots((s,), jnp.int32), lengths=slots((s,), jnp.int32),
        generated=slots((s,), jnp.int32), max_new=slots((s,), jnp.int32), seeds=slots((s,), jnp.uint32),
        active=slots((s,), bool),
        version=jax.ShapeDtypeStruct((), jnp.int32, sharding=mesh_lib.replicated(layout.mesh)),
    )


@dataclasses.dataclass
class PendingDecode:
    """A dispatched ``generate``: its outputs ``[k, live slots]`` on device and the version it sampled under."""

    out: tuple[jax.Array, jax.Array, jax.Array]
    num_slots: int
    version: int

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Waits for the dispatch; host arrays [k, S] (token ids, behaviour log-probs, emitted mask)."""
        tokens, logps, emitted = distributed.fetch(self.out)
        if tokens.shape[1] == self.num_slots:
            return tokens, logps, emitted
        pad = ((0, 0), (0, self.num_slots - tokens.shape[1]))  # the idle slots above the bucket emit nothing
        return np.pad(tokens, pad), np.pad(logps, pad), np.pad(emitted, pad)


@functools.cache
def _config_graphdef(model_cfg, compute_dtype: str | None) -> nnx.GraphDef:
    """The rollout graph of a model of ``model_cfg`` (``rollout_graphdef`` of an abstract one): no weights."""
    return rollout_graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0))), compute_dtype)


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The engine's static layout on its own mesh, from the model's config (``of``): the decode state's place
    (``PoolLayout``, the pool's pages), the graph its programs merge params into, the sampler and stop tokens, the
    attention kernels, and from those ``EngineStatic``, the key its compiled programs are cached on. The
    ``Engine`` is built from it (``engine``), and the deviceless compile lowers the same programs from it
    (``lower_*``), so what is sized is what runs. Its mesh is the engine's: a learner may train on another."""

    model_cfg: Any  # Qwen3Config
    config: EngineConfig
    sampling: SamplingConfig
    mesh: Mesh
    graphdef: nnx.GraphDef
    layout: PoolLayout
    num_pages: int
    eos_ids: tuple[int, ...]  # sorted; (-1,) when there are none
    stop_ids: tuple[int, ...]  # sorted, none of them an EOS
    flash: FlashConfig = DEFAULT_FLASH
    attention: tuple[tuple[str, Any], ...] = ()  # paged_attention's knobs, sorted (name, value) pairs

    @classmethod
    def of(cls, model_cfg, engine_cfg: EngineConfig, sampling: SamplingConfig, mesh: Mesh, *,
           eos_ids: tuple[int, ...] = (), stop_ids: tuple[int, ...] = (), flash: FlashConfig = DEFAULT_FLASH,
           attention: Mapping[str, Any] | None = None, graphdef: nnx.GraphDef | None = None) -> EnginePlan:
        """The plan of an engine for a model of ``model_cfg`` on ``mesh``. ``graphdef``: the concrete model's
        ``rollout_graphdef`` (None: derived from ``model_cfg``, without weights)."""
        eos = tuple(sorted(set(eos_ids))) or (-1,)
        layout = PoolLayout.for_mesh(mesh, engine_cfg.num_slots, model_cfg.num_key_value_heads,
                                     model_cfg.num_attention_heads, engine_cfg.megacore)
        return cls(model_cfg=model_cfg, config=engine_cfg, sampling=sampling, mesh=mesh,
                   graphdef=graphdef if graphdef is not None else _config_graphdef(model_cfg,
                                                                                    engine_cfg.compute_dtype),
                   layout=layout, num_pages=pool_pages(model_cfg, engine_cfg, layout.num_shards), eos_ids=eos,
                   stop_ids=tuple(sorted(set(stop_ids) - set(eos))), flash=flash,
                   attention=tuple(sorted(dict(attention or {}).items())))

    def static(self, sampling: SamplingConfig | None = None) -> EngineStatic:
        """What the compiled programs specialise on, sampling with ``sampling`` (None: the plan's)."""
        return EngineStatic(self.graphdef, sampling or self.sampling, tuple(sorted(self.eos_ids + self.stop_ids)),
                            self.layout, self.config.logits_chunk, self.flash, self.attention)

    def abstract_state(self) -> DecodeState:
        """The decode state the engine allocates, as ``jax.ShapeDtypeStruct``s with their shardings."""
        return abstract_decode_state(self.model_cfg, self.config, self.layout, self.num_pages)

    def param_shardings(self, params: nnx.State) -> nnx.State:
        """The shardings the engine holds ``params`` in (``EngineConfig.serving_layout``)."""
        return serving_param_shardings(params, self.mesh, self.config.serving_layout, self.model_cfg.rules())

    def abstract_params(self, params: nnx.State) -> nnx.State:
        """``params`` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs in the engine's shardings."""
        return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), params,
                            self.param_shardings(params), is_leaf=lambda x: isinstance(x, nnx.Variable))

    # The shape ladders: every compiled engine program is one of these buckets (run/shape_plan.py lists them).

    @property
    def pages_per_seq(self) -> int:
        return -(-self.config.max_seq_len // self.config.page_size)

    def prefill_widths(self) -> list[int]:
        """The packed prefill's row widths, ascending (``schedule_rules.prefill_widths``)."""
        c = self.config
        return schedule_rules.prefill_widths(c.min_prefill_len, c.max_seq_len, c.bucket_ratio)

    def prefill_rows(self, width: int) -> list[int]:
        """The packed prefill's row counts at ``width``, ascending (``schedule_rules.prefill_rows``)."""
        c = self.config
        return schedule_rules.prefill_rows(width, c.num_slots, c.prefill_token_budget, c.bucket_ratio)

    def live_slot_buckets(self) -> list[int]:
        """The slot counts decode compiles for, ascending: all slots divided by ``bucket_ratio`` while at least 8
        remain. One bucket (all slots) when ``live_slots`` is off or the slots are split over devices."""
        live = self.config.live_slots and self.layout.num_shards == 1
        return schedule_rules.live_slot_buckets(self.config.num_slots, live, self.config.bucket_ratio)

    def live_page_buckets(self) -> list[int]:
        """The page-table widths decode compiles for, ascending (the whole table only with ``live_pages`` off). On
        TPU each is a multiple of the Pallas kernel's ``pages_per_compute_block`` (the kernel refuses others)."""
        buckets = schedule_rules.live_page_buckets(self.pages_per_seq, self.config.live_pages,
                                                   self.config.bucket_ratio)
        if self.layout.platform != "tpu":
            return buckets
        block = dict(self.attention).get("pages_per_compute_block", PALLAS_TPU_BLOCK)
        return sorted({min(-(-b // block) * block, self.pages_per_seq) for b in buckets})

    def extend_widths(self) -> list[int]:
        """The widths of ``Engine.extend`` (a tool reply's new tokens), ascending."""
        return schedule_rules.ladder(1, self.config.max_seq_len, self.config.bucket_ratio)

    def copy_capacity(self, width: int) -> int:
        """Page copies a prefill of ``width`` can carry: every slot's pages of a row (a multiple of the slots)."""
        return self.config.num_slots * -(-width // self.config.page_size)

    def abstract_packed(self, rows: int, width: int) -> PackedPrefill:
        """A prefill call's input of ``rows`` x ``width`` as ShapeDtypeStructs (replicated)."""
        def sds(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=mesh_lib.replicated(self.mesh))
        n, c = self.config.num_slots, self.copy_capacity(width)
        return PackedPrefill(*[sds(rows, width)] * 6, *[sds(n)] * 3, sds(c), sds(c), sds())

    def lower_prefill(self, params, rows: int, width: int | None = None) -> jax.stages.Lowered:
        """The prefill (one program for new prompts and resumes: its log-prob pass is a runtime branch) of ``rows``
        packed rows of ``width`` tokens (default ``max_seq_len``) for (abstract) ``params``."""
        flag = jax.ShapeDtypeStruct((), bool, sharding=mesh_lib.replicated(self.mesh))
        return _prefill_jit.lower(self.static(), params, self.abstract_state(),
                                  self.abstract_packed(rows, width or self.config.max_seq_len), flag)

    def lower_decode(self, params, live_pages: int | None = None, live_slots: int | None = None
                     ) -> jax.stages.Lowered:
        """One decode dispatch (``steps_per_dispatch`` tokens) for (abstract) ``params``; ``live_pages``: the
        page-table bucket it reads, ``live_slots``: the slot bucket it runs over (None: all)."""
        return _generate_jit.lower(self.static(), params, self.abstract_state(), self.config.steps_per_dispatch,
                                   live_pages, live_slots, self.config.decode_stop_finished or None)

    def lower_activate(self) -> jax.stages.Lowered:
        """The slot activation after a prefill (one program: its arrays have one row per slot)."""
        def arg(shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.replicated(self.mesh))
        n = self.config.num_slots
        return _activate_fn.lower(self.abstract_state(), *[arg((n,))] * 5, arg((n,), jnp.uint32),
                                  arg((n, self.pages_per_seq)), arg((n,), bool))

    def lower_extend(self, params, width: int) -> jax.stages.Lowered:
        """``Engine.extend`` of every slot at once, ``width`` new tokens each (tool replies)."""
        def arg(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.replicated(self.mesh))
        rows, pps = self.config.num_slots, -(-self.config.max_seq_len // self.config.page_size)
        return _extend_jit.lower(self.static(), params, self.abstract_state(), arg((rows, width), jnp.int32),
                                 arg((rows, width), jnp.int32), arg((rows, width), bool),
                                 *[arg((rows,), jnp.int32)] * 3, arg((rows,), jnp.uint32), arg((rows,), jnp.int32),
                                 arg((rows, pps), jnp.int32), arg((rows,), bool))

    def engine(self, model: Qwen3ForCausalLM) -> Engine:
        """The engine of this plan holding ``model``'s weights (concrete), on the plan's mesh."""
        return Engine.from_plan(self, model)


class Engine:
    """Owns the compiled prefill/insert/generate functions and the decode state of ``num_slots`` slots."""

    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig, sampling: SamplingConfig,
                 eos_ids: tuple[int, ...] = (), mesh: Mesh | None = None, flash: FlashConfig = DEFAULT_FLASH,
                 attention: Mapping[str, Any] | None = None, stop_ids: tuple[int, ...] = ()):
        """``flash``: the prefill's attention kernel; ``attention``: ``paged_attention``'s knobs for decode (both
        part of what the compiled functions are cached on). ``stop_ids``: tokens that end a policy turn without
        ending the sequence (a tool call's closing tag): decode stops there like at an EOS, and the host decides
        what follows (``extend`` with the tool's reply)."""
        mesh = mesh or mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
        self._open(model, EnginePlan.of(model.cfg, config, sampling, mesh, eos_ids=eos_ids, stop_ids=stop_ids,
                                        flash=flash, attention=attention,
                                        graphdef=rollout_graphdef(model, config.compute_dtype)))

    @classmethod
    def from_plan(cls, plan: EnginePlan, model: Qwen3ForCausalLM) -> Engine:
        """The engine of ``plan`` holding ``model``'s weights: the layout is not worked out again."""
        engine = cls.__new__(cls)
        engine._open(model, plan)
        return engine

    def _open(self, model: Qwen3ForCausalLM, plan: EnginePlan) -> None:
        """Places ``model``'s weights and allocates the decode state as ``plan`` lays them out."""
        self.plan, config = plan, plan.config
        self._statics: dict[SamplingConfig, EngineStatic] = {}  # _static's, per sampler
        self.config, self.sampling, self.flash, self.attention = config, plan.sampling, plan.flash, plan.attention
        self.model_config, self.graphdef, self.mesh = model.cfg, plan.graphdef, plan.mesh
        self.eos_ids, self.stop_ids, self.layout = self.plan.eos_ids, self.plan.stop_ids, self.plan.layout
        _, trainable, frozen = lora.split_trainable(model)
        self._frozen = self._place_params(frozen)  # an adapted model's base: never republished
        self._install(self._place_params(trainable))
        self.allocator = paged_cache.PageAllocator(self.plan.num_pages, config.page_size, config.num_slots,
                                                   config.max_seq_len, self.layout.num_shards)
        self.state = _zeros_like(abstract_decode_state(model.cfg, config, self.layout, self.allocator.num_pages))
        self.sync_page_table()  # every slot starts on its own shard's scratch page
        self._version = 0  # the host's copy of state.version: reading the device's would wait for every dispatch
        self.dispatched: set[tuple[str, tuple]] = set()  # (family, bucket) of every program run (shape_plan)

    # ------------------------------------------------------------------------------------------------
    # Placement

    def _place_params(self, params):
        # From the learner's mesh, which may be other devices (the asynchronous mode): a reshard that neither
        # waits for the params to be computed nor goes through the host (infra/transfer.py).
        return transfer.reshard(params, self.plan.param_shardings(params))

    def place_params(self, params: nnx.State) -> nnx.State:
        """A copy of ``params`` (on any mesh) in the engine's serving layout, on its mesh; not waited for (the
        copy runs while the engine decodes: a staging copy that ``swap_params`` installs)."""
        return self._place_params(params)

    def swap_params(self, placed: nnx.State, version: int) -> None:
        """Installs a whole copy made by ``place_params`` as the weights of policy ``version``."""
        self._install(placed)
        self.set_version(version)

    def _install(self, placed: nnx.State) -> None:
        # The programs take one params tree: an adapted model's base joined with its adapters (no copy).
        self.trainable = placed
        self.params = nnx.merge_state(self._frozen, placed) if jax.tree.leaves(self._frozen) else placed

    def update_params(self, params: nnx.State, version: int) -> None:
        """New policy weights (e.g. after a train step) and their version number. A serving copy replaces the
        old one, never beside it (the old one is dropped first). ``params``: what the learner trains (every
        weight, or an adapted model's adapters: the base stays)."""
        self.params = self.trainable = None
        self.swap_params(self._place_params(params), version)

    def set_version(self, version: int) -> None:
        self._version = int(version)
        # On the decode state's own (replicated) sharding: an unplaced scalar is another program's input type.
        self.state = dataclasses.replace(self.state, version=jax.device_put(np.int32(version),
                                                                            mesh_lib.replicated(self.mesh)))

    @property
    def compute_dtype(self) -> str:
        """The activation dtype the engine runs (``EngineConfig.compute_dtype`` or the model's own)."""
        return self.config.compute_dtype or self.model_config.dtype

    def _static(self) -> EngineStatic:
        """The plan's static with the current sampler (evaluation swaps ``sampling`` for its own): one object per
        sampler, built once, so that every dispatch's static argument is the same object, its hash already known."""
        static = self._statics.get(self.sampling)
        if static is None:
            static = self._statics[self.sampling] = self.plan.static(self.sampling)
        return static

    @property
    def static(self) -> EngineStatic:
        """The compiled programs' static argument (what ``lower_decode`` and friends take); its ``kernel()`` names
        the prefill kernel in use."""
        return self._static()

    @property
    def version(self) -> int:
        """The current params' policy version (host-side: no wait for the device)."""
        return self._version

    # ------------------------------------------------------------------------------------------------
    # JetStream-shaped API (host side)

    def warmup(self, prompt_len: int | None = None) -> None:
        """Compiles the programs a first admission uses: the prefill of a full batch of new prompts of
        ``prompt_len`` tokens (default 1), the activation, and decode over the smallest live buckets. The rest of
        the shape plan compiles when first used, or ahead with ``run/shape_plan.compile_ahead``. The dummy
        prompts sit in free slots, whose pages are the scratch page, and no slot is activated."""
        n = self.config.num_slots
        seqs = [np.zeros((prompt_len or 1,), np.int32)] * n
        self.prefill(seqs, list(range(n)), [len(s) for s in seqs], with_logp=False)
        self.state = _activate_fn(self.state, *self._activation_args([], [], [], [], []))
        self.state, _ = _generate_jit(self._static(), self.params, self.state, self.config.steps_per_dispatch,
                                      self.live_page_buckets()[0] if self.config.live_pages else None,
                                      self._slot_bucket(self.live_slot_buckets()[0]),
                                      self.config.decode_stop_finished or None)
        self.state = _deactivate_fn(self.state, np.zeros((n,), bool))
        self.sync_page_table()

    def prefill_widths(self) -> list[int]:
        return self.plan.prefill_widths()

    def prefill_rows(self, width: int) -> list[int]:
        return self.plan.prefill_rows(width)

    def prefill_bucket(self, seq_len: int) -> int:
        """The packed row width of a prefill whose longest sequence has ``seq_len`` tokens (its last token is the
        slot's pending token, not prefilled)."""
        return schedule_rules.smallest_holding(self.prefill_widths(), max(1, seq_len - 1))

    def pack(self, sequences: list[np.ndarray], slots: list[int], prompt_lens: list[int],
             source: list[int] | None = None) -> PackedPrefill:
        """The packed layout of one prefill call (host arrays): each sequence but its last token, in rows of the
        longest one's width bucket, filled first-fit, their number a bucket (``prefill_rows``); sequence i's tokens
        go to the pages of ``slots[i]``. ``source[i] = j != i``: sequence i repeats sequence j's tokens (a group's
        members), so i gets a copy of j's pages instead of its own rows."""
        n, c = len(sequences), self.config
        if n > c.num_slots:
            raise ValueError(f"Engine.pack: {n} sequences, more than the {c.num_slots} slots.")
        source = list(range(n)) if source is None else source
        own = [i for i in range(n) if source[i] == i]
        lengths = {i: len(sequences[i]) - 1 for i in own}
        width = self.prefill_bucket(max(len(s) for s in sequences))
        layout = [[own[k] for k in row] for row in schedule_rules.first_fit([lengths[i] for i in own], width)]
        buckets = self.prefill_rows(width)
        if len(layout) > buckets[-1]:
            raise ValueError(f"Engine.pack: {len(layout)} rows of {width} tokens, more than the "
                             f"{buckets[-1]} of EngineConfig.prefill_token_budget: split the call "
                             "(Scheduler does, by Engine.split_for_prefill).")
        rows = schedule_rules.smallest_holding(buckets, len(layout))
        tokens, positions, segments, pages, page_slots, targets = (np.zeros((rows, width), np.int32)
                                                                   for _ in range(6))
        row, start, plens = (np.zeros((c.num_slots,), np.int32) for _ in range(3))
        size, table = self.allocator.page_size, self.allocator.table
        for r, members in enumerate(layout):
            offset = 0
            for segment, i in enumerate(members, start=1):
                m, cols, seq = lengths[i], slice(offset, offset + lengths[i]), sequences[i]
                pos = np.arange(m)
                tokens[r, cols], positions[r, cols], segments[r, cols] = seq[:-1], pos, segment
                targets[r, cols] = seq[1:]
                pages[r, cols], page_slots[r, cols] = table[slots[i], pos // size], pos % size
                row[i], start[i] = r, offset
                offset += m
        row[:n], start[:n] = row[source], start[source]  # a copying member reads its source's place
        plens[:n] = prompt_lens
        pairs = [(table[slots[source[i]], p], table[slots[i], p]) for i in range(n) if source[i] != i
                 for p in range(-(-(len(sequences[i]) - 1) // size))]
        cap = self.plan.copy_capacity(width)
        copy_src, copy_dst = np.zeros((cap,), np.int32), np.zeros((cap,), np.int32)
        if pairs:
            copy_src[: len(pairs)], copy_dst[: len(pairs)] = zip(*pairs, strict=True)
        return PackedPrefill(tokens, positions, segments, pages, page_slots, targets, row, start, plens,
                             copy_src, copy_dst, np.asarray(len(pairs), np.int32))

    def split_for_prefill(self, lengths: list[int]) -> list[list[int]]:
        """Indices of sequences of ``lengths`` tokens (one width bucket) in groups that each pack into at most
        the largest row bucket: the calls ``EngineConfig.prefill_token_budget`` allows (one when it is None)."""
        width = self.prefill_bucket(max(lengths))
        most = self.prefill_rows(width)[-1]
        layout = schedule_rules.first_fit([max(0, n - 1) for n in lengths], width)
        return [sorted(i for row in layout[k: k + most] for i in row) for k in range(0, len(layout), most)]

    def prefill(self, sequences: list[np.ndarray], slots: list[int], prompt_lens: list[int],
                with_logp: bool = True, source: list[int] | None = None, coupled_seeds: list[int] | None = None):
        """Runs every sequence but its last token through the current params in one call, packed (``pack``),
        writing K/V into the pages already allocated to ``slots`` (a ``source`` member gets a copy of its
        source's pages). Returns (on device) each sequence's response log pi, float32[S, W] (entry j: response
        token j), which verification needs; ``with_logp`` False skips that full-vocabulary pass (zeros).
        ``coupled_seeds`` (one sampling seed per sequence): returns (log pi, match bool[S, W]) instead, match[i, j]
        = the current params with response token j's noise (seed i, index j) sample that token (the coupled
        verification rule; another program than the two-stage rule's, compiled at its first use)."""
        packed = self.pack(sequences, slots, prompt_lens, source)
        self.dispatched.add(("prefill" if coupled_seeds is None else "coupled_prefill", packed.tokens.shape))
        if coupled_seeds is None:
            self.state, response_logp = _prefill_jit(self._static(), self.params, self.state, packed,
                                                     np.asarray(with_logp))
            return response_logp
        self.state, out = _prefill_jit(self._static(), self.params, self.state, packed, np.asarray(True),
                                       self._coupled_keys(packed, sequences, prompt_lens, coupled_seeds, source))
        return out

    @staticmethod
    def _coupled_keys(packed: PackedPrefill, sequences, prompt_lens, seeds, source=None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(seed uint32[R, W], response index int32[R, W]) of each packed position's target: the key its token
        was sampled with. Sequences that copy another's pages hold no rows (new prompts: nothing to check)."""
        key_seeds = np.zeros(packed.tokens.shape, np.uint32)
        key_index = np.zeros(packed.tokens.shape, np.int32)
        for i, seq in enumerate(sequences):
            r, a, m = int(packed.row[i]), int(packed.start[i]), len(seq) - 1
            if m <= 0 or (source is not None and source[i] != i):
                continue
            key_seeds[r, a: a + m] = seeds[i]
            key_index[r, a: a + m] = np.arange(1, m + 1) - prompt_lens[i]  # target p + 1 is response index p + 1 - P
        return key_seeds, key_index

    def activate(self, slots: list[int], sequences: list[np.ndarray], gen_index: list[int], seeds: list[int],
                 max_new: list[int]) -> None:
        """Slots ``slots`` decode on after ``prefill``: each from its sequence's last token (pending: the next
        decode step writes its K/V and samples token ``gen_index[i]`` after it). Nothing is sampled here, so
        nothing is read back."""
        self.state = _activate_fn(self.state, *self._activation_args(slots, sequences, gen_index, seeds, max_new))

    def _activation_args(self, slots, sequences, gen_index, seeds, max_new) -> tuple:
        n = self.config.num_slots
        page_rows = np.zeros((n, self.allocator.pages_per_seq), np.int32)
        page_rows[: len(slots)] = self.allocator.table[slots]
        return (_pad(slots, n, np.int32), _pad([s[-1] for s in sequences], n, np.int32),
                _pad([len(s) - 1 for s in sequences], n, np.int32), _pad(gen_index, n, np.int32),
                _pad(max_new, n, np.int32), _pad(seeds, n, np.uint32), page_rows, _pad([True] * len(slots), n, bool))

    def admit(self, sequences: list[np.ndarray], slots: list[int], prompt_lens: list[int], gen_index: list[int],
              seeds: list[int], max_new: list[int], source: list[int] | None = None) -> None:
        """``prefill`` (no log-probs) then ``activate``: admissions that verify nothing. ``source[i] = j < i``:
        sequence i equals sequence j (a group's members, one prompt), so it is prefilled once and i's pages get
        a copy of j's K/V; each samples its first token in decode with its own seed. Two dispatches, no read."""
        self.prefill(sequences, slots, prompt_lens, with_logp=False, source=source)
        self.activate(slots, sequences, gen_index, seeds, max_new)

    def extend(self, slots: list[int], sequences: list[np.ndarray], cached: list[int], gen_index: list[int],
               seeds: list[int], max_new: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Continues the sequences held (inactive) in ``slots``: ``sequences[i]`` is slot i's whole sequence, of
        which the first ``cached[i]`` tokens are in its pages; the rest (a tool call's closing tag, the reply) is
        written after them, attending over the cache, and each slot samples its next token (index ``gen_index``)
        from its last position and decodes on. The slots' pages must cover the sequences. Returns (tokens, log
        mu) of the sampled tokens."""
        n = len(slots)
        news = [np.asarray(seq[c:], np.int32) for seq, c in zip(sequences, cached, strict=True)]
        if any(len(x) == 0 for x in news):
            raise ValueError("Engine.extend: every sequence needs at least one token past its cached prefix.")
        width = schedule_rules.smallest_holding(self.plan.extend_widths(), max(len(x) for x in news))
        nb = self.config.num_slots
        tokens, positions = np.zeros((nb, width), np.int32), np.zeros((nb, width), np.int32)
        valid, sample_at = np.zeros((nb, width), bool), np.zeros((nb,), np.int32)
        for i, (x, c) in enumerate(zip(news, cached, strict=True)):
            tokens[i, : len(x)], valid[i, : len(x)] = x, True
            positions[i] = c + np.minimum(np.arange(width), len(x) - 1)  # padding repeats the last position
            sample_at[i] = len(x) - 1
        self.dispatched.add(("extend", (width,)))
        self.state, out = _extend_jit(self._static(), self.params, self.state, tokens, positions, valid, sample_at,
                                      *self._slot_args(nb, slots, gen_index, seeds, max_new))
        tok, logp = distributed.fetch(out)
        return tok[:n], logp[:n]

    def _slot_args(self, nb: int, slots, gen_index, seeds, max_new) -> tuple:
        """insert's per-sequence arguments padded to ``nb`` rows (padding rows are not valid: dropped)."""
        page_rows = np.zeros((nb, self.allocator.pages_per_seq), np.int32)
        page_rows[: len(slots)] = self.allocator.table[slots]
        return (_pad(slots, nb, np.int32), _pad(gen_index, nb, np.int32), _pad(seeds, nb, np.uint32),
                _pad(max_new, nb, np.int32), page_rows, _pad([True] * len(slots), nb, bool))

    def generate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``steps_per_dispatch`` decode steps over all slots. Returns host arrays [k, S]: token ids,
        behaviour log-probs and the emitted mask."""
        return self.dispatch_generate().fetch()

    def dispatch_generate(self) -> PendingDecode:
        """``generate`` without waiting for it: the outputs stay on device until ``PendingDecode.fetch``, so the
        host can plan (and dispatch) the next one while the device decodes this one."""
        live = self.live_pages() if self.config.live_pages else None
        slots = self.live_slots()
        self.dispatched.add(("decode", (slots, live)))
        self.state, out = _generate_jit(self._static(), self.params, self.state, self.config.steps_per_dispatch,
                                        live, self._slot_bucket(slots), self.config.decode_stop_finished or None)
        return PendingDecode(out, self.config.num_slots, self._version)

    def live_slot_buckets(self) -> list[int]:
        return self.plan.live_slot_buckets()

    def _slot_bucket(self, slots: int) -> int | None:
        """``_generate_fn``'s ``live_slots`` key of a bucket (None: all slots)."""
        return None if slots == self.config.num_slots else slots

    def live_slots(self) -> int:
        """The smallest slot bucket above every slot that holds pages (a running sequence)."""
        top = max(self.allocator.owned, default=0) + 1
        return next(b for b in self.live_slot_buckets() if b >= top)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Moves running sequences from slots ``src`` to free slots ``dst`` (their pages stay: only the
        page-table rows and the slot metadata move), so running slots can be packed to the front."""
        for a, b in zip(src, dst, strict=True):
            self.allocator.move(a, b)
        n = self.config.num_slots
        pad = np.full((n,), n, np.int32)  # out of range: dropped
        src_, dst_ = pad.copy(), pad.copy()
        src_[: len(src)], dst_[: len(dst)] = src, dst
        self.state = _move_slots_fn(self.state, src_, dst_)

    def live_page_buckets(self) -> list[int]:
        return self.plan.live_page_buckets()

    def live_pages(self) -> int:
        """The smallest bucket that holds every slot's pages: decode attends over live pages only, not over the
        whole page table (on CPU and GPU the reference attention gathers what the table lists)."""
        most = max((len(p) for p in self.allocator.owned.values()), default=1)
        return next(b for b in self.live_page_buckets() if b >= most)

    def sync_page_table(self) -> None:
        """Pushes the host page table to the device after pages were granted to running slots: a new array in the
        table's sharding (each process fills its own devices' shards), not a call that takes the whole decode
        state (at 36 layers its ~80 arrays cost the host 0.2 ms a dispatch)."""
        table = self.allocator.table.copy()
        self.state = dataclasses.replace(self.state, page_table=jax.make_array_from_callback(
            table.shape, self.state.page_table.sharding, lambda index: table[index]))

    def deactivate(self, slots: list[int]) -> None:
        mask = np.zeros((self.config.num_slots,), bool)
        mask[slots] = True
        self.state = _deactivate_fn(self.state, mask)
