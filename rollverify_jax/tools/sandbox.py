"""Running untrusted Python in a sandboxed subprocess, from the trainer's side: the limits, the launch, the
reading of its output under a deadline, and the clean-up. The child side is ``sandbox_child.py``;
``docs/tools.md`` states what is and is not guaranteed.

Two modes: ``namespaces`` (the only one used unless told otherwise) runs the code in new user, mount, network,
PID and IPC namespaces, in a jail whose only writable place is a size-limited tmpfs, as an unprivileged uid, with
rlimits and no capabilities. ``guarded`` (no namespaces; only with ``SandboxConfig.allow_unsandboxed_network``)
keeps the rlimits and adds a Python audit hook, which is a guard against accidents, not a boundary.

The launch uses no ``preexec_fn`` (unsafe in a process with JAX's threads): the trainer starts a fresh
interpreter in a new session, and everything else happens in that interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
NAMESPACES, GUARDED = "namespaces", "guarded"
EXIT_MEMORY_ERROR = 3  # sandbox_child.EXIT_MEMORY_ERROR (the child script is not imported here)

# The interpreter's and the system's libraries, read-only in the jail. The project's sources are not among them.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# The child's whole environment (``-I`` ignores PYTHON* variables anyway): one thread per numeric library, so a
# numpy import fits the address-space limit and the process limit.
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1", "MPLBACKEND": "Agg", "MPLCONFIGDIR": "/tmp",
}
_STOP_GRACE_S = 2.0  # from the SIGTERM that asks the relay to kill the sandbox to a SIGKILL of its process group


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """The limits of one sandboxed run of the python tool.

    timeout_s: wall-clock limit of a run; past it the sandbox is killed and the run is a timeout. In a rollout it
      is the call's limit, ``ToolUseConfig.timeout_s``, set by the tool environment (not bound in gin).
    cpu_s: CPU seconds each process of the run may use (RLIMIT_CPU, whole seconds, rounded up).
    memory_mb: address space of each process (RLIMIT_AS); past it an allocation fails with a MemoryError. The
      run's total is at most ``max_processes * memory_mb`` plus ``scratch_mb``.
    max_output_bytes: stdout and stderr kept, together; a run that prints more is stopped and its output cut.
    max_processes: processes and threads the code may have at once (RLIMIT_NPROC in the sandbox's own user
      namespace), the first one included: bounds a fork bomb.
    max_file_mb: size of any one file the code writes (RLIMIT_FSIZE).
    scratch_mb: size of the sandbox's tmpfs (its cwd /sandbox, /tmp and /dev/shm together).
    max_open_files: file descriptors per process (RLIMIT_NOFILE).
    max_code_bytes: longest program accepted.
    sandbox_uid, sandbox_gid: the ids the code runs as on the host when the trainer is root (``nobody`` by
      default: it must own no files). A non-root trainer's code runs as the trainer's own ids.
    readonly_paths: host paths added read-only to the jail beside the interpreter's (e.g. a data directory).
    python: the interpreter that runs the code (its prefixes, a venv's site-packages included, are bound into the
      jail); empty: the trainer's own. A separate one gives the tool its own packages; in the guarded mode as
      root it must be readable by ``sandbox_uid`` (not under /root).
    allow_unsandboxed_network: where user namespaces are unavailable, run the code anyway in the ``guarded``
      mode (no network namespace, no jail: rlimits and a Python audit hook only). Off: such a machine refuses the
      tool with a message saying how to enable the sandbox.
    """

    timeout_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 16384
    max_processes: int = 16
    max_file_mb: int = 16
    scratch_mb: int = 64
    max_open_files: int = 256
    max_code_bytes: int = 65536
    sandbox_uid: int = 65534
    sandbox_gid: int = 65534
    readonly_paths: tuple[str, ...] = ()
    python: str = ""
    allow_unsandboxed_network: bool = False

    def __post_init__(self):
        checks = (
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (self.cpu_s > 0, "cpu_s must be > 0"),
            (self.memory_mb >= 64, "memory_mb must be >= 64 (the child interpreter alone maps about 20 MB)"),
            (self.max_output_bytes >= 1, "max_output_bytes must be >= 1"),
            (self.max_processes >= 1, "max_processes must be >= 1 (the code's own process counts)"),
            (self.max_file_mb >= 1, "max_file_mb must be >= 1 (the code is written to main.py)"),
            (self.scratch_mb >= 1, "scratch_mb must be >= 1"),
            (self.max_open_files >= 16, "max_open_files must be >= 16"),
            (self.max_code_bytes >= 1, "max_code_bytes must be >= 1"),
            (self.sandbox_uid > 0 and self.sandbox_gid > 0, "sandbox_uid and sandbox_gid must be > 0: root's ids "
                                                            "would exempt the code from the process limit"),
            (all(isinstance(p, str) and os.path.isabs(p) for p in self.readonly_paths),
             "readonly_paths must be absolute paths"),
            (self.python == "" or os.path.isabs(self.python), "python must be an absolute path or empty (the "
                                                              "trainer's interpreter)"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SandboxConfig: {message}; got {self}")
        object.__setattr__(self, "readonly_paths", tuple(self.readonly_paths))


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """What one run did. ``setup_error`` (the sandbox could not be built or started) excludes the rest;
    ``timed_out`` and ``output_overflow`` mean the trainer stopped the run; otherwise ``exit_code`` or
    ``signal`` says how the code ended."""

    mode: str
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    output_overflow: bool = False
    setup_error: str | None = None
    setup_stage: str | None = None
    elapsed_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------
# Which mode.

_UNAVAILABLE: dict[int, str] = {}  # euid -> why namespaces failed here (found once, by a first run)
_UNAVAILABLE_LOCK = threading.Lock()


def unavailable_reason() -> str | None:
    """Why the namespaces sandbox failed in this process (None: it works or has not been tried yet)."""
    return _UNAVAILABLE.get(os.geteuid())


_WARNED_GUARDED: set[str] = set()


def _fallback(code: str, cfg: SandboxConfig, reason: str, elapsed_s: float = 0.0) -> SandboxRun:
    """Namespaces failed: the guarded mode if ``allow_unsandboxed_network`` (said once on stderr), else the
    refusal."""
    if not cfg.allow_unsandboxed_network:
        return SandboxRun(NAMESPACES, setup_error=refusal_message(reason), setup_stage="unavailable",
                          elapsed_s=elapsed_s)
    with _UNAVAILABLE_LOCK:
        first = reason not in _WARNED_GUARDED
        _WARNED_GUARDED.add(reason)
    if first:
        print(f"warning: the python tool's namespace sandbox is unavailable here ({reason}); running code in the "
              "guarded mode (SandboxConfig.allow_unsandboxed_network=True): no network or file isolation, rlimits "
              "and an audit hook only", file=sys.stderr, flush=True)
    return _run(code, cfg, GUARDED)


def refusal_message(reason: str) -> str:
    """The one message of a refused python tool: what failed and the ways to fix it."""
    return (f"the python tool's sandbox is unavailable here ({reason}), so the code was not run. It needs user "
            "namespaces (with a network namespace): allow them (sysctl user.max_user_namespaces > 0; "
            "kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels; "
            "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04), or in Docker run the container with "
            "--security-opt seccomp=unconfined --security-opt apparmor=unconfined (or --privileged); or set "
            "SandboxConfig.allow_unsandboxed_network=True to run the code without namespaces (rlimits and an audit "
            "hook only, no network or file isolation: docs/tools.md)")


def run_sandboxed(code: str, cfg: SandboxConfig, mode: str | None = None) -> SandboxRun:
    """Run ``code`` under ``cfg``'s limits. ``mode`` None picks ``namespaces``, falling back to ``guarded``
    only where namespaces failed and ``cfg.allow_unsandboxed_network`` is set; otherwise a setup error says how
    to enable the sandbox. Never raises for anything the code does."""
    if mode is None:
        reason = unavailable_reason()
        if reason is not None:
            return _fallback(code, cfg, reason)
        run = _run(code, cfg, NAMESPACES)
        if run.setup_stage in ("unshare", "map"):  # the kernel or its policy refuses namespaces: for good
            with _UNAVAILABLE_LOCK:
                _UNAVAILABLE[os.geteuid()] = run.setup_error or "unknown"
        if run.setup_stage in ("unshare", "map", "jail"):  # a jail that cannot be built may be this config's
            return _fallback(code, cfg, run.setup_error or "unknown", run.elapsed_s)
        return run
    if mode not in (NAMESPACES, GUARDED):
        raise ValueError(f"run_sandboxed: mode must be {NAMESPACES!r}, {GUARDED!r} or None, got {mode!r}")
    return _run(code, cfg, mode)


def check_sandbox(cfg: SandboxConfig) -> str:
    """Run a tiny program once; the mode it ran in, or RuntimeError with the reason and the fix. For a run's
    start-up, so a machine that cannot sandbox fails before training rather than at its first tool call."""
    run = run_sandboxed("print(6 * 7)", cfg)
    if run.setup_error is not None:
        raise RuntimeError(run.setup_error)
    if run.stdout.strip() != b"42":
        raise RuntimeError(f"the python tool's sandbox ran a test program ({run.mode} mode) but it printed "
                           f"{run.stdout[:200]!r} (exit {run.exit_code}, signal {run.signal}, stderr "
                           f"{run.stderr[-500:]!r}); raise SandboxConfig.memory_mb or timeout_s if they are tight")
    return run.mode


# ----------------------------------------------------------------------------------------------------------
# One run.


def _run(code: str, cfg: SandboxConfig, mode: str) -> SandboxRun:
    start = time.monotonic()
    python = cfg.python or sys.executable
    try:
        prefixes = interpreter_prefixes(python)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return SandboxRun(mode, setup_error=f"SandboxConfig.python {python!r} could not be run to find its "
                                            f"library directories: {e}", setup_stage="launch")
    scratch = tempfile.mkdtemp(prefix="rollverify_tool_")
    status_r, status_w = os.pipe()
    try:
        spec_path = os.path.join(scratch, "spec.json")
        with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(_spec(code, cfg, mode, scratch, prefixes), f)
        try:
            proc = subprocess.Popen(
                [python, "-I", "-B", CHILD_SCRIPT, spec_path, str(status_w)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True,
                env=_CHILD_ENV, cwd="/")
        except OSError as e:
            return SandboxRun(mode, setup_error=f"could not start the sandbox's interpreter {python}: {e}",
                              setup_stage="launch", elapsed_s=time.monotonic() - start)
        os.close(status_w)
        status_w = -1
        with proc, _running(proc):
            stdout, stderr, timed_out, overflow = _collect(proc, cfg, start + cfg.timeout_s)
            report = _read_report(status_r)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        shutil.rmtree(scratch, ignore_errors=True)
    return _outcome(mode, report, stdout, stderr, timed_out, overflow, time.monotonic() - start)


_RUNNING: dict[subprocess.Popen, int] = {}  # the relays of the sandboxes running now -> the thread running each
_RUNNING_LOCK = threading.Lock()


@contextlib.contextmanager
def _running(proc: subprocess.Popen):
    with _RUNNING_LOCK:
        _RUNNING[proc] = threading.get_ident()
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING.pop(proc, None)


def running_pids(threads: Collection[int] | None = None) -> list[int]:
    """The relays of the sandboxes running now (of those ``threads``' calls; all by default)."""
    with _RUNNING_LOCK:
        return [p.pid for p, t in _RUNNING.items() if threads is None or t in threads]


def stop_running(threads: Collection[int]) -> int:
    """Stops the sandboxes that these threads (``threading.get_ident``) run now, as a timeout does (the relay
    kills the sandbox; its process group is killed if it does not within ``_STOP_GRACE_S``): those calls return
    at once, with what they printed. For a run's end, where a call still running is not waited for. Returns how
    many were stopped."""
    with _RUNNING_LOCK:
        procs = [p for p, t in _RUNNING.items() if t in threads]
    stopped = 0
    for proc in procs:
        if proc.poll() is None:  # not reaped: its pid is still its process group's
            _stop(proc)
            stopped += 1
    return stopped


def _spec(code: str, cfg: SandboxConfig, mode: str, scratch: str, prefixes: list[str]) -> dict:
    """Everything the child needs, decided here (the child makes no choices)."""
    root = os.geteuid() == 0
    limits = {"cpu_s": max(1, -(-cfg.cpu_s // 1)), "memory_bytes": cfg.memory_mb * 2**20,
              "file_bytes": cfg.max_file_mb * 2**20, "max_open_files": cfg.max_open_files,
              # Without namespaces a non-root uid's count is all of the trainer's own processes: no limit there
              # (the guard refuses forks instead).
              "max_processes": cfg.max_processes if (mode == NAMESPACES or root) else None}
    spec = {"mode": mode, "code": code, "scratch": scratch, "parent_pid": os.getpid(), "timeout_s": cfg.timeout_s,
            "limits": limits}
    if mode == NAMESPACES:
        spec["map"] = ({"uid": cfg.sandbox_uid, "gid": cfg.sandbox_gid, "setgroups": True} if root
                       else {"uid": os.geteuid(), "gid": os.getegid(), "setgroups": False})
        spec["jail"] = {**jail_layout(prefixes, cfg.readonly_paths), "scratch_mb": cfg.scratch_mb,
                        "max_inodes": 16384}
    else:
        spec["guard"] = {"switch_uid": [cfg.sandbox_uid, cfg.sandbox_gid] if root else None,
                         "interpreter": [os.path.realpath(p) for p in prefixes],
                         "read_roots": [os.path.realpath(p) for p in (*prefixes, *cfg.readonly_paths, *_DEVICES)],
                         "write_roots": [os.path.realpath(scratch), "/dev/null"]}
    return spec


def interpreter_prefixes(python: str) -> list[str]:
    """The directories an interpreter reads its standard library and site-packages from (its prefixes; a venv's
    own and its base's). The trainer's own from ``sys``; another's asked once, by running it."""
    if python == sys.executable:
        return sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    return list(_other_prefixes(python))


@functools.lru_cache(maxsize=8)
def _other_prefixes(python: str) -> tuple[str, ...]:
    query = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, env=_CHILD_ENV,
                         check=True).stdout
    return tuple(sorted(set(json.loads(out))))


def jail_layout(prefixes: list[str], extra: tuple[str, ...] = ()) -> dict:
    """The jail's read-only binds ``[path, is_dir]`` and symlinks ``[path, target]``: the system's library
    directories, the interpreter's prefixes (a venv included), ``extra``; each path at its own place, a symlinked
    one (``/lib -> usr/lib``) as the same symlink, a path inside another bind left to that bind."""
    binds, symlinks = {}, {}
    todo = [*_SYSTEM_PATHS, *prefixes, *extra]
    for path in todo:
        path = os.path.normpath(path)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path):
            symlinks[path] = os.readlink(path)
        real = os.path.realpath(path)
        if os.path.exists(real):
            binds[real] = os.path.isdir(real)
    kept = []
    for path in sorted(binds):
        if not any(path.startswith(parent.rstrip("/") + "/") for parent, _ in kept):
            kept.append((path, binds[path]))
    links = [[p, t] for p, t in sorted(symlinks.items())
             if p not in binds and not any(p.startswith(parent.rstrip("/") + "/") for parent, _ in kept)]
    devices = [[d, False] for d in _DEVICES if os.path.exists(d)]
    return {"binds": [list(b) for b in kept], "symlinks": links, "devices": devices}


class _Output:
    """stdout and stderr as they arrive, the first ``limit`` bytes of the two together kept."""

    def __init__(self, limit: int, fds: tuple[int, int]):
        self.limit, self.total, self.kept = limit, 0, {fd: bytearray() for fd in fds}

    def add(self, fd: int, chunk: bytes) -> None:
        room = self.limit - sum(len(b) for b in self.kept.values())
        self.kept[fd] += chunk[:max(room, 0)]
        self.total += len(chunk)

    @property
    def overflow(self) -> bool:
        return self.total > self.limit

    def drain(self, fd: int) -> None:
        """What is left in a pipe whose writers are gone, read without blocking (should one have survived)."""
        os.set_blocking(fd, False)
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 65536):
                self.add(fd, chunk)


