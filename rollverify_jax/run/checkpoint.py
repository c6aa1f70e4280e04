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

Storage: ``workdir`` is any ``etils.epath`` path (``rollverify_jax.infra.storage``), e.g. ``gs://bucket/runs/x``. Every
host reads and writes the same directory, so on several hosts it must be a filesystem they all share (a
``gs://`` bucket, NFS, Lustre), never each host's local disk. On ``gs://`` orbax commits a step by writing
``commit_success.txt`` into it (no tmp directory, no rename); the commit-file checks below cover that too.
Only process 0 moves a damaged or uncommitted step aside (every host waits for it), so hosts never race to
rename the same directory.

Faults met on resume, none deleting a user's data silently:

- an interrupted save (a ``<step>.orbax-checkpoint-tmp-*`` directory) is removed by orbax, and a bare ``<step>``
  directory without its commit file is moved aside to ``<step>.uncommitted`` before the manager lists steps
  (otherwise orbax counts the step as saved and never saves it again); one line says what was cleaned up and
  which step the run resumes from;
- a committed checkpoint is moved aside to ``<step>.corrupt`` only on positive evidence that its files are
  damaged (``_damage_evidence``: a missing item or JSON file, JSON that does not parse, a missing manifest, a
  chunk tensorstore finds truncated or undecodable, a chunk file it names that is gone from a directory that is
  there), with a warning naming it; the restore then falls back to the next newest committed step;
- any other error (permissions, storage unavailable, out of device memory, a state of another shape) stops the
  run with one message naming the step and the error (``RestoreError``), and moves nothing: set aside on such
  an error, every good checkpoint would go the same way and the next start would begin at step 0.

On several hosts each host's outcome is all-gathered before anything moves: an error on any host stops every
host, and a step is set aside only when no host met an error and some host found it damaged. (A chunk that only
one host reads is an exception in practice: the other hosts wait in orbax's restore barrier until it times out,
which they report as an error, so such damage stops the run instead of being set aside.)
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rollverify_jax.infra import distributed, storage

COMMIT_FILE = "commit_success.txt"
ITEM_NAMES = ("state", "extra", "meta")
_ARRAY_TAG = "__ndarray__"
SET_ASIDE = ("corrupt", "uncommitted")  # <step>.<why> directories: kept, out of orbax's step list


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Gin-tunable checkpoint policy (`CheckpointConfig.save_interval_steps = 50`).

    `async_save` writes to disk in a background thread after the arrays are copied off the device, so training
    continues during the write; `Checkpointer.close()` (or `wait_until_finished()`) waits for it.
    """

    save_interval_steps: int = 50  # a checkpoint every N steps (and always at the last step and at a stop)
    max_to_keep: int | None = 3  # newest checkpoints kept (None: all)
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


# Fingerprint entries kept for the record, not compared: where an adapter run's base was read (a moved copy of the
# same weights, whose hash is compared, resumes).
_RECORD_ONLY = frozenset({"lora_base_path"})


def _fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    missing = "<absent>"
    return [f"{k}: checkpoint={saved.get(k, missing)!r}, current={current.get(k, missing)!r}"
            for k in sorted(set(saved) | set(current) - _RECORD_ONLY)
            if saved.get(k, missing) != current.get(k, missing)]


class RestoreError(ValueError):
    """A committed checkpoint could not be restored, and its files show no damage (permissions, storage, device
    memory): the run stops with this one message (a ValueError: the CLI's ``error:`` line, exit 2) and the
    checkpoint stays where it is."""


class FingerprintMismatch(ValueError):
    """The checkpoint was saved for another model architecture."""


def check_fingerprint(step_dir: epath.Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raises FingerprintMismatch naming every differing field when checkpoint ``step_dir``'s model fingerprint
    (its ``meta`` item) is not ``current``."""
    diff = _fingerprint_diff(saved, current)
    if diff:
        raise FingerprintMismatch(
            f"Checkpoint {step_dir} was saved for a different model; differing fields: " + "; ".join(diff)
            + ". Use a fresh workdir for this model (or restore with the matching model config).")


def read_json_item(step_dir: storage.PathLike, item: str) -> Any:
    """A JSON item (``extra``, ``meta``) of a committed step as orbax's ``JsonSave`` wrote it, read as plain JSON
    (no orbax manager, no arrays)."""
    return json.loads((storage.as_path(step_dir) / item / "metadata").read_text())


def file_damage(step_dir: epath.Path) -> str | None:
    """What a committed step's files show to be damaged without reading an array: a missing item, a missing or
    unparsable JSON item, a missing OCDBT manifest. Raises what the storage raises when they cannot be looked at."""
    for item in ITEM_NAMES:
        if not (step_dir / item).is_dir():
            return f"its {item!r} item is missing"
    for name in ("extra/metadata", "meta/metadata", "state/_METADATA"):
        path = step_dir / name
        if not path.exists():
            if name.startswith("state"):  # orbax restores without it
                continue
            return f"{name} is missing"
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{name} is not valid JSON"
    state = step_dir / "state"
    if ((state / "d").is_dir() or any(state.glob("ocdbt.process_*"))) and not (state / "manifest.ocdbt").exists():
        return "state/manifest.ocdbt is missing"
    return None


def _missing_file(error: BaseException, step_dir: epath.Path) -> str | None:
    """A NOT_FOUND error naming a file of ``step_dir`` that is gone from a directory that is there: damage."""
    if _status_code(error) != "NOT_FOUND":
        return None
    for named in _QUOTED.findall(str(error)):
        path = storage.as_path(named)
        if named.startswith(str(step_dir)) and not path.exists() and path.parent.is_dir():
            return f"{named[len(str(step_dir)) + 1:]} is missing"
    return None


def _kvstore_url(path: epath.Path) -> str:
    text = str(path).rstrip("/") + "/"
    return text if "://" in text else f"file://{storage.absolute(path)}/"


def array_damage(step_dir: epath.Path) -> str | None:
    """What the ``state`` item's OCDBT database shows to be damaged without reading an array: a B+tree node that
    does not decode, or a value it references in a data file that is gone or shorter than the reference. Reads
    the manifest and the tree's nodes (keys and small inline values: kilobytes), and one byte per data file, at
    the end of the last value the tree places there. Raises what the storage raises that is not damage."""
    import tensorstore as ts

    state = step_dir / "state"
    if not (state / "manifest.ocdbt").exists():
        return None  # no OCDBT database (another layout): the file checks are all there is
    kv = ts.KvStore.open(_kvstore_url(state)).result()
    try:
        versions = ts.ocdbt.dump(kv).result().get("versions") or []
        latest = max(versions, key=lambda v: v["generation_number"])["root"] if versions else {}
        pending = [latest["location"]] if "location" in latest else []
        ends: dict[str, int] = {}  # data file -> end of the last value referenced there
        while pending:
            for entry in ts.ocdbt.dump(kv, pending.pop()).result().get("entries", ()):
                if "location" in entry:  # an interior node's child
                    pending.append(entry["location"])
                if "indirect_value" in entry:  # value:<base>:<relative path>:<offset>:<length>
                    where, offset, length = entry["indirect_value"].split(":", 1)[1].rsplit(":", 2)
                    name = where.replace(":", "", 1)
                    ends[name] = max(ends.get(name, 0), int(offset) + int(length))
    except ValueError as e:
        if _status_code(e) in _DAMAGE_CODES:
            return f"state's OCDBT tree does not decode ({_first_line(e)})"
        missing = _missing_file(e, step_dir)
        if missing:
            return missing
        raise
    for name, end in sorted(ends.items()):
        try:
            read = kv.read(name, byte_range=slice(max(end - 1, 0), end)).result()
        except ValueError as e:
            if _status_code(e) in _DAMAGE_CODES:
                return f"state/{name} is shorter than the {end} bytes its OCDBT tree references"
            raise
        if read.state == "missing":
            return f"state/{name} is missing"
    return None


def step_damage(step_dir: storage.PathLike) -> str | None:
    """Why committed step ``step_dir`` cannot be taken as whole without restoring it, or None when it is: the
    damage its files show (``file_damage``, ``array_damage``), or an error reading them (then a restore decides
    whether it is damage). What the "run complete" check reads; no orbax manager, no array read."""
    step_dir = storage.as_path(step_dir)
    try:
        if not (step_dir / COMMIT_FILE).exists():
            return f"{COMMIT_FILE} is missing"
        return file_damage(step_dir) or array_damage(step_dir)
    except Exception as e:  # noqa: BLE001  (storage errors: the restore path says what they are)
        return f"its files could not be read ({_first_line(e)})"


# Outcomes of one restore attempt on one host, all-gathered before anything moves: an error on any host stops
# every host, else damage seen by any host sets the step aside.
_RESTORED, _DAMAGED, _FAILED = 0, 1, 2


class Checkpointer:
    """Saves and restores (state, extra) under ``<workdir>/checkpoints``; every host calls every method."""

    def __init__(self, workdir: storage.PathLike, config: CheckpointConfig = CheckpointConfig(),
                 model_fingerprint: Mapping[str, Any] | None = None, read_only: bool = False):
        """``read_only`` (evaluation, export): creates, removes and moves nothing on disk, so a reader never
        deletes the in-flight save of a run that is still training, nor makes a directory for a mistyped path."""
        self.config = config
        self.directory = storage.absolute(workdir) / "checkpoints"
        # Normalised through JSON (tuples -> lists) so it compares equal to what a restore reads back.
        self.model_fingerprint: dict[str, Any] = json.loads(json.dumps(encode_extra(dict(model_fingerprint or {}),
                                                                                    "model_fingerprint")))
        self.cleaned_up: list[str] = []  # interrupted saves found on disk, said with the step the run resumes from
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
        """Notes each save that never committed, and moves bare uncommitted step directories aside (process 0
        does; the others wait for it, so every host then lists the same steps)."""
        if _is_primary():
            self._move_uncommitted_aside()
        _sync("rollverify_checkpoint_scanned")

    def _move_uncommitted_aside(self) -> None:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if ".orbax-checkpoint-tmp" in path.name:
                self.cleaned_up.append(f"removed {path.name} (a save interrupted before it committed)")
            elif path.is_dir() and path.name.isdigit() and not (path / COMMIT_FILE).exists():
                aside = self._set_aside(int(path.name), "uncommitted")
                self.cleaned_up.append(f"moved step {path.name} to {aside.name} (no {COMMIT_FILE}: never committed)")

    def say_cleanup(self, resume_step: int | None) -> None:
        """One line (process 0): the interrupted saves found on disk and the step the run resumes from."""
        if self.cleaned_up and _is_primary():
            where = f"resuming from step {resume_step}" if resume_step is not None else "starting at step 0"
            _say(f"checkpoint: {'; '.join(self.cleaned_up)}; {where}")
        self.cleaned_up = []

    def set_aside_steps(self) -> list[str]:
        """Names of the step directories set aside (``<step>.corrupt``, ``<step>.uncommitted``, ...)."""
        if not self.directory.is_dir():
            return []
        return sorted(p.name for p in self.directory.iterdir()
                      if p.name.split(".")[0].isdigit() and p.name.partition(".")[2].startswith(SET_ASIDE))

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
        """Raises FingerprintMismatch (a ValueError) when checkpoint ``step`` was saved for a different model
        architecture; whatever orbax raises when its ``meta`` item cannot be read."""
        saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
        check_fingerprint(self.directory / str(step), saved, self.model_fingerprint)

    def restore(self, step: int | None = None, abstract_state: Any = None) -> tuple[int, Any, dict[str, Any]]:
        """Returns (step, state, extra) of ``step`` (default: the latest committed step that can be read).

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (or arrays) with shardings; the arrays are
        read straight onto those shardings. Without it, orbax uses the shardings recorded at save time, which
        only works on the same device topology. Without ``step``, see ``restore_newest``; a step asked for by
        number is never moved.
        """
        if step is None:
            restored = self.restore_newest(abstract_state)
            if restored is None:
                raise FileNotFoundError(f"No committed checkpoint under {self.directory}; nothing to restore.")
            return restored
        self.wait_until_finished()
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(f"No committed checkpoint for step {step} under {self.directory}; "
                                    f"available steps: {steps}.")
        outcome, value = self._agreed_attempt(step, abstract_state)
        if outcome == _DAMAGED:
            raise ValueError(f"Checkpoint {self.directory / str(step)} cannot be read: {value}")
        return value

    def restore_newest(self, abstract_state: Any = None) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, extra) of the newest committed step that restores, or None when none does (no step
        committed, or every one damaged). A damaged step is moved aside (``<step>.corrupt``, with a warning
        naming the damage) and the next newest is tried; any other error raises (``RestoreError``, or the
        ValueError of a fingerprint or state-tree mismatch) and moves nothing."""
        self.wait_until_finished()
        for candidate in reversed(self.all_steps()):
            outcome, value = self._agreed_attempt(candidate, abstract_state)
            if outcome == _RESTORED:
                self.say_cleanup(candidate)
                return value
            if _is_primary():
                aside = self._set_aside(candidate, "corrupt")
                _say(f"checkpoint: step {candidate} cannot be read ({value}); moved to {aside.name}, trying the "
                     "previous step")
            _sync(f"rollverify_checkpoint_{candidate}_set_aside")
            self._manager.reload()
        return None

    def _agreed_attempt(self, step: int, abstract_state: Any) -> tuple[int, Any]:
        """(_RESTORED, (step, state, extra)) or (_DAMAGED, what shows the damage), decided alike on every host;
        raises the error when any host met one that is not damage (nothing is moved then)."""
        try:
            outcome, value = _RESTORED, self._restore_step(step, abstract_state)
        except Exception as e:  # noqa: BLE001  (classified below: damage, or an error that stops the run)
            evidence = self._damage_evidence(step, e)
            outcome, value = (_DAMAGED, f"{evidence}; {_first_line(e)}") if evidence else (_FAILED, e)
        every = distributed.gather_ints([outcome])[:, 0]
        if outcome == _FAILED:
            failure = self._failure(step, value)
            if failure is value:
                raise value
            raise failure from value
        if (every == _FAILED).any():
            failed = [int(i) for i in np.flatnonzero(every == _FAILED)]
            raise RestoreError(f"Checkpoint {self.directory / str(step)} could not be restored on process(es) "
                               f"{failed} (their log names the error); nothing was moved. Fix the cause and run "
                               "the same command again.")
        if outcome == _RESTORED and (every == _DAMAGED).any():
            damaged = [int(i) for i in np.flatnonzero(every == _DAMAGED)]
            return _DAMAGED, f"process(es) {damaged} found it damaged"
        return outcome, value

    def _failure(self, step: int, e: Exception) -> Exception:
        """The one message of a restore error that is not damage: a mismatch the user must fix, or the error."""
        where = self.directory / str(step)
        if isinstance(e, FingerprintMismatch):
            return e
        if isinstance(e, ValueError) and _status_code(e) is None and _TREE_MISMATCH.search(str(e)):
            return ValueError(f"Could not restore the state of {where} onto abstract_state (does the state tree, "
                              f"e.g. the optimizer, match the one saved?): {e}")
        return RestoreError(f"Checkpoint {where} could not be restored: {_first_line(e)}. Its files show no damage, "
                            "so nothing was moved: fix the cause (permissions, storage, device memory) and run the "
                            "same command again.")

    def _damage_evidence(self, step: int, error: Exception) -> str | None:
        """What the step's own files show to be damaged, or None when they show nothing (then the error is the
        storage's, the machine's or the settings', and the step must stay where it is)."""
        step_dir = self.directory / str(step)
        try:
            if not (step_dir / COMMIT_FILE).exists():
                return None  # the step itself cannot be seen now: storage, not damage
            evidence = file_damage(step_dir)
            if evidence:
                return evidence
            code = _status_code(error)
            if code in _DAMAGE_CODES:
                return f"tensorstore reports {code}"
            missing = _missing_file(error, step_dir)
            if missing:
                return missing
            # orbax wraps an array's read error without tensorstore's status code: the tree's references decide.
            return array_damage(step_dir)
        except Exception:  # noqa: BLE001  (the files cannot even be looked at: no evidence of damage)
            return None

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
        except FingerprintMismatch:
            raise
        except Exception as e:
            raise ValueError(f"Checkpoint {self.directory / str(step)} cannot be read: {_first_line(e)}") from None
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
        """One step's (step, state, extra); raises whatever the fingerprint check or orbax raises."""
        self.check_fingerprint(step)
        state_args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
            else ocp.args.StandardRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(state=state_args,
                                                                         extra=ocp.args.JsonRestore()))
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


