"""Rollout phases: on-policy (synchronous), naive partial rollout, and RollVerify (METHOD.md sections 3-5).

A phase at policy version k keeps every decode slot busy: verified resumed trajectories go first, then new
prompt groups. It ends once ``batch_groups`` groups have all their members finished; everything unfinished is
paused into the cache. In RollVerify mode, every cached trajectory is verified against the newest policy on
the log-probs of its resume prefill (no extra forward pass) and resumes from its verified prefix.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from rollverify_jax import schedule_decisions, schedule_rules
from rollverify_jax.rl.buffer import Group, PausedCache
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.verify import (
    CutStats,
    ShiftStats,
    SwitchConfig,
    SwitchState,
    VerifyConfig,
    coupled_verify_with_stats,
    trajectory_staleness,
    two_stage_verify_with_stats,
    verify_stats,
    window_mean,
)

MODES = schedule_rules.ROLLOUT_MODES
AT_SWAP = ("verify", "reprefill", "keep_stale_kv")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """What a rollout phase produces. mode: on_policy | partial | rollverify | async (verification settings:
    `VerifyConfig`, switching: `SwitchConfig`, the baselines' filters: `FilterConfig`, the asynchronous mode's
    device split and swap: `AsyncConfig`)."""

    mode: str = "on_policy"
    batch_groups: int = 8  # B: complete groups per training batch
    group_size: int = 8  # G: samples per prompt
    max_new_tokens: int = 256  # response cap (the reward's and Dr. GRPO's cap follow it)
    queue_groups: int = 0  # new groups kept queued ahead of free slots (0: enough to fill every slot)
    # Groups complete beyond B when a partial phase ends: 'carry' them to the next step's batch, or 'train' them
    # in this step (a batch of at least B groups, padded to a multiple of B with rows outside the loss).
    extra_complete_groups: str = "carry"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Unknown rollout mode {self.mode!r}; known modes: {list(MODES)}.")
        if self.extra_complete_groups not in ("carry", "train"):
            raise ValueError(f"RolloutConfig.extra_complete_groups={self.extra_complete_groups!r}: use 'carry' or "
                             "'train'.")
        for name in ("batch_groups", "group_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name}={getattr(self, name)} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """Fully-asynchronous RollVerify (``RolloutConfig.mode = 'async'``): rollout and training on disjoint devices of
    one program. The rollout decodes without pause; a complete batch goes to the learner on its own devices while
    decoding goes on; the new weights are published to the rollout at a decode-step boundary (the swap), where the
    running trajectories are paused and resumed through the fused verify-resume prefill under the new weights.

    rollout_devices: each host's local devices given to rollout: a count (int >= 1) or a fraction (float in
        (0, 1)); the rest train. The train mesh is ``make_mesh.shape`` over the train devices.
    rollout_mesh: the rollout mesh's (data, fsdp, tensor) shape over the rollout devices (one entry may be -1).
    overlap_dispatches: decode dispatches run while an update computes; the swap comes after them or when the
        update is done, whichever is later (a schedule that never reads the clock: runs and resumes repeat).
    max_staleness: admission stops while (max_staleness + 1) x batch_groups groups are admitted and not yet
        trained (AReaL's (eta + v + 1) B cap), so the rollout runs at most that far ahead of the learner.
    at_swap: 'verify' (the running trajectories re-prefilled under the new weights, verified on that prefill's
        log-probs and cut at the first violation: RollVerify), 'reprefill' (re-prefilled, nothing cut: the
        unverified baseline) or 'keep_stale_kv' (no re-prefill: decoding goes on over the older versions' KV).
    """

    rollout_devices: int | float = 0.5
    rollout_mesh: tuple = (-1, 1, 1)
    overlap_dispatches: int = 8
    max_staleness: int = 1
    at_swap: str = "verify"

    def __post_init__(self):
        if self.at_swap not in AT_SWAP:
            raise ValueError(f"AsyncConfig.at_swap={self.at_swap!r}: use one of {list(AT_SWAP)}.")
        r = self.rollout_devices
        if isinstance(r, bool) or not (isinstance(r, int) and r >= 1 or isinstance(r, float) and 0 < r < 1):
            raise ValueError(f"AsyncConfig.rollout_devices={r!r}: a device count per host (an int >= 1) or a "
                             "fraction of each host's devices (a float between 0 and 1).")
        for name in ("overlap_dispatches", "max_staleness"):
            if getattr(self, name) < 0:
                raise ValueError(f"AsyncConfig.{name}={getattr(self, name)} must be >= 0.")
        object.__setattr__(self, "rollout_mesh", tuple(self.rollout_mesh))


@dataclasses.dataclass
class PhaseResult:
    groups: list[Group]
    metrics: dict


class RolloutManager:
    """Drives the scheduler through rollout phases, owns the paused-trajectory cache and, at the end of each
    cycle, the acceptance window that switches RollVerify to on-policy rollout."""

    def __init__(self, config: RolloutConfig, scheduler: Scheduler, next_record: Callable[[], dict],
                 encode_prompt: Callable[[dict], np.ndarray], *, seed: int = 0, switch: SwitchConfig,
                 verify: VerifyConfig, asynchronous: AsyncConfig | None = None):
        self.config = config
        self.async_cfg = asynchronous or AsyncConfig()
        self.asynchronous = config.mode == schedule_rules.ASYNC_MODE
        self.groups_trained = 0  # groups handed to the learner: the asynchronous mode's staleness cap counts them
        self.verify_cfg = verify
        if scheduler.coupled != (verify.rule == "coupled"):
            raise ValueError(f"VerifyConfig.rule={verify.rule!r} needs a Scheduler built with "
                             f"coupled={verify.rule == 'coupled'} (its resume prefill computes what the rule reads).")
        self.switch_cfg = switch
        self.switch_state: SwitchState = self.switch_cfg.init()
        self.scheduler = scheduler
        self.next_record = next_record
        self.encode_prompt = encode_prompt
        self.seed = seed
        self.cache = PausedCache()
        self.on_policy = config.mode == "on_policy"
        self.next_group_id = 0
        self.next_uid = 0
        self.verify_time = 0.0
        self.cut_stats = CutStats()
        self.shift_stats = ShiftStats()

    @property
    def verifying(self) -> bool:
        """Paused trajectories are verified at their resume: RollVerify, synchronous or asynchronous."""
        if self.on_policy:
            return False
        return self.config.mode == "rollverify" or (self.asynchronous and self.async_cfg.at_swap == "verify")

    @property
    def pauses_at_swap(self) -> bool:
        """The asynchronous mode re-prefills the running trajectories at each swap (not with 'keep_stale_kv')."""
        return self.async_cfg.at_swap != "keep_stale_kv"

    # ------------------------------------------------------------------------------------------------

    def _new_group(self) -> list[Trajectory]:
        record = self.next_record()
        prompt = np.asarray(self.encode_prompt(record), np.int32)
        gid = self.next_group_id
        self.next_group_id += 1
        self.cache.add_group(Group(gid, self.config.group_size, record))
        trajs = []
        for _ in range(self.config.group_size):
            uid = self.next_uid
            self.next_uid += 1
            seed = (self.seed * 1_000_003 + uid) % (2**31 - 1)
            trajs.append(Trajectory(uid=uid, group_id=gid, prompt=prompt, seed=seed,
                                    max_new_tokens=self.config.max_new_tokens))
        return trajs

    def _keep_fn(self, new_logp, behavior_logp, versions, lengths, match=None):
        """Verification on the resume prefill (timed as verification), noting where it cut: the two-stage rule on
        its log-probs, or the coupled rule on its ``match`` (the scheduler's, with ``VerifyConfig.rule='coupled'``);
        and how far the policy moved at the checked tokens (``ShiftStats``)."""
        t0 = time.perf_counter()
        if self.verify_cfg.rule == "coupled":
            keep, cuts = coupled_verify_with_stats(match, versions, lengths, self.scheduler.engine.version)
        else:
            keep, cuts = two_stage_verify_with_stats(new_logp, behavior_logp, versions, lengths, self.verify_cfg.ds,
                                                     self.verify_cfg.dt, self.scheduler.engine.version)
        self.cut_stats.merge(cuts)
        self.verify_time += time.perf_counter() - t0
        # the policy shift at the checked tokens (both rules), outside the rule's timing
        self.shift_stats.merge(ShiftStats.of(new_logp, behavior_logp, versions, lengths,
                                             self.scheduler.engine.version, match))
        return keep

    def switch_to_on_policy(self) -> int:
        """Conditional switching: synchronous rollout for the rest of the run; the cache is dropped. Returns
        how many cached trajectories were dropped."""
        self.on_policy = True
        self.cache.pause(self.scheduler.pause_all())  # the asynchronous mode's running trajectories are dropped too
        dropped = len(self.cache.paused) + sum(len(g.finished) for g in self.cache.groups.values())
        self.cache = PausedCache()
        return dropped

    def end_cycle(self, step: int, phase_metrics: dict) -> dict:
        """After the update to version ``step``: push the cycle's acceptance (``phase_metrics`` of its rollout
        phase) into the window, for cycles that verified something only, and switch to on-policy rollout once
        the full window's mean is below the threshold. Returns the cycle's switching metrics."""
        m = phase_metrics
        metrics = {}
        if self.verifying and m.get("verify/num_verified", 0) > 0:
            self.switch_state = self.switch_cfg.update(self.switch_state, m["verify/acceptance"], step)
            if self.switch_state.on_policy:
                metrics["mode/dropped_at_switch"] = self.switch_to_on_policy()
                metrics["mode/switch_step"] = self.switch_state.switch_step
        metrics["verify/acceptance_window"] = window_mean(self.switch_state)
        return metrics

    def run_phase(self) -> PhaseResult:
        sched = self.scheduler
        sched.reset_stats()
        self.verify_time = 0.0
        self.cut_stats = CutStats()
        self.shift_stats = ShiftStats()
        t0 = time.perf_counter()
        if self.on_policy:
            groups = self._on_policy_phase()
        elif self.asynchronous:
            groups = self._async_phase()
        else:
            groups = self._partial_phase()
        self.groups_trained += len(groups)
        wall = time.perf_counter() - t0
        stats = sched.stats
        version = sched.engine.version
        batch_stale = trajectory_staleness(version, [t.versions for g in groups for t in g.finished.values()
                                                     if t.versions])
        cache_stale = self.cache.staleness(version)
        verified = _verify_summary(sched.verified)  # paused trajectories: the acceptance rate's tokens
        rechecked = _verify_summary(sched.verified_finished)
        metrics = {
            "time/rollout": wall - self.verify_time,
            "time/verify": self.verify_time,
            "rollout/tokens_per_s": stats.tokens_generated / max(wall, 1e-9),
            "rollout/tokens": stats.tokens_generated,
            "rollout/slot_utilization": stats.slot_utilization(sched.engine.config.num_slots),
            "rollout/prefill_tokens": stats.prefill_tokens,
            "rollout/shared_prompt_tokens": stats.shared_prompt_tokens,
            "rollout/host_time": stats.host_time,
            # Device-call timers and counts, so a cost model can price prefill and decode separately.
            "rollout/prefill_time": stats.prefill_time,
            "rollout/decode_time": stats.decode_time,
            "rollout/dispatches": stats.dispatches,
            "rollout/decode_steps": stats.decode_steps,
            "rollout/decode_steps_dropped": stats.decode_steps_dropped,
            "staleness/mean": float(batch_stale.mean()) if batch_stale.size else 0.0,
            "staleness/max": int(batch_stale.max()) if batch_stale.size else 0,
            "cache/size": len(self.cache),
            "cache/staleness_mean": float(cache_stale.mean()) if cache_stale.size else 0.0,
            "verify/acceptance": verified["acceptance"],
            "verify/num_verified": verified["num_verified"],
            "verify/num_cut": verified["num_cut"],
            "verify/num_restarted": verified["num_restarted"],
            "verify/tokens_total": verified["tokens_total"],
            "verify/tokens_removed": verified["tokens_removed"],
            "verify/finished_verified": rechecked["num_verified"],
            "verify/finished_cut": rechecked["num_cut"],
            **self.cut_stats.metrics(),
            **self.shift_stats.metrics(),
            "verify/regen_tokens": stats.regen_tokens,
            "verify/regen_equal_rate": stats.regen_equal / stats.regen_tokens if stats.regen_tokens else float("nan"),
            "mode/on_policy": int(self.on_policy),
        }
        if self.verify_cfg.rule == "coupled":  # kept only by VerifyConfig.coupled_tolerance: 0 when exact
            metrics["verify/near_ties_kept"] = stats.near_ties_kept
        for s, count in zip(*np.unique(cache_stale, return_counts=True), strict=True):
            metrics[f"cache/staleness_hist/{int(s)}"] = int(count)
        if sched.env is not None:
            metrics.update(sched.env.phase_metrics([t for g in groups for t in g.finished.values()], wall, stats,
                                                   sched.engine.config.num_slots))
        return PhaseResult(groups=groups, metrics=metrics)

    def _collect_finished(self) -> None:
        for t in self.scheduler.take_finished():
            self.cache.add_finished(t)

    def _on_policy_phase(self) -> list[Group]:
        """Exactly B groups, and wait for all of them (a synchronous rollout)."""
        for _ in range(self.config.batch_groups):
            self.scheduler.submit(self._new_group())
        self.scheduler.run()
        self._collect_finished()
        return self.cache.pop_complete(self.config.batch_groups)

    def _partial_phase(self) -> list[Group]:
        groups = self._decode_until_batch()
        self.cache.pause(self.scheduler.pause_all())
        return groups

    def _decode_until_batch(self) -> list[Group]:
        """The cache resumed (verified under the newest policy when verifying), then every slot kept busy with new
        groups until B groups are complete; returns them (all complete ones with 'train')."""
        sched, cfg = self.scheduler, self.config
        resumed = self.cache.take_for_resume(include_finished=self.verifying and self.verify_cfg.verify_finished)
        sched.resume(resumed, keep=self._keep_fn if self.verifying else None)
        self._collect_finished()  # finished members resumed unverified are back in their groups at once
        target = self._queue_target()
        while not schedule_decisions.phase_done(self.cache.num_complete(), cfg.batch_groups):
            self._top_up(target)
            if sched.idle:
                raise RuntimeError(f"the rollout has nothing to decode with {self.cache.num_complete()} of "
                                   f"{cfg.batch_groups} groups complete: the staleness cap admits too few groups")
            sched.step()
            self._collect_finished()
        return self.cache.pop_complete(cfg.batch_groups if cfg.extra_complete_groups == "carry" else None)

    # The asynchronous mode ------------------------------------------------------------------------------

    def _admission_open(self) -> bool:
        """The staleness cap: at most (max_staleness + 1) x B groups admitted and not yet trained."""
        cap = (self.async_cfg.max_staleness + 1) * self.config.batch_groups
        return not self.asynchronous or self.next_group_id - self.groups_trained < cap

    def _top_up(self, target: int) -> None:
        """New groups queued up to ``target`` queued trajectories, as far as the staleness cap admits."""
        for _ in range(schedule_decisions.groups_to_queue(self.scheduler.num_new_queued(), target,
                                                          self.config.group_size)):
            if not self._admission_open():
                return
            self.scheduler.submit(self._new_group())

    def _queue_target(self) -> int:
        return schedule_decisions.queue_target(self.config.queue_groups, self.scheduler.engine.config.num_slots,
                                               self.config.group_size)

    def _async_phase(self) -> list[Group]:
        """A partial phase that pauses nothing at its end: decoding goes on while the learner trains
        (``overlap``), and the swap pauses (``at_swap``)."""
        return self._decode_until_batch()

    def overlap(self, dispatches: int) -> dict:
        """Up to ``dispatches`` decode dispatches with the weights the rollout holds, while the learner computes
        the next version on its own devices. Returns their metrics (``overlap/*``)."""
        sched = self.scheduler
        sched.reset_stats()
        t0 = time.perf_counter()
        target = self._queue_target()
        count = 0
        for count in range(1, dispatches + 1):  # noqa: B007  (the count is reported)
            self._top_up(target)
            if sched.idle:
                count -= 1
                break
            sched.step()
            self._collect_finished()
        return {"overlap/dispatches": count, "overlap/tokens": sched.stats.tokens_generated,
                "overlap/decode_time": sched.stats.decode_time, "time/overlap": time.perf_counter() - t0}

    def at_swap(self) -> None:
        """After new weights are installed: the running trajectories are paused, to be re-prefilled (and, with
        'verify', verified) under them at the next phase's start; with 'keep_stale_kv' they decode on."""
        if self.pauses_at_swap:
            self.cache.pause(self.scheduler.pause_all())

    def quiesce(self) -> None:
        """Every running trajectory paused into the cache (the engine's slots freed for an evaluation)."""
        self.cache.pause(self.scheduler.pause_all())

    # ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The host state a checkpoint holds. The asynchronous mode's trajectories still decoding ('keep_stale_kv')
        are saved as paused (a resume re-prefills them: their KV is not saved)."""
        cache = self.cache.to_dict()
        live = self.scheduler.snapshot() if self.asynchronous else []
        if live:
            cache = {**cache, "paused": [t.to_dict() for t in live] + cache["paused"]}
        return {"cache": cache, "on_policy": int(self.on_policy),
                "next_group_id": self.next_group_id, "next_uid": self.next_uid,
                "switch": self.switch_state.to_dict(), "groups_trained": self.groups_trained}

    def load_state_dict(self, d: dict) -> None:
        self.cache = PausedCache.from_dict(d["cache"])
        # An on-policy config stays on-policy even on a cache saved in a partial mode (a changed-settings resume).
        self.on_policy = bool(d["on_policy"]) or self.config.mode == "on_policy"
        self.switch_state = SwitchState.from_dict(d["switch"])
        self.next_group_id = int(d["next_group_id"])
        self.next_uid = int(d["next_uid"])
        self.groups_trained = int(d.get("groups_trained", 0))


def _verify_summary(verified: list[tuple[int, int]]) -> dict:
    return verify_stats(np.asarray([k for k, _ in verified], np.int64), np.asarray([n for _, n in verified], np.int64))
