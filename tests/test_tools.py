"""Tools for multi-turn rollouts: the registry, the call/reply text, the calculator, and the python tool's sandbox.

The sandbox tests run hostile programs (a fork bomb, an infinite loop, a memory hog) under small limits, so each
is bounded by its own limits (processes, CPU seconds, wall seconds, address space) whatever the host; each
sandboxed call takes about 0.1 s. They skip where the machine cannot sandbox (no user namespaces); the refusal
and the guarded fallback are tested everywhere.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import types
import uuid
from pathlib import Path

import pytest

from rollverify_jax.tools import (
    CalculatorError,
    CalculatorTool,
    PythonTool,
    SandboxConfig,
    ToolRegistry,
    ToolResult,
    ToolStatus,
    builtin_tools,
    check_sandbox,
    evaluate,
    format_tool_output,
    parse_tool_call,
    run_sandboxed,
    sandbox,
    strip_code_fence,
)
from rollverify_jax.tools.python_tool import error_summary

BUILTIN = builtin_tools()
# Small limits: a hostile program's cost on the shared test machine is bounded by these.
TIGHT = SandboxConfig(timeout_s=3.0, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=4096, scratch_mb=16)


def python(code: str, **overrides) -> ToolResult:
    cfg = SandboxConfig(**{**{f: getattr(TIGHT, f) for f in TIGHT.__dataclass_fields__}, **overrides})
    return PythonTool(cfg).call(code)


@pytest.fixture(scope="module")
def namespaces():
    """Skip where this machine cannot build the namespace sandbox (the refusal tests below cover that case)."""
    try:
        mode = check_sandbox(TIGHT)
    except RuntimeError as e:
        pytest.skip(f"no namespace sandbox on this machine: {str(e).split('. It needs')[0]}")
    if mode != sandbox.NAMESPACES:
        pytest.skip(f"the sandbox runs in {mode} mode here")


def _processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text``: every process of one sandboxed call carries its relay's
    command line, which names the call's own scratch directory (forks of the code included)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue  # exited meanwhile
    return found


# ----------------------------------------------------------------------------------------------------------
# Calculator.


@pytest.mark.parametrize("expression, value", [
    ("2+3*4", "14"), ("(2 + 3) * 4", "20"), ("-(3)**2", "-9"), ("2**10", "1024"), ("7 // 2", "3"), ("7 % 3", "1"),
    ("1/4", "0.25"), ("0.1 + 0.2", "0.3"), ("6/3", "2"), ("2**-2", "0.25"), ("1e3 * 2", "2000"), (" 12 - 5 = ", "7"),
    ("10**999 // 10**998", "10"),
])
def test_calculator_computes(expression, value):
    result = BUILTIN.call("calculator", expression)
    assert result.status == ToolStatus.OK and result.output == value, result


@pytest.mark.parametrize("expression, message", [
    ("2**100000", "too large"), ("9**9**9", "too large"), ("10**1000", "too large"), ("1e308 * 10", "finite"),
    ("x + 1", "unknown name 'x'"), ("(1).real", "attribute access"), ("__import__('os')", "function calls"),
    ("abs(-1)", "function calls"), ("2^3", "write **"), ("1/0", "division by zero"), ("5 % 0", "division by zero"),
    ("(-8) ** 0.5", "complex"), ("1 << 3", "LShift"), ("'a' * 3", "not a number"), ("True + 1", "not a number"),
    ("", "empty"), ("1 +", "not an arithmetic expression"), ("1" * 2000, "longer than"),
    ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"), ("[1, 2]", "List"),
])
def test_calculator_refuses_with_a_short_message(expression, message):
    result = BUILTIN.call("calculator", expression)
    assert result.status == ToolStatus.ERROR and result.output == "" and message in result.error, result
    assert len(result.error) < 200
    with pytest.raises(CalculatorError):
        evaluate(expression)


# ----------------------------------------------------------------------------------------------------------
# Registry and text.


def test_registry_names_and_failures():
    registry = builtin_tools()
    assert registry.names == ("calculator", "python")
    with pytest.raises(ValueError, match=r"unknown tool 'nope'; known tools: \[.*'calculator'.*'python'"):
        registry.get("nope")
    assert "known tools" in registry.call("nope", "").error
    with pytest.raises(ValueError, match=r"unknown tool 'nope'; known tools: \['calculator', 'python'\]"):
        builtin_tools(("calculator", "nope"))

    class Broken:
        name, description = "broken_tool", "raises"

        def call(self, arguments: str) -> ToolResult:
            raise RuntimeError("bug")

    registry.register(Broken())
    result = registry.call("broken_tool", "x")
    assert result.status == ToolStatus.ERROR and "RuntimeError: bug" in result.error
    with pytest.raises(ValueError, match="not a valid tag name"):
        registry.register(type("Bad", (), {"name": "a b", "description": "", "call": lambda self, a: None})())
    with pytest.raises(TypeError):
        registry.register(object())


def test_registries_are_separate():
    """Each user builds its own tools: a tool added to one registry, or a python tool with other limits, is not
    seen by another (two rollout environments in one process keep their own)."""
    a, b = builtin_tools(sandbox=SandboxConfig(memory_mb=512)), builtin_tools(("calculator",))
    echo = type("Echo", (), {"name": "echo", "description": "", "call": lambda self, x: ToolResult(x, "ok", 0.0)})
    a.register(echo())
    assert "echo" in a and "echo" not in b and "python" not in b and "echo" not in builtin_tools()
    assert a.get("python").config.memory_mb == 512 and builtin_tools().get("python").config.memory_mb == 1024
    assert ToolRegistry([CalculatorTool()]).names == ("calculator",) and ToolRegistry().names == ()


def test_parse_tool_call_formats():
    assert parse_tool_call("Let me compute. <calculator>2+3*4</calculator>") == ("calculator", "2+3*4")
    assert parse_tool_call("<tool_call>python\n    x = 2\n    print(x)\n</tool_call>") == ("python", "x = 2\nprint(x)")
    assert parse_tool_call('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>') == (
        "python", "print(1)")
    # The last complete call is the one that ended generation; an unfinished or unknown tag is not a call.
    text = "<calculator>1+1</calculator> then <python>print(2)</python> and <calculator>3"
    assert parse_tool_call(text) == ("python", "print(2)")
    assert parse_tool_call("<think>2+2</think> <calculator>2+2") is None
    assert parse_tool_call("<search>q</search>", names=["search"]) == ("search", "q")
    assert parse_tool_call("<tool_call>nope 1</tool_call>") == ("nope", "1")  # call_tool answers unknown names
    assert strip_code_fence("```python\nprint(1)\n```") == "print(1)"
    assert strip_code_fence("print('```')") == "print('```')"


def test_format_tool_output():
    ok = ToolResult("14\n", ToolStatus.OK, 0.0)
    assert format_tool_output(ok) == "<tool_response>\n14\n</tool_response>"
    assert format_tool_output(ToolResult("", ToolStatus.OK, 0.0), tag="") == "(no output)"
    error = ToolResult("partial\n", ToolStatus.ERROR, 0.0, "line 2: ZeroDivisionError: division by zero")
    assert format_tool_output(error, tag="interpreter") == (
        "<interpreter>\npartial\nError: line 2: ZeroDivisionError: division by zero\n</interpreter>")
    assert format_tool_output(ToolResult("", ToolStatus.TIMEOUT, 0.0, "timed out after 5 s"), tag="") == (
        "Error: timed out after 5 s")
    long = format_tool_output(ToolResult("x" * 10_000, ToolStatus.OK, 0.0), tag="", max_chars=100)
    assert len(long) == 100 and long.endswith("[reply cut at 100 characters]")
    assert error_summary('Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n    1/0\n'
                         "ZeroDivisionError: division by zero\n") == "line 3: ZeroDivisionError: division by zero"


def test_sandbox_config_validates():
    for bad in ({"timeout_s": 0}, {"memory_mb": 10}, {"max_processes": 0}, {"sandbox_uid": 0},
                {"readonly_paths": ("relative/path",)}, {"max_output_bytes": 0}):
        with pytest.raises(ValueError, match="SandboxConfig"):
            SandboxConfig(**bad)
    assert hash(SandboxConfig(readonly_paths=["/data"])) == hash(SandboxConfig(readonly_paths=("/data",)))


# ----------------------------------------------------------------------------------------------------------
# The python tool in its sandbox.


def test_python_prints_a_result(namespaces):
    result = python("import os, numpy\nprint(sum(range(10)), numpy.arange(4).sum())\n"
                    "open('note.txt', 'w').write('scratch')\nprint(os.getcwd(), open('note.txt').read())")
    assert result.status == ToolStatus.OK, result
    assert result.output == "45 6\n/sandbox scratch\n" and result.elapsed_s > 0
    assert format_tool_output(result, tag="") == "45 6\n/sandbox scratch"


@pytest.mark.parametrize("code, status, error", [
    ("1/0", ToolStatus.ERROR, "line 1: ZeroDivisionError: division by zero"),
    ("x = 1\ndef f(:\n", ToolStatus.ERROR, "line 2: SyntaxError: invalid syntax"),
    ("import sys\nprint('out')\nsys.exit(3)", ToolStatus.ERROR, "exited with status 3"),
    ("import os\nos.abort()", ToolStatus.ERROR, "crashed (SIGABRT)"),
    ("x = bytearray(8 * 2**30)", ToolStatus.ERROR, "MemoryError: the program passed its memory limit (256 MB)"),
    ("x = [0] * 10**9", ToolStatus.ERROR, "MemoryError"),
])
def test_python_faults_become_short_errors(namespaces, code, status, error):
    result = python(code)
    assert result.status == status and error in result.error, result
    assert len(result.error) <= 300


def test_python_has_no_network(namespaces):
    """The sandbox's network namespace has only a loopback that is down: nothing outside, and not even the
    trainer's own loopback listener, can be reached."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = ("import socket\n"
                "for how, connect in [('outside', lambda: socket.create_connection(('1.1.1.1', 80), timeout=1)),\n"
                f"                     ('loopback', lambda: socket.socket().connect(('127.0.0.1', {port})))]:\n"
                "    try:\n"
                "        connect()\n"
                "        print(how, 'connected')\n"
                "    except OSError as e:\n"
                "        print(how, 'failed', e.errno)\n")
        result = python(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.status == ToolStatus.OK, result
    assert "connected" not in result.output
    assert "outside failed" in result.output and "loopback failed" in result.output


def test_python_files_outside_the_scratch_dir_are_unreachable(namespaces, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root only")
    secret.chmod(0o600)
    public = tmp_path / "public.txt"
    public.write_text("world readable")
    public.chmod(0o644)
    project_file = Path(__file__).resolve()  # the project's sources, readable by every user on the host
    marker = f"rollverify_test_{uuid.uuid4().hex}"
    code = f"""
for path in [{str(secret)!r}, {str(public)!r}, {str(project_file)!r}, '/etc/passwd', '/root/.bashrc']:
    try:
        open(path).read()
        print('read', path)
    except OSError as e:
        print('no read', type(e).__name__)
for path in [{str(tmp_path / 'written.txt')!r}, '/usr/{marker}', '/work/{marker}']:
    try:
        open(path, 'w').write('x')
        print('wrote', path)
    except OSError as e:
        print('no write', type(e).__name__)
open('/tmp/{marker}', 'w').write('inside the jail only')
print(open('/tmp/{marker}').read())
"""
    result = python(code)
    assert result.status == ToolStatus.OK, result
    lines = result.output.splitlines()
    assert lines[:5] == ["no read FileNotFoundError"] * 5, result.output  # not in the jail at all
    # Not there (FileNotFoundError) or read-only (OSError): which, depends on where the interpreter is bound from.
    assert [line.split()[:2] for line in lines[5:8]] == [["no", "write"]] * 3, result.output
    assert lines[-1] == "inside the jail only"
    assert not (tmp_path / "written.txt").exists() and not Path(f"/tmp/{marker}").exists()
    assert not Path(f"/usr/{marker}").exists() and not Path(f"/work/{marker}").exists()


def test_python_has_no_privileges(namespaces):
    """No capability left: no mount, no unmount of the read-only binds, no chroot, no nested user namespace
    (where the kernel lets the sandbox forbid it) in which to regain capabilities."""
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print('mount', libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())
print('umount', libc.umount2(b'/usr', 2))
print('remount', libc.mount(None, b'/usr', None, 32 | 4096, None))
try:
    os.chroot('/tmp')
    print('chroot ok')
except OSError as e:
    print('chroot', e.errno)
print('nested userns', libc.unshare(0x10000000))
hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)()
libc.capget(hdr, data)
print('caps', list(data))
"""
    result = python(code)
    assert result.status == ToolStatus.OK, result
    out = result.output
    assert "mount -1 1" in out and "umount -1" in out and "remount -1" in out and "chroot 1" in out, out
    assert "caps [0, 0, 0, 0, 0, 0]" in out
    if os.access("/proc/sys/user/max_user_namespaces", os.W_OK):  # where the sandbox can forbid nesting
        assert "nested userns -1" in out


def test_python_infinite_loop_is_stopped(namespaces):
    """By its CPU-time limit (SIGXCPU), long before the wall-clock timeout, however loaded the machine."""
    result = python("while True: pass", timeout_s=60.0, cpu_s=1)
    assert result.status == ToolStatus.TIMEOUT and result.error == "CPU time limit reached (1 s)", result


def test_python_wall_clock_timeout_keeps_earlier_output(namespaces):
    result = python("import time\nprint('started')\ntime.sleep(60)", timeout_s=0.5)
    assert result.status == ToolStatus.TIMEOUT and result.error == "timed out after 0.5 s", result
    assert result.output == "started\n"


@pytest.mark.parametrize("code", [
    "import os\nwhile True: os.fork()",  # each process dies at its first refused fork
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",  # they never stop
])
def test_python_fork_bomb_is_contained_and_leaves_nothing(namespaces, monkeypatch, code):
    scratch_dirs = []

    def mkdtemp(**kwargs) -> str:
        scratch_dirs.append(tempfile.mkdtemp(**kwargs))
        return scratch_dirs[-1]

    monkeypatch.setattr(sandbox, "tempfile", types.SimpleNamespace(mkdtemp=mkdtemp))
    seen = []
    watcher = threading.Timer(0.25, lambda: seen.append(len(_processes_mentioning(scratch_dirs[0]))))
    watcher.start()
    result = python(code, max_processes=8, timeout_s=0.5, cpu_s=1)
    watcher.join()
    assert result.status != ToolStatus.OK, result
    # The relay, C and D, and at most max_processes tasks of the code.
    assert seen[0] <= 3 + 8, f"{seen[0]} processes of one sandbox at once"
    assert not _processes_mentioning(scratch_dirs[0]), "processes of the sandbox survived it"
    assert not os.path.exists(scratch_dirs[0])


def test_python_thread_limit(namespaces):
    code = ("import threading, time\nthreads = []\ntry:\n    for _ in range(100):\n"
            "        t = threading.Thread(target=time.sleep, args=(5,), daemon=True); t.start(); threads.append(t)\n"
            "except RuntimeError as e:\n    print('refused at', len(threads))\n")
    result = python(code, max_processes=4)
    assert result.status == ToolStatus.OK and result.output == "refused at 3\n", result  # 4 tasks with the main one


def test_python_huge_output_is_cut(namespaces):
    """Stopped by its output limit (not by a timeout, which would say TIMEOUT)."""
    result = python("while True:\n    print('y' * 100)", max_output_bytes=1000)
    assert result.status == ToolStatus.OUTPUT_TRUNCATED, result
    assert result.output.startswith("y" * 100) and "[output truncated: more than 1000 bytes" in result.output
    assert len(result.output) < 1200


def test_python_cannot_touch_the_trainer(namespaces):
    """The code cannot see the trainer's processes (its own PID namespace), signal them or its group."""
    parent, group = os.getpid(), os.getpgrp()
    code = f"""
import os, signal
print('ppid', os.getppid())
for pid in [os.getppid(), {parent}, {group}]:
    try:
        os.kill(pid, signal.SIGKILL)
        print('sent', pid)
    except OSError as e:
        print('kill failed', type(e).__name__)
for how in [lambda: os.killpg({group}, signal.SIGKILL), lambda: os.kill(-1, signal.SIGKILL)]:
    try:
        how()
    except OSError as e:
        print('group kill failed', type(e).__name__)
print('still here')
"""
    result = python(code)
    assert result.status == ToolStatus.OK and result.output.endswith("still here\n"), result
    assert "sent" not in result.output.replace("sent 1", "") and "group kill failed" in result.output
    assert os.getpid() == parent  # this process is alive and answers
    assert python("print('next call fine')").output == "next call fine\n"


def test_python_calls_run_concurrently_and_leak_no_fds(namespaces):
    fds_before = len(os.listdir("/proc/self/fd"))
    results = [None] * 3

    def work(i: int) -> None:
        results[i] = python(f"print({i} * 7)")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert [r.output for r in results] == ["0\n", "7\n", "14\n"]
    assert len(os.listdir("/proc/self/fd")) == fds_before


# ----------------------------------------------------------------------------------------------------------
# Without namespaces: refusal, or the guarded mode when explicitly allowed.


def test_python_refuses_without_a_sandbox(monkeypatch, capsys):
    monkeypatch.setitem(sandbox._UNAVAILABLE, os.geteuid(), "simulated: unshare: Operation not permitted")
    result = python("print('should not run')")
    assert result.status == ToolStatus.ERROR and "unavailable" in result.error and result.output == ""
    assert result.elapsed_s == 0.0  # nothing was started
    assert "allow_unsandboxed_network" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="user namespaces.*allow_unsandboxed_network=True"):
        check_sandbox(TIGHT)