# tensorstore's errors begin with an absl status code. DATA_LOSS (bytes that do not decode) and OUT_OF_RANGE (a file
# shorter than its manifest says) are about the files themselves; NOT_FOUND is damage only when the file it names
# is confirmed missing (an unreachable bucket or an unmounted disk says NOT_FOUND too), and every other code
# (PERMISSION_DENIED, UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...) is never damage.
# orbax writes a replicated array in slices, one per replica (replica-parallel saving), and each slice is a small
# compiled program: one per array shape and replica. Below 1 MiB a slice saves no time worth its compile, so
# smaller arrays are written whole by one replica (run/shape_plan.py counts the slices that remain).
REPLICA_SLICE_MIN_BYTES = 1 << 20


def _register_array_handler() -> None:
    """orbax's default jax.Array handler (its metadata store keeps typed PRNG keys' dtype), with the slice floor."""
    from orbax.checkpoint._src.metadata import array_metadata_store  # what orbax's own default handler holds

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that it overrides its own default handler: expected here
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(),
            min_slice_bytes_for_replica_parallel=REPLICA_SLICE_MIN_BYTES), override=True)
    finally:
        absl.setLevel(level)


_register_array_handler()

_STATUS_CODE = re.compile(r"^([A-Z][A-Z_]+): ")
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE")
_QUOTED = re.compile(r'"([^"]+)"')
# How orbax words a target state that does not fit the saved one (another optimizer, shape or dtype).
_TREE_MISMATCH = re.compile(r"tree structure|shape|dtype", re.IGNORECASE)


def _status_code(e: Exception) -> str | None:
    match = _STATUS_CODE.match(str(e))
    return match.group(1) if match else None


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
