"""What each piece of a training step costs, in seconds: the simulator's cost model.

    decode dispatch (k steps over the live bucket of b slots and a live page table W tokens wide, A attended
    tokens of the running ones at its start)
        = k * (decode_step_s + decode_slot_s * b + decode_width_token_s * b * W + decode_ctx_token_s * A)
    admission round (per length bucket of the requests admitted together: one prefill-and-sample call, or a
    log-prob prefill and an insert call when the bucket verifies a resume; ``Workload.prefill_shape`` packs it)
        = prefill_call_s * calls + prefill_token_s * padded tokens (rows x width the calls compute)
          + prefill_attn_s * sum over the calls of rows x width^2 (causal attention over every packed row)
          + prefill_logp_token_s * padded tokens of the log-prob calls + verify_token_s * verified cached tokens
    train step (sequences of p + L_i tokens, packed by the learner into rows r of width T_r: ``TrainLayout``)
        = train_step_s + train_token_s * sum_i (p + L_i) + train_attn_s * sum_i (p + L_i)^2
          + train_position_s * sum_r T_r + train_row_attn_s * sum_r T_r^2
      (the token terms price the real tokens, the position terms the rows the packed step computes, padding
      included; without a layout every sequence is its own row of its own length: perfect packing)
    every step also pays step_overhead_s (grading, packing, host bookkeeping)

Costs come from measured rates (``calibrate.fit_costs`` on a run's ``metrics.jsonl``) or from a roofline of the
compiled programs (``RooflineCosts``: XLA cost analysis of the real config's decode, prefill and train step,
at stated chip peaks and efficiencies). Pure Python: importing this never imports JAX.
"""

from __future__ import annotations

import dataclasses

