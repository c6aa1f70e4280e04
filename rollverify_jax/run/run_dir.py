"""A training run's workdir: opening it (the one-launch lock, a fresh workdir removed again when the run cannot
start, the files that let a run be reproduced from it alone) and what a failed write there means."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

from etils import epath

from rollverify_jax.infra import distributed, storage
from rollverify_jax.run import builder
from rollverify_jax.run.checkpoint import COMMIT_FILE
from rollverify_jax.run.metrics import save_operative_config
from rollverify_jax.run.spec import RunSpec
from rollverify_jax.run.trainer import Trainer
from rollverify_jax.run.workdir_lock import WorkdirLock


def resolve(spec: RunSpec, workdir: str | None, gin_files: list[str]) -> epath.Path:
    """``--workdir``, else ``runs_root/run_name`` (default name: the first gin file's stem); printed absolute."""
    path = storage.as_path(workdir) if workdir else spec.workdir(gin_files)
    print(f"workdir: {storage.absolute(path)}")
    return path


@contextlib.contextmanager
def open_trainer(spec: RunSpec, workdir: storage.PathLike) -> Iterator[Trainer]:
    """The run's ``Trainer``, with the workdir locked for this launch until the block ends. A configuration error
    while building leaves no half-made workdir behind."""
    workdir = storage.as_path(workdir)
    fresh = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    # Before anything touches the checkpoints: a second launch would remove this one's in-flight saves.
    lock = WorkdirLock.acquire(workdir)
    try:
        try:
            trainer = builder.build_trainer(spec, workdir)
        except BaseException:
            if fresh:
                lock.release()
                storage.remove_tree(workdir)
            raise
        write_run_files(trainer)
        try:
            yield trainer
        finally:
            trainer.close()
    finally:
        lock.release()


def write_run_files(trainer: Trainer) -> None:
    """The gin config as parsed and every value in effect, and the policy the run started from."""
    spec, workdir = trainer.spec, trainer.workdir
    save_operative_config(workdir, spec.operative_text(), spec.gin_text)
    if distributed.is_main_process():
        (workdir / "policy.txt").write_text(json.dumps({"policy_path": spec.train.policy_path}) + "\n")


def committed_steps(workdir: storage.PathLike) -> list[int]:
    """The steps under ``<workdir>/checkpoints`` with their commit file, read from the listing alone (no orbax)."""
    root = storage.as_path(workdir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / COMMIT_FILE).exists())


def latest_committed_step(workdir: storage.PathLike) -> int | None:
    steps = committed_steps(workdir)
    return steps[-1] if steps else None


def _error_files(e: OSError) -> list[str]:
    return [os.fsdecode(n) for n in (e.filename, e.filename2) if isinstance(n, str | bytes | os.PathLike)]


def is_workdir_error(e: OSError, workdir: epath.Path) -> bool:
    """Whether an OSError is the workdir's (a full or unwritable disk): it names a file there, or none at all
    (orbax and tensorstore name none at save time). One that names another file is an input's."""
    files = _error_files(e)
    return not files or any(storage.is_within(f, workdir) for f in files)


def explain_os_error(e: OSError, workdir: epath.Path) -> None:
    """An OSError that ended a run, said as what it is: a missing input file re-raised (the CLI's usual one-line
    error), another input's error as a ValueError naming it, the workdir's (a full or unwritable disk) as one
    message naming the checkpoints already committed, exit status 2."""
    if isinstance(e, FileNotFoundError):
        raise e
    if not is_workdir_error(e, workdir):  # e.g. an unreadable data file: said as it is, not as a full disk
        raise ValueError(f"cannot use {_error_files(e)[0]}: {e.strerror or e}. It is one of the run's inputs "
                         f"(data, policy, tokenizer), not its workdir {storage.absolute(workdir)}: check the "
                         "path and its permissions.") from e
    committed = committed_steps(workdir)
    kept = f"The committed checkpoints are intact (latest: step {committed[-1]})" if committed else \
        "No checkpoint was committed yet"
    print(f"error: could not write to {storage.absolute(workdir)}: {e}. {kept}; free space or fix the permissions, "
          "then run the same command to resume.", file=sys.stderr, flush=True)
    raise SystemExit(2)
