"""``MetricsConfig.profile_steps = (first, last)``: a ``jax.profiler`` trace of training steps first..last.

The trace starts before step ``first``'s rollout and stops when step ``last`` has trained (its update is fetched
to the host, so its device work is in the trace); a resumed run that starts inside the window traces what is left
of it. Each step is marked in the trace (``StepTraceAnnotation``). Every process writes its own file, named by
host, under ``<workdir>/profile/plugins/profile/<time>/``: open it with TensorBoard's profile plugin
(``tensorboard --logdir <workdir>/profile``, ``pip install tensorboard-plugin-profile``), xprof or Perfetto.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import jax

from rollverify_jax.infra import storage

PROFILE_DIR = "profile"


class StepProfiler:
    """Starts and stops one trace around a window of steps; does nothing when ``window`` is None."""

    def __init__(self, window: tuple[int, int] | None, workdir: storage.PathLike):
        self.window = window
        self.directory = storage.as_path(workdir) / PROFILE_DIR
        self.active = False
        self.traced: list[int] = []

    def in_window(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step <= self.window[1]

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: starts the trace at the window's first step this launch runs, marks the
        step, and stops the trace after the window's last step."""
        if not self.in_window(step):
            yield
            return
        if not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
        self.traced.append(step)
        if step >= self.window[1]:
            self.stop()

    def stop(self) -> None:
        """Ends the trace (also when the run stops inside the window) and says where it is, in one line."""
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        steps = f"{self.traced[0]}-{self.traced[-1]}" if self.traced else "none"
        print(f"profile: steps {steps} traced into {storage.absolute(self.directory)}", file=sys.stderr, flush=True)
