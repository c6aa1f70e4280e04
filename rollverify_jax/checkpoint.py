"""Orbax checkpoints of the whole training state in ``<workdir>/checkpoints/<step>``, so a resumed run loses nothing.

Each step directory holds three orbax items:

- ``state``: the pytree of jax arrays (params, optimizer state, step, PRNG keys, typed or raw), saved with
  ``StandardSave`` and restored straight onto the shardings of an abstract target (``jax.ShapeDtypeStruct``
  with ``sharding``), so a host never materialises the full parameters.
- ``extra``: JSON host state (data iterator position, paused-trajectory cache, switching state, mode).
  numpy/jax arrays inside it are stored as ``{"__ndarray__": flat values, "dtype", "shape"}`` and come back as
  numpy arrays of the same dtype and shape; floats are written as float64 reprs, which round-trip float32,
  bfloat16 and float16 values exactly. numpy scalars come back as Python numbers (``float(np.float32(x))`` is
  exact, so ``np.float32(value)`` recovers it). Tuples come back as lists; NaN/inf are written as the
  ``NaN``/``Infinity`` tokens Python's json reads back. Dict keys must be strings (JSON would silently turn an
  int key into a string).
- ``meta``: the model fingerprint (architecture config), checked on restore so a workdir cannot silently
  resume another model.

Atomicity (verified against orbax-checkpoint 0.12.8 on a local filesystem): a save writes into
``<step>.orbax-checkpoint-tmp`` and is renamed to ``<step>`` only after every item and ``commit_success.txt``
are written. A save that fails (in the background, for async saves) raises from ``wait_until_finished``, leaves
the tmp directory behind, and ``latest_step`` keeps pointing at the previous step; orbax's step listing skips
tmp directories, and a new ``Checkpointer`` removes them in a background thread (``cleanup_tmp_directories``,
awaited before its first save). orbax *does* list a bare ``<step>`` directory with no ``commit_success.txt``
(e.g. a half-finished copy of a checkpoint), so ``latest_step``/``all_steps`` here additionally require that file.
A failed save is reported once: a later ``wait_until_finished``/``close`` does not raise it again.

Storage: ``workdir`` is any ``etils.epath`` path (``rollverify_jax.storage``), e.g. ``gs://bucket/runs/x``. Every
host reads and writes the same directory, so on several hosts it must be a filesystem they all share (a
``gs://`` bucket, NFS, Lustre), never each host's local disk. On ``gs://`` orbax commits a step by writing
``commit_success.txt`` into it (no tmp directory, no rename); the commit-file checks below cover that too.
Only process 0 moves a damaged or uncommitted step aside (every host waits for it), so hosts never race to
rename the same directory.

Faults met on resume, each said in one line and none deleting a user's data silently:

- an interrupted save (a ``<step>.orbax-checkpoint-tmp-*`` directory) is named, then removed by orbax;
- a bare ``<step>`` directory without its commit file is moved aside to ``<step>.uncommitted`` before the
  manager lists steps (otherwise orbax counts the step as saved and never saves it again);
- a committed checkpoint that cannot be read (a truncated array file, a missing item) is moved aside to
  ``<step>.corrupt`` with the error, and the restore falls back to the next newest committed step.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rollverify_jax import storage

COMMIT_FILE = "commit_success.txt"
ITEM_NAMES = ("state", "extra", "meta")
_ARRAY_TAG = "__ndarray__"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Gin-tunable checkpoint policy (`CheckpointConfig.save_interval_steps = 50`).

    `async_save` writes to disk in a background thread after the arrays are copied off the device, so training
    continues during the write; `Checkpointer.close()` (or `wait_until_finished()`) waits for it.
    """

    save_interval_steps: int = 50
    max_to_keep: int | None = 3
    async_save: bool = True

    def __post_init__(self):
        if self.save_interval_steps < 1:
            raise ValueError(f"CheckpointConfig.save_interval_steps must be >= 1, got {self.save_interval_steps}.")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"CheckpointConfig.max_to_keep must be >= 1 or None (keep all), got {self.max_to_keep}.")


