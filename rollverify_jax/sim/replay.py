"""A discrete-event replay of the rollout scheduler and the training loop (no model, no JAX).

It follows ``rl/partial_rollout.py`` and ``rollout/scheduler.py`` dispatch by dispatch, jumping from one
sequence's end to the next (between two ends every active slot generates ``k`` tokens per dispatch, so the
jump is exact and the cost of the dispatches in between has a closed form, ``CostModel.decode``):

- on-policy: a phase admits exactly ``B`` groups of ``G`` samples and runs until every one has finished; freed
  slots take queued samples of the same batch, then idle through the long tail.
- partial (naive): the phase keeps every slot busy (resumed trajectories first, then new groups, with
  ``ceil(S / G)`` groups queued ahead of the free slots); it ends after the first dispatch at whose end ``B``
  groups are complete, and pauses everything unfinished. A resumed trajectory is re-prefilled (prompt + its
  tokens) when admitted and keeps all its tokens.
- rollverify: as partial, but the resume prefill also returns log-probs, everything cached is verified
  (paused trajectories and, with ``verify_finished``, finished members waiting for their group and complete
  groups carried beyond ``B``); a verified trajectory of ``n`` tokens keeps ``keep = round(a * n)`` of them
  (``cut_model='fraction'``, rounded half up; ``'all_or_nothing'``: all with probability ``a``, else none),
  where ``a`` is the step's acceptance (``AcceptanceModel``), and regenerates the cut suffix up to its drawn
  length. The cycle's acceptance ``sum keep / sum n`` enters the switching window; once the full window's
  mean is below the threshold the run goes on-policy and the cache is dropped.

A sequence's response length is drawn once, when its group is created (``LengthModel``), and a cut
trajectory regenerates up to that same length. As in the engine, an admitted sequence's first token is sampled
by ``insert`` (counted apart from decode's tokens), a decode dispatch runs over the live slot bucket (the smallest
of ``Workload.slot_buckets`` that holds the running sequences, which the scheduler packs below it), and an
admission round prefills once per length bucket (padded rows x length). Time of a step = prefill calls + decode
dispatches + train step + overhead (``CostModel``); nothing overlaps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math

import numpy as np

from rollverify_jax.sim.costs import CostModel

MODES = ("on_policy", "partial", "rollverify")
CUT_MODELS = ("fraction", "all_or_nothing")


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
    verify_finished: bool = True
    live_slots: bool = True  # decode over the smallest slot bucket holding the running sequences (engine default)
    min_prefill_len: int = 0  # prefill length buckets: powers of two >= this (0: no padding)
    max_seq_len: int = 0  # the largest prefill bucket and the page table's width (0: prompt_len + max_new_tokens)
    page_size: int = 0  # > 0: track the live page-table width decode reads (EngineConfig.live_pages buckets)
    live_pages: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {list(MODES)}.")
        for name in ("batch_groups", "group_size", "num_slots", "steps_per_dispatch", "max_new_tokens",
                     "switch_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.prompt_len < 0 or self.queue_groups < 0:
            raise ValueError("prompt_len and queue_groups must be >= 0.")
        if not 0.0 <= self.switch_threshold <= 1.0:
            raise ValueError(f"switch_threshold={self.switch_threshold} must be in [0, 1].")
        if self.min_prefill_len < 0 or self.max_seq_len < 0:
            raise ValueError("min_prefill_len and max_seq_len must be >= 0.")

    @functools.cached_property
    def slot_buckets(self) -> list[int]:
        """The slot counts a decode dispatch runs over, ascending (``Engine.live_slot_buckets``): all slots
        halved while at least 8 remain, or all slots only (live slots off, or a pool sharded over devices)."""
        out = [self.num_slots]
        while self.live_slots and out[-1] // 2 >= 8:
            out.append(out[-1] // 2)
        return out[::-1]

    def slot_bucket(self, active: int) -> int:
        """The scheduler packs running sequences below the smallest bucket that holds them."""
        return next(b for b in self.slot_buckets if b >= active)

    @functools.cached_property
    def page_buckets(self) -> list[int]:
        """Page-table widths decode reads, ascending (``Engine.live_page_buckets``): the table halved (rounded
        up) while it has at least 16 pages and the half at least 4; the whole table with live pages off."""
        out = [-(-(self.max_seq_len or self.prompt_len + self.max_new_tokens) // max(1, self.page_size))]
        while self.live_pages and out[0] >= 16 and out[-1] // 2 >= 4:
            out.append(-(-out[-1] // 2))
        return out[::-1]

    def live_width(self, tokens: int) -> int:
        """Tokens of the page-table width a dispatch reads when the longest running sequence holds ``tokens``
        response tokens: its pages (reserved through the dispatch: prompt + tokens + k + 1, at most the cap)
        rounded up to a bucket; 0 when ``page_size`` is 0."""
        if not self.page_size:
            return 0
        need = min(self.prompt_len + self.max_new_tokens, self.prompt_len + tokens + self.steps_per_dispatch + 1)
        pages = -(-need // self.page_size)
        return next((b for b in self.page_buckets if b >= pages), self.page_buckets[-1]) * self.page_size

    def widens_after(self, tokens: int) -> int | None:
        """The first ``d >= 1`` at which ``live_width(tokens + d * k)`` differs from ``live_width(tokens)`` (None:
        never), in closed form so that a long jump needs no scan: the width grows once the reserved positions
        pass its bucket's pages, unless it is the last bucket or the cap stops the reservation below that."""
        if not self.page_size:
            return None
        k, edge = self.steps_per_dispatch, self.live_width(tokens)
        if edge // self.page_size == self.page_buckets[-1] or self.prompt_len + self.max_new_tokens <= edge:
            return None
        return (edge - self.prompt_len - tokens - k - 1) // k + 1

    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(rows, length) one prefill call computes (``Engine.prefill``): powers of two, rows up to the slot
        count, length in [min_prefill_len, max_seq_len]; unpadded when ``min_prefill_len`` is 0."""
        if self.min_prefill_len == 0:
            return rows, longest
        return _pow2(rows, 1, max(self.num_slots, rows)), self.prefill_bucket(longest)

    def prefill_bucket(self, tokens: int) -> int:
        if self.min_prefill_len == 0:
            return tokens
        return _pow2(tokens, self.min_prefill_len, self.max_seq_len or self.prompt_len + self.max_new_tokens)


def _pow2(n: int, lo: int, hi: int) -> int:
    """Smallest power of two (times ``lo`` >= 1) >= n, capped at ``hi`` (the engine's ``_bucket``); bit length
    instead of the engine's doubling loop, since the replay asks once per admitted sequence."""
    return min(lo << max(-(-n // lo) - 1, 0).bit_length(), hi)


class LengthModel:
    """Response lengths in tokens, drawn one group (one ``draw`` call) at a time: an explicit list (cycled), or
    a lognormal with the given median and (total) sigma, rounded and clipped to [1, max_new_tokens]. A group's
    members answer the same prompt, so their lengths are alike: ``group_share`` of the log-variance is drawn
    once per group (sigma_between = sigma sqrt(share)), the rest per member."""

    def __init__(self, max_new_tokens: int, lengths=None, median: float = 0.0, sigma: float = 0.0,
                 seed: int = 0, group_share: float = 0.0):
        self.max_new_tokens = int(max_new_tokens)
        self.lengths = None if lengths is None else [int(x) for x in lengths]
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError("explicit response lengths must be a non-empty list of integers >= 1.")
        if self.lengths is None and (median <= 0 or sigma < 0):
            raise ValueError(f"lognormal lengths need median > 0 and sigma >= 0 (got {median}, {sigma}).")
        if not 0.0 <= group_share <= 1.0:
            raise ValueError(f"group_share={group_share} must be in [0, 1].")
        self.median, self.sigma, self.group_share = float(median), float(sigma), float(group_share)
        self._rng = np.random.default_rng(seed)
        self._next = 0

    def draw(self, n: int) -> list[int]:
        """The lengths of one group of ``n`` members."""
        if self.lengths is not None:
            out = [self.lengths[(self._next + i) % len(self.lengths)] for i in range(n)]
            self._next += n
        elif self.sigma == 0:
            out = np.rint(np.full(n, self.median)).astype(np.int64).tolist()
        elif self.group_share == 0:
            out = np.rint(self._rng.lognormal(math.log(self.median), self.sigma, size=n)).astype(np.int64).tolist()
        else:
            between = self.sigma * math.sqrt(self.group_share) * self._rng.standard_normal()
            within = self.sigma * math.sqrt(1.0 - self.group_share) * self._rng.standard_normal(n)
            out = np.rint(self.median * np.exp(between + within)).astype(np.int64).tolist()
        return [min(max(1, int(v)), self.max_new_tokens) for v in out]


class AcceptanceModel:
    """The acceptance ``a`` a verification at step ``s`` (1-based) applies: ``trace[s - 1]`` (the last value
    beyond the trace), or ``clip(start + slope * (s - 1), 0, 1)``."""

    def __init__(self, trace=None, start: float = 1.0, slope: float = 0.0, cut_model: str = "fraction",
                 seed: int = 0):
        if cut_model not in CUT_MODELS:
            raise ValueError(f"unknown cut model {cut_model!r}; known: {list(CUT_MODELS)}.")
        self.trace = None if trace is None else [float(a) for a in trace]
        if self.trace is not None and (not self.trace or not all(0.0 <= a <= 1.0 for a in self.trace)):
            raise ValueError("an acceptance trace must be a non-empty list of rates in [0, 1].")
        self.start, self.slope, self.cut_model = float(start), float(slope), cut_model
        self._rng = np.random.default_rng(seed)

    def at(self, step: int) -> float:
        if self.trace is not None:
            return self.trace[min(step, len(self.trace)) - 1]
        return min(1.0, max(0.0, self.start + self.slope * (step - 1)))

    def keep(self, n: int, step: int) -> int:
        a = self.at(step)
        if self.cut_model == "fraction":
            return min(n, math.floor(a * n + 0.5))  # round half up
        return n if self._rng.random() < a else 0


@dataclasses.dataclass
class _Traj:
    uid: int
    gid: int
    target: int  # response length drawn at creation; a cut suffix regenerates up to it
    tokens: int = 0
    finished: bool = False
    verify: bool = False  # queued for a verified resume


class _Slots:
    """The decode slots on a dispatch clock: a running sequence holds ``base + k * clock`` tokens, so a jump of
    ``n`` dispatches is one addition, the next end is a heap's top and the longest sequence another's; an event
    costs O(log S) instead of passes over every slot."""

    def __init__(self, num_slots: int, k: int):
        self.num_slots, self.k = num_slots, k
        self.clock = 0  # dispatches so far
        self.base = [0] * num_slots  # tokens held - k * clock
        self.target = [0] * num_slots
        self._admissions = 0
        self.clear()

    def clear(self) -> None:
        """Every slot free (``Scheduler.pause``, or nothing running)."""
        self.uid = [-1] * self.num_slots
        self.stamp = [-1] * self.num_slots  # admission number of the running sequence (-1: free)
        self.free = list(range(self.num_slots))  # a heap: admission fills the lowest free slot first
        self.ends: list[tuple[int, int]] = []  # (clock at whose dispatch it ends, slot)
        self.longest: list[tuple[int, int, int]] = []  # (-base, stamp, slot); stale once the stamp moved on
        self.active = self.base_sum = 0

    def tokens(self, slot: int) -> int:
        return self.base[slot] + self.k * self.clock

    def place(self, slot: int, uid: int, tokens: int, target: int) -> None:
        base = tokens - self.k * self.clock
        self.uid[slot], self.base[slot], self.target[slot] = uid, base, target
        self.stamp[slot] = self._admissions
        self._admissions += 1
        heapq.heappush(self.ends, (self.clock - (tokens - target) // self.k, slot))  # + ceil(rem / k)
        heapq.heappush(self.longest, (-base, self.stamp[slot], slot))
        self.active += 1
        self.base_sum += base

    def longest_tokens(self) -> int:
        while self.stamp[self.longest[0][2]] != self.longest[0][1]:
            heapq.heappop(self.longest)
        return -self.longest[0][0] + self.k * self.clock

    def tokens_sum(self) -> int:
        return self.base_sum + self.active * self.k * self.clock

    def to_next_end(self) -> int:
        return self.ends[0][0] - self.clock

    def advance(self, n: int) -> list[tuple[int, int]]:
        """Runs ``n`` dispatches; frees the slots whose sequences end in them and returns their (uid, tokens
        they still needed), those being at most ``n * k``."""
        ended = []
        while self.ends and self.ends[0][0] <= self.clock + n:
            slot = heapq.heappop(self.ends)[1]
            ended.append((self.uid[slot], self.target[slot] - self.tokens(slot)))
            self.uid[slot], self.stamp[slot] = -1, -1
            heapq.heappush(self.free, slot)
            self.active -= 1
            self.base_sum -= self.base[slot]
        self.clock += n
        if not self.active:
            self.longest = []
        return ended


@dataclasses.dataclass
class StepRecord:
    step: int
    on_policy: bool
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_s: float = 0.0  # the verification share of the prefill rounds (log-probs + verifier)
    train_s: float = 0.0
    overhead_s: float = 0.0
    dispatches: int = 0
    decode_steps: int = 0
    slot_steps: int = 0  # live-bucket slots x decode steps (what decode computes over)
    width_slot_steps: int = 0  # slot-steps x live page-table width in tokens (what reference attention gathers)
    tokens_generated: int = 0  # by decode dispatches (the engine's rollout/tokens)
    inserted_tokens: int = 0  # the first token of every admitted sequence, sampled by insert
    useful_token_steps: int = 0
    prefill_tokens: int = 0
    prefill_calls: int = 0  # one prefill + insert per length bucket per admission round
    prefill_padded_tokens: int = 0  # rows x length the prefill calls compute
    regen_tokens: int = 0  # tokens decoded again where a cut removed them
    batch_tokens: int = 0  # response tokens of the trained batch
    verified: int = 0
    verified_tokens: int = 0
    kept_tokens: int = 0
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
        tot = {k: sum(getattr(r, k) for r in self.steps) for k in
               ("prefill_s", "decode_s", "verify_s", "train_s", "overhead_s", "tokens_generated", "regen_tokens",
                "batch_tokens", "dispatches", "decode_steps", "slot_steps", "width_slot_steps", "useful_token_steps",
                "verified_tokens", "kept_tokens", "inserted_tokens", "prefill_tokens", "prefill_calls",
                "prefill_padded_tokens")}
        return {
            "mode": self.workload.mode, "steps": n, "wall_s": self.wall_s,
            "step_s_mean": self.wall_s / max(n, 1), "device_days": self.device_days(num_devices),
            "num_devices": num_devices, "rollout_s": tot["prefill_s"] + tot["decode_s"], **tot,
            "rollout_fraction": (tot["prefill_s"] + tot["decode_s"]) / max(self.wall_s, 1e-30),
            "slot_utilization": tot["useful_token_steps"] / max(1, self.workload.num_slots * tot["decode_steps"]),
            "acceptance": tot["kept_tokens"] / tot["verified_tokens"] if tot["verified_tokens"] else float("nan"),
            "switch_step": self.switch_step,
        }


class Replay:
    """The scheduler's state across steps: slots (``_Slots``), queue, paused cache, groups, switching."""

    def __init__(self, w: Workload, costs: CostModel, lengths: LengthModel, acceptance: AcceptanceModel):
        self.w, self.costs, self.lengths, self.acceptance = w, costs, lengths, acceptance
        self.trajs: dict[int, _Traj] = {}
        self.group_members: dict[int, list[int]] = {}
        self.group_done: dict[int, int] = {}  # finished members per cached group
        self.complete: set[int] = set()  # groups with all G members finished
        self.slots = _Slots(w.num_slots, w.steps_per_dispatch)
        self.queue: collections.deque[int] = collections.deque()
        self.new_queued = 0  # queued requests that count as new (not verified, no tokens)
        self.paused: list[int] = []
        self.next_uid = self.next_gid = 0
        self.on_policy = w.mode == "on_policy"
        self.window: list[float] = []
        self.switch_step = -1

    # -- bookkeeping --------------------------------------------------------------------------------

    def _new_group(self) -> list[int]:
        gid = self.next_gid
        self.next_gid += 1
        uids = []
        for target in self.lengths.draw(self.w.group_size):
            self.trajs[self.next_uid] = _Traj(self.next_uid, gid, target)
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

    def _admit(self, rec: StepRecord, step: int) -> None:
        """Fills free slots from the queue head (``Scheduler._admit``): verifies and cuts resumed trajectories,
        prefills prompt + kept tokens (one call per length bucket), and ``insert`` samples each admitted
        sequence's next token; one that reaches its length there finishes without taking a slot."""
        slots, held = self.slots, []
        tokens = verified_tokens = 0
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        while self.queue and slots.free:
            t = self.trajs[self.queue.popleft()]
            if self._is_new(t):
                self.new_queued -= 1
            tokens += self.w.prompt_len + t.tokens
            by_bucket[self.w.prefill_bucket(self.w.prompt_len + t.tokens)].append(self.w.prompt_len + t.tokens)
            slot = heapq.heappop(slots.free)  # held through the prefill even when the sequence leaves at once
            if t.verify and t.tokens > 0:
                n = t.tokens
                keep = self.acceptance.keep(n, step)
                verified_tokens += n
                rec.verified += 1
                rec.verified_tokens += n
                rec.kept_tokens += keep
                t.verify = False
                if t.finished and keep >= n:  # a finished member survived: back to its group, no decoding
                    self._group_gains(t.gid)
                    held.append(slot)
                    continue
                t.tokens, t.finished = keep, False
            t.verify = False
            t.tokens += 1  # insert's sample
            rec.inserted_tokens += 1
            if t.tokens >= t.target:
                self._finish(t)
                held.append(slot)
                continue
            slots.place(slot, t.uid, t.tokens, t.target)
        for slot in held:
            heapq.heappush(slots.free, slot)
        calls = len(by_bucket)
        padded = sum(math.prod(self.w.prefill_shape(len(v), max(v))) for v in by_bucket.values())
        cost_all = self.costs.prefill(padded, verified_tokens, calls)
        verify_part = (self.costs.prefill_logp_token_s + self.costs.verify_token_s) * verified_tokens
        rec.prefill_s += cost_all - verify_part
        rec.verify_s += verify_part
        rec.prefill_tokens += tokens
        rec.prefill_calls += calls
        rec.prefill_padded_tokens += padded

    def _dispatch(self, rec: StepRecord, one: bool) -> None:
        """Dispatches up to the first end of a sequence (exactly one if ``one``), each over the live slot
        bucket of the running sequences."""
        k, slots = self.w.steps_per_dispatch, self.slots
        m = slots.active
        # a slot left free by a sequence that ended at insert is refilled at the next dispatch if anything can
        # be admitted (partial phases top the queue up before every dispatch)
        one = one or (m < self.w.num_slots and (bool(self.queue) or not self.on_policy))
        n = 1 if one else slots.to_next_end()
        longest = slots.longest_tokens()
        width = self.w.live_width(longest)
        widens = self.w.widens_after(longest)
        if widens is not None:
            n = min(n, widens)
        attended = m * self.w.prompt_len + slots.tokens_sum()
        bucket = self.w.slot_bucket(m)
        rec.decode_s += self.costs.decode(n, k, m, attended, bucket, width)
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
            t.tokens = t.target
            self._finish(t)

    def _pause_all(self) -> list[int]:
        running = []
        for slot, uid in enumerate(self.slots.uid):
            if uid >= 0:
                self.trajs[uid].tokens = self.slots.tokens(slot)
                running.append(uid)
        self.slots.clear()
        queued, self.queue, self.new_queued = list(self.queue), collections.deque(), 0
        return running + queued

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
        target = (w.queue_groups or -(-w.num_slots // w.group_size)) * w.group_size
        while len(self.complete) < w.batch_groups:
            while self.new_queued < target:
                self._enqueue(self._new_group())
            self._admit(rec, step)
            if self._running():
                self._dispatch(rec, one=len(self.complete) >= w.batch_groups)
        batch = self._pop_complete()
        self.paused = self._pause_all()
        return batch

    def run_step(self, step: int) -> StepRecord:
        rec = StepRecord(step=step, on_policy=self.on_policy)
        batch = self._on_policy_phase(rec, step) if self.on_policy else self._partial_phase(rec, step)
        lengths = [self.trajs[u].target for g in batch for u in self.group_members[g]]
        rec.batch_tokens = sum(lengths)
        rec.regen_tokens = rec.verified_tokens - rec.kept_tokens
        rec.train_s = self.costs.train([self.w.prompt_len + x for x in lengths])
        rec.overhead_s = self.costs.step_overhead_s
        self._drop_groups(batch)
        if rec.verified_tokens:
            rec.acceptance = rec.kept_tokens / rec.verified_tokens
        if self.w.mode == "rollverify" and not self.on_policy and rec.verified > 0:
            self.window = (self.window + [rec.acceptance])[-self.w.switch_window:]
            full = len(self.window) == self.w.switch_window
            if self.w.switching and full and sum(self.window) / len(self.window) < self.w.switch_threshold:
                self.on_policy, self.switch_step, rec.switched = True, step, True
                self.paused = []
                self._drop_groups(list(self.group_done))
                self.group_done, self.complete = {}, set()
        return rec


def simulate(w: Workload, costs: CostModel, lengths: LengthModel, acceptance: AcceptanceModel | None = None,
             num_steps: int = 1) -> SimResult:
    """Replays ``num_steps`` training steps of ``w`` and returns every step's record."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1.")
    replay = Replay(w, costs, lengths, acceptance or AcceptanceModel())
    steps = [replay.run_step(s) for s in range(1, num_steps + 1)]
    return SimResult(w, steps, replay.switch_step)
