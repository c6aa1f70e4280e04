"""What each piece of a training step costs, in seconds: the simulator's cost model.

    decode dispatch (k steps over the live bucket of b slots and a live page table W tokens wide, A attended
    tokens of the running ones at its start)
        = k * (decode_step_s + decode_slot_s * b + decode_width_token_s * b * W + decode_ctx_token_s * A)
      (the rates fitted on runs); at real scale (``RooflineCosts``) a decode step is priced as
      ``python -m rollverify_jax.aot`` prices it (``KernelDecode``: ``roofline.DecodeStep.estimate_s``): the
      weights as laid out, the KV blocks the paged-attention kernel reads (each running slot its attended
      tokens in whole blocks, every other slot of the bucket one block), the FLOPs if they bind, the collectives
      (``KernelCostModel``)
    admission round (per prefill call of the requests admitted together, one per width bucket unless a token
    budget splits it: a prefill, log-prob when it verifies a resume, and an activation of the slots that decode
    on; ``Workload.prefill_shape`` packs it)
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
compiled programs (``RooflineCosts``: the aot reports of the real config's decode, prefill and train step, at
stated chip peaks and efficiencies). Pure Python (numpy and the JAX-free ``roofline``): importing this never
imports JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollverify_jax.scale import roofline


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work (all default 0: a model with nothing bound costs nothing)."""

    decode_step_s: float = 0.0  # per decode step (weights read, fixed-shape work, host per dispatch / k)
    decode_slot_s: float = 0.0  # per slot of the live bucket per decode step (idle slots in it compute too)
    decode_ctx_token_s: float = 0.0  # per attended (cached) token per decode step
    # per bucket slot per token of the live page-table width per decode step (the reference attention of CPU
    # and GPU gathers every page the table lists for every slot of the bucket; Pallas on TPU reads A only)
    decode_width_token_s: float = 0.0
    prefill_call_s: float = 0.0  # per prefill or activate call (an engine dispatch of an admission round)
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
        for f in dataclasses.fields(CostModel):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CostModel.{f.name}={v!r} must be a number >= 0 (seconds).")

    # the replay passes decode() the running slots' own lengths only where a model reads them
    reads_slot_lengths = False

    def decode(self, dispatches: int, steps_per_dispatch: int, active: int, attended0: int,
               bucket: int | None = None, width: int = 0, running=None) -> float:
        """``dispatches`` consecutive dispatches with the same ``active`` slots running in a live bucket of
        ``bucket`` slots (None: ``active``), every one generating ``steps_per_dispatch`` tokens per running
        slot, the first starting with ``attended0`` attended tokens (each later one with ``active *
        steps_per_dispatch`` more), all reading a page table ``width`` tokens wide. Closed form of the
        per-dispatch sum. ``running`` (``KernelCostModel``'s; unused here): each running slot's tokens attended
        at the first step and steps it runs."""
        n, k, m = dispatches, steps_per_dispatch, active
        b = m if bucket is None else bucket
        attended = n * attended0 + m * k * n * (n - 1) // 2  # sum over the dispatches of A at their start
        per_dispatch = self.decode_step_s + self.decode_slot_s * b + self.decode_width_token_s * b * width
        return k * (n * per_dispatch + self.decode_ctx_token_s * attended)

    def decode_per_step_s(self) -> dict:
        """The part of a decode step that no slot's length changes, by source (``studies/sim_scale.py``'s cost
        terms): here the fitted per-step rate."""
        return {"step": self.decode_step_s}

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