def encode_extra(obj: Any, path: str = "extra") -> Any:
    """JSON-ready copy of ``obj``: arrays tagged with dtype/shape, numpy scalars as exact Python numbers.

    Copying eagerly also means the caller may mutate ``obj`` while an async save is still writing.
    """
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.generic):
        return obj.item() if not isinstance(obj, np.floating) else float(obj)
    if isinstance(obj, np.ndarray | jax.Array):
        arr = np.asarray(obj)
        if jnp.issubdtype(arr.dtype, jnp.floating):
            values = arr.astype(np.float64).ravel().tolist()
        elif arr.dtype.kind in "iub":
            values = arr.ravel().tolist()
        else:
            raise TypeError(f"{path}: cannot store an array of dtype {arr.dtype} in checkpoint extra.")
        return {_ARRAY_TAG: values, "dtype": arr.dtype.name, "shape": list(arr.shape)}
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict key {k!r} is a {type(k).__name__}; checkpoint extra needs str keys "
                                "(JSON would turn it into a string). Convert keys with str() and back on restore.")
            if k == _ARRAY_TAG:
                raise ValueError(f"{path}: the key {_ARRAY_TAG!r} is reserved for arrays.")
            out[k] = encode_extra(v, f"{path}[{k!r}]")
        return out
    if isinstance(obj, list | tuple):
        return [encode_extra(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{path}: {type(obj).__name__} is not JSON-serialisable; checkpoint extra holds dicts, lists, "
                    "numbers, strings, None and numpy arrays.")


def decode_extra(obj: Any) -> Any:
    """Inverse of ``encode_extra``: tagged dicts become numpy arrays of the saved dtype and shape."""
    if isinstance(obj, dict):
        if _ARRAY_TAG in obj:
            dtype = jnp.dtype(obj["dtype"])  # knows bfloat16 (ml_dtypes) as well as numpy dtypes
            wide = np.float64 if jnp.issubdtype(dtype, jnp.floating) else dtype
            return np.asarray(obj[_ARRAY_TAG], dtype=wide).astype(dtype).reshape(obj["shape"])
        return {k: decode_extra(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_extra(v) for v in obj]
    return obj


def _fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    missing = "<absent>"
    return [f"{k}: checkpoint={saved.get(k, missing)!r}, current={current.get(k, missing)!r}"
            for k in sorted(set(saved) | set(current)) if saved.get(k, missing) != current.get(k, missing)]


class Checkpointer:
    """Saves and restores (state, extra) under ``<workdir>/checkpoints``; every host calls every method."""

    def __init__(self, workdir: storage.PathLike, config: CheckpointConfig | None = None,
                 model_fingerprint: Mapping[str, Any] | None = None, read_only: bool = False):
        """``read_only`` (evaluation, export): creates, removes and moves nothing on disk, so a reader never
        deletes the in-flight save of a run that is still training, nor makes a directory for a mistyped path."""
        self.config = config if config is not None else CheckpointConfig()
        self.directory = storage.absolute(workdir) / "checkpoints"
        # Normalised through JSON (tuples -> lists) so it compares equal to what a restore reads back.
        self.model_fingerprint: dict[str, Any] = json.loads(json.dumps(encode_extra(dict(model_fingerprint or {}),
                                                                                    "model_fingerprint")))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.max_to_keep,
            save_interval_steps=1,  # the interval is decided in `save`, see `should_save`
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
        )
        if not read_only:
            self._report_interrupted_saves()
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEM_NAMES)
        self._closed = False
        atexit.register(self.close)  # a forgotten close() must not lose the last async save

    # -- faults found on disk -------------------------------------------------------------------------------------

    def _report_interrupted_saves(self) -> None:
        """Names each save that never committed, and moves bare uncommitted step directories aside (process 0
        does; the others wait for it, so every host then lists the same steps)."""
        if _is_primary():
            self._move_uncommitted_aside()
        _sync("rollverify_checkpoint_scanned")

    def _move_uncommitted_aside(self) -> None:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if ".orbax-checkpoint-tmp" in path.name:
                _say(f"checkpoint: removing {path.name}, a save that was interrupted before it committed")
            elif path.is_dir() and path.name.isdigit() and not (path / COMMIT_FILE).exists():
                aside = self._set_aside(int(path.name), "uncommitted")
                _say(f"checkpoint: step {path.name} has no {COMMIT_FILE} (never committed); moved to {aside.name}")

    def _set_aside(self, step: int, why: str) -> epath.Path:
        """Renames ``<step>`` to ``<step>.<why>`` (``.<why>-1``, ... if taken): out of orbax's step list, kept."""
        aside = self.directory / f"{step}.{why}"
        n = 0
        while aside.exists():
            n += 1
            aside = self.directory / f"{step}.{why}-{n}"
        (self.directory / str(step)).rename(aside)
        return aside

    # -- queries -------------------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a step directory without orbax's commit file is ignored)."""
        return sorted(s for s in self._manager.all_steps() if (self.directory / str(s) / COMMIT_FILE).exists())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Every ``save_interval_steps``, or when a multi-host preemption sync point is reached (all hosts agree)."""
        return step % self.config.save_interval_steps == 0 or self.reached_preemption(step)

    def reached_preemption(self, step: int) -> bool:
        """Whether JAX's preemption sync point is ``step`` (every host gets the same answer; always False on one
        host without the preemption service)."""
        return bool(self._manager.reached_preemption(step))

    # -- save ----------------------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, extra: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Saves when ``should_save(step)`` or ``force``; a step already on disk is skipped. Returns whether it saved.

        With ``async_save`` this returns once the arrays are off the device; the previous save is awaited first.
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self.all_steps() or step in self._manager.all_steps():  # committed, or still being written
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            extra=ocp.args.JsonSave(encode_extra(dict(extra or {}))),
            meta=ocp.args.JsonSave(self.model_fingerprint),
        )
        return bool(self._manager.save(step, args=args, force=True))

    def wait_until_finished(self) -> None:
        """Blocks until the in-flight async save is committed; raises if it failed."""
        self._manager.wait_until_finished()

    # -- restore -------------------------------------------------------------------------------------------------

    def check_fingerprint(self, step: int) -> None:
        """Raises ValueError when checkpoint ``step`` was saved for a different model architecture (and
        `_Unreadable` when its ``meta`` item cannot be read)."""
        try:
            saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
        except Exception as e:
            raise _Unreadable(_first_line(e)) from e
        diff = _fingerprint_diff(saved, self.model_fingerprint)
        if diff:
            raise ValueError(
                f"Checkpoint {self.directory / str(step)} was saved for a different model; differing fields: "
                + "; ".join(diff)
                + ". Use a fresh workdir for this model (or restore with the matching model config)."
            )

    def restore(self, step: int | None = None, abstract_state: Any = None) -> tuple[int, Any, dict[str, Any]]:
        """Returns (step, state, extra) of ``step`` (default: the latest committed step that can be read).

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (or arrays) with shardings; the arrays are
        read straight onto those shardings. Without it, orbax uses the shardings recorded at save time, which
        only works on the same device topology. Without ``step``, an unreadable newest checkpoint is moved
        aside (``<step>.corrupt``, with a warning that names the error) and the next newest is tried.
        """
        self.wait_until_finished()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"No committed checkpoint for step {step} under {self.directory}; "
                                        f"available steps: {steps}.")
            try:
                return self._restore_step(step, abstract_state)
            except _Unreadable as e:
                raise ValueError(f"Checkpoint {self.directory / str(step)} cannot be read: {e}") from None
        for candidate in reversed(steps):
            try:
                return self._restore_step(candidate, abstract_state)
            except _Unreadable as e:
                if _is_primary():
                    aside = self._set_aside(candidate, "corrupt")
                    _say(f"checkpoint: step {candidate} cannot be read ({e}); moved to {aside.name}, trying the "
                         "previous step")
                _sync(f"rollverify_checkpoint_{candidate}_set_aside")
                self._manager.reload()
        raise FileNotFoundError(f"No committed checkpoint under {self.directory}; nothing to restore.")

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the ``params`` of step's train state, read onto the shardings of ``abstract_params`` (a pytree of
        ``jax.ShapeDtypeStruct``): evaluation and export need neither the optimizer moments (twice the params'
        memory) nor the host state. Use a fresh Checkpointer: its ``state`` item is then read as a plain pytree."""
        self.wait_until_finished()
        if step not in self.all_steps():
            raise FileNotFoundError(f"No committed checkpoint for step {step} under {self.directory}; "
                                    f"available steps: {self.all_steps()}.")
        try:
            self.check_fingerprint(step)  # a ValueError naming the fields when it was saved for another model
        except _Unreadable as e:
            raise ValueError(f"Checkpoint {self.directory / str(step)} cannot be read: {e}") from None
        item = {"params": abstract_params}
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                                   dtype=a.dtype), item)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True)))
        except Exception as e:  # damaged files, or params of another shape
            raise ValueError(f"Could not read the params of {self.directory / str(step)}: {_first_line(e)}") from e
        return restored["state"]["params"]

    def _restore_step(self, step: int, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
        """One step's (step, state, extra); ValueError for a mismatch the user must fix, `_Unreadable` for a
        checkpoint whose files are damaged (orbax raises a bare Exception or FileNotFoundError then)."""
        self.check_fingerprint(step)
        state_args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
            else ocp.args.StandardRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=state_args,
                                                                             extra=ocp.args.JsonRestore()))
        except json.JSONDecodeError as e:
            raise _Unreadable(_first_line(e)) from e
        except ValueError as e:
            if _STORAGE_ERROR.search(str(e)):  # tensorstore reports damaged files as ValueErrors too
                raise _Unreadable(_first_line(e)) from e
            raise ValueError(f"Could not restore the state of {self.directory / str(step)} onto abstract_state "
                             f"(does the state tree, e.g. the optimizer, match the one saved?): {e}") from e
        except Exception as e:
            raise _Unreadable(_first_line(e)) from e
        return step, restored["state"], decode_extra(restored["extra"] or {})

    # -- lifetime ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the in-flight save, then releases orbax's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._manager.wait_until_finished()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# How tensorstore words a file it cannot read (a truncated or missing chunk, a bad manifest).
_STORAGE_ERROR = re.compile(r"OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|Error reading|Error opening")


class _Unreadable(Exception):
    """A checkpoint's files are damaged (truncated, missing): not the user's settings."""


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _is_primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    """Every process waits here until all have arrived (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
