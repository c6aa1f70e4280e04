"""The rollout scheduler's decisions, as pure functions over plain data that the scheduler and the replay both call.

``rollout/scheduler.py`` (over a real engine's allocator and trajectories) and ``sim/replay.py`` (over a dispatch
clock and token counts) decide with the same code: which queued requests are admitted into which free slots, how
many pages a slot reserves, which running slots grow and which are preempted when pages run short, which slots
move down so that decode runs over fewer (live slots), how many new groups a partial phase keeps queued, when the
phase is done and in what order it pauses what is left. Each side only translates its state into the arguments
(pages per shard, slots, token counts), so the simulator cannot drift from the scheduler
(``tests/test_scheduler_parity.py`` replays recorded scheduler traces through the replay, call for call).
Pure Python + numpy: importing this never imports JAX or gin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from rollverify_jax import schedule_rules

T = TypeVar("T")


def reserved_tokens(prompt_len, tokens, max_new_tokens, steps_per_dispatch: int, dispatches: int = 1,
                    full: bool = False):
    """Cache positions a sequence of ``prompt_len`` prompt tokens holding ``tokens`` response tokens must own
    through its next ``dispatches`` decode dispatches of ``steps_per_dispatch`` steps: the positions those write
    plus the one the next token is read from (``+ 1``), at most prompt + ``max_new_tokens``; everything (prompt +
    ``max_new_tokens``) under ``full`` reservation. Ints give an int; numpy arrays (the replay's slots) an array."""
    cap = prompt_len + max_new_tokens
    if full:
        return cap
    want = prompt_len + tokens + dispatches * steps_per_dispatch + 1
    return np.minimum(cap, want) if isinstance(want, np.ndarray) else min(cap, want)


def pages_for(tokens, page_size: int):
    """Pages that hold ``tokens`` cache positions (an int, or elementwise over an array)."""
    return -(-tokens // page_size)


@dataclasses.dataclass(frozen=True)
class Admission:
    """One admission round: the slot each admitted queue head takes (queue order: the first ``len(slots)`` of
    the queue are admitted) and whether the round stopped because the next head's pages did not fit."""

    slots: tuple[int, ...]
    page_blocked: bool


def admit(needs: Sequence[int], free_slots: Sequence[int], slots_per_shard: int,
          free_pages: Sequence[int] | None, busy: Sequence[int], headroom: int) -> Admission:
    """Fills free slots from the queue head, in order, while pages fit: a head that does not fit waits (and every
    request behind it), so requests start in queue order.

    ``needs``: pages each of the first queued requests must own through its first dispatch (at least
    ``min(len(queue), len(free_slots))`` of them, queue order). ``free_slots``: ascending; ``n`` requests take
    at most the ``n`` lowest free slots of a shard, so those suffice. Slot ``s`` lives on pool shard
    ``s // slots_per_shard`` and takes only that shard's pages. ``free_pages``: free pages per shard (None:
    a pool that never binds, every head fits). ``busy``: running (or parked) slots per shard. ``headroom``: pages
    kept free per busy slot of the shard (1 under incremental reservation, so the running sequences can grow at
    their next dispatch instead of being preempted at once; 0 under full reservation). A head takes the first free
    slot whose shard has its pages plus the headroom."""
    free = list(free_slots)
    pages = None if free_pages is None else list(free_pages)
    busy = list(busy)
    taken: list[int] = []
    for need in needs:
        if not free:
            break
        if pages is None:
            slot = free[0]
        else:
            slot = next((s for s in free if need + headroom * busy[s // slots_per_shard]
                         <= pages[s // slots_per_shard]), None)
            if slot is None:
                return Admission(tuple(taken), True)
            pages[slot // slots_per_shard] -= need
            busy[slot // slots_per_shard] += 1
        free.remove(slot)
        taken.append(slot)
    return Admission(tuple(taken), False)


def grow_or_preempt(shards: Sequence[int], have: Sequence[int], need: Sequence[int],
                    free_pages: Sequence[int]) -> tuple[int, ...]:
    """Which running slots are preempted for want of pages (indices into the arguments, ascending).

    The running slots are listed oldest request first (by uid): slot ``i`` lives on pool shard ``shards[i]``,
    owns ``have[i]`` pages and needs ``need[i]`` through its next dispatch; ``free_pages`` are each shard's free
    pages. In that order each slot is granted what it lacks while its shard has it; one that cannot be is
    preempted (its pages are released only after the round, so they help nobody in it), and a younger slot
    needing less may still grow. The oldest requests always progress, so a pool too small for every slot
    at full length still finishes every request."""
    left = list(free_pages)
    preempted = []
    for i, (shard, h, n) in enumerate(zip(shards, have, need, strict=True)):
        extra = max(0, n - h)
        if extra <= left[shard]:
            left[shard] -= extra
        else:
            preempted.append(i)
    return tuple(preempted)


def pack_moves(held: Sequence[int], buckets: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(from, to)`` slot moves that pack the held slots (running, or parked on a reply) below the smallest of the
    ascending slot ``buckets`` holding them all, so decode runs over that bucket only: each held slot at or above
    it, ascending, moves to the lowest free slot below it. A moved sequence counts as activated anew (it is last
    in the scheduler's slot order, which is the order a pause returns)."""
    target = schedule_rules.smallest_holding(buckets, len(held))
    high = sorted(s for s in held if s >= target)
    if not high:
        return ()
    taken = set(held)
    low = [s for s in range(target) if s not in taken][: len(high)]
    return tuple(zip(high, low, strict=True))


def queue_target(queue_groups: int, num_slots: int, group_size: int) -> int:
    """New (never started) requests a partial phase keeps queued ahead of the free slots: ``queue_groups``
    groups, or (0) enough groups to fill every slot."""
    return (queue_groups or -(-num_slots // group_size)) * group_size


def groups_to_queue(new_queued: int, target: int, group_size: int) -> int:
    """New groups a partial phase submits before a dispatch so that ``new_queued`` new requests reach
    ``target`` (whole groups: it may overshoot by less than a group)."""
    return max(0, -(-(target - new_queued) // group_size))


def phase_done(num_complete: int, batch_groups: int) -> bool:
    """A partial phase ends after the dispatch at whose end ``batch_groups`` groups have every member finished."""
    return num_complete >= batch_groups


def pause_order(running: Sequence[T], parked: Sequence[T], queued: Sequence[T]) -> list[T]:
    """What a pause returns, in the order it is resumed next phase: the running trajectories (in the order they
    were last activated), then those parked on an external reply, then the queue (resumed ones first)."""
    return [*running, *parked, *queued]