import gin


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work (all default 0: a model with nothing bound costs nothing)."""

    decode_step_s: float = 0.0  # per decode step (weights read, fixed-shape work, host per dispatch / k)
    decode_slot_s: float = 0.0  # per slot of the live bucket per decode step (idle slots in it compute too)
    decode_ctx_token_s: float = 0.0  # per attended (cached) token per decode step
    # per bucket slot per token of the live page-table width per decode step (the reference attention of CPU
    # and GPU gathers every page the table lists for every slot of the bucket; Pallas on TPU reads A only)
    decode_width_token_s: float = 0.0
    prefill_call_s: float = 0.0  # per prefill, prefill-and-sample or insert call
    prefill_token_s: float = 0.0  # per prefilled token the calls compute (packed rows x width)
    prefill_attn_s: float = 0.0  # per row x width^2 of every prefill call (causal attention: halved already)
    # extra per token of a log-prob prefill (a resume to verify: the full-vocabulary projection runs over every
    # position of its packed rows x width, not the cached tokens only)
    prefill_logp_token_s: float = 0.0
    verify_token_s: float = 0.0  # two-stage verification per verified cached token
    train_step_s: float = 0.0  # per train step
    train_token_s: float = 0.0  # per trained token (prompt + response)
    train_attn_s: float = 0.0  # per (sequence length)^2 of every trained sequence (causal attention)
    train_position_s: float = 0.0  # per position the train step's packed rows compute (real or padding)
    train_row_attn_s: float = 0.0  # per (row width)^2 of every packed row computed (causal attention over the row)
    step_overhead_s: float = 0.0  # per step: grading, batch building, host work outside the above

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CostModel.{f.name}={v!r} must be a number >= 0 (seconds).")

    def decode(self, dispatches: int, steps_per_dispatch: int, active: int, attended0: int,
               bucket: int | None = None, width: int = 0) -> float:
        """``dispatches`` consecutive dispatches with the same ``active`` slots running in a live bucket of
        ``bucket`` slots (None: ``active``), every one generating ``steps_per_dispatch`` tokens per running
        slot, the first starting with ``attended0`` attended tokens (each later one with ``active *
        steps_per_dispatch`` more), all reading a page table ``width`` tokens wide. Closed form of the
        per-dispatch sum."""
        n, k, m = dispatches, steps_per_dispatch, active
        b = m if bucket is None else bucket
        attended = n * attended0 + m * k * n * (n - 1) // 2  # sum over the dispatches of A at their start
        per_dispatch = self.decode_step_s + self.decode_slot_s * b + self.decode_width_token_s * b * width
        return k * (n * per_dispatch + self.decode_ctx_token_s * attended)

    def prefill(self, tokens: int, verified_tokens: int, calls: int = 1, squares: int = 0,
                logp_tokens: int | None = None) -> float:
        """``calls`` calls computing ``tokens`` (padded) tokens in rows whose squared widths sum to ``squares``,
        ``logp_tokens`` of them in log-prob calls (None: ``verified_tokens``), ``verified_tokens`` cached tokens
        verified."""
        if tokens == 0 and verified_tokens == 0:
            return 0.0
        logp = verified_tokens if logp_tokens is None else logp_tokens
        return (self.prefill_call_s * calls + self.prefill_token_s * tokens + self.prefill_attn_s * squares
                + self.prefill_logp_token_s * logp + self.verify_token_s * verified_tokens)

    def train(self, seq_lengths, rows=None) -> float:
        """A train step over sequences of ``seq_lengths`` tokens computed as ``rows``: ``(width, count)`` pairs,
        ``count`` packed rows of ``width`` positions (``TrainLayout.rows``; None: each sequence a row of its own
        length)."""
        lengths = [int(x) for x in seq_lengths]
        total, squares = sum(lengths), sum(x * x for x in lengths)
        if rows is None:
            positions, row_squares = total, squares
        else:
            positions = sum(int(w) * int(n) for w, n in rows)
            row_squares = sum(int(w) ** 2 * int(n) for w, n in rows)
        return (self.train_step_s + self.train_token_s * total + self.train_attn_s * squares
                + self.train_position_s * positions + self.train_row_attn_s * row_squares)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RooflineCosts:
    """A cost model from the compiled programs of a real config (``python -m rollverify_jax.aot``, recorded in
    docs/scale.md and its JSON reports) and a chip's public peaks. Per chip, all chips working in parallel:

    - decode step: ``max(decode_flops / (peak * mfu), decode_bytes / (bandwidth * hbm_efficiency))`` from the
      decode program's cost analysis (its loop body: one step over every slot; the Pallas paged-attention
      kernel is a custom call whose page reads the analysis does not count), plus the KV reads per attended
      token: ``kv_bytes_per_token / num_devices / (bandwidth * hbm_efficiency)`` (slots and KV heads are
      spread over every chip).
    - prefill token: ``prefill_flops_per_token / (num_devices * peak * mfu)``; the verification log-probs
      (full-vocabulary projection) add ``2 * hidden * vocab`` FLOPs per position of a log-prob call. The cost
      analysis does not count the attention kernel (splash on TPU is a custom call: the per-token FLOPs are
      the matmuls only), so causal attention is added: a packed row ``T`` tokens wide costs
      ``attn_flops_per_token_ctx * T^2 / 2`` (the reference attention scores the whole row, whatever the
      packing). The log-prob projection runs over every position of a log-prob call's packed rows.
    - train: per position of the rows the packed train step computes (``TrainLayout.rows``: each minibatch's
      sequences first-fit into rows of the context width, micro-batches of ``micro_batch_size`` rows, tail rows
      of ``tail_row_width``; real tokens and padding alike), forward ``2 * (active params + head)`` FLOPs plus
      causal attention over its row, ``attn_flops_per_token_ctx * T / 2`` for a row ``T`` wide (full and tail
      rows each at their own width), times ``train_passes`` = 3 (forward + backward) at ``train_mfu``: model
      FLOPs, as ``aot.packed_train_estimate`` counts them. The recompute of full remat is not counted: MFU is
      defined on model FLOPs (MaxText's figures count no recompute either), so the remat cost is in the 45%.
      ``train_mfu`` = 0.45 is MaxText's published figure for an 8B dense model (Llama 3.1 8B on v6e), the anchor
      ``AotConfig.train_mfu`` uses; its 65-71% for 32-70B dense models on v5p come from larger matmuls per chip
      than these configs' 4-8B shards, and it publishes none for a sparse MoE (which will sit below it).
    - ``mfu`` is the prefill's (and decode's FLOPs bound's) share of peak, stated apart: no published anchor,
      and the calls are forward-only and far smaller than a train micro-batch (a length bucket's rows per
      admission round), so not above training's.
    """

    num_devices: int = 16
    peak_flops: float = 459e12  # bf16 dense per chip (TPU v5p)
    hbm_bandwidth: float = 2.765e12  # bytes/s per chip (TPU v5p)
    mfu: float = 0.5  # achieved share of peak FLOPs in prefill (and decode's FLOPs bound)
    train_mfu: float = 0.45  # model-FLOPs utilisation of the train step (MaxText's 8B anchor; AotConfig.train_mfu)
    hbm_efficiency: float = 0.7  # achieved share of HBM bandwidth in decode
    decode_flops: float = 0.0  # per chip per decode step (cost analysis)
    decode_bytes: float = 0.0  # per chip per decode step (cost analysis)
    kv_bytes_per_token: float = 0.0  # K and V of one token, all layers and KV heads
    prefill_flops_per_token: float = 0.0  # whole slice, per prefilled token (cost analysis / tokens compiled)
    logp_flops_per_token: float = 0.0  # whole slice, the log-prob projection of one position of a log-prob call
    train_flops_per_token: float = 0.0  # forward, whole slice: 2 * (active params + head)
    attn_flops_per_token_ctx: float = 0.0  # forward attention per token per token of context
    train_passes: float = 3.0  # model FLOPs: forward + backward (2x); remat's recompute is not model FLOPs
    decode_host_s: float = 0.0  # per decode step, host and dispatch overhead
    step_overhead_s: float = 0.0

    def cost_model(self) -> CostModel:
        flops = self.num_devices * self.peak_flops * self.mfu
        train_flops = self.num_devices * self.peak_flops * self.train_mfu
        bw = self.hbm_bandwidth * self.hbm_efficiency
        step = max(self.decode_flops / (self.peak_flops * self.mfu), self.decode_bytes / bw) + self.decode_host_s
        return CostModel(
            decode_step_s=step,
            decode_ctx_token_s=self.kv_bytes_per_token / self.num_devices / bw,
            prefill_token_s=self.prefill_flops_per_token / flops,
            # causal attention of a prefilled row of T tokens: sum_t attn * t ~ attn * T^2 / 2
            prefill_attn_s=self.attn_flops_per_token_ctx / 2 / flops,
            prefill_logp_token_s=self.logp_flops_per_token / flops,
            # per position of the packed rows, and causal attention of a row T wide: sum_t attn * t ~ attn * T^2 / 2
            train_position_s=self.train_passes * self.train_flops_per_token / train_flops,
            train_row_attn_s=self.train_passes * self.attn_flops_per_token_ctx / 2 / train_flops,
            step_overhead_s=self.step_overhead_s,
        )
