"""One training launch per workdir: a lock file, ``<workdir>/run.lock``, taken by process 0 before anything touches
the checkpoints.

Two launches in one workdir would each clean up what they take for the other's leftovers (orbax removes every
``<step>.orbax-checkpoint-tmp`` directory it finds: the other launch's save in flight) and write the same steps.
The lock records who holds it (pid, host, start time, the command, the SLURM job); a second launch refuses with
one line naming the holder. A lock whose holder is gone is taken over with a warning, when that can be known:
a dead pid on this host (or a pid reused by a process that started after the lock was taken, or this very pid:
a restarted container), or an earlier run of the same SLURM job (a requeue, which may land on another node).
A lock held from another host cannot be checked from here: remove the file once that process is gone.

On a local or shared filesystem the file is created exclusively (``O_EXCL``), so two launches at the same moment
cannot both take it. An object store (``gs://``) has no exclusive create: there the check and the write are two
steps, and only launches seconds apart are told apart.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from etils import epath

from rollverify_jax.infra import distributed, storage

LOCK_FILE = "run.lock"


def _holder() -> dict[str, Any]:
    """What this process writes into the lock: enough to tell who holds it and whether that process is alive."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(sys.argv), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0")}


def _process_start_time(pid: int) -> tuple[float, str] | None:
    """(start time as Unix time, state letter) of a live process from /proc (Linux); None elsewhere."""
    try:
        stat = epath.Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in epath.Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, StopIteration, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK"), fields[0]


def stale_reason(holder: dict[str, Any]) -> str | None:
    """Why the process that wrote ``holder`` no longer holds the lock, or None when it may still run."""
    mine = _holder()
    if holder.get("slurm_job_id") and holder["slurm_job_id"] == mine["slurm_job_id"] \
            and holder.get("slurm_restart_count") != mine["slurm_restart_count"]:
        return f"it was an earlier run of this SLURM job ({mine['slurm_job_id']}, requeued)"
    if holder.get("host") != mine["host"]:
        return None  # another host's process cannot be checked from here
    pid = int(holder.get("pid", -1))
    if pid == os.getpid():
        return f"process {pid} is this process (the holder was an earlier process, e.g. before a container restart)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is not running"
    except PermissionError:
        pass  # alive, another user's
    started = _process_start_time(pid)
    if started is not None:
        if started[1] in "ZX":
            return f"process {pid} has exited"
        if started[0] > float(holder.get("started", 0)) + 1.0:
            return f"pid {pid} now belongs to a process started after the lock was taken"
    return None


def _describe(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_utc')}"
            + (f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else "")
            + (f" ({holder.get('command')})" if holder.get("command") else ""))


class WorkdirLock:
    """The lock of one launch; ``release`` removes it if this launch still holds it. Every process calls
    ``acquire`` and ``release`` (only process 0 touches the file; the others learn its outcome)."""

    def __init__(self, path: epath.Path, holder: dict[str, Any] | None):
        self.path, self.holder = path, holder

    @classmethod
    def acquire(cls, workdir: storage.PathLike) -> WorkdirLock:
        """Takes ``<workdir>/run.lock``, or raises ValueError (the CLI's one line, exit 2) naming the launch that
        holds it; every process gets the same outcome."""
        path = storage.as_path(workdir) / LOCK_FILE
        refusal, holder = None, None
        if distributed.is_main_process():
            try:
                holder = _take(path)
            except ValueError as e:
                refusal = e
        if distributed.gather_ints([refusal is not None])[0, 0]:
            raise refusal or ValueError(f"process 0 could not take the lock {storage.absolute(path)}: another "
                                        "launch is using this workdir (see process 0's log).")
        return cls(path, holder)

    def release(self) -> None:
        """Removes the lock file if it is still this launch's (idempotent; never raises)."""
        if self.holder is None:
            return
        holder, self.holder = self.holder, None
        try:
            if _read(self.path) == holder:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _read(path: epath.Path) -> dict[str, Any] | None:
    """The holder recorded in a lock file; None when there is no file. A file being written reads as empty."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _take(path: epath.Path) -> dict[str, Any]:
    """Creates the lock file for this process (taking over a stale one with a warning); ValueError if held."""
    for _ in range(2):  # a stale lock is removed once, then created again
        holder = _holder()
        if _create_exclusively(path, json.dumps(holder) + "\n"):
            return holder
        current = _read(path)
        if current is None:  # released between the two calls
            continue
        reason = stale_reason(current) if current else None
        where = storage.absolute(path)
        if reason is None:
            who = _describe(current) if current else "a launch that is writing it now"
            raise ValueError(f"{where.parent} is in use by another launch ({who}): two runs in one workdir delete "
                             f"each other's checkpoints. Wait for it to end or stop it; if it is gone (its host "
                             f"died), remove {where} and run again.")
        print(f"warning: taking over the lock {where} of {_describe(current)}: {reason}.", file=sys.stderr,
              flush=True)
        _remove_if_unchanged(path, current)
    raise ValueError(f"could not take the lock {storage.absolute(path)}: another launch took it at the same time.")


def _remove_if_unchanged(path: epath.Path, stale: dict[str, Any]) -> None:
    """Removes the stale lock, unless another launch replaced it meanwhile (two launches taking over the same
    stale lock): the file is first renamed (only one launch can move it), then checked."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return  # the other launch moved it first; the exclusive create decides between us
    moved = _read(aside)
    if moved != stale and moved is not None:  # a fresh lock of a launch that took over first: put it back
        _create_exclusively(path, json.dumps(moved) + "\n")
    aside.unlink(missing_ok=True)


def _create_exclusively(path: epath.Path, text: str) -> bool:
    """Writes ``text`` to a new file; False if the file exists. Exclusive on a mounted filesystem; on an object
    store a check, then one object write."""
    if not storage.is_local(path):
        if path.exists():
            return False
        path.write_text(text)
        return True
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True