def _collect(proc: subprocess.Popen, cfg: SandboxConfig, deadline: float) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes or more than ``max_output_bytes`` arrive
    (then stop the sandbox at once: the rest would be dropped anyway); then make sure the process group is gone
    and the relay reaped."""
    fds = (proc.stdout.fileno(), proc.stderr.fileno())
    out, timed_out = _Output(cfg.max_output_bytes, fds), False
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not out.overflow:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    out.add(key.fd, chunk)
                else:
                    sel.unregister(key.fd)
        still_open = [key.fd for key in sel.get_map().values()]
    overflow = out.overflow
    if not (timed_out or overflow) and not _wait_exit(proc, deadline - time.monotonic()):
        timed_out = True  # the code closed its output but ran on
    if timed_out or overflow:
        _stop(proc)
    _kill_group_and_reap(proc)
    if not overflow:
        for fd in still_open:  # what a stopped run printed before the stop
            out.drain(fd)
    return bytes(out.kept[fds[0]]), bytes(out.kept[fds[1]]), timed_out, overflow


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until the relay exits, without reaping it (its pid stays its process group's, for the kill)."""
    deadline, pause = time.monotonic() + max(timeout_s, 0.0), 0.001
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # already reaped
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _stop(proc: subprocess.Popen) -> None:
    """Ask the relay to kill the sandbox (it knows the sandbox's processes); SIGKILL its group if it does not."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    if not _wait_exit(proc, _STOP_GRACE_S):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _wait_exit(proc, _STOP_GRACE_S)


def _kill_group_and_reap(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the relay's process group (nothing, normally) while the relay, exited but not
    reaped, still holds the group's id; then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_report(fd: int) -> dict | None:
    """The relay's JSON report (written just before it exits); None if it wrote none."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def _outcome(mode: str, report: dict | None, stdout: bytes, stderr: bytes, timed_out: bool, overflow: bool,
             elapsed_s: float) -> SandboxRun:
    common = {"mode": mode, "stdout": stdout, "stderr": stderr, "elapsed_s": elapsed_s}
    if timed_out or overflow:
        return SandboxRun(**common, timed_out=timed_out, output_overflow=overflow)
    if report is None:
        return SandboxRun(**common, setup_error="the sandbox's relay process ended without a report (its stderr: "
                                                f"{stderr[-300:].decode(errors='replace')!r})", setup_stage="relay")
    if "setup_error" in report:
        return SandboxRun(**common, setup_error=report["setup_error"], setup_stage=report.get("stage"))
    if report.get("stopped"):  # the relay's own deadline, just after the trainer's
        return SandboxRun(**common, timed_out=True)
    return SandboxRun(**common, exit_code=report.get("exit"), signal=report.get("signal"))