@dataclasses.dataclass(frozen=True)
class KernelDecode:
    """A decode step priced as ``python -m rollverify_jax.aot`` prices it (``aot_decode.decode_report``'s
    estimate, ``roofline.DecodeStep.estimate_s``), per chip:

        max(weights / HBM + kernel KV / (HBM x kernel share), (program FLOPs + kernel KV's attention FLOPs) / peak)
          + collective bytes / ICI + collectives x latency

    The KV is what the paged-attention kernel reads: each running slot the tokens it attends at each step
    rounded up to whole blocks of ``block_tokens``, every other slot of the bucket one block (an inactive slot
    attends over one token), spread evenly over the slot shards. ``step`` is the compiled program's, which
    decodes ``num_slots`` slots; a live bucket of fewer slots (a pool on one device) scales its FLOPs and
    collective bytes (activations) by bucket / ``num_slots`` and keeps its weights and collective count (at
    real scale the pool is split over the devices and every dispatch runs all slots). Consecutive dispatches
    are priced as one span of steps: the max binds on the same side for each (memory, at every real config)."""

    step: roofline.DecodeStep
    num_slots: int
    block_tokens: int

    def __post_init__(self):
        if self.num_slots < 1 or self.block_tokens < 1 or self.step.shards < 1 or self.step.devices < 1:
            raise ValueError(f"KernelDecode: num_slots={self.num_slots}, block_tokens={self.block_tokens}, shards="
                             f"{self.step.shards} and devices={self.step.devices} must be >= 1.")
        if not 0 < self.step.kernel_hbm_share <= 1 or self.step.hbm_bandwidth <= 0 or self.step.peak_flops <= 0:
            raise ValueError("KernelDecode: kernel_hbm_share in (0, 1], hbm_bandwidth and peak_flops > 0 needed.")
        object.__setattr__(self, "_at", {})

    def at(self, bucket: int) -> roofline.DecodeStep:
        """The step of a dispatch over ``bucket`` slots."""
        got = self._at.get(bucket)
        if got is None:
            f = bucket / self.num_slots
            got = self._at[bucket] = dataclasses.replace(self.step, program_flops=self.step.program_flops * f,
                                                         collective_bytes=self.step.collective_bytes * f)
        return got

    def kernel_tokens(self, steps: int, bucket: int, first, runs) -> int:
        """Tokens the kernel reads over ``steps`` steps of a ``bucket``-slot dispatch: running slot i attends
        ``first[i]``, ``first[i] + 1``, ... for ``runs[i]`` steps (whole blocks each); every other slot-step
        reads one block."""
        first, runs = np.asarray(first, np.int64), np.asarray(runs, np.int64)
        read = int(roofline.block_tokens_sum(first, first + runs - 1, self.block_tokens).sum())
        return read + (bucket * steps - int(runs.sum())) * self.block_tokens

    def seconds(self, steps: int, bucket: int, first, runs) -> float:
        return self.at(bucket).estimate_s(steps, self.kernel_tokens(steps, bucket, first, runs))

    def per_step_s(self) -> dict:
        """The all-slot step's parts that no length changes: the weights' read, and the collectives."""
        s = self.step
        ici = s.collective_bytes / s.ici_bandwidth if s.ici_bandwidth else 0.0
        return {"weights": s.weights / s.hbm_bandwidth, "collectives": ici + s.collectives * s.collective_latency_s}


@dataclasses.dataclass(frozen=True)
class KernelCostModel(CostModel):
    """``CostModel`` whose decode adds ``decode_kernel``'s steps, priced from the running slots' own lengths
    (``RooflineCosts.cost_model``; the fitted rates stay the plain ``CostModel``)."""

    decode_kernel: KernelDecode | None = None

    @property
    def reads_slot_lengths(self) -> bool:
        return self.decode_kernel is not None

    def decode(self, dispatches: int, steps_per_dispatch: int, active: int, attended0: int,
               bucket: int | None = None, width: int = 0, running=None) -> float:
        """``CostModel.decode`` plus the kernel's ``dispatches * steps_per_dispatch`` steps; ``running`` = (each
        running slot's tokens attended at the first step, steps it runs: at most that many, fewer for one that
        ends in the last dispatch, inactive for the rest)."""
        linear = super().decode(dispatches, steps_per_dispatch, active, attended0, bucket, width)
        if self.decode_kernel is None:
            return linear
        if running is None:
            raise ValueError("KernelCostModel.decode needs the running slots' lengths (running=(first, runs)).")
        b = active if bucket is None else bucket
        return linear + self.decode_kernel.seconds(dispatches * steps_per_dispatch, b, *running)

    def decode_per_step_s(self) -> dict:
        out = super().decode_per_step_s()
        return {**out, **self.decode_kernel.per_step_s()} if self.decode_kernel is not None else out


