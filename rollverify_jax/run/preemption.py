"""Stopping at a safe point: SIGTERM (the preemption notice of TPU VMs, SLURM and Kubernetes) and SIGINT.

A signal does not kill the run mid-step: it is recorded, the step in flight finishes, a checkpoint of it is
saved and committed, and the process exits with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), the status
schedulers read as "stopped by that signal", so a requeue resumes from the saved step. A second SIGINT stops at
once (for a person at the keyboard). JAX's own preemption notice (its sync point,
``Checkpointer.reached_preemption``) exits 143 too: it stands for the SIGTERM a scheduler sent.

On several hosts every host must stop after the same step, or one waits forever in a collective the others left:
``StopRequest.agree`` takes every stop decision (a signal, JAX's notice, a host's clock past the time budget, too
many skipped steps) from all hosts at once (a small all-gather per check), and each host acts on the result.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time

from rollverify_jax.infra import distributed

EXIT_STATUS = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}
PREEMPTION_EXIT_STATUS = EXIT_STATUS[signal.SIGTERM]  # JAX's notice: the status of the SIGTERM it stands for
SKIPPED_EXIT_STATUS = 3  # TrainConfig.max_skipped_steps steps in a row had non-finite updates


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every host decided at one stop check; the same on each (``StopRequest.agree``)."""

    signum: int | None = None  # the strongest signal any host received
    preempted: bool = False  # JAX's preemption sync point is this step
    out_of_time: bool = False  # some host's clock passed TrainConfig.time_budget_s
    too_many_skipped: bool = False  # TrainConfig.max_skipped_steps non-finite steps in a row

    @property
    def stop(self) -> bool:
        return bool(self.signum or self.preempted or self.out_of_time or self.too_many_skipped)

    @property
    def exit_status(self) -> int:
        """3 for the non-finite steps (a requeue would meet them again: a person must look), else the signal's
        status, 143 for JAX's notice, 0 for the time budget (a finished run)."""
        if self.too_many_skipped:
            return SKIPPED_EXIT_STATUS
        if self.signum:
            return EXIT_STATUS.get(self.signum, 128 + self.signum)
        return PREEMPTION_EXIT_STATUS if self.preempted else 0


class StopRequest:
    """Context manager: while inside, SIGTERM/SIGINT set ``signum`` instead of killing the process. Off the
    main thread (where Python allows no signal handlers) the signals keep their default behaviour."""

    def __init__(self):
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal on this host
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in EXIT_STATUS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = signum
        if self.received_at is None:
            self.received_at = time.monotonic()
        print(f"\nreceived {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def agree(self, preempted: bool = False, out_of_time: bool = False, too_many_skipped: bool = False) -> Decision:
        """Whether to stop now, and why, the same on every process: what any process saw counts for all (each
        adopts the strongest signal number seen, so every host exits with the same status). Every process must
        call this at the same point of the step, like any collective."""
        rows = distributed.gather_ints([self.signum or 0, preempted, out_of_time, too_many_skipped])
        signum, preempted, out_of_time, too_many_skipped = (int(v) for v in rows.max(axis=0))
        if signum:
            self.signum = signum
        return Decision(signum or None, bool(preempted), bool(out_of_time), bool(too_many_skipped))

    def seconds_since_signal(self) -> float | None:
        """How long ago this host received the signal (None: it received none): what the stop took."""
        return None if self.received_at is None else time.monotonic() - self.received_at
