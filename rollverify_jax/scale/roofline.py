"""Decode against the HBM roofline: what one decode step must read per chip, and what the compiled step reads.

    roofline step  = max(weight bytes / chips + live KV bytes, 2 * active params * running tokens / chips
                         * (bytes per FLOP of the chip)) / HBM bandwidth
    estimated step = max(weights as laid out + KV the kernel reads, the program's FLOPs) / the chip's peaks
                     + collective bytes sent / ICI bandwidth + collectives x latency
    decode_roofline_fraction = roofline time / estimated time, summed over the steps of a phase

Live KV: the tokens the running slots attend over (a slot at its t-th response token attends prompt + t + 1).
What the paged-attention kernel reads is more: whole blocks of pages per slot, and for an inactive slot (finished,
preempted, free) either its stale length (clamped to the live page-table width; the rule before issue 26) or one
block. The response lengths follow the simulator's real-scale model (a lognormal capped at ``max_new_tokens``;
configs/sim/scale_common.gin). Pure Python (and the JAX-free ``schedule_rules``): the simulator's cost model can
use the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence

from rollverify_jax import schedule_rules

INACTIVE_RULES = ("stale", "one")  # an inactive slot attends over its stale length, or over one token


def lognormal_lengths(median: float, sigma: float, cap: int, n: int = 512, seed: int = 0) -> list[int]:
    """``n`` response lengths at equal-probability quantiles of a lognormal (``median``, ``sigma``), each in
    [1, cap], in a fixed shuffled order (the order sequences are admitted in): deterministic, no sampling noise
    in the mean, and a phase's tail is not the sorted longest ones."""
    if median < 1 or sigma < 0 or cap < 1 or n < 1:
        raise ValueError(f"lognormal_lengths: median={median} >= 1, sigma={sigma} >= 0, cap={cap} >= 1 and n={n} "
                         ">= 1 needed.")
    dist = statistics.NormalDist()
    out = [max(1, min(cap, round(median * math.exp(sigma * dist.inv_cdf((i + 0.5) / n))))) for i in range(n)]
    random.Random(seed).shuffle(out)
    return out


def block_tokens_sum(lo, hi, block: int):
    """sum over x in [lo, hi] of x rounded up to a multiple of ``block`` (tokens a kernel reads that fetches
    whole blocks), in closed form; 0 when hi < lo. ``lo`` and ``hi`` may be ints or integer numpy arrays
    (elementwise: the simulator prices every running slot at once)."""

    def upto(n):  # sum over x in [1, n]
        q, s = divmod(n * (n > 0), block)
        return block * block * q * (q + 1) // 2 + s * (q + 1) * block
    return (upto(hi) - upto(lo - 1)) * (hi >= lo)