@dataclasses.dataclass(frozen=True)
class RooflineCosts:
    """A cost model from the compiled programs of a real config (``python -m rollverify_jax.aot``, recorded in
    docs/scale.md and its JSON reports) and a chip's public peaks. Per chip, all chips working in parallel:

    - decode step: as the aot report's decode estimate prices it (``KernelDecode``; ``aot_decode.py``, the JSON's
      ``"decode"``), from its figures: the weights as the engine lays them out (``decode_weights_bytes``: the
      serving copy, split over 'tensor'), the KV blocks the paged-attention kernel reads (``decode_block_tokens``
      a block, ``decode_kv_bytes_per_token`` per chip, over ``decode_kv_shards`` slot shards; inactive slots one
      block), the compiled step's FLOPs over every slot (``decode_program_flops``) plus the kernel's attention
      FLOPs at peak if they bind (they never do here), and ``decode_collectives`` collectives sending
      ``decode_collective_bytes`` a step at ``ici_bandwidth`` and ``collective_latency_s`` each, not overlapped;
      HBM at the chip's full bandwidth (``kernel_hbm_share`` of it for the kernel: 1 when it runs on both
      TensorCores), as aot assumes. ``decode_host_s`` a step is added (host and dispatch time; aot has none).
      ``decode_num_slots`` = 0: no decode program bound (a decode step costs ``decode_host_s``).
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
      rows each at their own width), times ``train_passes`` = 3 (forward + backward; 2 for LoRA, whose frozen
      base takes no weight gradient; attention ``train_attn_passes`` = 3 either way) at ``train_mfu``: model
      FLOPs, as ``scale.fit.packed_train_estimate`` counts them. The recompute of full remat is not counted: MFU is
      defined on model FLOPs (MaxText's figures count no recompute either), so the remat cost is in the 45%.
      ``train_mfu`` = 0.45 is MaxText's published figure for an 8B dense model (Llama 3.1 8B on v6e), the anchor
      ``AotConfig.train_mfu`` uses; its 65-71% for 32-70B dense models on v5p come from larger matmuls per chip
      than these configs' 4-8B shards, and it publishes none for a sparse MoE (which will sit below it).
    - ``mfu`` is the prefill's share of peak, stated apart: no published anchor,
      and the calls are forward-only and far smaller than a train micro-batch (a length bucket's rows per
      admission round), so not above training's.
    - the async mode (``sim/async_replay.py``) splits the chips (``on_devices``): the rollout group keeps the
      compiled decode program per chip (its slots and slot shards in proportion), prefill and training run on
      their group's chips at the same efficiencies, and a swap copies ``param_bytes`` at ``publish_bandwidth``
      (``publish_s``; 0: free).
    """

    num_devices: int = 16
    peak_flops: float = 459e12  # bf16 dense per chip (TPU v5p)
    hbm_bandwidth: float = 2.765e12  # bytes/s per chip (TPU v5p)
    mfu: float = 0.5  # achieved share of peak FLOPs in prefill
    train_mfu: float = 0.45  # model-FLOPs utilisation of the train step (MaxText's 8B anchor; AotConfig.train_mfu)
    # decode, per chip per step of the compiled decode program (the aot JSON's "decode" and programs.decode)
    decode_num_slots: int = 0  # slots the program decodes (EngineConfig.num_slots); 0: no decode program bound
    decode_weights_bytes: float = 0.0  # weights read, as the engine lays them out (weights_bytes_per_chip)
    decode_kv_bytes_per_token: float = 0.0  # K and V of one token, every layer, the chip's KV heads
    decode_kv_shards: int = 1  # slot shards (PoolLayout.num_shards): a chip reads its shard's slots' KV
    decode_block_tokens: int = 1  # the kernel reads whole blocks of this many tokens a slot (kernel_block_tokens)
    decode_program_flops: float = 0.0  # every slot, the attention kernel excluded (cost analysis)
    decode_collectives: float = 0.0  # collectives per step (collectives_per_step.count)
    decode_collective_bytes: float = 0.0  # bytes sent per step (collectives_per_step.bytes_sent)
    ici_bandwidth: float = 0.0  # bytes/s a collective sends at (0: bytes free)
    collective_latency_s: float = 0.0  # per collective, beyond its bytes
    kernel_hbm_share: float = 1.0  # the share of HBM bandwidth the attention kernel reads at
    prefill_flops_per_token: float = 0.0  # whole slice, per prefilled token (cost analysis / tokens compiled)
    logp_flops_per_token: float = 0.0  # whole slice, the log-prob projection of one position of a log-prob call
    train_flops_per_token: float = 0.0  # forward, whole slice: 2 * (active params + head)
    attn_flops_per_token_ctx: float = 0.0  # forward attention per token per token of context
    train_passes: float = 3.0  # model FLOPs: forward + backward (2x); remat's recompute is not model FLOPs
    # attention's passes apart: it has no weights, so a LoRA run (train_passes 2: no base-weight gradients) still
    # runs its forward and both input gradients, as `fit.analytic_train_flops` counts them
    train_attn_passes: float = 3.0
    decode_host_s: float = 0.0  # per decode step, host and dispatch overhead
    step_overhead_s: float = 0.0
    param_bytes: float = 0.0  # the model's weights as trained (all of them), what a swap publishes
    publish_bandwidth: float = 0.0  # bytes/s the publish copies at, train -> rollout chips (0: a free publish)

    def on_devices(self, devices: int, decode: bool = True) -> RooflineCosts:
        """The same config on ``devices`` of its chips (the async mode's rollout or train group): FLOP-bound
        work (prefill, training) spreads over fewer chips; the decode program stays the compiled one per chip,
        with the slots and slot shards in proportion (``devices`` must hold whole slot shards). ``decode``
        False: no decode program (a train group)."""
        if not 0 < devices <= self.num_devices:
            raise ValueError(f"RooflineCosts.on_devices({devices}): 1 to num_devices={self.num_devices} chips.")
        if not decode or not self.decode_num_slots:
            return dataclasses.replace(self, num_devices=devices, decode_num_slots=0)
        per = self.num_devices // self.decode_kv_shards
        if self.num_devices % self.decode_kv_shards or devices % per:
            raise ValueError(f"RooflineCosts.on_devices({devices}): a multiple of the {per} chips of a slot shard.")
        shards = devices // per
        return dataclasses.replace(self, num_devices=devices, decode_kv_shards=shards,
                                   decode_num_slots=self.decode_num_slots // self.decode_kv_shards * shards)

    def publish_s(self) -> float:
        """Seconds one swap copies the weights for (``param_bytes / publish_bandwidth``)."""
        return self.param_bytes / self.publish_bandwidth if self.publish_bandwidth else 0.0

    def decode_kernel(self) -> KernelDecode | None:
        """The decode step as aot prices it (None: no decode program bound)."""
        if not self.decode_num_slots:
            return None
        step = roofline.DecodeStep(
            weights=self.decode_weights_bytes, weights_min=0.0,  # the roofline's least bytes: not priced here
            kv_bytes_per_token=self.decode_kv_bytes_per_token, shards=self.decode_kv_shards,
            devices=self.num_devices, forward_flops_per_token=self.train_flops_per_token,
            attn_flops_per_token_ctx=self.attn_flops_per_token_ctx, program_flops=self.decode_program_flops,
            collective_bytes=self.decode_collective_bytes, collectives=self.decode_collectives,
            hbm_bandwidth=self.hbm_bandwidth, peak_flops=self.peak_flops, ici_bandwidth=self.ici_bandwidth,
            collective_latency_s=self.collective_latency_s, kernel_hbm_share=self.kernel_hbm_share)
        return KernelDecode(step, self.decode_num_slots, self.decode_block_tokens)

    def cost_model(self) -> KernelCostModel:
        flops = self.num_devices * self.peak_flops * self.mfu
        train_flops = self.num_devices * self.peak_flops * self.train_mfu
        return KernelCostModel(
            decode_step_s=self.decode_host_s,
            decode_kernel=self.decode_kernel(),
            prefill_token_s=self.prefill_flops_per_token / flops,
            # causal attention of a prefilled row of T tokens: sum_t attn * t ~ attn * T^2 / 2
            prefill_attn_s=self.attn_flops_per_token_ctx / 2 / flops,
            prefill_logp_token_s=self.logp_flops_per_token / flops,
            # per position of the packed rows, and causal attention of a row T wide: sum_t attn * t ~ attn * T^2 / 2
            train_position_s=self.train_passes * self.train_flops_per_token / train_flops,
            train_row_attn_s=self.train_attn_passes * self.attn_flops_per_token_ctx / 2 / train_flops,
            step_overhead_s=self.step_overhead_s,
        )
