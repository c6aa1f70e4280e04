"""Stopping at a safe point: SIGTERM (the preemption notice of TPU VMs, SLURM and Kubernetes) and SIGINT.

A signal does not kill the run mid-step: it is recorded, the step in flight finishes, a checkpoint of it is
saved and committed, and the process exits with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), the status
schedulers read as "stopped by that signal", so a requeue resumes from the saved step. A second SIGINT stops at
once (for a person at the keyboard). On several hosts every host must stop after the same step, whichever host
got the signal: ``StopRequest.agree`` takes the decision from all of them at once (a four-byte all-gather per
check), and JAX's preemption sync point covers the notices JAX itself receives (``Checkpointer.reached_preemption``).
"""

from __future__ import annotations

import signal
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

EXIT_STATUS = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}


class StopRequest:
    """Context manager: while inside, SIGTERM/SIGINT set ``signum`` instead of killing the process. Off the
    main thread (where Python allows no signal handlers) the signals keep their default behaviour."""

    def __init__(self):
        self.signum: int | None = None
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
        print(f"\nreceived {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def agree(self) -> bool:
        """Whether to stop now, the same answer on every process: a signal seen by any process counts for all
        (each adopts the strongest signal number seen, so every host exits with the same status). Every process
        must call this at the same point of the step, like any collective."""
        seen = self.signum or 0
        if jax.process_count() > 1:
            seen = int(np.max(multihost_utils.process_allgather(np.asarray(seen, np.int32))))
        if seen:
            self.signum = seen
        return bool(seen)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 1)