def test_python_guarded_mode_when_allowed(monkeypatch, tmp_path):
    """Only with allow_unsandboxed_network: rlimits and an audit hook refusing sockets, processes and files
    outside the scratch dir (a guard, not a boundary)."""
    monkeypatch.setitem(sandbox._UNAVAILABLE, os.geteuid(), "simulated")
    interpreter = ""
    probe = python("print(1)", allow_unsandboxed_network=True)
    if probe.status != ToolStatus.OK:
        assert probe.error.startswith("sandbox setup failed"), probe
        if "cannot read the interpreter's directory" not in probe.error:
            pytest.skip(f"the guarded mode cannot start here: {probe.error}")  # e.g. root without the sandbox uid
        # As root the code runs as nobody, who cannot read an interpreter under /root: a clear refusal naming the
        # fix (a Python every user can read).
        interpreter = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), "")
        if not interpreter:
            pytest.skip("no interpreter every user can read, for the guarded mode as root")
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    outside.chmod(0o644)
    code = f"""
import os, socket, subprocess
print(sum(range(4)))
open('mine.txt', 'w').write('ok')
for name, attempt in [('socket', lambda: socket.create_connection(('127.0.0.1', 1), timeout=1)),
                      ('read', lambda: open({str(outside)!r}).read()),
                      ('write', lambda: open({str(tmp_path / 'new.txt')!r}, 'w')),
                      ('fork', os.fork), ('subprocess', lambda: subprocess.run(['true'])),
                      ('kill', lambda: os.kill(os.getppid(), 9))]:
    try:
        attempt()
        print(name, 'allowed')
    except (OSError, ImportError) as e:
        print(name, 'refused')
"""
    result = python(code, allow_unsandboxed_network=True, python=interpreter)
    assert result.status == ToolStatus.OK, result
    assert result.output.splitlines() == ["6"] + [f"{n} refused" for n in
                                                  ("socket", "read", "write", "fork", "subprocess", "kill")]
    assert not (tmp_path / "new.txt").exists()
    timed = python("while True: pass", allow_unsandboxed_network=True, python=interpreter, timeout_s=60.0, cpu_s=1)
    assert timed.status == ToolStatus.TIMEOUT and timed.error == "CPU time limit reached (1 s)", timed  # the rlimit


def test_python_sandbox_launch_failure_is_a_result(monkeypatch):
    monkeypatch.setattr(sandbox, "_UNAVAILABLE", {})  # as on a first call, on any machine
    monkeypatch.setattr(sandbox, "CHILD_SCRIPT", "/nonexistent/sandbox_child.py")
    run = run_sandboxed("print(1)", TIGHT, mode=sandbox.NAMESPACES)
    assert run.setup_error is not None and "without a report" in run.setup_error
    result = PythonTool(TIGHT).call("print(1)")
    assert result.status == ToolStatus.ERROR and result.error.startswith("sandbox setup failed")
