"""A discrete-event replay of the rollout scheduler and the training loop (no model, no JAX).

It follows ``rl/partial_rollout.py`` and ``rollout/scheduler.py`` dispatch by dispatch, jumping from one
sequence's end to the next (between two ends every active slot generates ``k`` tokens per dispatch, so the
jump is exact and the cost of the dispatches in between has a closed form, ``CostModel.decode``). Every
scheduling decision (admission into slots, page reservation, growth or preemption, slot packing, the queue
top-up, the phase end, the pause order) is the scheduler's own code, ``schedule_decisions``, called on the
replay's state; ``tests/test_scheduler_parity.py`` replays recorded scheduler traces call for call:

- on-policy: a phase admits exactly ``B`` groups of ``G`` samples and runs until every one has finished; freed
  slots take queued samples of the same batch, then idle through the long tail.
- partial (naive): the phase keeps every slot busy (resumed trajectories first, then new groups, with
  ``ceil(S / G)`` groups queued ahead of the free slots); it ends after the first dispatch at whose end ``B``
  groups are complete, and pauses everything unfinished. A resumed trajectory is re-prefilled (prompt + its
  tokens) when admitted and keeps all its tokens.
- rollverify: as partial, but the resume prefill also returns log-probs and the paused trajectories are
  verified (with ``verify_finished`` also finished members waiting for their group and complete groups carried
  beyond ``B``). A trajectory's cached tokens are segments, one per step that sampled some of them; at
  verification each segment of age ``c`` (the verifying step minus the segment's) fails with probability
  ``p(c)`` (``CutModel``), oldest first, and the cut falls at the first failing segment's first token (keep =
  the tokens before it; 0 restarts from the prompt). Under the coupled rule (``CutModel.rule = 'coupled'``)
  each cached token of age ``c`` matches with probability ``1 - q(c)`` instead, and the cut falls at the first
  token that does not (``min(n, Geometric)`` tokens kept). A cut trajectory regenerates to a length set by
  ``LengthModel.cut_length``: the one drawn for it at creation ('keep', the unfavourable end of the bracket) or a
  fresh draw given the kept prefix ('redraw', ``LengthModel.redraw``: shorter on average, the favourable end).
  The cycle's acceptance ``sum keep / sum n`` over the verified paused trajectories enters the switching
  window; once the full window's mean is below the threshold (``schedule_rules.switch_due``) the run goes
  on-policy and the cache is dropped.
- async (``sim/async_replay.py``): rollout and training on disjoint devices, overlapped, with a swap of weights
  (and a re-prefill, verified or not) per update; it reuses this replay's admission, dispatch and cuts.

A sequence's response length is drawn when its group is created (``LengthModel``). As in the engine, admission
samples nothing: a sequence's last token is not prefilled but is its slot's pending token, so every response
token of an admitted sequence, its first included, comes from decode; a decode dispatch runs over the live slot
bucket (the smallest of ``Workload.slot_buckets`` that holds the running sequences, which the scheduler packs
below it), and an admission round prefills per width bucket (``Workload.prefill_bucket``), split into calls of
at most the largest row bucket (``Workload.split_for_prefill``; one call without a prefill token budget), each
call packed as ``Engine.pack`` packs it (``Workload.prefill_shape``: every sequence but its last token, end to
end in rows of the bucket's width, first-fit decreasing, the rows a bucket of ``schedule_rules.prefill_rows``).
A call that verifies nothing is a prefill and an activation (``Engine.admit``), and a group's new members in it
compute their prompt once (the others copy its K/V); a call with a verified resume is a log-prob prefill, then
an activation of what goes on decoding (``Engine.activate``). With a KV page pool
too small for every slot at full length (``Workload.kv_pages_per_shard``), a request waits at the queue head
until its shard has its pages plus a page of headroom per running slot (``schedule_decisions.admit``), and a
running sequence that cannot get the pages of its next dispatch is preempted back to the queue head
(``schedule_decisions.grow_or_preempt``). Time of a step = prefill calls + decode dispatches + train
step + overhead (``CostModel``); nothing overlaps. The train step computes the rows the learner packs the batch
into (``TrainLayout``, with ``rl/packing.py``'s own planner), the batch in the order the trainer builds it:
complete groups in the order they were created, each group's members in order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import math
import statistics

import numpy as np

from rollverify_jax import schedule_decisions, schedule_rules
from rollverify_jax.rl import packing
from rollverify_jax.schedule_rules import MODES
from rollverify_jax.sim.costs import CostModel

RESERVATIONS = ("incremental", "full")
# What a cut trajectory regenerates to (``LengthModel.regenerated``): the two ends of the bracket the true
# length of a regeneration lies in
CUT_LENGTHS = ("keep", "redraw")
# The verifier's rule a cut model follows (``VerifyConfig.rule``; ``verify/verifier.py`` RULES)
RULES = ("two_stage", "coupled")


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """The rows the learner's train step computes for a batch: ``LearnerConfig`` (minibatches, micro-batch rows,
    tail rows, packing, epochs) and the width it packs into (``EngineConfig.max_seq_len``, as ``train.select``
    builds the batch). ``rows`` plans them with ``rl/packing.py``, the code ``packing.pack_for_learner`` runs."""

    width: int  # T: the packed rows' width (the engine's max_seq_len)
    num_minibatches: int = 1
    micro_batch_size: int | None = None  # rows per micro-batch (None: one micro-batch of a minibatch's rows)
    tail_row_width: int | None = None
    pack_sequences: bool = True  # False: padded rows of the batch's power-of-two bucket (rl/batch.length_bucket)
    ppo_epochs: int = 1
    row_multiple: int = 1  # batch devices (data x fsdp): micro_batch_size None rounds its rows up to this

    def __post_init__(self):
        if min(self.width, self.num_minibatches, self.ppo_epochs, self.row_multiple) < 1:
            raise ValueError(f"TrainLayout: width, num_minibatches, ppo_epochs and row_multiple must be >= 1: {self}.")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"TrainLayout.micro_batch_size={self.micro_batch_size} must be >= 1 or None.")
        if self.tail_row_width is not None and (not 0 < self.tail_row_width <= self.width
                                                or self.micro_batch_size is None or not self.pack_sequences):
            raise ValueError(f"TrainLayout.tail_row_width={self.tail_row_width} needs packing, micro_batch_size and "
                             f"a width in [1, {self.width}].")

    def rows(self, lengths) -> tuple[tuple[int, int], ...]:
        """``(width, count)`` of the full and the tail rows one train step computes (every epoch runs each
        minibatch's micro-batches) over sequences of ``lengths`` tokens (prompt + response) in batch row order.
        A sequence longer than ``width`` (a replay whose prompt + cap exceeds max_seq_len, which the engine never
        gives) widens the full rows to it instead of failing."""
        lengths = np.asarray(lengths, np.int64)
        b, e = len(lengths), self.ppo_epochs
        if b % self.num_minibatches:
            raise ValueError(f"a batch of {b} sequences does not split into {self.num_minibatches} minibatches.")
        if not self.pack_sequences:
            return ((schedule_rules.train_length_bucket(int(lengths.max())), b * e),)
        width = max(self.width, int(lengths.max()))
        plans = packing.plan_batch(lengths, self.num_minibatches, width, self.micro_batch_size, self.tail_row_width)
        shape = packing.plan_shape(plans, b, width, self.num_minibatches, self.micro_batch_size,
                                   self.tail_row_width, self.row_multiple)
        full, tail, _ = packing.planned_positions(plans, shape)
        out = [(shape.width, full // shape.width * e)]
        if tail:
            out.append((shape.tail_width, tail // shape.tail_width * e))
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The run's shape (from its gin config: RolloutConfig, EngineConfig, SwitchConfig, VerifyConfig)."""

    mode: str
    batch_groups: int  # B
    group_size: int  # G
    num_slots: int  # S
    steps_per_dispatch: int  # k
    max_new_tokens: int
    prompt_len: int
    queue_groups: int = 0  # 0: ceil(S / G)
    switch_window: int = 8
    switch_threshold: float = 0.5
    switching: bool = True
    verify_finished: bool = False  # also re-verify finished members of cached groups (VerifyConfig)
    live_slots: bool = True  # decode over the smallest slot bucket holding the running sequences (engine default)
    min_prefill_len: int = 0  # the narrowest prefill width (widths grow by bucket_ratio; 0: no padding)
    max_seq_len: int = 0  # the largest prefill bucket and the page table's width (0: prompt_len + max_new_tokens)
    bucket_ratio: int = 2  # EngineConfig.bucket_ratio: the step of every shape ladder (prefill, slots, pages)
    prefill_token_budget: int | None = None  # EngineConfig.prefill_token_budget: most rows x width per prefill
    page_size: int = 0  # > 0: track the live page-table width decode reads (EngineConfig.live_pages buckets)
    live_pages: bool = True
    kv_pages_per_shard: int = 0  # pages one pool shard can hand out (its scratch page excluded); 0: no limit
    pool_shards: int = 1  # the pool and the slots are split into this many shards (a slot takes its shard's pages)
    page_reservation: str = "incremental"  # EngineConfig.page_reservation
    train_layout: TrainLayout | None = None  # the learner's packed rows (None: each sequence a row of its length)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {list(MODES)}.")
        for name in ("batch_groups", "group_size", "num_slots", "steps_per_dispatch", "max_new_tokens",
                     "switch_window", "pool_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.prompt_len < 0 or self.queue_groups < 0:
            raise ValueError("prompt_len and queue_groups must be >= 0.")
        if not 0.0 <= self.switch_threshold <= 1.0:
            raise ValueError(f"switch_threshold={self.switch_threshold} must be in [0, 1].")
        if self.min_prefill_len < 0 or self.max_seq_len < 0 or self.kv_pages_per_shard < 0:
            raise ValueError("min_prefill_len, max_seq_len and kv_pages_per_shard must be >= 0.")
        if self.bucket_ratio < 2:
            raise ValueError(f"bucket_ratio={self.bucket_ratio} must be >= 2 (EngineConfig.bucket_ratio).")
        if self.prefill_token_budget is not None and self.prefill_token_budget < self.prefill_max_width:
            raise ValueError(f"prefill_token_budget={self.prefill_token_budget} must hold one row of "
                             f"{self.prefill_max_width} tokens (or be None), as EngineConfig requires.")
        if self.train_layout and self.batch_groups * self.group_size % self.train_layout.num_minibatches:
            raise ValueError(f"a batch of {self.batch_groups * self.group_size} sequences does not split into "
                             f"{self.train_layout.num_minibatches} minibatches (TrainLayout.num_minibatches).")
        if self.page_reservation not in RESERVATIONS:
            raise ValueError(f"page_reservation={self.page_reservation!r}; known: {list(RESERVATIONS)}.")
        if self.kv_pages_per_shard:
            if self.page_size < 1 or self.num_slots % self.pool_shards:
                raise ValueError("a KV page limit needs page_size >= 1 and the slots divided evenly over the shards.")
            if self.kv_pages_per_shard < self.full_pages:
                raise ValueError(f"a sequence of {self.full_tokens} tokens needs {self.full_pages} pages but a pool "
                                 f"shard has {self.kv_pages_per_shard}: raise the KV memory budget.")

    @property
    def full_tokens(self) -> int:
        """Prompt + response cap: the most cache positions a sequence ever reserves."""
        return self.prompt_len + self.max_new_tokens

    @property
    def full_pages(self) -> int:
        return -(-self.full_tokens // max(1, self.page_size))

    @property
    def prefill_max_width(self) -> int:
        """The widest prefill row: the engine's max_seq_len (0: prompt + response cap)."""
        return self.max_seq_len or self.full_tokens

    @functools.cached_property
    def slot_buckets(self) -> list[int]:
        """The slot counts a decode dispatch runs over, ascending (``Engine.live_slot_buckets``)."""
        return schedule_rules.live_slot_buckets(self.num_slots, self.live_slots, self.bucket_ratio)

    def slot_bucket(self, active: int) -> int:
        """The scheduler packs running sequences below the smallest bucket that holds them."""
        return schedule_rules.smallest_holding(self.slot_buckets, active)

    @functools.cached_property
    def page_buckets(self) -> list[int]:
        """Page-table widths decode reads, ascending (``Engine.live_page_buckets``; the whole table with live
        pages off)."""
        pages_per_seq = -(-(self.max_seq_len or self.full_tokens) // max(1, self.page_size))
        return schedule_rules.live_page_buckets(pages_per_seq, self.live_pages, self.bucket_ratio)

    def live_width(self, tokens: int) -> int:
        """Tokens of the page-table width a dispatch reads when the longest running sequence holds ``tokens``
        response tokens: its pages (reserved through the dispatch: prompt + tokens + k + 1, at most the cap)
        rounded up to a bucket; 0 when ``page_size`` is 0."""
        if not self.page_size:
            return 0
        need = min(self.full_tokens, self.prompt_len + tokens + self.steps_per_dispatch + 1)
        return schedule_rules.smallest_holding(self.page_buckets, -(-need // self.page_size)) * self.page_size

    def widens_after(self, tokens: int) -> int | None:
        """The first ``d >= 1`` at which ``live_width(tokens + d * k)`` differs from ``live_width(tokens)`` (None:
        never), in closed form so that a long jump needs no scan: the width grows once the reserved positions
        pass its bucket's pages, unless it is the last bucket or the cap stops the reservation below that."""
        if not self.page_size:
            return None
        k, edge = self.steps_per_dispatch, self.live_width(tokens)
        if edge // self.page_size == self.page_buckets[-1] or self.full_tokens <= edge:
            return None
        return (edge - self.prompt_len - tokens - k - 1) // k + 1

    @functools.cached_property
    def prefill_widths(self) -> list[int]:
        """The packed prefill's row widths, ascending (``Engine.prefill_widths``)."""
        return schedule_rules.prefill_widths(self.min_prefill_len, self.prefill_max_width, self.bucket_ratio)

    def prefill_rows(self, width: int) -> list[int]:
        """The packed prefill's row counts at ``width``, ascending (``Engine.prefill_rows``)."""
        return schedule_rules.prefill_rows(width, self.num_slots, self.prefill_token_budget, self.bucket_ratio)

    def prefill_bucket(self, tokens: int) -> int:
        """The packed row width of a prefill whose longest sequence has ``tokens`` tokens (``Engine.prefill_bucket``):
        the smallest width holding all but its last token, which is its slot's pending token. With
        ``min_prefill_len`` 0 (no padding): exactly those tokens (none for an empty sequence: prompt_len 0)."""
        if self.min_prefill_len == 0:
            return max(0, tokens - 1)
        return schedule_rules.smallest_holding(self.prefill_widths, max(1, tokens - 1))

    def _prefill_width(self, lengths) -> int:
        # the engine never prefills past max_seq_len; a replay whose prompt_len + max_new_tokens does gets rows as
        # wide as its longest sequence's prefilled tokens there instead of an error
        return max(self.prefill_bucket(max(lengths)), max(lengths) - 1)

    def prefill_shape(self, lengths) -> tuple[int, int]:
        """(rows, width) of one prefill call over sequences of ``lengths`` tokens (``Engine.pack``): every sequence
        but its last token, packed end to end into rows of the longest one's width bucket (first-fit decreasing,
        ``schedule_rules.first_fit``), their number the smallest row bucket holding them (``prefill_rows``). With
        ``min_prefill_len`` 0 (no padding) a row per sequence, as wide as the longest's prefilled tokens."""
        width = self._prefill_width(lengths)
        if self.min_prefill_len == 0:
            return len(lengths), width
        used = len(schedule_rules.first_fit([max(0, n - 1) for n in lengths], width))
        buckets = self.prefill_rows(width)
        if used > buckets[-1]:
            raise ValueError(f"Workload.prefill_shape: {used} rows of {width} tokens, more than the {buckets[-1]} "
                             "of prefill_token_budget: split the call (split_for_prefill).")
        return schedule_rules.smallest_holding(buckets, used), width

    def split_for_prefill(self, lengths) -> list[list[int]]:
        """Indices of sequences of ``lengths`` tokens (one width bucket) in the prefill calls they are split into
        (``Engine.split_for_prefill``): first-fit rows of every sequence but its last token, at most the largest
        row bucket per call; one call without a ``prefill_token_budget`` (its largest row bucket is the slots, which
        a round's sequences never outnumber) or without padding."""
        if self.min_prefill_len == 0 or self.prefill_token_budget is None:
            return [list(range(len(lengths)))]
        width = self._prefill_width(lengths)
        most = self.prefill_rows(width)[-1]
        layout = schedule_rules.first_fit([max(0, n - 1) for n in lengths], width)
        return [sorted(i for row in layout[k: k + most] for i in row) for k in range(0, len(layout), most)]

    def reserved_pages(self, tokens, dispatches: int = 1):
        """Pages a sequence holding ``tokens`` response tokens (an int, or an array of them) must own through its
        next ``dispatches`` dispatches (``schedule_decisions.reserved_tokens``, as the scheduler reserves): prompt
        + tokens + k + 1 positions for one, at most the cap."""
        return schedule_decisions.pages_for(schedule_decisions.reserved_tokens(
            self.prompt_len, tokens, self.max_new_tokens, self.steps_per_dispatch, dispatches,
            self.page_reservation == "full"), self.page_size)

    @functools.cached_property
    def pool_binds(self) -> bool:
        """Whether the page limit can ever hold a request back: a shard's pages are fewer than its slots at full
        length plus the admission headroom (a page per other running slot). If not, the replay skips the
        page accounting (it could never change a decision)."""
        per_shard = self.num_slots // self.pool_shards
        return 0 < self.kv_pages_per_shard < per_shard * self.full_pages + per_shard - 1


class LengthModel:
    """Response lengths in tokens, drawn one group (one ``draw`` call) at a time: an explicit list (cycled), or
    a lognormal with the given median and (total) sigma, rounded and clipped to [1, max_new_tokens]. A group's
    members answer the same prompt, so their lengths are alike: ``group_share`` of the log-variance is drawn
    once per group (sigma_between = sigma sqrt(share)), the rest per member. Regenerated lengths (``redraw``)
    come from a generator of their own, so the new groups' lengths are the same in every mode.

    ``cut_length``: what a trajectory that verification cut regenerates to (``regenerated``). 'keep': the length
    drawn for it at creation (the cut changes which tokens it holds, not how long the policy writes: the
    unfavourable end, since the long trajectories are the ones cut and they stay long); 'redraw': a fresh draw
    ``L | L > keep`` (what an independent resample from the prefix would give if its length did not depend on the
    tokens cut: the favourable end, shorter on average). The truth lies between; report both."""

    def __init__(self, max_new_tokens: int, lengths=None, median: float = 0.0, sigma: float = 0.0,
                 seed: int = 0, group_share: float = 0.0, redraw_lengths=None, cut_length: str = "redraw"):
        self.max_new_tokens = int(max_new_tokens)
        self.lengths = None if lengths is None else [int(x) for x in lengths]
        self.redraw_lengths = self.lengths if redraw_lengths is None else [int(x) for x in redraw_lengths]
        if any(v is not None and (not v or min(v) < 1) for v in (self.lengths, self.redraw_lengths)):
            raise ValueError("explicit response lengths must be a non-empty list of integers >= 1.")
        if self.lengths is None and (median <= 0 or sigma < 0):
            raise ValueError(f"lognormal lengths need median > 0 and sigma >= 0 (got {median}, {sigma}).")
        if not 0.0 <= group_share <= 1.0:
            raise ValueError(f"group_share={group_share} must be in [0, 1].")
        if cut_length not in CUT_LENGTHS:
            raise ValueError(f"cut_length={cut_length!r}; choose one of {list(CUT_LENGTHS)}.")
        self.cut_length = cut_length
        self.median, self.sigma, self.group_share = float(median), float(sigma), float(group_share)
        self._rng = np.random.default_rng(seed)
        self._redraw_rng = np.random.default_rng([seed, 1])
        self._next = self._next_redraw = 0

    def draw(self, n: int) -> list[int]:
        """The lengths of one group of ``n`` members."""
        return self.draw_group(n)[0]

    def draw_group(self, n: int) -> tuple[list[int], float]:
        """One group's lengths and its log-median (the prompt's part: what a redraw of a member keeps)."""
        mu = math.log(self.median) if self.lengths is None else 0.0
        if self.lengths is not None:
            out = [self.lengths[(self._next + i) % len(self.lengths)] for i in range(n)]
            self._next += n
        elif self.sigma == 0:
            out = np.rint(np.full(n, self.median)).astype(np.int64).tolist()
        elif self.group_share == 0:
            out = np.rint(self._rng.lognormal(mu, self.sigma, size=n)).astype(np.int64).tolist()
        else:
            mu += self.sigma * math.sqrt(self.group_share) * self._rng.standard_normal()
            within = self.sigma * math.sqrt(1.0 - self.group_share) * self._rng.standard_normal(n)
            out = np.rint(np.exp(mu + within)).astype(np.int64).tolist()
        return [self._clip(v) for v in out], mu

    def _clip(self, v) -> int:
        return min(max(1, int(v)), self.max_new_tokens)

    def regenerated(self, mu: float, keep: int, drawn: int) -> int:
        """The length a member of a group of log-median ``mu`` drawn ``drawn`` tokens long regenerates to after a
        cut at ``keep`` (``cut_length``)."""
        if self.cut_length == "keep":
            return max(drawn, min(keep + 1, self.max_new_tokens))
        return self.redraw(mu, keep)

    def redraw(self, mu: float, keep: int) -> int:
        """The new length of a member that regenerates from its first ``keep`` tokens (0: a restart from the
        prompt, a fresh draw), for a group of log-median ``mu``: the member distribution conditioned on not having
        ended within the kept prefix, ``L | L > keep``: a fresh sample of the same policy from that prefix (the
        engine samples the regenerated tokens with a new seed) if its length did not depend on the prompt beyond
        the group's part. It does at real scale (a hard prompt's cut trajectory stays long), so this is the
        favourable end of the bracket (``cut_length='keep'`` the other). Explicit lists give the next value of
        ``redraw_lengths`` (default: the lengths; a cycle of its own), at least ``keep + 1``."""
        if self.lengths is not None:
            v = self.redraw_lengths[self._next_redraw % len(self.redraw_lengths)]
            self._next_redraw += 1
            return min(max(v, keep + 1), self.max_new_tokens)
        s = self.sigma * math.sqrt(1.0 - self.group_share)
        if s == 0:
            return min(max(int(np.rint(math.exp(mu))), keep + 1), self.max_new_tokens)
        z0 = (math.log(keep + 0.5) - mu) / s  # rint(x) > keep  <=>  x >= keep + 0.5
        tail = 0.5 * math.erfc(z0 / math.sqrt(2.0))  # P(Z >= z0), accurate far in the tail
        q = min(tail * (1.0 - self._redraw_rng.random()), 1.0 - 1e-16)  # uniform in (0, tail]
        if q <= 0.0:
            return min(keep + 1, self.max_new_tokens)
        z = -statistics.NormalDist().inv_cdf(q)
        return min(max(int(np.rint(math.exp(mu + s * z))), keep + 1), self.max_new_tokens)


class CutModel:
    """Where verification cuts a cached trajectory, from its segments (runs of tokens one policy version
    sampled: here one per step that decoded some of them), under the verifier's ``rule`` (``VerifyConfig.rule``).

    'two_stage': checked oldest first, a segment of age ``c >= 1`` (the verifying step minus its own) fails with
    probability ``p_s(c)``; the cut falls at the first failing segment's first token, and a trajectory none of
    whose segments fails passes whole. This is the verifier's segment stage (the first segment whose mean OPS
    reaches ``ds`` cuts; the token stage can only cut inside it, and ``verify/token_stage_cuts`` measures how often
    it does). ``p(c) = fail_prob[min(c, len) - 1]`` (the last value repeats); ``trace`` gives a ``fail_prob`` per
    step instead (step ``s`` reads ``trace[s - 1]``, the last beyond it: a run's own measured rates).

    'coupled' (docs/method.md, "Coupled verification"): each cached token of age ``c`` matches the new policy's
    own sample independently with probability ``1 - q(c)`` (``mismatch``, per token: ``coupled_survival``), and
    the cut falls at the first token that does not: the kept prefix is ``min(n, Geometric)`` for one age, in
    general the first token whose cumulative hazard ``sum -log(1 - q(c_t))`` passes one exponential draw per
    trajectory (the same law as a coin per token, memoryless, in one draw per trajectory whatever its length).

    A late fall of the acceptance is a ramp of the hazard: from step ``ramp_start`` on (0: never)
    ``p_s(c) = 1 - (1 - p(c)) ** f(s)`` with ``f(s) = 2 ** ((s - ramp_start) / ramp_doubling)``, so each
    segment's (under 'coupled' each token's) log-survival doubles every ``ramp_doubling`` steps (probabilities stay
    in [0, 1]; p = 0 or 1 stay as they are)."""

    def __init__(self, fail_prob=(0.0,), trace=None, ramp_start: int = 0, ramp_doubling: float = 10.0,
                 seed: int = 0, rule: str = "two_stage", mismatch=(0.0,)):
        if rule not in RULES:
            raise ValueError(f"CutModel: rule={rule!r}; choose one of {list(RULES)} (VerifyConfig.rule).")
        self.rule = rule
        self.fail_prob = _check_probs(fail_prob, "fail_prob")
        self.mismatch = check_mismatch(mismatch, "CutModel: mismatch")
        self.trace = None if trace is None else [_check_probs(p, "trace entry") for p in trace]
        if self.trace is not None and not self.trace:
            raise ValueError("a fail-probability trace needs at least one step.")
        if ramp_start < 0 or ramp_doubling <= 0:
            raise ValueError(f"ramp_start={ramp_start} must be >= 0 and ramp_doubling={ramp_doubling} > 0.")
        self.ramp_start, self.ramp_doubling = int(ramp_start), float(ramp_doubling)
        self._rng = np.random.default_rng([seed, 2])

    def scale(self, step: int) -> float:
        """``f(s)``: the hazard multiplier of step ``step`` (1 before the ramp)."""
        if not self.ramp_start or step <= self.ramp_start:
            return 1.0
        return 2.0 ** ((step - self.ramp_start) / self.ramp_doubling)

    def prob(self, age: int, step: int) -> float:
        base = self.fail_prob if self.trace is None else self.trace[min(step, len(self.trace)) - 1]
        p = base[min(age, len(base)) - 1]
        f = self.scale(step)
        return p if f == 1.0 or p in (0.0, 1.0) else 1.0 - (1.0 - p) ** f

    def token_hazard(self, age: int, step: int) -> float:
        """``-log`` of a cached token's chance to survive the coupled check at ``age`` and ``step``:
        ``-log coupled_survival(mismatch, age)`` times the ramp's ``f(s)``."""
        return -math.log(coupled_survival(self.mismatch, age)) * self.scale(step)

    def verify(self, segments, step: int) -> tuple[int, list[int], int | None]:
        """(keep, ages of the segments examined, age of the failing one or None) for ``segments`` [(step that
        sampled it, tokens)] in position order, verified at ``step``. Under 'coupled' the failing segment is the
        one holding the first mismatched token, as ``verifier.coupled_verify_with_stats`` counts it."""
        if self.rule == "coupled":
            return self._verify_coupled(segments, step)
        keep, checked = 0, []
        for seg_step, count in segments:
            age = _age(step, seg_step)
            checked.append(age)
            p = self.prob(age, step)
            if p >= 1.0 or (p > 0.0 and self._rng.random() < p):
                return keep, checked, age
            keep += count
        return keep, checked, None

    def _verify_coupled(self, segments, step: int) -> tuple[int, list[int], int | None]:
        budget = -math.log1p(-self._rng.random())  # Exp(1): the trajectory's total hazard before its first miss
        keep, checked = 0, []
        for seg_step, count in segments:
            age = _age(step, seg_step)
            checked.append(age)
            h = self.token_hazard(age, step)
            if h * count > budget:  # the miss falls in this segment, after floor(budget / h) matched tokens
                return keep + min(count - 1, int(budget // h)), checked, age
            budget -= h * count
            keep += count
        return keep, checked, None


def coupled_survival(mismatch: tuple[float, ...], age: int) -> float:
    """A cached token's chance to match under the coupled rule at ``age`` versions: ``1 - q(age)`` for the
    ages ``mismatch = (q(1), ..., q(A))`` gives; beyond A the per-token log-survival grows linearly with age,
    ``(1 - q(A)) ** (age / A)`` (one ``q`` alone: ``(1 - q) ** age``, each version's shift matching on its own,
    the agreement bound (1 - TV)/(1 + TV) with TV at most additive over versions: the pessimistic end)."""
    if age < 1:
        raise ValueError(f"coupled_survival: age={age}; ages start at 1.")
    n = len(mismatch)
    if age <= n:
        return 1.0 - mismatch[age - 1]
    return (1.0 - mismatch[-1]) ** (age / n)


def coupled_keep_mean(n: int, q: float) -> float:
    """``E[min(n, G)]``, G the matched tokens before the first mismatch at a per-token mismatch ``q``
    (``P(G >= j) = (1 - q) ** j``): ``(1 - q) (1 - (1 - q) ** n) / q``, and ``n`` at ``q = 0``. The closed form
    the coupled cut model's mean keep of a one-segment trajectory of ``n`` tokens follows."""
    if q == 0.0:
        return float(n)
    a = 1.0 - q
    return a * (1.0 - a ** n) / q


def check_mismatch(q, what: str) -> tuple[float, ...]:
    """``q`` as a tuple of per-token mismatch probabilities in [0, 1) (1 would cut every cached token and has no
    geometric law; a rule that cuts everything is on-policy)."""
    q = tuple(float(x) for x in (q if isinstance(q, list | tuple) else (q,)))
    if not q or not all(0.0 <= x < 1.0 for x in q):
        raise ValueError(f"{what}={q!r}: per-token mismatch probabilities in [0, 1), one per age (1, 2, ...; "
                         "beyond the last, its per-token log-survival grows linearly with age).")
    return q


def _age(step: int, seg_step: int) -> int:
    age = step - seg_step
    if age < 1:
        raise ValueError(f"a segment of step {seg_step} verified at step {step}: ages start at 1.")
    return age


def _check_probs(p, what: str) -> tuple[float, ...]:
    p = tuple(float(x) for x in (p if isinstance(p, list | tuple) else (p,)))
    if not p or not all(0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"CutModel: {what} must be a non-empty list of probabilities in [0, 1], got {p}.")
    return p


@dataclasses.dataclass
class _Traj:
    uid: int
    gid: int
    target: int  # response length (drawn at creation, redrawn after a cut)
    mu: float = 0.0  # its group's log-median (LengthModel.redraw)
    tokens: int = 0
    finished: bool = False
    verify: bool = False  # queued for a verified resume
    segments: list[list[int]] = dataclasses.field(default_factory=list)  # [[step, tokens]] in position order


@dataclasses.dataclass
class _Call:
    """The sequences of one admission round in one width bucket, in queue order (the group ``Scheduler._admit``
    hands to ``Engine.split_for_prefill``: one prefill call, or several under a prefill token budget)."""

    lengths: list[int] = dataclasses.field(default_factory=list)  # prompt + cached tokens of each
    new_group: list[int] = dataclasses.field(default_factory=list)  # its group if it has no tokens yet, else -1
    verifies: list[bool] = dataclasses.field(default_factory=list)  # it has cached tokens to verify (log-prob call)
    activates: list[bool] = dataclasses.field(default_factory=list)  # it decodes on (not a verified finished
    # member that survived)

    def add(self, length: int, new_group: int, verifies: bool, activates: bool) -> None:
        self.lengths.append(length)
        self.new_group.append(new_group)
        self.verifies.append(verifies)
        self.activates.append(activates)


class _Slots:
    """The decode slots on a dispatch clock: a running sequence holds ``base + k * clock`` tokens, so a jump of
    ``n`` dispatches is one addition, the next end is a heap's top and the longest sequence another's; an event
    costs O(log S) instead of passes over every slot. Free slots are kept per pool shard (admission takes the
    lowest free slot whose shard has room), and the bases are mirrored in an array for the page accounting."""

    def __init__(self, num_slots: int, k: int, shards: int = 1):
        self.num_slots, self.k, self.shards = num_slots, k, shards
        self.per_shard = num_slots // shards
        self.clock = 0  # dispatches so far
        self.base = [0] * num_slots  # tokens held - k * clock
        self.target = [0] * num_slots
        self.base_np = np.zeros(num_slots, np.int64)
        self.target_np = np.zeros(num_slots, np.int64)
        self.floor_np = np.zeros(num_slots, np.int64)  # pages granted at admission (a grant never shrinks)
        self._admissions = 0
        self.clear()

    def clear(self) -> None:
        """Every slot free (``Scheduler.pause``, or nothing running)."""
        self.uid = [-1] * self.num_slots
        self.stamp = [-1] * self.num_slots  # admission number of the running sequence (-1: free)
        self.free = [list(range(s * self.per_shard, (s + 1) * self.per_shard)) for s in range(self.shards)]  # heaps
        self.num_free = self.num_slots
        self.ends: list[tuple[int, int, int]] = []  # (clock at whose dispatch it ends, stamp, slot)
        self.longest: list[tuple[int, int, int]] = []  # (-base, stamp, slot); stale once the stamp moved on
        self.live_np = np.zeros(self.num_slots, bool)
        self.active = self.base_sum = 0

    def take(self, slot: int) -> None:
        """Takes the free ``slot``, the lowest free one of its shard (admission takes no other)."""
        if heapq.heappop(self.free[slot // self.per_shard]) != slot:
            raise RuntimeError(f"slot {slot} is not the lowest free slot of its shard.")
        self.num_free -= 1

    def give(self, slot: int) -> None:
        self.num_free += 1
        heapq.heappush(self.free[slot // self.per_shard], slot)

    def tokens(self, slot: int) -> int:
        return self.base[slot] + self.k * self.clock

    def place(self, slot: int, uid: int, tokens: int, target: int, pages: int = 0) -> None:
        base = tokens - self.k * self.clock
        self.uid[slot], self.base[slot], self.target[slot] = uid, base, target
        self.stamp[slot] = self._admissions
        self._admissions += 1
        heapq.heappush(self.ends, (self.clock - (tokens - target) // self.k, self.stamp[slot], slot))  # + ceil(rem/k)
        heapq.heappush(self.longest, (-base, self.stamp[slot], slot))
        self.base_np[slot], self.floor_np[slot], self.live_np[slot] = base, pages, True
        self.target_np[slot] = target
        self.active += 1
        self.base_sum += base

    def move(self, src: int, dst: int) -> None:
        """Moves the running sequence of ``src`` to the free ``dst``, the lowest free slot (``pack_moves``); it
        counts as admitted anew (a new stamp: the scheduler's slot order puts a moved sequence last)."""
        if heapq.heappop(self.free[dst // self.per_shard]) != dst:
            raise RuntimeError(f"slot {dst} is not the lowest free slot of its shard.")
        heapq.heappush(self.free[src // self.per_shard], src)
        self.uid[dst], self.base[dst], self.target[dst] = self.uid[src], self.base[src], self.target[src]
        self.base_np[dst], self.target_np[dst] = self.base[dst], self.target[dst]
        self.floor_np[dst] = self.floor_np[src]
        self.live_np[dst], self.live_np[src] = True, False
        self.uid[src], self.stamp[src] = -1, -1
        self.stamp[dst] = self._admissions
        self._admissions += 1
        heapq.heappush(self.ends, (self.clock - (self.tokens(dst) - self.target[dst]) // self.k, self.stamp[dst], dst))
        heapq.heappush(self.longest, (-self.base[dst], self.stamp[dst], dst))

    def remove(self, slot: int) -> None:
        """Frees a running slot (its sequence ended or was preempted); its heap entries go stale."""
        self.uid[slot], self.stamp[slot] = -1, -1
        self.live_np[slot] = False
        self.give(slot)
        self.active -= 1
        self.base_sum -= self.base[slot]

    def _drop_stale_ends(self) -> None:
        while self.ends and self.stamp[self.ends[0][2]] != self.ends[0][1]:
            heapq.heappop(self.ends)

    def longest_tokens(self) -> int:
        while self.stamp[self.longest[0][2]] != self.longest[0][1]:
            heapq.heappop(self.longest)
        return -self.longest[0][0] + self.k * self.clock

    def tokens_sum(self) -> int:
        return self.base_sum + self.active * self.k * self.clock

    def to_next_end(self) -> int:
        self._drop_stale_ends()
        return self.ends[0][0] - self.clock

    def advance(self, n: int) -> list[tuple[int, int]]:
        """Runs ``n`` dispatches; frees the slots whose sequences end in them and returns their (uid, tokens
        they still needed), those being at most ``n * k``."""
        ended = []
        self._drop_stale_ends()
        while self.ends and self.ends[0][0] <= self.clock + n:
            slot = heapq.heappop(self.ends)[2]
            ended.append((self.uid[slot], self.target[slot] - self.tokens(slot)))
            self.remove(slot)
            self._drop_stale_ends()
        self.clock += n
        if not self.active:
            self.longest = []
        return ended

    def pages(self, w: Workload, dispatches: int) -> np.ndarray:
        """[S] pages each running slot reserves through its next ``dispatches`` dispatches (0: what it holds
        after a dispatch; 1: what its next dispatch needs), never below its admission grant; 0 when free."""
        need = w.reserved_pages(self.base_np + self.k * self.clock, dispatches)
        return np.where(self.live_np, np.maximum(need, self.floor_np), 0)

    def lowest_free(self, n: int) -> list[int]:
        """The ``n`` lowest free slots of every shard, ascending: all that an admission of ``n`` requests may take
        (``schedule_decisions.admit``), without sorting every free slot at every round."""
        return [s for heap in self.free for s in heapq.nsmallest(n, heap)]

    def by_shard(self, per_slot: np.ndarray) -> np.ndarray:
        return per_slot.reshape(self.shards, self.per_shard).sum(1)

    def reads(self, prompt_len: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """For the running slots over the next ``steps`` decode steps: tokens each attends at the first (prompt +
        its tokens), and steps it runs (fewer for one that ends sooner)."""
        live = self.live_np
        held = self.base_np[live] + self.k * self.clock
        return prompt_len + held, np.minimum(self.target_np[live] - held, steps)


@dataclasses.dataclass
class StepRecord:
    step: int
    on_policy: bool
    prefill_s: float = 0.0  # prefill (+ activate) calls, without the verification share (verify_s)
    prefill_attn_s: float = 0.0  # of prefill_s: the attention (quadratic) term
    decode_s: float = 0.0
    verify_s: float = 0.0  # the verification share of the prefill rounds (log-probs + verifier)
    train_s: float = 0.0
    overhead_s: float = 0.0
    dispatches: int = 0
    decode_steps: int = 0
    slot_steps: int = 0  # live-bucket slots x decode steps (what decode computes over)
    width_slot_steps: int = 0  # slot-steps x live page-table width in tokens (what reference attention gathers)
    tokens_generated: int = 0  # by decode dispatches (the engine's rollout/tokens)
    prefill_sequences: int = 0  # sequences the prefill calls took in (admitted; rollout/prefill_sequences)
    useful_token_steps: int = 0
    prefill_tokens: int = 0  # prompt + cached tokens, each sequence's last aside, computed (rollout/prefill_tokens)
    shared_prompt_tokens: int = 0  # prompt tokens of a group's new members copied, not computed
    prefill_calls: int = 0  # engine dispatches per prefill call: 2 (prefill, activate), 1 if none activates
    prefill_padded_tokens: int = 0  # rows x width the prefill calls compute
    logp_tokens: int = 0  # of those, the ones the log-prob projection runs over (the verified calls' rows x width)
    removed_tokens: int = 0  # cached tokens verification cut (paused and finished)
    batch_tokens: int = 0  # response tokens of the trained batch
    train_tokens: int = 0  # prompt + response tokens of the trained batch
    train_positions: int = 0  # positions the train step's rows compute (TrainLayout.rows; = train_tokens without)
    verified: int = 0  # paused trajectories verified (what the acceptance counts: verify/num_verified)
    verified_tokens: int = 0
    kept_tokens: int = 0
    num_cut: int = 0
    num_restarted: int = 0
    examined_tokens: int = 0  # of the verified tokens, those up to and including each one's first cut token
    examined_token_age: int = 0  # their ages summed (age: the verifying step minus the step that sampled it)
    verified_token_age: int = 0  # every verified token's age summed
    finished_verified: int = 0  # finished members re-verified (verify_finished)
    finished_cut: int = 0
    preemptions: int = 0  # running sequences sent back to the queue for want of KV pages
    page_waits: int = 0  # admission rounds that stopped because the queue head's shard lacked pages
    segments_checked: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by age
    segments_failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    keep_fraction_sum: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    acceptance: float = float("nan")
    switched: bool = False

    @property
    def rollout_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def step_s(self) -> float:
        return self.prefill_s + self.decode_s + self.verify_s + self.train_s + self.overhead_s

    def slot_utilization(self, num_slots: int) -> float:
        return self.useful_token_steps / max(1, num_slots * self.decode_steps)

    def verify_metrics(self) -> dict:
        """The step's verification counts under the keys the rollout phase logs (``metrics.jsonl``), so that
        ``calibrate.fit_segment_fail_prob`` reads a replay as it reads a run."""
        out = {"verify/num_verified": self.verified, "verify/num_cut": self.num_cut,
               "verify/num_restarted": self.num_restarted, "verify/tokens_total": self.verified_tokens,
               "verify/tokens_removed": self.verified_tokens - self.kept_tokens,
               "verify/acceptance": 1.0 if math.isnan(self.acceptance) else self.acceptance}
        for age in sorted(self.segments_checked):
            out[f"verify/segments_checked/{age}"] = self.segments_checked[age]
            out[f"verify/segments_failed/{age}"] = self.segments_failed[age]
            if self.segments_failed[age]:
                out[f"verify/keep_fraction/{age}"] = self.keep_fraction_sum[age] / self.segments_failed[age]
        return out


SUMMED = ("prefill_s", "prefill_attn_s", "decode_s", "verify_s", "train_s", "overhead_s", "tokens_generated",
          "removed_tokens", "batch_tokens", "dispatches", "decode_steps", "slot_steps", "width_slot_steps",
          "useful_token_steps", "verified", "verified_tokens", "kept_tokens", "num_cut", "num_restarted",
          "finished_verified", "finished_cut", "preemptions", "page_waits", "prefill_sequences", "prefill_tokens",
          "prefill_calls", "prefill_padded_tokens", "shared_prompt_tokens", "logp_tokens", "train_tokens",
          "train_positions")


@dataclasses.dataclass
class SimResult:
    workload: Workload
    steps: list[StepRecord]
    switch_step: int = -1

    @property
    def wall_s(self) -> float:
        return sum(r.step_s for r in self.steps)

    def device_days(self, num_devices: int) -> float:
        return self.wall_s * num_devices / 86400.0

    def summary(self, num_devices: int) -> dict:
        n = len(self.steps)
        tot = {k: sum(getattr(r, k) for r in self.steps) for k in SUMMED}
        return {
            "mode": self.workload.mode, "steps": n, "wall_s": self.wall_s,
            "step_s_mean": self.wall_s / max(n, 1), "device_days": self.device_days(num_devices),
            "num_devices": num_devices, "rollout_s": tot["prefill_s"] + tot["decode_s"], **tot,
            "rollout_fraction": (tot["prefill_s"] + tot["decode_s"]) / max(self.wall_s, 1e-30),
            "slot_utilization": tot["useful_token_steps"] / max(1, self.workload.num_slots * tot["decode_steps"]),
            "acceptance": tot["kept_tokens"] / tot["verified_tokens"] if tot["verified_tokens"] else float("nan"),
            "train_useful_fraction": tot["train_tokens"] / max(1, tot["train_positions"]),
            "switch_step": self.switch_step,
        }


class Replay:
    """The scheduler's state across steps: slots (``_Slots``), queue, paused cache, groups, switching."""

    def __init__(self, w: Workload, costs: CostModel, lengths: LengthModel, cut: CutModel):
        self.w, self.costs, self.lengths, self.cut = w, costs, lengths, cut
        self.trajs: dict[int, _Traj] = {}
        self.group_members: dict[int, list[int]] = {}
        self.group_done: dict[int, int] = {}  # finished members per cached group
        self.complete: set[int] = set()  # groups with all G members finished
        self.slots = _Slots(w.num_slots, w.steps_per_dispatch, w.pool_shards if w.pool_binds else 1)
        self.queue: collections.deque[int] = collections.deque()
        self.new_queued = 0  # queued requests that count as new (not verified, no tokens)
        self.paused: list[int] = []
        self.next_uid = self.next_gid = 0
        self.on_policy = w.mode == "on_policy"
        self.window: list[float] = []
        self.switch_step = -1
        self.step = 0
        self.page_blocked = False  # the last admission round stopped for want of pages

    # -- bookkeeping --------------------------------------------------------------------------------

    def _new_group(self) -> list[int]:
        gid = self.next_gid
        self.next_gid += 1
        uids = []
        lengths, mu = self.lengths.draw_group(self.w.group_size)
        for target in lengths:
            self.trajs[self.next_uid] = _Traj(self.next_uid, gid, target, mu)
            uids.append(self.next_uid)
            self.next_uid += 1
        self.group_members[gid], self.group_done[gid] = uids, 0
        return uids

    def _is_new(self, t: _Traj) -> bool:
        return not t.verify and t.tokens == 0

    def _enqueue(self, uids, front: bool = False) -> None:
        uids = list(uids)
        self.new_queued += sum(self._is_new(self.trajs[u]) for u in uids)
        if front:
            self.queue.extendleft(reversed(uids))
        else:
            self.queue.extend(uids)

    def _grow_tokens(self, t: _Traj, tokens: int) -> None:
        """``t`` now holds ``tokens``: the new ones belong to this step's segment."""
        new = tokens - t.tokens
        if new > 0:
            if t.segments and t.segments[-1][0] == self.step:
                t.segments[-1][1] += new
            else:
                t.segments.append([self.step, new])
            t.tokens = tokens

    def _cut(self, t: _Traj, keep: int) -> None:
        """Truncates ``t`` to its first ``keep`` tokens and sets the length it regenerates to
        (``LengthModel.regenerated``)."""
        left, segs = keep, []
        for step, count in t.segments:
            if left <= 0:
                break
            segs.append([step, min(count, left)])
            left -= count
        t.segments, t.tokens, t.finished = segs, keep, False
        t.target = self.lengths.regenerated(t.mu, keep, t.target)

    def _group_gains(self, gid: int) -> None:
        self.group_done[gid] += 1
        if self.group_done[gid] == self.w.group_size:
            self.complete.add(gid)

    def _finish(self, t: _Traj) -> None:
        t.finished = True
        self._group_gains(t.gid)

    def _pop_complete(self) -> list[int]:
        gids = sorted(self.complete)[: self.w.batch_groups]
        for g in gids:
            del self.group_done[g]
            self.complete.discard(g)
        return gids

    def _drop_groups(self, gids) -> None:
        for g in gids:
            for u in self.group_members.pop(g):
                self.trajs.pop(u, None)

    def _running(self) -> bool:
        return self.slots.active > 0

    # -- one admission round and the dispatches up to the next end ------------------------------------

    def _verify(self, rec: StepRecord, t: _Traj, step: int) -> int:
        """Verifies ``t``'s cached tokens at ``step``, records the cycle's statistics, returns the keep."""
        n = t.tokens
        keep, checked, fail_age = self.cut.verify(t.segments, step)
        rec.segments_checked.update(checked)
        if fail_age is not None:
            rec.segments_failed[fail_age] += 1
            rec.keep_fraction_sum[fail_age] += keep / n
        rec.removed_tokens += n - keep
        if t.finished:
            rec.finished_verified += 1
            rec.finished_cut += keep < n
        else:
            rec.verified += 1
            rec.verified_tokens += n
            rec.kept_tokens += keep
            rec.num_cut += keep < n
            rec.num_restarted += keep == 0
            examined = min(n, keep + 1)  # the kept tokens and the one that cut
            rec.examined_tokens += examined
            for seg_step, count in t.segments:  # token-weighted ages (the coupled fit's age correction)
                rec.verified_token_age += (step - seg_step) * count
                rec.examined_token_age += (step - seg_step) * max(0, min(count, examined))
                examined -= count
        return keep

    def _admit(self, rec: StepRecord, step: int) -> None:
        """Fills free slots from the queue head while pages fit (``schedule_decisions.admit``, as the scheduler
        does): verifies and cuts resumed trajectories and prefills prompt + cached tokens but the last (per width
        bucket, ``_charge_prefill``). Admission samples nothing: each admitted sequence decodes on from its last
        token, except a verified finished member that survived, which goes back to its group."""
        w, slots, held = self.w, self.slots, []
        verified_tokens = 0
        calls: dict[int, _Call] = collections.defaultdict(_Call)
        # per width bucket, per sequence of its call: (slot, trajectory, pages granted), None if it left
        starts: dict[int, list[tuple[int, _Traj, int] | None]] = collections.defaultdict(list)
        head = list(itertools.islice(self.queue, slots.num_free))
        needs, free_pages, busy = [0] * len(head), None, [0] * slots.shards
        if w.pool_binds:
            needs = [w.reserved_pages(self.trajs[u].tokens) for u in head]
            free_pages = (w.kv_pages_per_shard - slots.by_shard(slots.pages(w, 0))).tolist()
            busy = slots.by_shard(slots.live_np.astype(np.int64)).tolist()
        admission = schedule_decisions.admit(needs, slots.lowest_free(len(head)), slots.per_shard, free_pages, busy,
                                             headroom=int(w.page_reservation == "incremental"))
        rec.page_waits += admission.page_blocked
        for slot, need in zip(admission.slots, needs, strict=False):
            slots.take(slot)  # held through the round even if the sequence leaves
            t = self.trajs[self.queue.popleft()]
            if self._is_new(t):
                self.new_queued -= 1
            length = w.prompt_len + t.tokens
            bucket = w.prefill_bucket(length)
            new_group = t.gid if t.tokens == 0 else -1  # no tokens yet: its prompt can be shared
            verifies, survived = t.verify and t.tokens > 0, False
            if verifies:
                verified_tokens += t.tokens
                keep = self._verify(rec, t, step)
                survived = t.finished and keep >= t.tokens
                if survived:  # a finished member survived: back to its group, no decoding
                    self._group_gains(t.gid)
                    held.append(slot)
                else:
                    if keep < t.tokens:
                        self._cut(t, keep)
                    t.finished = False
            t.verify = False
            calls[bucket].add(length, new_group, verifies, not survived)
            starts[bucket].append(None if survived else (slot, t, need))
        # They start decoding in the order the scheduler activates them: per width bucket (ascending), per prefill
        # call of it, in queue order: the order a pause returns them in, and the next phase resumes them in.
        for bucket in sorted(calls):
            for part in w.split_for_prefill(calls[bucket].lengths):
                for slot, t, need in filter(None, (starts[bucket][i] for i in part)):
                    slots.place(slot, t.uid, t.tokens, t.target, need)
        for slot in held:
            slots.give(slot)
        # A head waiting for pages waits for an end or a preemption, unless a sequence admitted with it already
        # left (a finished member that survived verification): its pages are free for the next round.
        self.page_blocked = admission.page_blocked and not held
        self._charge_prefill(rec, list(calls.values()), verified_tokens)

    def _charge_prefill(self, rec: StepRecord, calls: list[_Call], verified_tokens: int) -> None:
        """The prefill of one admission round (``Scheduler._prefill_and_activate`` per call of each width bucket,
        ``split_for_prefill``), every sequence but its last token: a call that verifies nothing is a prefill and
        an activation (``Engine.admit``) in which a group's new members compute their prompt once (the first is
        packed, the others copy its K/V: ``_shared_prompts``); a call with a verified resume packs every sequence
        into a log-prob prefill (the projection runs over its rows x width), then an activation if anything goes
        on decoding. Each prefill computes ``prefill_shape`` rows x width, and causal attention over each packed
        row (rows x width^2; the halving is in the rate)."""
        padded = squares = n_calls = computed = shared = logp = sequences = 0
        for call in calls:
            for part in self.w.split_for_prefill(call.lengths):
                verifies = any(call.verifies[i] for i in part)
                packed, seen = [], set()
                for i in part:
                    length, gid = call.lengths[i], call.new_group[i]
                    if not verifies and gid >= 0 and gid in seen:
                        shared += max(0, length - 1)
                        continue
                    seen.add(gid)
                    packed.append(length)
                rows, width = self.w.prefill_shape(packed)
                padded += rows * width
                squares += rows * width * width
                logp += rows * width if verifies else 0
                computed += sum(max(0, n - 1) for n in packed)
                n_calls += 1 + any(call.activates[i] for i in part)
                sequences += len(part)
        c = self.costs
        verify_part = c.prefill_logp_token_s * logp + c.verify_token_s * verified_tokens
        rec.prefill_s += c.prefill(padded, verified_tokens, n_calls, squares, logp) - verify_part
        rec.prefill_attn_s += c.prefill_attn_s * squares
        rec.verify_s += verify_part
        rec.prefill_calls += n_calls
        rec.prefill_sequences += sequences
        rec.prefill_padded_tokens += padded
        rec.prefill_tokens += computed
        rec.shared_prompt_tokens += shared
        rec.logp_tokens += logp

    def _grow_or_preempt(self, rec: StepRecord) -> np.ndarray | None:
        """Grants every running slot the pages of its next dispatch (``schedule_decisions.grow_or_preempt``, as
        the scheduler does): on a shard that cannot, slots are served in admission order (uid) and those that do
        not fit go back to the queue head. Returns the pages each shard's slots then hold (None: no page limit)."""
        w, slots = self.w, self.slots
        if not w.pool_binds or not slots.active:
            return None
        need = slots.pages(w, 1)
        over = np.flatnonzero(slots.by_shard(need) > w.kv_pages_per_shard)
        if not over.size:  # every shard has its slots' pages: the decision preempts nobody
            return slots.by_shard(need)
        have = slots.pages(w, 0)
        running = sorted((s for shard in over.tolist() for s in range(shard * slots.per_shard,
                                                                         (shard + 1) * slots.per_shard)
                          if slots.live_np[s]), key=lambda s: slots.uid[s])
        out = schedule_decisions.grow_or_preempt([s // slots.per_shard for s in running], have[running].tolist(),
                                                 need[running].tolist(),
                                                 (w.kv_pages_per_shard - slots.by_shard(have)).tolist())
        uids = []
        for s in (running[i] for i in out):  # oldest first: they queue in that order
            t = self.trajs[slots.uid[s]]
            self._grow_tokens(t, slots.tokens(s))
            slots.remove(s)
            uids.append(t.uid)
        self._enqueue(uids, front=True)
        rec.preemptions += len(uids)
        return slots.by_shard(slots.pages(w, 1))

    def _tops_up(self) -> bool:
        """Whether new requests may join the queue before the next dispatch (a partial phase always may)."""
        return not self.on_policy

    def _dispatch(self, rec: StepRecord, one: bool, limit: int | None = None, budget_s: float | None = None) -> int:
        """Dispatches up to the first end of a sequence (exactly one if ``one``; at most ``limit``; no more than
        the first that reaches ``budget_s`` seconds), each over the live slot bucket of the running sequences,
        after granting their pages. Returns the dispatches run."""
        k, slots = self.w.steps_per_dispatch, self.slots
        preempted = rec.preemptions
        held = self._grow_or_preempt(rec)
        m = slots.active
        if not m:
            return 0
        # some running slot above the live bucket: pack them below it (one pool shard: a sharded pool's engine
        # decodes over all slots and never moves one)
        if slots.shards == 1 and slots.live_np[self.w.slot_bucket(m):].any():
            for src, dst in schedule_decisions.pack_moves(np.flatnonzero(slots.live_np).tolist(), self.w.slot_buckets):
                slots.move(src, dst)
        # a slot left free by a finished member that survived verification is refilled at the next dispatch if
        # anything can be admitted (partial phases top the queue up before every dispatch); a queue head waiting
        # for pages waits until a sequence ends or is preempted (running sequences only ever take pages)
        waits = self.page_blocked and rec.preemptions == preempted
        refill = m < self.w.num_slots and not waits and (bool(self.queue) or self._tops_up())
        n = 1 if one or refill else slots.to_next_end()
        if held is not None and n > 1:
            n = min(n, self._pages_safe(held) + 1)
        longest = slots.longest_tokens()
        width = self.w.live_width(longest)
        widens = self.w.widens_after(longest)
        if widens is not None:
            n = min(n, widens)
        if limit is not None:
            n = max(1, min(n, limit))
        attended = m * self.w.prompt_len + slots.tokens_sum()
        bucket = self.w.slot_bucket(m)

        def seconds(d: int) -> float:
            running = slots.reads(self.w.prompt_len, d * k) if self.costs.reads_slot_lengths else None
            return self.costs.decode(d, k, m, attended, bucket, width, running)

        cost = seconds(n)
        if budget_s is not None and n > 1 and cost > budget_s:  # the fewest dispatches that reach the budget
            lo, hi = 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if seconds(mid) >= budget_s else (mid + 1, hi)
            n, cost = lo, seconds(lo)
        rec.decode_s += cost
        ended = slots.advance(n)
        total = m * n * k - sum(n * k - rem for _, rem in ended)
        rec.dispatches += n
        rec.decode_steps += n * k
        rec.slot_steps += n * k * bucket
        rec.width_slot_steps += n * k * bucket * width
        rec.tokens_generated += total
        rec.useful_token_steps += total
        for uid, _ in ended:
            t = self.trajs[uid]
            self._grow_tokens(t, t.target)
            self._finish(t)
        return n

    def _pages_safe(self, held: np.ndarray) -> int:
        """Dispatches after the next one that surely need no preemption: a running slot gains at most
        ceil(k / page) pages a dispatch, so shard ``s`` with ``m_s`` of them has room for (free / (m_s * that))."""
        w, slots = self.w, self.slots
        if w.page_reservation == "full":
            return 1 << 62
        gain = -(-w.steps_per_dispatch // w.page_size)
        counts = slots.by_shard(slots.live_np.astype(np.int64))
        room = [(w.kv_pages_per_shard - int(h)) // (int(c) * gain) for h, c in zip(held, counts, strict=True) if c]
        return min(room)

    def _pause_all(self) -> list[int]:
        """Everything unfinished, running (in the order they started decoding, as the scheduler's slots are
        ordered) then queued (``schedule_decisions.pause_order``); every slot is freed and the queue emptied."""
        running = []
        for slot in sorted((s for s, uid in enumerate(self.slots.uid) if uid >= 0), key=lambda s: self.slots.stamp[s]):
            uid = self.slots.uid[slot]
            self._grow_tokens(self.trajs[uid], self.slots.tokens(slot))
            running.append(uid)
        self.slots.clear()
        queued, self.queue, self.new_queued = list(self.queue), collections.deque(), 0
        return schedule_decisions.pause_order(running, [], queued)

    # -- phases ------------------------------------------------------------------------------------

    def _on_policy_phase(self, rec: StepRecord, step: int) -> list[int]:
        for _ in range(self.w.batch_groups):
            self._enqueue(self._new_group())
        while self.queue or self._running():
            self._admit(rec, step)
            if self._running():
                self._dispatch(rec, one=False)
        return self._pop_complete()

    def _partial_phase(self, rec: StepRecord, step: int) -> list[int]:
        w = self.w
        verifying = w.mode == "rollverify"
        resumed, self.paused = self.paused, []
        if verifying and w.verify_finished:  # finished members of cached groups are verified again
            queued = set(resumed)  # finished members still queued when the last phase ended are in it already
            for gid in sorted(self.group_done):
                resumed.extend(u for u in self.group_members[gid] if self.trajs[u].finished and u not in queued)
                self.group_done[gid] = 0
            self.complete.clear()
        for u in resumed:
            self.trajs[u].verify = verifying
        self._enqueue(resumed, front=True)
        target = schedule_decisions.queue_target(w.queue_groups, w.num_slots, w.group_size)
        while not schedule_decisions.phase_done(len(self.complete), w.batch_groups):
            for _ in range(schedule_decisions.groups_to_queue(self.new_queued, target, w.group_size)):
                self._enqueue(self._new_group())
            self._admit(rec, step)
            if self._running():  # the phase's last dispatch (done after admission) is one dispatch
                self._dispatch(rec, one=schedule_decisions.phase_done(len(self.complete), w.batch_groups))
        batch = self._pop_complete()
        self.paused = self._pause_all()
        return batch

    def run_step(self, step: int) -> StepRecord:
        self.step = step
        rec = StepRecord(step=step, on_policy=self.on_policy)
        batch = self._on_policy_phase(rec, step) if self.on_policy else self._partial_phase(rec, step)
        lengths = [self.trajs[u].target for g in batch for u in self.group_members[g]]
        rec.batch_tokens = sum(lengths)
        seqs = [self.w.prompt_len + x for x in lengths]
        rows = self.w.train_layout.rows(seqs) if self.w.train_layout and seqs else None
        rec.train_tokens = sum(seqs)
        rec.train_positions = sum(w * n for w, n in rows) if rows else rec.train_tokens
        rec.train_s = self.costs.train(seqs, rows)
        rec.overhead_s = self.costs.step_overhead_s
        self._drop_groups(batch)
        if rec.verified_tokens:
            rec.acceptance = rec.kept_tokens / rec.verified_tokens
        if self.w.mode == "rollverify" and not self.on_policy and rec.verified > 0:  # cycles that verified
            self.window = (self.window + [rec.acceptance])[-self.w.switch_window:]
            if self.w.switching and schedule_rules.switch_due(self.window, self.w.switch_window,
                                                              self.w.switch_threshold):
                self.on_policy, self.switch_step, rec.switched = True, step, True
                self.paused = []
                self._drop_groups(list(self.group_done))
                self.group_done, self.complete = {}, set()
        return rec


def simulate(w: Workload, costs: CostModel, lengths: LengthModel, cut: CutModel | None = None,
             num_steps: int = 1) -> SimResult:
    """Replays ``num_steps`` training steps of ``w`` and returns every step's record (``cut``: no cuts)."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1.")
    replay = Replay(w, costs, lengths, cut or CutModel())
    steps = [replay.run_step(s) for s in range(1, num_steps + 1)]
    return SimResult(w, steps, replay.switch_step)
