"""One training launch per workdir: a lock file, ``<workdir>/run.lock``, taken by process 0 before anything touches
the checkpoints.

Two launches in one workdir would each clean up what they take for the other's leftovers (orbax removes every
``<step>.orbax-checkpoint-tmp`` directory it finds: the other launch's save in flight) and write the same steps.
The lock records who holds it (pid, host, start time, the command, the SLURM job); a second launch refuses with
one line naming the holder. A lock whose holder is gone is taken over with a warning, when that can be known:
a dead pid on this host (or a pid reused by a process that started after the lock was taken, or this very pid:
a restarted container), or an earlier run of the same SLURM job (a requeue, which may land on another node).
A lock held from another host cannot be checked from here: remove the file once that process is gone.

What holds on a local or shared POSIX filesystem (NFS included): a lock is written to a temporary file and
hard-linked into place, so it is created exclusively and a reader never sees it half-written; two launches at
the same moment cannot both take a free lock, and launches taking over the same stale lock at once are
serialised by an exclusively created takeover marker (``_take_over``), so exactly one of them (or a launch that
found no lock at all) ends up holding it. A lock that does not parse was damaged (cut short, edited): it is
refused with how to clear it, never taken over blindly. What does not hold: an object store (``gs://``) has no
exclusive create, so there the check and the write are two steps, for the lock and the marker alike, and only
launches seconds apart are told apart; and a takeover is only as right as ``stale_reason`` (a holder on another
host is taken for gone only when it was an earlier run of this SLURM job).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import secrets
import socket
import sys
import time
from typing import Any

from etils import epath

from rollverify_jax.infra import storage

LOCK_FILE = "run.lock"
_ATTEMPTS = 5  # creations tried: a stale lock taken over, or a lock released while read, costs one
_REREADS = 10  # reads of a lock that does not parse, 0.05 s apart


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
        from rollverify_jax.infra import distributed  # here: the lock's own functions run without JAX

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
            read = _read(self.path)
            if read is not None and read[1] == holder:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _read_text(path: epath.Path) -> str | None:
    """A lock file's text; None when there is no file."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _parse(text: str) -> dict[str, Any] | None:
    """The holder a lock's text records; None when it is not a holder (a damaged file)."""
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) and "pid" in holder and "host" in holder else None


def _read(path: epath.Path) -> tuple[str, dict[str, Any] | None] | None:
    """(text, holder) of a lock file, holder None when the text records none; None when there is no file. Locks
    are written whole (``_create_exclusively``), so a text that does not parse is damaged: it is read again for
    up to half a second first, in case a filesystem without hard links made the writer fall back to writing the
    file in place."""
    for _ in range(_REREADS):
        text = _read_text(path)
        if text is None:
            return None
        holder = _parse(text)
        if holder is not None:
            return text, holder
        time.sleep(0.05)
    return text, None


def _take(path: epath.Path) -> dict[str, Any]:
    """Creates the lock file for this process (taking over a stale one with a warning); ValueError if held."""
    where = storage.absolute(path)
    for _ in range(_ATTEMPTS):
        holder = _holder()
        if _create_exclusively(path, json.dumps(holder) + "\n"):
            _remove_leftovers(path)
            return holder
        read = _read(path)
        if read is None:  # released between the two calls
            continue
        text, current = read
        if current is None:
            raise ValueError(f"{where} is damaged (it records no launch: {text[:80]!r}); a launch writes its lock "
                             f"whole, so this one was cut short or edited. If no other launch is using "
                             f"{where.parent}, remove {where} and run again.")
        reason = stale_reason(current)
        if reason is None:
            raise ValueError(f"{where.parent} is in use by another launch ({_describe(current)}): two runs in one "
                             f"workdir delete each other's checkpoints. Wait for it to end or stop it; if it is gone "
                             f"(its host died), remove {where} and run again.")
        _take_over(path, text, current, reason)
    raise ValueError(f"could not take the lock {where}: other launches took it and released it while this one "
                     "tried; run again.")