def _blocks(tokens: int, block: int) -> int:
    """``tokens`` rounded up to whole blocks."""
    return -(-tokens // block) * block


def running_context(lengths: Sequence[int], prompt_len: int) -> float:
    """Mean tokens a running slot attends over at a decode step, over every step of every sequence (a sequence
    of L response tokens runs L steps, attending prompt + 1 .. prompt + L): the live KV per running slot when
    slots stay full (partial rollout)."""
    steps = sum(lengths)
    return sum(n * (prompt_len + 1) + n * (n - 1) / 2 for n in lengths) / steps


@dataclasses.dataclass(frozen=True)
class DispatchReads:
    """One dispatch of ``steps`` decode steps: slot-steps of running slots, tokens they attend over (live KV),
    and tokens the kernel reads per inactive-slot rule (whole blocks, every slot)."""

    steps: int
    running: int
    live: int
    kernel: dict[str, int]


@dataclasses.dataclass(frozen=True)
class PhaseReads:
    """A phase's decode, dispatch by dispatch."""

    dispatches: tuple[DispatchReads, ...]

    @property
    def steps(self) -> int:
        return sum(d.steps for d in self.dispatches)

    @property
    def running_slot_steps(self) -> int:
        return sum(d.running for d in self.dispatches)

    @property
    def live_tokens(self) -> int:
        return sum(d.live for d in self.dispatches)

    def kernel_tokens(self, rule: str) -> int:
        return sum(d.kernel[rule] for d in self.dispatches)

    def read_ratio(self, rule: str) -> float:
        """KV the kernel reads over the KV the running slots need."""
        return self.kernel_tokens(rule) / self.live_tokens


def on_policy_phase(lengths: Sequence[int], num_slots: int, prompt_len: int, page_size: int, max_seq_len: int,
                    steps_per_dispatch: int, block_tokens: int) -> PhaseReads:
    """Decode of one on-policy phase: ``lengths`` (response tokens, in admission order) through ``num_slots``
    slots with continuous batching (a finished slot takes the next queued sequence at the next dispatch), until
    every sequence is done; the tail runs with fewer and fewer slots. Attention reads the live page-table width
    (``schedule_rules.live_page_buckets``, pages held for the next dispatch's tokens) and whole blocks of
    ``block_tokens``. An inactive slot reads its stale length + 1 clamped to that width ('stale') or one token
    ('one'), rounded to a block either way."""
    if num_slots < 1 or page_size < 1 or steps_per_dispatch < 1 or block_tokens < 1:
        raise ValueError("on_policy_phase: num_slots, page_size, steps_per_dispatch and block_tokens must be >= 1.")
    if any(n < 1 for n in lengths) or any(prompt_len + n > max_seq_len for n in lengths):
        raise ValueError(f"on_policy_phase: every length must be in [1, max_seq_len - prompt_len = "
                         f"{max_seq_len - prompt_len}].")
    k, queue = steps_per_dispatch, list(lengths)[::-1]
    buckets = schedule_rules.live_page_buckets(-(-max_seq_len // page_size))
    running: list[tuple[int, int, int]] = []  # (slot, cached tokens, response tokens left)
    stale = [0] * num_slots  # cached tokens of each slot's last sequence (0: never used)
    free = list(range(num_slots))[::-1]
    out = []
    while queue or running:
        while queue and free:
            running.append((free.pop(), prompt_len, queue.pop()))
        most = max(min(max_seq_len, c + k + 1) for _, c, _ in running)
        width = schedule_rules.smallest_holding(buckets, -(-most // page_size)) * page_size
        busy = {slot for slot, _, _ in running}
        idle = [s for s in range(num_slots) if s not in busy]  # inactive for the whole dispatch
        kernel = {"one": k * len(idle) * block_tokens,
                  "stale": k * sum(_blocks(min(stale[s] + 1, width), block_tokens) for s in idle)}
        live = steps = 0
        keep = []
        for slot, cached, left in running:
            r = min(k, left)  # steps it runs in this dispatch, attending cached + 1 .. cached + r
            live += r * cached + r * (r + 1) // 2
            steps += r
            read = block_tokens_sum(cached + 1, cached + r, block_tokens)
            kernel["one"] += read + (k - r) * block_tokens  # then inactive for the dispatch's other steps
            kernel["stale"] += read + (k - r) * _blocks(min(cached + r + 1, width), block_tokens)
            if left > r:
                keep.append((slot, cached + r, left - r))
            else:
                stale[slot] = cached + r
                free.append(slot)
        running = keep
        out.append(DispatchReads(k, steps, live, kernel))
    return PhaseReads(tuple(out))


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """Per chip, what a decode step costs beside its KV: the weights it reads (as laid out; and the least any
    layout reads, every byte once over the slice), its FLOPs, its collectives, and the chip's figures. Tokens
    are counted over the whole slice; ``shards`` split the slots, every chip reads its slots' KV of its heads."""

    weights: float  # bytes per chip as laid out
    weights_min: float  # model bytes / chips
    kv_bytes_per_token: float  # per chip: K and V of one token, every layer, the chip's KV heads
    shards: int  # slot shards: each chip reads the KV of num_slots / shards slots
    devices: int
    forward_flops_per_token: float  # whole model: 2 x (active params + head)
    attn_flops_per_token_ctx: float  # whole model: 4 x layers x q heads x head_dim per attended token
    program_flops: float  # per chip per step as compiled (cost analysis: every slot, attention kernel excluded)
    collective_bytes: float  # per chip per step, sent
    collectives: float  # per step
    hbm_bandwidth: float
    peak_flops: float
    ici_bandwidth: float  # bytes/s one collective sends at
    collective_latency_s: float
    kernel_hbm_share: float = 1.0  # the share of HBM bandwidth the attention kernel reads at

    def roofline_s(self, steps: int, running: int, live: int) -> float:
        """``steps`` steps with ``running`` slot-steps attending ``live`` tokens: the least bytes (weights once
        over the slice, live KV) or the useful FLOPs, whichever binds, at the chip's peaks."""
        kv = live / self.shards * self.kv_bytes_per_token
        flops = (running * self.forward_flops_per_token + live * self.attn_flops_per_token_ctx) / self.devices
        return max((steps * self.weights_min + kv) / self.hbm_bandwidth, flops / self.peak_flops)

    def estimate_s(self, steps: int, kernel_tokens: int) -> float:
        """``steps`` steps of the compiled program whose attention kernel reads ``kernel_tokens``: weights as laid
        out and that KV, or every slot's FLOPs, whichever binds; then the collectives, not overlapped (each
        layer waits on the one before)."""
        kv = kernel_tokens / self.shards * self.kv_bytes_per_token
        memory = steps * self.weights / self.hbm_bandwidth + kv / (self.hbm_bandwidth * self.kernel_hbm_share)
        flops = steps * self.program_flops + kernel_tokens * self.attn_flops_per_token_ctx / self.devices
        ici = self.collective_bytes / self.ici_bandwidth if self.ici_bandwidth else 0.0
        return max(memory, flops / self.peak_flops) + steps * (ici + self.collectives * self.collective_latency_s)

    def phase(self, reads: PhaseReads, rule: str) -> tuple[float, float]:
        """(roofline, estimate) seconds of a phase under an inactive-slot rule, dispatch by dispatch."""
        roof = sum(self.roofline_s(d.steps, d.running, d.live) for d in reads.dispatches)
        return roof, sum(self.estimate_s(d.steps, d.kernel[rule]) for d in reads.dispatches)
