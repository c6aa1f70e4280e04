"""The sandbox's child side: run by path as ``python -I -B sandbox_child.py SPEC_PATH STATUS_FD`` by
``sandbox.run_sandboxed``, never imported by the trainer. Standard library only, and no import of the package:
it runs in a fresh interpreter that sees no project code.

Processes (``namespaces`` mode), each with one job:
  B  this script, started by the trainer in a new session: forks C, writes C's uid/gid maps, relays the final
     status to the trainer on STATUS_FD, kills C (its own child, so the pid is safe) when the trainer asks
     (SIGTERM) or its own deadline passes. A child subreaper, so nothing it started is orphaned to the host's init.
  C  unshares user, mount, network, PID, IPC and UTS namespaces, builds the jail (a size-limited tmpfs root,
     read-only binds of the interpreter's directories, /dev/null & co.), pivots into it, sets the rlimits, drops
     every capability, forks D.
  D  PID 1 of the new PID namespace: reaps, waits for E, reports E's status; when D exits the kernel kills every
     process left in the namespace (a fork bomb's survivors included).
  E  the user's code, run in this (forked) interpreter as ``main.py`` in /sandbox.

``guarded`` mode (no namespaces: only with ``SandboxConfig.allow_unsandboxed_network``): B forks E directly,
which sets the rlimits, drops to the sandbox uid when B is root, and installs a Python audit hook that refuses
sockets, processes, signals, ctypes and file access outside the scratch directory. A guard, not a boundary.

Messages from C and D to B are lines on a pipe: ``unshared``, ``ready <pid of D>``, ``error <text>``,
``exit <code>``, ``signal <number>``. The report to the trainer is one JSON object: ``{"exit": n}``,
``{"signal": n}``, ``{"setup_error": text, "stage": "unshare" | "map" | "jail" | "run" | "guard" | "relay"}`` or
``{"stopped": true}``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
import time
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
# A read-only remount inside a user namespace must keep the flags the kernel locked on the source mount.
_KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER = 1, 24, 28, 36
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE, each locked.
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
_CAPABILITY_VERSION_3 = 0x20080522
# The jail's only writable places, all on its one size-limited tmpfs.
_WRITABLE = (("/sandbox", 0o755), ("/tmp", 0o1777), ("/dev/shm", 0o1777))
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

EXIT_MEMORY_ERROR = 3  # E's exit status when the user's code ended on a MemoryError

_libc = ctypes.CDLL(None, use_errno=True)


class _Stop(BaseException):
    """Raised by B's SIGTERM (the trainer's stop) or SIGALRM (B's own deadline) handler, or D's deadline."""


def _raise_stop(signum, frame) -> None:
    """Stop once: a second SIGTERM or alarm must not interrupt the clean-up the first one started."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    raise _Stop()


def _check(result: int, what: str) -> None:
    """A libc call's -1 as an OSError naming the call."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0) -> None:
    _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {source} on {target}")


def _send(fd: int, line: str) -> None:
    """One message line to B (the pipe is small and messages are short: one write each)."""
    os.write(fd, (" ".join(line.split("\n")) + "\n").encode(errors="replace"))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------------------
# B: the relay.


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    status_fd = int(sys.argv[2])
    # Die with the trainer (its thread that started us) rather than run on unsupervised.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent_pid"]:
        os._exit(1)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGALRM, _raise_stop)
    signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"] + 1.0)
    try:
        report = _run_namespaced(spec, status_fd) if spec["mode"] == "namespaces" else _run_guarded(spec, status_fd)
    except _Stop:
        report = {"stopped": True}
    except BaseException as e:  # noqa: BLE001  (a bug here is a setup error, not a trainer crash)
        report = {"setup_error": f"the sandbox's relay failed: {_describe(e)}", "stage": "relay"}
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _reap_all()
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def _kill_child(pid: int | None) -> None:
    """SIGKILL to a child of B that has not been reaped (so its pid cannot belong to anyone else)."""
    if pid is None:
        return
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # ChildProcessError: not (or no more) ours
        os.kill(pid, signal.SIGKILL)
    except (ChildProcessError, ProcessLookupError):
        pass


def _reap_all(timeout_s: float = 2.0) -> None:
    """Reap every child of B (C, and D or any other orphan handed to this subreaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.005)


class _Lines:
    """Lines from C and D, read with blocking reads (B's signal handlers interrupt them)."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def next(self) -> str | None:
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")


def _run_namespaced(spec: dict, status_fd: int) -> dict:
    c2b_r, c2b_w = os.pipe()
    b2c_r, b2c_w = os.pipe()
    b_pid = os.getpid()
    pid_c = os.fork()
    if pid_c == 0:
        for fd in (c2b_r, b2c_w, status_fd):
            os.close(fd)
        _child_c(spec, b_pid, c2b_w, b2c_r)
    for fd in (c2b_w, b2c_r):
        os.close(fd)
    lines, pid_d, result = _Lines(c2b_r), None, None
    try:
        msg = lines.next()
        if msg != "unshared":
            return _setup_error(msg, "unshare", "the namespace process ended before unsharing")
        try:
            _write_maps(pid_c, spec["map"])
        except OSError as e:
            return {"setup_error": f"writing the user namespace's uid/gid maps failed: {_describe(e)}", "stage": "map"}
        os.write(b2c_w, b"go\n")
        while (msg := lines.next()) is not None:
            kind, _, rest = msg.partition(" ")
            if kind == "ready":
                pid_d = int(rest)
            elif kind == "error":
                return {"setup_error": rest, "stage": "jail" if pid_d is None else "run"}
            elif kind in ("exit", "signal"):
                result = {kind: int(rest)}
        return result or {"setup_error": "the sandbox ended without reporting a status", "stage": "run"}
    finally:
        os.close(b2c_w)
        _kill_child(pid_c)
        try:
            os.waitpid(pid_c, 0)
        except ChildProcessError:
            pass
        # C is gone: a D that C had not reaped was handed to this subreaper, so its pid is ours to kill.
        _kill_child(pid_d)
        os.close(c2b_r)


def _setup_error(msg: str | None, stage: str, default: str) -> dict:
    text = msg.partition(" ")[2] if msg and msg.startswith("error ") else default
    return {"setup_error": text, "stage": stage}


def _write_maps(pid: int, mapping: dict) -> None:
    """Map uid/gid 0 inside C's user namespace to the sandbox's outside ids (root: any ids; a user: its own)."""
    if not mapping["setgroups"]:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
    for name, outside in (("uid_map", mapping["uid"]), ("gid_map", mapping["gid"])):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 {outside} 1\n")


# ----------------------------------------------------------------------------------------------------------
# C: namespaces, jail, limits.


def _child_c(spec: dict, b_pid: int, c2b_w: int, b2c_r: int) -> None:
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != b_pid:
            os._exit(1)
        for sig in (signal.SIGTERM, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            _check(_libc.unshare(NAMESPACES), "unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWNET|CLONE_NEWPID|"
                                               "CLONE_NEWIPC|CLONE_NEWUTS)")
        except OSError as e:
            _send(c2b_w, f"error {e.strerror}")
            os._exit(1)
        _send(c2b_w, "unshared")
        if os.read(b2c_r, 16) != b"go\n":
            os._exit(1)
        os.close(b2c_r)
        _build_jail(spec)
        _set_limits(spec["limits"], extra_processes=2)  # C and D count against RLIMIT_NPROC too
        _drop_capabilities()
        pid_d = os.fork()
        if pid_d == 0:
            _child_d(spec, c2b_w)
        _send(c2b_w, f"ready {pid_d}")
        os.close(c2b_w)
        os.waitpid(pid_d, 0)
        os._exit(0)
    except BaseException as e:  # noqa: BLE001  (every failure is one line to B)
        try:
            _send(c2b_w, f"error {_describe(e)}")
        finally:
            os._exit(1)


def _build_jail(spec: dict) -> None:
    """Mount a size-limited tmpfs over the (empty) scratch dir, bind the read-only paths and devices into it,
    and pivot into it; the host's tree is then unmounted from this mount namespace, so nothing else is reachable.
    The jail's root is read-only; /sandbox, /tmp and /dev/shm (binds of its own directories) are writable.

    Paths are opened (O_PATH) before the uid switch: as root C is still uid 0 outside and can cross a 0700
    directory such as /root that holds the interpreter; the mounts use those handles."""
    jail = spec["jail"]
    scratch = spec["scratch"]
    handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path, _ in jail["binds"] + jail["devices"]}
    scratch_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # uid=0/gid=0 are read in the new namespace: the tmpfs belongs to the sandbox's own (mapped) root.
    _mount("tmpfs", f"/proc/self/fd/{scratch_fd}", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={jail['scratch_mb']}m,nr_inodes={jail['max_inodes']},mode=0755,uid=0,gid=0")
    os.chdir(scratch)  # crosses into the new tmpfs
    os.close(scratch_fd)
    m = spec["map"]
    if m["setgroups"]:
        os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    for path, is_dir in jail["binds"]:
        _bind(handles[path], path, is_dir, MS_NOSUID | MS_NODEV | MS_RDONLY)
    for path, target in jail["symlinks"]:
        os.makedirs("." + os.path.dirname(path), mode=0o755, exist_ok=True)
        os.symlink(target, "." + path)
    for path, _ in jail["devices"]:
        _bind(handles[path], path, False, MS_NOSUID | MS_NOEXEC)
    for path, mode in _WRITABLE:
        os.makedirs("." + path, exist_ok=True)
        os.chmod("." + path, mode)
        # Its own mount, left writable when the root is not; recursive, so a read-only bind already made inside
        # it (an interpreter whose venv lies under /tmp) stays visible instead of being covered.
        _mount("." + path, "." + path, None, MS_BIND | MS_REC)
    for fd in handles.values():
        os.close(fd)
    _forbid_nested_user_namespaces()
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number known for {platform.machine()}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _check(_libc.umount2(b".", MNT_DETACH), "umount2 of the host's root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _forbid_nested_user_namespaces() -> None:
    """user.max_user_namespaces = 0 for this namespace (the sysctl is per user namespace; the host's is untouched),
    so the code cannot make a nested user namespace and regain capabilities there, the entry to most
    namespace-based kernel exploits. Best effort: where /proc/sys is read-only (Docker) nesting stays possible."""
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass


def _bind(handle: int, path: str, is_dir: bool, flags: int) -> None:
    """Bind a host path (by its handle) at the same path in the jail, then remount it with ``flags`` (and the
    flags the kernel locked on the source)."""
    target = "." + path
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(f"/proc/self/fd/{handle}", target, None, MS_BIND | MS_REC)
    kept = os.statvfs(target).f_flag
    flags |= sum(ms for st, ms in _KEPT_FLAGS if kept & st)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def _set_limits(limits: dict, extra_processes: int) -> None:
    """The rlimits every sandboxed process inherits. RLIMIT_NPROC counts the tasks (threads too) of one uid in
    one user namespace, and binds only a process without CAP_SYS_RESOURCE outside it whose uid is not root's."""
    cpu = int(limits["cpu_s"])
    pairs = [
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    if limits["max_processes"] is not None:
        pairs.append((resource.RLIMIT_NPROC, limits["max_processes"] + extra_processes))
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def _drop_capabilities() -> None:
    """No capability left, none regainable: root in the namespace gets none from an exec (securebits, an empty
    bounding set) and setuid files grant nothing (no_new_privs)."""
    _prctl(PR_SET_SECUREBITS, _SECUREBITS)
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno == errno.EINVAL:  # past the kernel's last capability
                break
            raise
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(_libc.capset(ctypes.byref(Header(_CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")


# ----------------------------------------------------------------------------------------------------------
# D: PID 1 of the sandbox.


def _child_d(spec: dict, c2b_w: int) -> None:
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()  # E's process group is not B's: a kill(0, ...) in the sandbox cannot reach B or C
        signal.signal(signal.SIGALRM, _raise_stop)  # PID 1 ignores signals it has no handler for
        signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"] + 2.0)  # should B and C be gone without us knowing
        pid_e = os.fork()
        if pid_e == 0:
            os.close(c2b_w)
            _child_e(spec["code"], "/sandbox")
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == pid_e:
                break
        signal.setitimer(signal.ITIMER_REAL, 0)
        if os.WIFSIGNALED(status):
            _send(c2b_w, f"signal {os.WTERMSIG(status)}")
        else:
            _send(c2b_w, f"exit {os.waitstatus_to_exitcode(status)}")
    except _Stop:
        _send(c2b_w, "error the sandbox's own deadline passed")
    except BaseException as e:  # noqa: BLE001
        _send(c2b_w, f"error the sandbox's init failed: {_describe(e)}")
    os._exit(0)  # the kernel now kills whatever is left in the namespace


# ----------------------------------------------------------------------------------------------------------
# E: the user's code.


def _child_e(code: str, workdir: str, guard: dict | None = None) -> None:
    """Run ``code`` as the script ``main.py`` (in ``workdir``, on ``sys.path``) and exit with its status, as
    ``python main.py`` would; a MemoryError exits with EXIT_MEMORY_ERROR."""
    status = 1
    try:
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGTERM, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(workdir)
        with open("main.py", "w") as f:
            f.write(code)
        sys.argv, sys.path[:0] = ["main.py"], [workdir]
        sys.stdout.reconfigure(line_buffering=True)
        if guard is not None:
            _install_guard(guard)
        status = _run_main(code)
    except BaseException:  # noqa: BLE001  (a failure before the user's code: reported as its traceback)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(status)


def _run_main(code: str) -> int:
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(code, "main.py", "exec"), namespace)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        return EXIT_MEMORY_ERROR
    except BaseException as e:  # noqa: BLE001
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # this frame is not the user's
        traceback.print_exception(type(e), e, tb)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------------
# guarded mode: no namespaces.


def _run_guarded(spec: dict, status_fd: int) -> dict:
    guard = spec["guard"]
    if guard["switch_uid"] is not None:
        try:
            os.chown(spec["scratch"], *guard["switch_uid"])
        except OSError as e:
            return {"setup_error": f"could not give the scratch dir to uid/gid {guard['switch_uid']} "
                                   f"(SandboxConfig.sandbox_uid/gid), which the guarded mode runs the code as when "
                                   f"the trainer is root: {_describe(e)}", "stage": "guard"}
    e2b_r, e2b_w = os.pipe()
    pid_e = os.fork()
    if pid_e == 0:
        for fd in (status_fd, e2b_r):
            os.close(fd)
        try:
            _guarded_setup(spec["limits"], guard)
        except BaseException as e:  # noqa: BLE001
            _send(e2b_w, f"error {_describe(e)}")
            os._exit(1)
        _child_e(spec["code"], spec["scratch"], guard)  # closes e2b_w with every other descriptor
    os.close(e2b_w)
    try:
        message = _Lines(e2b_r).next()  # None: E is running the code (it closed the pipe)
        _, status = os.waitpid(pid_e, 0)
    except _Stop:
        _kill_child(pid_e)
        raise
    finally:
        os.close(e2b_r)
    if message is not None:
        return {"setup_error": message.partition(" ")[2], "stage": "guard"}
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.waitstatus_to_exitcode(status)}


def _guarded_setup(limits: dict, guard: dict) -> None:
    """Limits, then (as root) the sandbox uid, which must be able to read the interpreter's files."""
    _set_limits(limits, extra_processes=0)
    if guard["switch_uid"] is None:
        return
    uid, gid = guard["switch_uid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    for path in guard["interpreter"]:
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(f"uid {uid} cannot read the interpreter's directory {path}: the guarded mode as "
                                  "root needs a Python every user can read (SandboxConfig.python, e.g. "
                                  "/usr/bin/python3), or a trainer that does not run as root")


_REFUSED_EVENTS = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
                   "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "pty.", "os.startfile")
_READ_EVENTS = ("os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr")
_WRITE_EVENTS = ("os.remove", "os.unlink", "os.rename", "os.replace", "os.mkdir", "os.rmdir", "os.symlink",
                 "os.link", "os.chmod", "os.chown", "os.truncate", "os.utime", "os.setxattr", "os.removexattr",
                 "os.chflags", "os.lchflags", "os.lchmod", "os.mkfifo", "os.mknod")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _install_guard(guard: dict) -> None:
    """A Python audit hook refusing what the guarded mode cannot stop at the OS level. Code can get around it
    (ctypes is refused, but a C extension module is not audited): it is a guard against accidents, not a
    security boundary."""
    read_roots = tuple(guard["read_roots"])
    write_roots = tuple(guard["write_roots"])
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep

    def inside(path, roots) -> bool:
        if isinstance(path, int) or path is None:
            return True  # an open descriptor (already checked when opened) or the cwd
        p = realpath(fspath(path))
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        return any(p == r or p.startswith(r.rstrip(sep) + sep) for r in roots)

    def refuse(event: str, what: object = "") -> None:
        raise PermissionError(f"refused by the sandbox's guard: {event} {what}".rstrip())

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_REFUSED_EVENTS):
            refuse(event)
        if event.startswith("ctypes."):
            raise ImportError("ctypes is refused by the sandbox's guard")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writes = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if not inside(path, write_roots if writes else read_roots + write_roots):
                refuse("open", path)
        elif event in _READ_EVENTS:
            if args and not inside(args[0], read_roots + write_roots):
                refuse(event, args[0])
        elif event in _WRITE_EVENTS:
            for path in args[:2] if event in ("os.rename", "os.replace", "os.link") else args[:1]:
                if not inside(path, write_roots):
                    refuse(event, path)

    sys.addaudithook(hook)


if __name__ == "__main__":
    main()