def _take_over(path: epath.Path, text: str, stale: dict[str, Any], reason: str) -> None:
    """Removes the stale lock whose contents are ``text``, unless another launch replaced it meanwhile; the caller
    then creates its own exclusively (a fresh launch may win that, and is then the one holder).

    Launches taking over the same stale lock at once are serialised by a takeover marker,
    ``run.lock.takeover-<hash of text>.<n>``, created exclusively: only its creator removes the lock, after it read
    it again and found ``text`` (a lock's text names its pid, host and start time, so it never comes back once
    gone). A marker whose creator died is passed over by creating the next ``n``; one whose creator lives means
    that launch is taking over now, and this one is refused. Renaming the lock aside instead left a moment with
    no lock, in which a third launch took it while the second put back the first's: two holders."""
    where = storage.absolute(path)
    passed: list[epath.Path] = []  # markers of dead creators
    for n in itertools.count(1):
        marker = _marker(path, text, n)
        if _create_exclusively(marker, json.dumps(_holder()) + "\n", durable=False):
            break
        read = _read(marker)
        if read is None:  # its creator is done: the caller looks at the lock again
            return
        other = read[1]  # None: a damaged marker, passed over like a dead creator's
        if other is not None and stale_reason(other) is None:
            raise ValueError(f"{where.parent} is being taken over by another launch ({_describe(other)}) from the "
                             f"stale lock of {_describe(stale)}: two runs in one workdir delete each other's "
                             "checkpoints.")
        passed.append(marker)
    try:
        if _read_text(path) == text:
            print(f"warning: taking over the lock {where} of {_describe(stale)}: {reason}.", file=sys.stderr,
                  flush=True)
            path.unlink(missing_ok=True)
        # The stale lock is gone for good: no launch needs its markers. (Not before: a dead creator's marker
        # removed while the lock is still there would let a second launch in beside this one's successor.)
        for dead in passed:
            dead.unlink(missing_ok=True)
    finally:
        marker.unlink(missing_ok=True)


def _marker(path: epath.Path, text: str, n: int) -> epath.Path:
    """The ``n``-th takeover marker of the lock whose contents are ``text``."""
    return path.with_name(f"{LOCK_FILE}.takeover-{hashlib.sha256(text.encode()).hexdigest()[:16]}.{n}")


def _remove_leftovers(path: epath.Path) -> None:
    """Removes what launches killed while taking the lock left beside it: takeover markers (their stale lock is
    gone: this launch's lock replaced it) and temporary files of dead processes on this host."""
    if not storage.is_local(path):
        return
    host = _host_tag()
    for leftover in path.parent.glob(f"{LOCK_FILE}.*"):
        name = leftover.name[len(LOCK_FILE) + 1:]
        if name.startswith("takeover-"):
            leftover.unlink(missing_ok=True)
        elif name.startswith(f"tmp-{host}-"):
            pid = name.split("-")[2]
            if pid.isdigit() and not _alive(int(pid)):
                leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _create_exclusively(path: epath.Path, text: str, durable: bool = True) -> bool:
    """Writes ``text`` to a new file; False if the file exists. On a mounted filesystem the text is written to a
    temporary file (on the disk before its name when ``durable``: a lock read after a power loss is whole), then
    hard-linked to ``path`` (atomic, and exclusive on NFS too): a reader never sees a partial file. On an object
    store: a check, then one object write."""
    if not storage.is_local(path):
        if path.exists():
            return False
        path.write_text(text)
        return True
    tmp = os.fspath(path.with_name(f"{LOCK_FILE}.tmp-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.link(tmp, os.fspath(path))
        except FileExistsError:
            return False
        except OSError as e:
            if os.stat(tmp).st_nlink == 2:  # NFS: the link was made, its reply was lost
                return True
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            return _create_in_place(path, text)  # no hard links here: readers wait for the text (``_read``)
        return True
    finally:
        os.unlink(tmp)


def _create_in_place(path: epath.Path, text: str) -> bool:
    """``O_EXCL`` creation of the lock itself, then its text: for filesystems without hard links."""
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True
