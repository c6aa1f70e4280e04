"""Publishing the learner's weights to a rollout engine on other devices (the asynchronous mode).

A publish has two halves. ``stage`` starts copying the new params into the engine's serving layout (a staging
copy beside the serving one) and returns at once, so decoding goes on while the update computes and the copy
moves. ``swap`` runs at a decode-step boundary: it waits for the copy, installs it only if it is whole and
advances the engine's version; a copy that failed or is not whole leaves the engine on the previous version and
says so in one line. Holding two serving copies for a moment is the price of publishing without a stall.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from rollverify_jax.infra.transfer import tree_bytes
from rollverify_jax.rollout.engine import Engine


@dataclasses.dataclass
class _Staged:
    params: Any
    version: int
    started: float
    error: BaseException | None = None


class WeightPublisher:
    """Stages the learner's params for ``engine`` and swaps them in whole."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.place: Callable[[Any], Any] = engine.place_params  # the copy into the engine's layout (a reshard)
        self._staged: _Staged | None = None

    def stage(self, params: Any, version: int) -> None:
        """Starts the copy of ``params`` (policy ``version``) into the engine's layout; does not wait for it (nor
        for the update that computes ``params``). A copy already staged and not swapped is dropped."""
        self._staged = None
        staged = _Staged(None, int(version), time.perf_counter())
        try:
            staged.params = self.place(params)
        except Exception as e:  # noqa: BLE001  (a failed copy is reported at the swap; rollout keeps its version)
            staged.error = e
        self._staged = staged

    def swap(self) -> dict:
        """At a decode-step boundary: waits for the staged copy and installs it when whole (the engine's version
        advances); otherwise the engine keeps its weights and version, and one line says why. Returns the
        publish's metrics (``publish/*``)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return {}
        t0 = time.perf_counter()
        error = staged.error
        if error is None:
            try:
                jax.block_until_ready(staged.params)
                _check_whole(staged.params, self.engine.trainable)
            except Exception as e:  # noqa: BLE001
                error = e
        wait = time.perf_counter() - t0
        if error is not None:
            print(f"publish of policy version {staged.version} failed ({type(error).__name__}: {error}); rollout "
                  f"stays on version {self.engine.version} until the next publish", flush=True)
            return {"publish/failed": 1, "publish/version": self.engine.version, "time/publish_wait": wait}
        self.engine.swap_params(staged.params, staged.version)
        return {"publish/failed": 0, "publish/version": staged.version, "publish/bytes": tree_bytes(staged.params),
                "time/publish_wait": wait, "time/publish": time.perf_counter() - staged.started}


def _check_whole(staged: Any, serving: Any) -> None:
    """A staged copy is whole when it has every array of the serving copy, with the same shape, dtype and
    sharding: a partial copy (an interrupted transfer) is never installed."""
    want, have = jax.tree.structure(serving), jax.tree.structure(staged)
    if want != have:
        raise ValueError(f"the staged copy's tree differs from the serving one ({have} vs {want})")
    for s, w in zip(jax.tree.leaves(staged), jax.tree.leaves(serving), strict=True):
        if s is None or s.shape != w.shape or s.dtype != w.dtype or s.sharding != w.sharding:
            raise ValueError(f"a staged array does not match the serving one: {getattr(s, 'shape', None)} "
                             f"{getattr(s, 'dtype', None)} vs {w.shape} {w.dtype}")
