"""The seam between continuous batching and whatever answers a response mid-way (an environment).

The scheduler knows only this much: a slot whose trajectory stopped where the environment replies (one of the
engine's stop tokens ended the turn; ``awaits_reply``) is *parked*: it keeps its pages and decodes nothing while
the environment works on a ``request``. The scheduler takes the reply (``reply``, which blocks until it is in) at
a point fixed in decode dispatches, never when it happens to arrive: before the ``reply_dispatches``-th dispatch
after the request, at a pause, or when nothing else can decode. Its tokens are appended to the trajectory as
environment tokens (``Trajectory.append_env``: no log mu, outside verification and the loss) and written into
the slot's cache with ``Engine.extend``, and the slot decodes on. So what a rollout produces (which groups finish
first, where a pause finds each trajectory) never depends on how long a reply took. Tool use
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
    read; a subclass may carry more, e.g. a tool call's clock)."""

    future: concurrent.futures.Future

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        """Drops the work: a thread cannot be stopped, its result (when it comes) is never read."""
        self.future.cancel()


class Environment(abc.ABC):
    """What a rollout's parked slots wait on. One instance per run (or per evaluation), holding its own state:
    two environments in one process never share anything.

    reply_dispatches: a request's reply is taken (blocking) before the ``reply_dispatches``-th decode dispatch
    issued after it (1: the next one), so the dispatches before that one overlap the environment's work; a pause
    takes every reply still open, and with nothing left to decode the earliest requests' replies are taken at
    once. Counted in dispatches, not seconds: which dispatch a reply joins is the same in every run."""

    reply_dispatches: int = 1

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
    def reply(self, request: Request, room: int) -> list[int]:
        """The reply's tokens, at most ``room`` of them, waiting for ``request`` to be answered. The wait is bounded
        by the environment's own limit (a tool's timeout), past which the reply says so: the scheduler calls this
        only at points fixed in dispatches, so a reply's content must not depend on when it is asked for."""

    def phase_metrics(self, batch: Sequence[Trajectory], wall: float, stats: RolloutStats,
                      num_slots: int) -> dict:
        """The environment's metrics of a rollout phase: ``batch`` its finished trajectories, ``wall`` its seconds,
        ``stats`` the scheduler's ``RolloutStats``, ``num_slots`` the engine's."""
        return {}

    def reset_stats(self) -> None:  # noqa: B027  (a hook: an environment without counters has nothing to do)
        """Starts the environment's counters afresh (with the scheduler's, ``Scheduler.reset_stats``)."""

    def close(self) -> None:  # noqa: B027  (a hook: an environment holding nothing has nothing to release)
        """Releases what the environment holds (threads, processes)."""
