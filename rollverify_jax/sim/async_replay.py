"""The fully-asynchronous mode in the replay: rollout and training on disjoint devices, overlapped.

It follows the async trainer's design (``RolloutConfig.mode = 'async'``, ``AsyncConfig``): of ``N`` devices,
``R`` decode and ``N - R`` train. The rollout keeps every slot busy (continuous batching, partial rollout:
``Replay._admit`` and ``Replay._dispatch``, the scheduler's own decisions, over the rollout group's slots). When
``B`` groups are complete and the learner is idle, the learner takes the ``B`` oldest complete groups and
updates on its devices (``CostModel.train`` of the train group, plus the step overhead: grading and batch
building sit on the learner's path) while the rollout decodes on. The swap (the new weights published to the
rollout) comes after ``K`` decode dispatches counted from the update's start or when the update is done,
whichever is later: a rollout that reaches ``K`` first waits for the update (the deterministic schedule). At
the swap the weights are copied (``publish_s``: the rollout stalls for it) and, by ``at_swap``:

- 'verify': every running trajectory is paused and re-prefilled under the new weights with log-probs (the
  fused verify-resume prefill, which recomputes the stale KV anyway), verified and cut at the first failing
  segment (``CutModel``: a segment's age is the number of versions between its sampling and the swap), then
  resumed (``Replay._admit`` of the paused ones, queue head first). Finished members waiting for their group
  are not re-verified. The swap's acceptance enters the switching window; once it is due
  (``schedule_rules.switch_due``) the run returns to the synchronous on-policy schedule on all ``N`` devices;
- 'reprefill': the same re-prefill without log-probs or cuts (the unverified baseline);
- 'keep_stale_kv': no re-prefill: decoding goes on over the KV of older versions.

Admission of new groups stops while ``(S + 1) * B`` groups are admitted and not yet trained (AReaL's
``(eta + v + 1) B`` cap). Both groups of devices are held the whole run: device-days = ``N`` x wall time.
Pure Python + numpy, no JAX.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rollverify_jax import schedule_decisions, schedule_rules
from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import CutModel, LengthModel, Replay, StepRecord, Workload

AT_SWAP = ("verify", "reprefill", "keep_stale_kv")
# the simulator's async modes and what each does at a swap
ASYNC_MODES = {"async_rollverify": "verify", "async_unverified": "reprefill", "async_keep_kv": "keep_stale_kv"}


@dataclasses.dataclass(frozen=True)
class AsyncSetup:
    """``AsyncConfig`` as the replay needs it: ``rollout_devices`` of ``num_devices`` decode (the rest train),
    ``overlap_dispatches`` K, ``max_staleness`` S, ``at_swap``."""

    num_devices: int
    rollout_devices: int
    overlap_dispatches: int
    max_staleness: int = 1
    at_swap: str = "verify"

    def __post_init__(self):
        if not 0 < self.rollout_devices < self.num_devices:
            raise ValueError(f"AsyncSetup: rollout_devices={self.rollout_devices} must leave devices to train "
                             f"(1 to {self.num_devices - 1}).")
        if self.overlap_dispatches < 1 or self.max_staleness < 0:
            raise ValueError("AsyncSetup: overlap_dispatches must be >= 1 and max_staleness >= 0.")
        if self.at_swap not in AT_SWAP:
            raise ValueError(f"AsyncSetup.at_swap={self.at_swap!r}; choose one of {list(AT_SWAP)}.")

    @property
    def train_devices(self) -> int:
        return self.num_devices - self.rollout_devices


@dataclasses.dataclass(frozen=True)
class AsyncCosts:
    """The cost models of each group of devices: ``rollout`` (decode and prefill on the rollout devices),
    ``train`` (the train step and step overhead on the train devices), ``sync`` (every device: the on-policy
    schedule after a switch), and ``publish_s`` (the weights' copy at a swap)."""

    rollout: CostModel
    train: CostModel
    sync: CostModel
    publish_s: float = 0.0


def split_costs(roofline: RooflineCosts, rollout_devices: int) -> AsyncCosts:
    """``AsyncCosts`` of a real config's roofline split into ``rollout_devices`` + the rest: each group's chips
    priced as the whole slice's (``RooflineCosts.on_devices``), the publish at ``RooflineCosts.publish_s``."""
    rest = roofline.num_devices - rollout_devices
    return AsyncCosts(rollout=roofline.on_devices(rollout_devices).cost_model(),
                      train=roofline.on_devices(rest, decode=False).cost_model(), sync=roofline.cost_model(),
                      publish_s=roofline.publish_s())


def rollout_workload(w: Workload, num_devices: int, rollout_devices: int, at_swap: str = "verify") -> Workload:
    """The rollout group's workload: the same slots per pool shard (the same decode program per chip), over the
    rollout devices' share of the shards; a pool on one shard decodes over live slot buckets, as the engine's."""
    per = num_devices // w.pool_shards  # devices per pool shard (the 'tensor' chips serving one slot shard)
    if num_devices % w.pool_shards or rollout_devices % per:
        raise ValueError(f"rollout_devices={rollout_devices} must be a multiple of the {per} devices of a slot "
                         f"shard ({num_devices} devices, {w.pool_shards} shards).")
    shards = rollout_devices // per
    slots = w.num_slots // w.pool_shards * shards
    return dataclasses.replace(w, mode="rollverify" if at_swap == "verify" else "partial", num_slots=slots,
                               pool_shards=shards, live_slots=w.live_slots or shards == 1)


def auto_overlap(w: Workload, costs: AsyncCosts, lengths: LengthModel) -> int:
    """K such that K full-slot dispatches at the length model's mean take about as long as one update: the swap
    then waits for neither side in the steady state. Priced on a batch drawn from a copy of ``lengths``' settings
    (its generators untouched) at the mean attended context."""
    probe = LengthModel(lengths.max_new_tokens, lengths.lengths, lengths.median, lengths.sigma, 12345,
                        lengths.group_share)
    seqs = [w.prompt_len + x for _ in range(w.batch_groups) for x in probe.draw(w.group_size)]
    rows = w.train_layout.rows(seqs) if w.train_layout else None
    update = costs.train.train(seqs, rows) + costs.train.step_overhead_s
    k, s = w.steps_per_dispatch, w.num_slots
    mean = sum(seqs) / len(seqs)
    ctx = int(w.prompt_len + (mean - w.prompt_len) / 2)  # a running slot is half way through on average
    running = (np.full(s, ctx, np.int64), np.full(s, k, np.int64)) if costs.rollout.reads_slot_lengths else None
    dispatch = costs.rollout.decode(1, k, s, s * ctx, s, w.live_width(int(mean - w.prompt_len)), running)
    return max(1, math.ceil(update / max(dispatch, 1e-12)))


@dataclasses.dataclass
class AsyncResult:
    """An async replay: one record per rollout version (swap interval; its rollout-side work and the cycle's
    verification), the learner's totals, the synchronous steps after a switch, and the wall clock."""

    workload: Workload
    setup: AsyncSetup
    versions: list[StepRecord]
    learner: dict
    sync_steps: list[StepRecord]
    wall_s: float
    switch_step: int = -1
    mode: str = "async_rollverify"

    def device_days(self) -> float:
        return self.wall_s * self.setup.num_devices / 86400.0

    def summary(self) -> dict:
        from rollverify_jax.sim.replay import SUMMED

        recs = self.versions + self.sync_steps
        tot = {k: sum(getattr(r, k) for r in recs) for k in SUMMED}
        lr = self.learner
        for key in ("train_s", "overhead_s", "batch_tokens", "train_tokens", "train_positions"):
            tot[key] += lr[key]
        sync_s = sum(r.step_s for r in self.sync_steps)
        async_s = self.wall_s - sync_s
        rollout_busy = sum(r.prefill_s + r.decode_s + r.verify_s for r in self.versions) + lr["publish_s"]
        return {
            "mode": self.mode, "steps": lr["updates"] + len(self.sync_steps), "wall_s": self.wall_s,
            "device_days": self.device_days(), "num_devices": self.setup.num_devices,
            "rollout_devices": self.setup.rollout_devices, "train_devices": self.setup.train_devices,
            "overlap_dispatches": self.setup.overlap_dispatches, "max_staleness": self.setup.max_staleness,
            "at_swap": self.setup.at_swap, **tot,
            "rollout_s": tot["prefill_s"] + tot["decode_s"],
            "publish_s": lr["publish_s"], "swaps": lr["swaps"], "reprefill_s": lr["reprefill_s"],
            "rollout_wait_s": lr["rollout_wait_s"], "rollout_idle_s": lr["rollout_idle_s"],
            "learner_busy_s": lr["busy_s"], "learner_wait_s": lr["wait_s"], "rollout_busy_s": rollout_busy,
            "async_wall_s": async_s, "sync_wall_s": sync_s,
            "learner_busy_fraction": lr["busy_s"] / max(async_s, 1e-30),
            "rollout_busy_fraction": rollout_busy / max(async_s, 1e-30),
            "staleness_mean": lr["staleness_tokens"] / max(lr["trained_response_tokens"], 1),
            "staleness_max": lr["staleness_max"], "admitted_max": lr["admitted_max"],
            "acceptance": tot["kept_tokens"] / tot["verified_tokens"] if tot["verified_tokens"] else float("nan"),
            "switch_step": self.switch_step,
        }


class AsyncReplay(Replay):
    """The rollout group's scheduler (``Replay``'s state and decisions) on a wall clock, with the learner and the
    swaps as events on it."""

    def __init__(self, w: Workload, costs: AsyncCosts, lengths: LengthModel, cut: CutModel, setup: AsyncSetup,
                 sync_workload: Workload | None = None):
        super().__init__(w, costs.rollout, lengths, cut)
        self.acosts, self.setup = costs, setup
        self.sync_workload = sync_workload
        self.on_policy = False
        self.t = 0.0  # the rollout's clock (a dispatch boundary)
        self.version = 0  # updates whose weights the rollout decodes with
        self.trained = 0  # updates done
        self.busy_until = 0.0  # the learner's
        self.update: tuple[int, float] | None = None  # in flight: (dispatch count at its start, done time)
        self.unpublished: list[tuple[int, float]] = []  # updates not yet swapped in: (start dispatch, done time)
        self.dispatches = 0
        self.outstanding = 0  # groups admitted and not yet trained
        self.rec = StepRecord(step=1, on_policy=False)
        self.versions: list[StepRecord] = []
        self.step = 1  # segment label: the rollout version + 1 (the synchronous step that would sample it)
        self.learner = {"updates": 0, "busy_s": 0.0, "wait_s": 0.0, "train_s": 0.0, "overhead_s": 0.0,
                        "batch_tokens": 0, "train_tokens": 0, "train_positions": 0, "publish_s": 0.0, "swaps": 0,
                        "reprefill_s": 0.0, "rollout_wait_s": 0.0, "rollout_idle_s": 0.0, "staleness_tokens": 0,
                        "trained_response_tokens": 0, "staleness_max": 0, "admitted_max": 0}
        self.switched = False

    # -- the staleness cap ------------------------------------------------------------------------

    @property
    def cap(self) -> int:
        return (self.setup.max_staleness + 1) * self.w.batch_groups

    def _tops_up(self) -> bool:
        return self.outstanding < self.cap

    def _new_group(self) -> list[int]:
        self.outstanding += 1
        self.learner["admitted_max"] = max(self.learner["admitted_max"], self.outstanding)
        return super()._new_group()

    def _top_up(self) -> None:
        w = self.w
        target = schedule_decisions.queue_target(w.queue_groups, w.num_slots, w.group_size)
        n = schedule_decisions.groups_to_queue(self.new_queued, target, w.group_size)
        for _ in range(min(n, self.cap - self.outstanding)):
            self._enqueue(self._new_group())

    # -- the learner ----------------------------------------------------------------------------------

    def _learner(self) -> None:
        """At the rollout's boundary ``t``: finish the update done by then, start the next if ``B`` groups are
        complete (the host issues it between two dispatches)."""
        if self.update is not None and self.update[1] <= self.t:
            self.trained += 1
            self.outstanding -= self.w.batch_groups
            self.update = None
        if self.update is None and schedule_decisions.phase_done(len(self.complete), self.w.batch_groups):
            self._start_update()

    def _start_update(self) -> None:
        batch = self._pop_complete()
        lengths = [self.trajs[u].target for g in batch for u in self.group_members[g]]
        seqs = [self.w.prompt_len + x for x in lengths]
        rows = self.w.train_layout.rows(seqs) if self.w.train_layout else None
        c = self.acosts.train
        train_s = c.train(seqs, rows)
        busy = train_s + c.step_overhead_s
        lr = self.learner
        lr["wait_s"] += max(0.0, self.t - self.busy_until)
        lr["busy_s"] += busy
        lr["train_s"] += train_s
        lr["overhead_s"] += c.step_overhead_s
        lr["updates"] += 1
        lr["batch_tokens"] += sum(lengths)
        lr["train_tokens"] += sum(seqs)
        lr["train_positions"] += sum(w * n for w, n in rows) if rows else sum(seqs)
        # staleness of what this update trains: its weights (``trained`` updates) minus each token's version
        for g in batch:
            for u in self.group_members[g]:
                for label, count in self.trajs[u].segments:
                    lag = self.trained - (label - 1)
                    lr["staleness_tokens"] += lag * count
                    lr["staleness_max"] = max(lr["staleness_max"], lag)
                lr["trained_response_tokens"] += self.trajs[u].tokens
        self._drop_groups(batch)
        done = self.t + busy
        self.update = (self.dispatches, done)
        self.unpublished.append((self.dispatches, done))
        self.busy_until = done

    # -- the swap -----------------------------------------------------------------------------------

    def _swap_state(self) -> str:
        """'due', 'wait' (K dispatches run, the update not done: the rollout waits) or 'no'."""
        if not self.unpublished:
            return "no"
        start, done = self.unpublished[0]
        if self.dispatches - start < self.setup.overlap_dispatches and self._decodes():
            return "no"
        return "due" if done <= self.t else "wait"

    def _decodes(self) -> bool:
        """Whether the rollout has anything to decode or admit now."""
        return self._running() or bool(self.queue) or self._tops_up()

    def _swap(self) -> None:
        """Publishes the newest update done, re-prefills (and verifies) the running trajectories per ``at_swap``,
        and closes the version's record."""
        done = [u for u in self.unpublished if u[1] <= self.t]
        self.unpublished = self.unpublished[len(done):]
        lr = self.learner
        lr["swaps"] += 1
        lr["publish_s"] += self.acosts.publish_s
        self.t += self.acosts.publish_s
        self._close_version()
        if self.switched:
            return
        for slot, uid in enumerate(self.slots.uid):  # the tokens decoded so far belong to the old version
            if uid >= 0:
                self._grow_tokens(self.trajs[uid], self.slots.tokens(slot))
        self.version = self.trained
        self.step = self.version + 1
        at = self.setup.at_swap
        if at == "keep_stale_kv":
            return
        paused = self._pause_all()
        for u in paused:
            t = self.trajs[u]
            t.verify = at == "verify" and t.tokens > 0
        self._enqueue(paused, front=True)
        before = self.rec.prefill_s + self.rec.verify_s
        self._admit(self.rec, self.step)
        spent = self.rec.prefill_s + self.rec.verify_s - before
        lr["reprefill_s"] += spent
        self.t += spent

    def _close_version(self) -> None:
        rec = self.rec
        if rec.verified_tokens:
            rec.acceptance = rec.kept_tokens / rec.verified_tokens
        self.versions.append(rec)
        if self.setup.at_swap == "verify" and rec.verified > 0:
            self.window = (self.window + [rec.acceptance])[-self.w.switch_window:]
            if self.w.switching and schedule_rules.switch_due(self.window, self.w.switch_window,
                                                              self.w.switch_threshold):
                rec.switched, self.switched, self.switch_step = True, True, self.trained
        self.rec = StepRecord(step=self.trained + 1, on_policy=False)

    # -- the run ------------------------------------------------------------------------------------

    def run(self, num_steps: int) -> tuple[float, list[StepRecord]]:
        """Runs until the ``num_steps``-th update is issued (or the switch); returns the wall clock at the last
        update's end and the synchronous steps after a switch."""
        lr = self.learner
        while not self.switched:
            self._learner()
            if self.update is not None and self.trained + 1 >= num_steps:
                break  # the last update is in flight: the run ends when it does
            state = self._swap_state()
            if state == "wait":  # the deterministic schedule: the swap waits for the update
                wait = self.unpublished[0][1] - self.t
                lr["rollout_wait_s" if self._decodes() else "rollout_idle_s"] += wait
                self.t += wait
                continue
            if state == "due":
                self._swap()
                continue
            self._top_up()
            before = self.rec.prefill_s + self.rec.verify_s
            self._admit(self.rec, self.step)
            self.t += self.rec.prefill_s + self.rec.verify_s - before
            if self._running():
                limit = None
                if self.unpublished:
                    limit = self.setup.overlap_dispatches - (self.dispatches - self.unpublished[0][0])
                budget = self.update[1] - self.t if self.update is not None and self.update[1] > self.t else None
                before = self.rec.decode_s
                self.dispatches += self._dispatch(self.rec, one=False, limit=limit, budget_s=budget)
                self.t += self.rec.decode_s - before
            elif self.queue and not self.page_blocked:
                continue  # every admitted sequence left at admission (verified, finished): admit again
            elif self.update is not None:  # nothing to decode: idle until the update ends
                lr["rollout_idle_s"] += max(0.0, self.update[1] - self.t)
                self.t = max(self.t, self.update[1])
            else:
                raise RuntimeError(f"async replay stuck after {self.trained} updates: nothing to decode, "
                                   f"{len(self.complete)} complete groups, {self.outstanding} admitted and untrained.")
        wall = max(self.t, self.busy_until) if self.switched else self.busy_until
        if self.update is not None:
            self.trained += 1
            self.update = None
        sync = self._synchronous(num_steps) if self.switched and self.trained < num_steps else []
        return wall + sum(r.step_s for r in sync), sync

    def _synchronous(self, num_steps: int) -> list[StepRecord]:
        """The on-policy schedule on every device for the steps left after a switch (the cache dropped; the
        update in flight finishes first)."""
        w = self.sync_workload or self.w
        replay = Replay(dataclasses.replace(w, mode="on_policy"), self.acosts.sync, self.lengths, self.cut)
        return [replay.run_step(s) for s in range(self.trained + 1, num_steps + 1)]


def simulate_async(w: Workload, costs: AsyncCosts, lengths: LengthModel, setup: AsyncSetup,
                   cut: CutModel | None = None, num_steps: int = 1, sync_workload: Workload | None = None,
                   mode: str | None = None) -> AsyncResult:
    """Replays ``num_steps`` updates of the async mode. ``w``: the rollout group's workload
    (``rollout_workload``); ``sync_workload``: the whole config's (the on-policy schedule after a switch)."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1.")
    replay = AsyncReplay(w, costs, lengths, cut or CutModel(), setup, sync_workload)
    wall, sync = replay.run(num_steps)
    name = mode or next(m for m, a in ASYNC_MODES.items() if a == setup.at_swap)
    return AsyncResult(w, setup, replay.versions + ([replay.rec] if replay.rec.dispatches else []),
                       replay.learner, sync, wall, replay.switch_step, name)
