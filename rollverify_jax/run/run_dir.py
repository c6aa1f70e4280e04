"""A training run's workdir: opening it (the one-launch lock, a fresh workdir removed again when the run cannot
start, the files that let a run be reproduced from it alone: ``spec.json``, the gin configs), the spec a finished
run is read back with, and what a failed write there means."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from etils import epath

from rollverify_jax.infra import distributed, spec_json, storage
from rollverify_jax.run import builder, checkpoint
from rollverify_jax.run.checkpoint import COMMIT_FILE
from rollverify_jax.run.metrics import save_operative_config
from rollverify_jax.run.spec import RunSpec, check_resume_settings, parse_gin
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
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a typo in a path, a read-only mount, a bucket without write access
        raise ValueError(f"cannot create the workdir {storage.absolute(workdir)} ({e.strerror or e}): pass "
                         "--workdir=<a directory you can write> or set TrainConfig.runs_root.") from e
    # Before anything touches the checkpoints: a second launch would remove this one's in-flight saves.
    lock = WorkdirLock.acquire(workdir)
    try:
        try:
            check_saved_spec(spec, workdir)  # before the weights load and the programs compile
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
    """The spec in effect as JSON (``spec.json``, read back by evaluate, export, simulate and the next launch's
    resume check) and as gin (every value in effect, and the config as parsed)."""
    spec, workdir = trainer.spec, trainer.workdir
    write_spec(workdir, spec)
    save_operative_config(workdir, spec.operative_text(), spec.gin_text)


def write_spec(workdir: storage.PathLike, spec: RunSpec) -> None:
    """``<workdir>/spec.json``, written atomically (a reader sees the last launch's or this one's) by the main
    process."""
    if distributed.is_main_process():
        storage.write_text_atomically(storage.as_path(workdir) / spec_json.SPEC_FILE, spec.to_json())


def read_spec(workdir: storage.PathLike) -> RunSpec:
    """The spec a training workdir's run started with (its ``spec.json``); a workdir from before it was written
    is one clear error."""
    path = storage.as_path(workdir) / spec_json.SPEC_FILE
    if not path.exists():
        raise FileNotFoundError(f"{storage.absolute(path)} does not exist: the run in {storage.absolute(workdir)} "
                                f"started before {spec_json.SPEC_FILE} was written (or never started); pass its "
                                "config, --gin_file=<workdir>/config.gin.")
    return RunSpec.from_json(path.read_text(), str(path))


def check_saved_spec(spec: RunSpec, workdir: storage.PathLike) -> None:
    """A resume refused before anything is built: the settings of the workdir's ``spec.json`` (its last launch's)
    against ``spec``'s, the same refusal as the checkpoint's (``check_resume_settings``), which still follows in
    full once the checkpoint is restored (with the data's and the tokenizer's hashes). Only a workdir with a
    committed checkpoint is checked; ``allow_changed_settings`` leaves the listing to that second check."""
    path = storage.as_path(workdir) / spec_json.SPEC_FILE
    if spec.train.allow_changed_settings or latest_committed_step(workdir) is None or not path.exists():
        return
    try:
        saved = RunSpec.from_json(path.read_text(), str(path)).settings()
    except (TypeError, ValueError):  # written by another version of the code: the checkpoint's check decides
        return
    check_resume_settings(saved, spec.settings(), allow=False, source=spec_json.SPEC_FILE,
                          report_execution=False)


def complete_step(spec: RunSpec, workdir: storage.PathLike) -> int | None:
    """The step of the workdir's checkpoint at ``TrainConfig.num_steps`` (or past it) when it is whole and this
    run's, so there is nothing to train; None when the run must be built: no such checkpoint, or one whose files
    are not whole (the resume then sets it aside and redoes it). Another model or other run-defining settings are
    refused as a resume refuses them, and changed execution settings reported (``check_resume_settings``).

    It reads the checkpoint listing, the step's JSON items (settings, model fingerprint), its OCDBT tree and one
    byte per data file (``checkpoint.step_damage``), ``spec.json``, the policy's config.json, the tokenizer and
    the train data (``builder.resume_settings``): no model is built, nothing compiled, no array restored."""
    done = latest_committed_step(workdir)
    if done is None or done < spec.train.num_steps:
        return None
    step_dir = storage.as_path(workdir) / "checkpoints" / str(done)
    problem = checkpoint.step_damage(step_dir)
    if distributed.gather_ints([problem is not None]).any():  # every host builds the run, or none does
        print(f"checkpoint step {done} is not whole ({problem or 'another process found it damaged'}): the run "
              "resumes to set it aside and redo it.", flush=True)
        return None
    check_saved_spec(spec, workdir)  # the last launch's spec.json, as before a resume
    fingerprint, settings = builder.resume_settings(spec)
    checkpoint.check_fingerprint(step_dir, checkpoint.read_json_item(step_dir, "meta") or {}, fingerprint)
    extra = checkpoint.decode_extra(checkpoint.read_json_item(step_dir, "extra") or {})
    check_resume_settings(extra.get("settings", {}), settings, allow=spec.train.allow_changed_settings)
    return done


def run_spec(checkpoint: storage.PathLike, gin_files: list[str], gin_params: list[str]) -> RunSpec:
    """The spec a tool reads a checkpoint with: the gin files and bindings when files are given; else, for a
    training workdir (or one of its ``checkpoints/<step>``), its ``spec.json`` with ``gin_params`` bound on top;
    else (an HF-layout policy directory) the defaults and ``gin_params``."""
    checkpoint = storage.as_path(checkpoint)
    if gin_files or (checkpoint / "config.json").exists():
        parse_gin(gin_files, gin_params)
        return RunSpec.from_gin()
    root, _ = builder.resolve_checkpoint(checkpoint)  # a mistyped path fails here, before the spec is read
    return read_spec(root).with_bindings(gin_params)


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
