"""The python tool: a program from the policy, run in the sandbox (``sandbox.py``), as a ``ToolResult``.

Every way a run can end becomes a result with one short line for the policy: a timeout (wall clock or CPU
limit), a crash (traceback's last line, with the line number in ``main.py``; a signal), a MemoryError, output
cut at the limit, a sandbox that could not be set up. The program's stdout is the output; its stderr (warnings)
follows it when the run succeeded.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import sys
import threading

from rollverify_jax.tools.registry import ToolResult, ToolStatus
from rollverify_jax.tools.sandbox import EXIT_MEMORY_ERROR, SandboxConfig, SandboxRun, run_sandboxed

_FENCE = re.compile(r"```[\w+.-]*[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)
_MAIN_LINE = re.compile(r'File "main\.py", line (\d+)')
_ERROR_CHARS = 300
_warned: set[str] = set()
_warned_lock = threading.Lock()


def strip_code_fence(arguments: str) -> str:
    """The code of a call: the inside of a Markdown fence (```python ... ```) when the arguments are one."""
    m = _FENCE.fullmatch(arguments.strip())
    return m.group(1) if m else arguments


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """``<python>print(2 ** 10)</python>`` -> ``1024``; thread-safe (each call is its own sandbox)."""

    config: SandboxConfig = SandboxConfig()
    name: str = "python"
    description: str = ("Runs a Python 3 program (the standard library and the installed packages, e.g. numpy) in "
                        "a sandbox without network or files, and returns what it prints: print() every value you "
                        "need.")

    def call(self, arguments: str) -> ToolResult:
        code = strip_code_fence(arguments)
        if len(code.encode(errors="replace")) > self.config.max_code_bytes:
            return ToolResult("", ToolStatus.ERROR, 0.0,
                              f"program longer than {self.config.max_code_bytes} bytes; not run")
        return result_of(run_sandboxed(code, self.config), self.config)


def result_of(run: SandboxRun, cfg: SandboxConfig) -> ToolResult:
    """The ToolResult of a sandboxed run; a setup error is also printed once for the operator."""
    stdout = run.stdout.decode(errors="replace")
    stderr = run.stderr.decode(errors="replace")

    def result(status: ToolStatus, error: str = "", output: str = stdout) -> ToolResult:
        return ToolResult(output, status, run.elapsed_s, error[:_ERROR_CHARS])

    if run.setup_error is not None:
        _warn_once(f"warning: the python tool could not run code: {run.setup_error}")
        # The policy reads one line; the operator reads the whole message (with the fix) on stderr.
        short = ("the sandbox is unavailable on this machine; the code was not run"
                 if run.setup_stage == "unavailable" else f"sandbox setup failed: {run.setup_error}")
        return ToolResult("", ToolStatus.ERROR, run.elapsed_s, short[:_ERROR_CHARS])
    if run.output_overflow:
        marker = f"\n[output truncated: more than {cfg.max_output_bytes} bytes; the program was stopped]"
        return result(ToolStatus.OUTPUT_TRUNCATED, f"output passed {cfg.max_output_bytes} bytes",
                      stdout + (stderr if stderr and not stdout else "") + marker)
    if run.timed_out:
        return result(ToolStatus.TIMEOUT, f"timed out after {cfg.timeout_s:g} s")
    if run.signal is not None:
        return _signal_result(run.signal, cfg, result)
    if run.exit_code == 0:
        return result(ToolStatus.OK, output=stdout + stderr)
    if run.exit_code == EXIT_MEMORY_ERROR and stderr.rstrip().endswith("MemoryError"):
        return result(ToolStatus.ERROR, f"MemoryError: the program passed its memory limit ({cfg.memory_mb} MB)")
    return result(ToolStatus.ERROR, error_summary(stderr) or f"the program exited with status {run.exit_code}")


def _signal_result(number: int, cfg: SandboxConfig, result) -> ToolResult:
    if number == signal.SIGXCPU:
        return result(ToolStatus.TIMEOUT, f"CPU time limit reached ({cfg.cpu_s:g} s)")
    if number == signal.SIGKILL:
        return result(ToolStatus.ERROR, "killed (SIGKILL: the CPU time hard limit or the kernel's memory killer)")
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return result(ToolStatus.ERROR, f"the program crashed ({name})")


def error_summary(stderr: str) -> str:
    """A traceback's last line, with the line of ``main.py`` it came from: ``line 3: ZeroDivisionError: ...``."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if not lines:
        return ""
    where = _MAIN_LINE.findall(stderr)
    return f"line {where[-1]}: {lines[-1].strip()}" if where else lines[-1].strip()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    print(message, file=sys.stderr, flush=True)
