"""Continuous batching over the engine's slots, with pause and verified resume.

Host-side only: it decides which request goes to which slot, refills freed slots at every dispatch, and
keeps each trajectory's tokens, behaviour log-probs (``log mu``) and policy versions. With an environment
(``rollout/environment.py``), a slot whose turn ended where the environment replies is parked until the reply's
tokens are extended into its cache. Every decision depends on the dispatches and the tokens sampled, never on
the clock: a reply is taken at a dispatch fixed when it was asked for (``Environment.reply_dispatches``), however
long it took, so two runs of one seed batch and pause the same trajectories.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from rollverify_jax import schedule_decisions
from rollverify_jax.infra import distributed
from rollverify_jax.rollout.engine import Engine, PendingDecode
from rollverify_jax.rollout.environment import Environment, Request
from rollverify_jax.rollout.sampling import NEAR_TIE, NOT_SAMPLED
from rollverify_jax.rollout.stats import RolloutStats
from rollverify_jax.rollout.trajectory import Trajectory

# keep_fn(new_logp [n, L], behavior_logp [n, L], versions [n, L], lengths [n]) -> keep [n]; a coupled scheduler
# also passes match=bool[n, L] (whether the current params, with each token's own noise, sample that token).
KeepFn = Callable[..., np.ndarray]


def validate_request(prompt: Sequence[int], max_new_tokens: int, max_seq_len: int) -> None:
    """Bad input fails here, before any slot or page is touched."""
    if len(prompt) == 0:
        raise ValueError("Empty prompt: a request needs at least one prompt token.")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be > 0.")
    if len(prompt) + max_new_tokens > max_seq_len:
        raise ValueError(
            f"Prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
            f"{max_seq_len} tokens; shorten the prompt, lower max_new_tokens or raise EngineConfig.max_seq_len."
        )


@dataclasses.dataclass
class _Pending:
    traj: Trajectory
    keep_fn: KeepFn | None  # set for resumed trajectories that must be verified


@dataclasses.dataclass
class _InFlight:
    """A decode dispatch not read yet, with the running slots it decodes (slot at dispatch time, trajectory)."""

    pending: PendingDecode
    slots: list[tuple[int, Trajectory]]
    steps: int


@dataclasses.dataclass
class _Wait:
    """A parked slot: its trajectory waits for the environment's reply to ``request``. Its pages hold the first
    ``cached`` tokens of prompt + response; the rest (the turn's last token, then the reply) is written by
    ``Engine.extend`` when the reply is taken: before decode dispatch number ``due`` (the scheduler's count of
    dispatches issued, ``Scheduler.issued``), sooner at a pause or when nothing else can decode."""

    traj: Trajectory
    request: Request
    cached: int
    due: int


class Scheduler:
    """Continuous batching: a queue of requests (resumed trajectories first), refilled at every dispatch.

    With ``EngineConfig.dispatch_ahead`` each ``step`` plans and dispatches decode n + 1 before it reads decode
    n's outputs (JAX dispatches asynchronously): the host's bookkeeping and the device-to-host copy overlap the
    device's work instead of leaving it idle. What the plan cannot know is what n produces: a slot that
    finishes in n is refilled before n + 2 instead of n + 1 (it idles one dispatch; the device already stopped
    it), and running slots reserve pages through n + 1. Every sample is unchanged (keys depend only on the
    request's seed and token index); which dispatch a request starts in may differ, so a pause mid-phase can
    find trajectories at other lengths. Between steps one dispatch may be in flight; ``pause_all`` waits for it
    (its device time is the rollout's, its steps are counted in ``RolloutStats.decode_steps_dropped``) and drops
    its tokens, so paused trajectories end where the host last read them."""

    def __init__(self, engine: Engine, env: Environment | None = None, coupled: bool = False,
                 coupled_tolerance: float = 0.0):
        """``env``: multi-turn rollouts; a turn that stops (at one of ``engine.stop_ids``) where ``env`` replies
        waits in its slot for the reply, which is appended without re-prefilling the history. ``coupled``: the
        coupled verification rule (``VerifyConfig.rule``): a resume prefill also says, per cached token, whether
        the current params sample it with its own noise (``keep_fn``'s ``match``), and a cut keeps the
        trajectory's key stream (no fresh draw), so the suffix decoded after it is what the current params sample
        from scratch with the same keys. ``coupled_tolerance``: a token the current params would not sample, but
        whose perturbed score is within this of the winner's, counts as a match (``VerifyConfig``; the kept ones
        are counted in ``RolloutStats.near_ties_kept``)."""
        self.engine = engine
        self.env = env
        self.coupled = coupled
        self.coupled_tolerance = coupled_tolerance
        self.waits: dict[int, _Wait] = {}
        self.dispatch_ahead = engine.config.dispatch_ahead
        self._inflight: _InFlight | None = None
        self.issued = 0  # decode dispatches issued so far: the clock a parked slot's reply is due on (_Wait.due)
        self._eos = set(engine.eos_ids)
        self.queue: collections.deque[_Pending] = collections.deque()
        self.slots: dict[int, Trajectory] = {}
        self.finished: list[Trajectory] = []
        self.stats = RolloutStats()
        self.verified: list[tuple[int, int]] = []  # (keep, n) per paused trajectory verified since reset
        self.verified_finished: list[tuple[int, int]] = []  # (keep, n) per finished member re-verified
        self._cut_suffix: dict[int, tuple[int, list[int]]] = {}  # uid -> (keep, tokens the cut removed)

    # ------------------------------------------------------------------------------------------------
    # Requests

    def submit(self, trajectories: Iterable[Trajectory]) -> None:
        """Queues new requests (after any resumed ones already queued). Validates each before queueing."""
        trajs = list(trajectories)
        for t in trajs:
            validate_request(t.prompt, t.max_new_tokens, self.engine.config.max_seq_len)
            self.engine.allocator.check_admissible(len(t.prompt) + t.max_new_tokens)
        self.queue.extend(_Pending(t, None) for t in trajs)

    def resume(self, trajectories: Iterable[Trajectory], keep: KeepFn | None = None) -> None:
        """Queues paused trajectories ahead of new prompts. At admission each is re-prefilled (prompt +
        prefix) under the current params; ``keep`` then sees the prefix's current log-probs and returns
        how many response tokens to keep. The trajectory is truncated and continues from the same
        prefill: no second forward pass. ``keep=None`` keeps everything: a finished trajectory (one queued
        for re-verification and paused before its turn) then goes straight back to ``finished``, since
        admitting it would decode past its end."""
        trajs = list(trajectories)
        for t in trajs:
            validate_request(t.prompt, t.max_new_tokens, self.engine.config.max_seq_len)
        if keep is None:
            self.finished.extend(t for t in trajs if t.finished)
            trajs = [t for t in trajs if not t.finished]
        self.queue.extendleft(_Pending(t, keep) for t in reversed(trajs))

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.engine.config.num_slots) if s not in self.slots and s not in self.waits]

    def num_new_queued(self) -> int:
        """Queued requests that have not started: new prompts (not resumed, no tokens yet)."""
        return sum(1 for p in self.queue if p.keep_fn is None and p.traj.num_tokens == 0)

    @property
    def idle(self) -> bool:
        return not self.slots and not self.queue and not self.waits

    # ------------------------------------------------------------------------------------------------
    # One dispatch

    def _tokens_to_reserve(self, t: Trajectory, dispatches: int = 1) -> int:
        """Cache positions a slot must own through its next ``dispatches`` dispatches (2 while one it runs in is
        not read yet; everything, under 'full' reservation): ``schedule_decisions.reserved_tokens``."""
        cfg = self.engine.config
        return schedule_decisions.reserved_tokens(len(t.prompt), t.num_tokens, t.max_new_tokens,
                                                  cfg.steps_per_dispatch, dispatches, cfg.page_reservation == "full")

    def _admit(self) -> None:
        """Fills free slots from the queue head while pages fit (a request that does not fit yet waits).
        Under incremental reservation, one page per running slot of a shard stays free on that shard as
        headroom for their growth."""
        alloc = self.engine.allocator
        free = self.free_slots
        need = [self._tokens_to_reserve(p.traj) for p in itertools.islice(self.queue, len(free))]
        busy = collections.Counter(alloc.shard_of(s) for s in [*self.slots, *self.waits])
        admission = schedule_decisions.admit(
            [alloc.pages_needed(n) for n in need], free, alloc.slots_per_shard, [len(f) for f in alloc.free],
            [busy[shard] for shard in range(alloc.num_shards)],
            headroom=int(self.engine.config.page_reservation == "incremental"))
        batch: list[tuple[int, _Pending]] = []
        for slot, tokens in zip(admission.slots, need, strict=False):  # need: one per queue head, maybe more
            alloc.allocate(slot, tokens)
            batch.append((slot, self.queue.popleft()))
        # One packed prefill per length bucket: a bucket's sequences share rows of its width (no padding of each
        # to the longest), and a few long resumed trajectories do not make the short ones attend over long rows.
        groups: dict[int, list[tuple[int, _Pending]]] = collections.defaultdict(list)
        for item in batch:
            t = item[1].traj
            groups[self.engine.prefill_bucket(len(t.prompt) + t.num_tokens)].append(item)
        for _, group in sorted(groups.items()):
            for part in self.engine.split_for_prefill([len(p.traj.prompt) + p.traj.num_tokens for _, p in group]):
                t0 = time.perf_counter()
                self._prefill_and_activate([group[i] for i in part])
                self.stats.prefill_time += time.perf_counter() - t0

    def _prefill_and_activate(self, batch: list[tuple[int, _Pending]]) -> None:
        """One prefill of ``batch`` (each sequence but its last token, which its slot decodes from); resumed
        trajectories are verified on its log-probs and cut first."""
        engine = self.engine
        slots = [s for s, _ in batch]
        trajs = [p.traj for _, p in batch]
        seqs = [np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)]).astype(np.int32) for t in trajs]
        self.stats.prefill_sequences += len(seqs)
        plens = [len(t.prompt) for t in trajs]
        verify = any(p.keep_fn is not None and p.traj.num_tokens for _, p in batch)
        awaiting = self.env is not None and any(self.env.awaits_reply(t) for t in trajs)
        if not verify and not awaiting:  # nothing to verify, every one decodes next: no read back
            source = _shared_prompts(trajs)
            shared = sum(len(s) - 1 for i, s in enumerate(seqs) if source[i] != i)
            self.stats.prefill_tokens += sum(len(s) - 1 for s in seqs) - shared
            self.stats.shared_prompt_tokens += shared
            engine.admit(seqs, slots, plens, [t.num_tokens for t in trajs], [t.sample_seed for t in trajs],
                         [t.max_new_tokens for t in trajs], source)
            self.slots.update(zip(slots, trajs, strict=True))
            return
        self.stats.prefill_tokens += sum(len(s) - 1 for s in seqs)
        match = None
        if verify and self.coupled:
            response_logp, match = engine.prefill(seqs, slots, plens, coupled_seeds=[t.sample_seed for t in trajs],
                                                  coupled_tolerance=self.coupled_tolerance)
        else:
            response_logp = engine.prefill(seqs, slots, plens, with_logp=verify)
        keeps = self._verify(batch, response_logp, match) if verify else [t.num_tokens for t in trajs]
        go, done = [], []
        for (slot, _), t, k in zip(batch, trajs, keeps, strict=True):
            if t.finished and k >= t.num_tokens:
                done.append((slot, t))  # a finished member of an unfinished group survived verification
                continue
            if k < t.num_tokens:
                self._cut_suffix[t.uid] = (int(k), t.tokens[int(k):])
            t.truncate(int(k), fresh_draw=not self.coupled)
            if self.env is not None and self.env.awaits_reply(t):  # paused while parked: ask again
                self._park(slot, t, len(t.prompt) + t.num_tokens - 1)  # its last token is not cached
            else:
                go.append((slot, t))
        for slot, t in done:
            engine.allocator.release(slot)
            self.finished.append(t)
        if not go:
            return
        gt = [t for _, t in go]
        engine.activate([s for s, _ in go], [np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)]) for t in gt],
                        [t.num_tokens for t in gt], [t.sample_seed for t in gt], [t.max_new_tokens for t in gt])
        self.slots.update(go)

    def _activate(self, go: list[tuple[int, Trajectory]], tok: np.ndarray, logp: np.ndarray) -> None:
        """Records each admitted (or extended) sequence's first sampled token; it then decodes in its slot, has
        finished, or waits for the environment's reply."""
        version = self.engine.version
        for (slot, t), y, lp in zip(go, tok, logp, strict=True):
            self._append(t, int(y), float(lp), version)
            self.slots[slot] = t
            self._settle(slot, t)

    def _settle(self, slot: int, t: Trajectory) -> None:
        """After new tokens of the running ``t``: it finishes, parks for the environment's reply, or decodes on."""
        if self._is_done(t):
            self._finish(slot, t)
        elif self.env is not None and self.env.awaits_reply(t):
            self._park(slot, t, len(t.prompt) + t.num_tokens - 1)  # the stop token is not cached yet

    def _park(self, slot: int, t: Trajectory, cached: int) -> None:
        """Asks the environment for ``t``'s reply; its slot keeps the pages (decode already stopped it). The reply
        is due before the ``reply_dispatches``-th dispatch issued from now."""
        self.slots.pop(slot, None)
        self.waits[slot] = _Wait(t, self.env.request(t), cached, self.issued + self.env.reply_dispatches)

    def _take_replies(self, waits: list[_Wait]) -> None:
        """Appends each one's reply to its trajectory, waiting for those not in yet (up to the environment's own
        limit): what is appended never depends on when it arrived."""
        t0 = time.perf_counter()
        for w in waits:
            t = w.traj
            t.append_env(self.env.reply(w.request, t.max_new_tokens - t.num_tokens - 1), self.engine.version)
        self.stats.reply_blocked_time += time.perf_counter() - t0

    def _serve_replies(self, due: int) -> None:
        """Takes the reply of every parked slot due by dispatch number ``due`` and continues those slots with one
        ``extend`` (their history stays cached). A slot whose pages cannot grow for the reply is preempted: it
        re-prefills, reply included, when pages free up."""
        taken = [(slot, w) for slot, w in self.waits.items() if w.due <= due]
        if not taken:
            return
        self._take_replies([w for _, w in taken])
        ready = []
        for slot, w in taken:
            t = w.traj
            del self.waits[slot]
            if self.engine.allocator.grow(slot, self._tokens_to_reserve(t)):
                ready.append((slot, w))
            else:
                self.engine.allocator.release(slot)
                self.queue.appendleft(_Pending(t, None))
                self.stats.preemptions += 1
        if not ready:
            return
        trajs = [w.traj for _, w in ready]
        seqs = [np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)]) for t in trajs]
        self.stats.extend_tokens += sum(len(s) - w.cached for s, (_, w) in zip(seqs, ready, strict=True))
        t0 = time.perf_counter()
        tok, logp = self.engine.extend([s for s, _ in ready], seqs, [w.cached for _, w in ready],
                                       [t.num_tokens for t in trajs], [t.sample_seed for t in trajs],
                                       [t.max_new_tokens for t in trajs])
        self.stats.prefill_time += time.perf_counter() - t0
        self._activate([(s, w.traj) for s, w in ready], tok, logp)

    def _verify(self, batch: list[tuple[int, _Pending]], response_logp, match=None) -> np.ndarray:
        """Keep lengths per admitted trajectory (everything for new prompts and ``keep=None``). Verification sees
        the policy's tokens only (``Trajectory.policy_view``): an environment reply's tokens are left out of the
        OPS, the segments and the acceptance, and a cut lands on a policy token (everything after it, later turns
        and replies included, goes)."""
        keeps = np.asarray([p.traj.num_tokens for _, p in batch], np.int64)
        rows = [i for i, (_, p) in enumerate(batch) if p.keep_fn is not None and p.traj.num_tokens > 0]
        if not rows:
            return keeps
        by_fn: dict[int, list[int]] = collections.defaultdict(list)
        for i in rows:
            by_fn[id(batch[i][1].keep_fn)].append(i)
        # Rows padded to the slot count and columns to the prefill's length bucket (unverified rows get length
        # 0), so the jitted verifier sees one shape per length bucket and compiles once for each.
        logp = distributed.fetch(response_logp)  # whole on every host: each decides the same cuts
        new_logp_all = np.zeros((max(logp.shape[0], self.engine.config.num_slots), logp.shape[1]), np.float32)
        new_logp_all[: logp.shape[0]] = logp
        extra, code_all = {}, None
        if match is not None:  # the check's codes (sampling.check_tokens): the rule reads whether each was drawn
            code = distributed.fetch(match)
            code_all = np.zeros(new_logp_all.shape, np.int8)
            code_all[: code.shape[0]] = code
        views = {i: batch[i][1].traj.policy_view() for i in rows}
        for i, view in views.items():
            if view.has_env:  # the row holds the policy's tokens only, in order (environment tokens: not sampled)
                new_logp_all[i] = 0.0
                new_logp_all[i, : len(view)] = logp[i, view.positions]
                if code_all is not None:
                    code_all[i] = NOT_SAMPLED
                    code_all[i, : len(view)] = code[i, view.positions]
        if code_all is not None:
            extra["match"] = code_all != NOT_SAMPLED
        for idx in by_fn.values():
            behavior = np.zeros(new_logp_all.shape, np.float32)
            versions = np.zeros(new_logp_all.shape, np.int32)
            lengths = np.zeros(new_logp_all.shape[0], np.int32)
            for i in idx:
                view = views[i]
                n = len(view)
                behavior[i, :n] = view.logps
                versions[i, :n] = view.versions
                lengths[i] = n
            keep = np.asarray(batch[idx[0]][1].keep_fn(new_logp_all, behavior, versions, lengths, **extra))[idx]
            keep = np.clip(keep, 0, lengths[idx])
            for i, k, n in zip(idx, keep.tolist(), lengths[idx].tolist(), strict=True):
                t = batch[i][1].traj
                if code_all is not None:  # kept only by the tolerance: how far the kept prefix is from exact
                    self.stats.near_ties_kept += int(np.sum(code_all[i, :k] == NEAR_TIE))
                keeps[i] = views[i].response_index(k)  # the first policy token cut (everything when none is)
                (self.verified_finished if t.finished else self.verified).append((k, n))
                t.history.append({"event": "verify", "version": self.engine.version, "kept": k, "of": n})
        return keeps

    def _append(self, t: Trajectory, token: int, logp: float, version: int) -> None:
        cut = self._cut_suffix.get(t.uid) if self._cut_suffix else None  # per token: skip the lookup when no cut
        if cut is not None:
            offset = t.num_tokens - cut[0]
            if offset < len(cut[1]):
                self.stats.regen_tokens += 1
                self.stats.regen_equal += int(cut[1][offset] == token)
            else:
                del self._cut_suffix[t.uid]
        t.tokens.append(token)
        t.logps.append(logp)
        t.versions.append(version)

    def _is_done(self, t: Trajectory) -> bool:
        """At its cap or an EOS; or where the environment would reply but cannot (``Environment.ends``)."""
        if t.num_tokens >= t.max_new_tokens or t.tokens[-1] in self._eos:
            return True
        return self.env is not None and self.env.ends(t)

    def _finish(self, slot: int, t: Trajectory) -> None:
        self._cut_suffix.pop(t.uid, None)  # finished before regenerating the whole cut suffix
        t.finished = True
        self.slots.pop(slot, None)
        self.engine.allocator.release(slot)
        self.finished.append(t)

    def _grow_or_preempt(self) -> None:
        """Grants each running slot the pages of its next dispatch; a slot that cannot grow is preempted back
        to the queue head (it resumes later by re-prefill, with the same seeds, so its sample is unchanged).
        Vectorised over the slots: only those that lack pages are visited, in the decision's order, and the
        exact decision (``schedule_decisions.grow_or_preempt``) runs only when some shard lacks the pages for
        every grant (otherwise it preempts none)."""
        if self.engine.config.page_reservation == "full" or not self.slots:
            return
        alloc, cfg = self.engine.allocator, self.engine.config
        flying = {id(t) for _, t in self._inflight.slots} if self._inflight else set()
        running = sorted(self.slots.items(), key=lambda kv: kv[1].uid)
        n = len(running)
        slots = np.fromiter((slot for slot, _ in running), np.int64, n)
        need = schedule_decisions.reserved_tokens(
            np.fromiter((len(t.prompt) for _, t in running), np.int64, n),
            np.fromiter((t.num_tokens for _, t in running), np.int64, n),
            np.fromiter((t.max_new_tokens for _, t in running), np.int64, n), cfg.steps_per_dispatch,
            np.fromiter((2 if id(t) in flying else 1 for _, t in running), np.int64, n))
        pages = schedule_decisions.pages_for(need, alloc.page_size)
        have = np.fromiter((len(alloc.owned.get(slot, ())) for slot, _ in running), np.int64, n)
        shards = slots // alloc.slots_per_shard
        free = [len(f) for f in alloc.free]
        lack = np.bincount(shards, weights=np.maximum(pages - have, 0), minlength=alloc.num_shards)
        out = set() if (lack <= free).all() else set(schedule_decisions.grow_or_preempt(
            shards.tolist(), have.tolist(), pages.tolist(), free))
        preempted = [slot for i, (slot, _) in enumerate(running) if i in out] if out else []
        grew = False
        for i in np.flatnonzero(pages > have).tolist():  # in the decision's order: the pages granted one by one
            if i not in out:
                slot = running[i][0]
                if not alloc.grow(slot, int(need[i])):
                    raise RuntimeError(f"slot {slot} could not grow to {int(need[i])} tokens as decided.")
                grew = True
        if preempted:
            self.engine.deactivate(preempted)
            for slot in reversed(preempted):
                alloc.release(slot)
                self.queue.appendleft(_Pending(self.slots.pop(slot), None))
            self.stats.preemptions += len(preempted)
        if grew:
            self.engine.sync_page_table()

    def _pack_slots(self) -> None:
        """Moves sequences (running, or parked) above the smallest slot bucket that could hold them all into free
        slots below it, so decode runs over that bucket only (the long tail of a batch decodes on a few slots)."""
        moves = schedule_decisions.pack_moves([*self.slots, *self.waits], self.engine.live_slot_buckets())
        if not moves:
            return
        high, low = [a for a, _ in moves], [b for _, b in moves]
        self.engine.move_slots(high, low)
        for a, b in moves:
            if a in self.slots:
                self.slots[b] = self.slots.pop(a)
            else:
                self.waits[b] = self.waits.pop(a)

    def step(self) -> int:
        """Admit into free slots, then one ``generate`` dispatch. Returns tokens generated (read): that dispatch's,
        or with ``dispatch_ahead`` the one before it, which is read once this one is on its way."""
        t0 = time.perf_counter()
        prefill_before, decode_before, blocked_before = (self.stats.prefill_time, self.stats.decode_time,
                                                         self.stats.reply_blocked_time)
        if self.waits:
            self._serve_replies(self.issued + 1)
        if self.queue and len(self.slots) + len(self.waits) < self.engine.config.num_slots:
            self._admit()  # (with no request or no free slot it admits nothing: skipped, a full batch's common case)
        self._grow_or_preempt()
        new = None
        if self.slots and not self._all_end_in_flight():
            self._pack_slots()
            t1 = time.perf_counter()
            new = _InFlight(self.engine.dispatch_generate(), list(self.slots.items()),
                            self.engine.config.steps_per_dispatch)
            self.issued += 1
            self.stats.decode_time += time.perf_counter() - t1
            self.stats.parked_slot_steps += len(self.waits) * self.engine.config.steps_per_dispatch
        elif self.waits and self._inflight is None:  # nothing to decode until a reply: take the earliest due now
            self._serve_replies(min(w.due for w in self.waits.values()))
        done, self._inflight = self._inflight, None
        if not self.dispatch_ahead:
            done, new = new, None
        n = self._read(done) if done is not None else 0
        self._inflight = new
        self.stats.host_time += (time.perf_counter() - t0) - (self.stats.prefill_time - prefill_before) - (
            self.stats.decode_time - decode_before) - (self.stats.reply_blocked_time - blocked_before)
        return n

    def _all_end_in_flight(self) -> bool:
        """Every running slot reaches its max length inside the dispatch in flight: the next one would decode
        nothing, so it waits to be planned on what this one produces."""
        flight = self._inflight
        if flight is None:
            return False
        flying = {id(t) for _, t in flight.slots}
        return all(id(t) in flying and t.num_tokens + flight.steps >= t.max_new_tokens for t in self.slots.values())

    def _read(self, flight: _InFlight) -> int:
        """Appends a dispatch's tokens to the trajectories it decoded and finishes the done ones. One that left
        its slot since (preempted, or paused) drops them: it re-prefills what the host holds and resamples the
        same tokens. One that moved (``_pack_slots``) is found in its new slot."""
        t0 = time.perf_counter()
        tokens, logps, emitted = flight.pending.fetch()
        self.stats.decode_time += time.perf_counter() - t0
        version = flight.pending.version
        where = {id(t): s for s, t in self.slots.items()}
        counts = emitted.sum(axis=0).tolist()  # a slot emits a prefix of the steps: it stops at its end
        token_rows, logp_rows = tokens.T.tolist(), logps.T.tolist()  # per slot, in one conversion each
        n = 0
        for slot, t in flight.slots:
            cur, m = where.get(id(t)), counts[slot]
            if cur is None:
                continue
            if m and t.uid in self._cut_suffix:  # regeneration statistics are per token
                for y, lp in zip(token_rows[slot][:m], logp_rows[slot][:m], strict=True):
                    self._append(t, y, lp, version)
            elif m:
                t.tokens.extend(token_rows[slot][:m])
                t.logps.extend(logp_rows[slot][:m])
                t.versions.extend([version] * m)
            n += m
            self._settle(cur, t)
        self.stats.dispatches += 1
        # the steps the device ran: all of them, or (EngineConfig.decode_stop_finished) up to its early stop, before
        # which some slot emits at every step
        self.stats.decode_steps += (int(emitted.any(axis=1).sum()) if self.engine.config.decode_stop_finished
                                    else tokens.shape[0])
        self.stats.useful_token_steps += n
        self.stats.tokens_generated += n
        return n

    def run(self, until: Callable[[Scheduler], bool] | None = None, max_dispatches: int | None = None) -> None:
        """Steps until ``until(self)`` holds, or nothing is left to do."""
        count = 0
        while not self.idle and not (until and until(self)):
            self.step()
            count += 1
            if max_dispatches is not None and count >= max_dispatches:
                break
        if self.idle:  # a dispatch still in flight decodes no running trajectory: nothing to read
            self._drop_inflight()

    def _drop_inflight(self) -> None:
        """Forgets the dispatch in flight, unread, after waiting for it: its device time is the rollout's
        (``decode_time``), not whatever runs next on the device (a train step), and its steps, which the device ran
        for nothing, are counted in ``decode_steps_dropped``."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        t0 = time.perf_counter()
        flight.pending.fetch()
        self.stats.decode_time += time.perf_counter() - t0
        self.stats.decode_steps_dropped += flight.steps

    # ------------------------------------------------------------------------------------------------
    # Pause

    def pause_all(self) -> list[Trajectory]:
        """Every unfinished trajectory (running ones first, then parked ones, then queued ones); their pages are
        freed and the queue is emptied. Finished ones stay in ``finished``. A dispatch in flight is waited for and
        dropped unread (``_drop_inflight``): the trajectories end where the host last read them, as without
        ``dispatch_ahead``. A parked one gets its reply, waited for (up to the environment's own limit) however
        long it takes: what a paused trajectory holds never depends on the clock."""
        self._drop_inflight()
        running = list(self.slots.items())
        if running:
            self.engine.deactivate([s for s, _ in running])
        for slot, _ in running:
            self.engine.allocator.release(slot)
        self.slots.clear()
        self._take_replies(list(self.waits.values()))
        for slot in self.waits:
            self.engine.allocator.release(slot)
        waiting = [w.traj for w in self.waits.values()]
        self.waits.clear()
        paused = schedule_decisions.pause_order([t for _, t in running], waiting, [p.traj for p in self.queue])
        self.queue.clear()
        for t in paused:  # one pause per stretch it ran (one resumed but never admitted again adds none)
            last = t.history[-1] if t.history else {}
            if t.num_tokens and not t.finished and (last.get("event"), last.get("tokens")) != ("pause", t.num_tokens):
                t.history.append({"event": "pause", "version": self.engine.version, "tokens": t.num_tokens})
        return paused

    def snapshot(self) -> list[Trajectory]:
        """What ``pause_all`` would return, as the host last read it, changing nothing (a checkpoint of a
        rollout that keeps decoding)."""
        return schedule_decisions.pause_order(list(self.slots.values()), [w.traj for w in self.waits.values()],
                                              [p.traj for p in self.queue])

    def take_finished(self) -> list[Trajectory]:
        out, self.finished = self.finished, []
        return out

    def reset_stats(self) -> None:
        self.stats = RolloutStats()
        if self.env is not None:
            self.env.reset_stats()
        self.verified = []
        self.verified_finished = []


def _shared_prompts(trajs: list[Trajectory]) -> list[int]:
    """For each new trajectory (no tokens yet), the first one admitted with it that has the same prompt (a
    group's members): it is prefilled once for all of them. ``source[i] == i`` for the others."""
    first: dict[tuple, int] = {}
    source = list(range(len(trajs)))
    for i, t in enumerate(trajs):
        if t.num_tokens == 0:
            source[i] = first.setdefault((t.group_id, np.asarray(t.prompt, np.int32).tobytes()), i)
    return source
