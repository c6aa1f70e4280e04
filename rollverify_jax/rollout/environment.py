"""The seam between continuous batching and whatever answers a response mid-way (an environment).

The scheduler knows only this much: a slot whose trajectory stopped where the environment replies (one of the
engine's stop tokens ended the turn; ``awaits_reply``) is *parked*: it keeps its pages and decodes nothing while
the environment works on a ``request``. Once ``reply`` gives the reply's tokens, they are appended to the
trajectory as environment tokens (``Trajectory.append_env``: no log mu, outside verification and the loss) and
written into the slot's cache with ``Engine.extend``, and the slot decodes on. Tool use
(``rollout/tool_use.py``) is one environment; the scheduler never sees a tool.

JAX-free (futures and trajectories only), so an environment is testable without an engine.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollverify_jax.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from rollverify_jax.rollout.stats import RolloutStats


@dataclasses.dataclass
class Request:
    """An environment's work for one parked trajectory: the future of its result (the environment's own to
    read) and when it started (``time.perf_counter``)."""

    future: concurrent.futures.Future
    started: float

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        """Drops the work: a thread cannot be stopped, its result (when it comes) is never read."""
        self.future.cancel()


class Environment(abc.ABC):
    """What a rollout's parked slots wait on. One instance per run (or per evaluation), holding its own state:
    two environments in one process never share anything.

    reply_grace_s: before each decode dispatch, and at a pause, the scheduler waits this long for the requests
    still running, so a reply that comes in microseconds joins the next dispatch instead of sitting one out, and
    a pause keeps it (which replies a paused trajectory holds never depends on thread timing)."""

    reply_grace_s: float = 0.0

    @abc.abstractmethod
    def awaits_reply(self, t: Trajectory) -> bool:
        """``t`` (unfinished) stopped where this environment replies next: its slot parks for ``request``."""

    @abc.abstractmethod
    def ends(self, t: Trajectory) -> bool:
        """``t`` stopped where a reply would be due, but none can come (a budget is spent): it finishes here."""

    @abc.abstractmethod
    def request(self, t: Trajectory) -> Request:
        """Starts the work whose reply continues ``t`` (off the decode loop)."""

    @abc.abstractmethod
    def reply(self, request: Request, room: int) -> list[int] | None:
        """The reply's tokens once ``request`` is answered (None while it is not), at most ``room`` of them."""

    @staticmethod
    def wait(requests: Sequence[Request], timeout: float, every: bool = False) -> None:
        """Blocks until one of ``requests`` (``every``: all of them) is done or ``timeout`` seconds pass."""
        concurrent.futures.wait([r.future for r in requests], timeout,
                                concurrent.futures.ALL_COMPLETED if every else concurrent.futures.FIRST_COMPLETED)

    def phase_metrics(self, batch: Sequence[Trajectory], wall: float, stats: RolloutStats,
                      num_slots: int) -> dict:
        """The environment's metrics of a rollout phase: ``batch`` its finished trajectories, ``wall`` its seconds,
        ``stats`` the scheduler's ``RolloutStats``, ``num_slots`` the engine's."""
        return {}

    def reset_stats(self) -> None:  # noqa: B027  (a hook: an environment without counters has nothing to do)
        """Starts the environment's counters afresh (with the scheduler's, ``Scheduler.reset_stats``)."""

    def close(self) -> None:  # noqa: B027  (a hook: an environment holding nothing has nothing to release)
        """Releases what the environment holds (threads, processes)."""
