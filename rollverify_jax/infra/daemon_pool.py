"""A fixed pool of daemon worker threads whose shutdown waits a bounded time.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits (``shutdown(wait=False)``
included), so one call stuck in a tool (a hung in-process function, a sandbox that ignores its limits) kept a run
alive after its summary until its caller's time limit killed it. These threads are daemons: a caller that gave up
on them (``shutdown`` past its wait) exits without them.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class DaemonThreadPool:
    """``submit`` returns a ``concurrent.futures.Future``, as an executor's does; ``shutdown`` cancels what has not
    started and waits at most ``timeout_s`` for the running calls."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        self._started = self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the pool is shut down")
        if not self._started:  # on the first call: a pool never used starts no thread
            self._started = True
            for thread in self._threads:
                thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller reads it from the future
                future.set_exception(e)

    def shutdown(self, timeout_s: float, interrupt: Callable[[set[int]], Any] | None = None) -> list[threading.Thread]:
        """Cancels the calls not started, lets each thread end after its running call (``interrupt``, given the
        idents of the threads still running one, may cut those calls short), and waits for them at most
        ``timeout_s`` in all; returns the threads still running (daemons: they do not hold up the exit)."""
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        if not self._started:
            return []
        for _ in self._threads:
            self._queue.put(None)
        if interrupt is not None:
            interrupt({t.ident for t in self.alive()})
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive()]

    def alive(self) -> list[threading.Thread]:
        return [t for t in self._threads if t.is_alive()]
