"""A run's end: nothing it started outlives it or holds up its exit. Tool calls still running when a run closes
are cut short (sandboxes stopped) or left to daemon threads; ``python -m rollverify_jax.train`` ends right after
its last line. Structure only, no clock: what is alive after a close, which line is last, the exit status."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from rollverify_jax.rollout import tool_use
from rollverify_jax.rollout.tool_use import ToolEnvironment, ToolUseConfig
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.tools import SandboxConfig, ToolRegistry, ToolResult
from rollverify_jax.tools import sandbox as sandbox_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TEXT = (lambda x: [ord(ch) for ch in x], lambda ids: "".join(map(chr, ids)))  # a codec that round-trips


def _call(env: ToolEnvironment, text: str):
    """Submits the tool call ``text`` (a whole policy turn) to ``env``."""
    turn = _TEXT[0](text)
    t = Trajectory(uid=0, group_id=0, prompt=np.asarray([5], np.int32), seed=0, max_new_tokens=4096, tokens=turn,
                   logps=[0.0] * len(turn), versions=[0] * len(turn))
    assert env.awaits_reply(t)
    return env.request(t)


def test_a_tool_call_stuck_at_the_end_is_left_to_a_daemon_thread(monkeypatch, capsys):
    """An in-process tool that never returns: close() gives up on it after its bounded wait, and the thread it
    holds is a daemon, so the interpreter's exit does not wait for it (a ThreadPoolExecutor's threads are joined
    at exit, ``shutdown(wait=False)`` or not)."""
    entered, release = threading.Event(), threading.Event()

    def hang(_arguments):
        entered.set()
        release.wait()
        return ToolResult("late", "ok", 0.0)
    stuck = type("Stuck", (), {"name": "stuck", "description": "", "call": lambda self, x: hang(x)})
    monkeypatch.setattr(tool_use, "CLOSE_WAIT_S", 0.1, raising=False)
    before = set(threading.enumerate())
    env = ToolEnvironment(ToolUseConfig(tools=("stuck",)), *_TEXT, ord(">"), registry=ToolRegistry([stuck()]))
    request = _call(env, "<stuck>1</stuck>")
    assert entered.wait(10)
    try:
        env.close()
        started = [t for t in threading.enumerate() if t not in before]
        assert started and not [t for t in started if not t.daemon], started
        assert not request.done()
        assert "1 tool call(s) still running 0.1 s after the run's end were left behind" in capsys.readouterr().err
    finally:
        release.set()


def test_a_sandbox_running_at_the_end_is_stopped_not_waited_for(sandbox_available):
    """A python call with a minute left on its clock when the run closes: close() stops its sandbox (its relay
    is gone when close returns) and the thread that ran it ends; nothing is left alive. It used to run on, and the
    interpreter's exit waited for it."""
    env = ToolEnvironment(ToolUseConfig(tools=("python",), timeout_s=60.0), *_TEXT, ord(">"),
                          sandbox=SandboxConfig(memory_mb=256))
    before = set(threading.enumerate())
    request = _call(env, "<python>import time\nprint('started', flush=True)\ntime.sleep(60)</python>")
    for _ in range(600):  # the sandbox starts (0.1 s, longer under load)
        relays = _relays()
        if relays:
            break
        threading.Event().wait(0.05)
    assert relays, "the sandbox never started"
    env.close()
    assert not [pid for pid in relays if _alive(pid)] and not _relays()
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert request.done()  # the stopped call returned (its reply is not read: the run is over)


def _relays() -> list[int]:
    """This process's children that are sandbox relays (running, not zombies)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(") ", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and sandbox_lib.CHILD_SCRIPT.encode() in command:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# A command's main that prints its summary, leaving behind what used to hold up an exit: a non-daemon thread that
# never ends (a stuck ThreadPoolExecutor worker is one), then exits with ``status``.
_MAIN = textwrap.dedent("""
    import sys, threading
    from rollverify_jax.infra import cli

    def main():
        threading.Thread(target=threading.Event().wait, name="stuck").start()
        print("summary: the last line", flush=False)
        if sys.argv[1] != "0":
            raise SystemExit(int(sys.argv[1]))

    cli.run_and_exit(main)
""")


@pytest.mark.parametrize("status", [0, 143])
def test_the_command_ends_right_after_its_last_line(status):
    """``cli.run_and_exit`` (``python -m rollverify_jax.train``'s ``__main__``): once main returns, the process
    ends with main's status and its last line (buffered: it is flushed) is the summary; a thread that would hold
    up the interpreter's exit is not waited for (the interpreter would wait for ever: the timeout below fails)."""
    out = subprocess.run([sys.executable, "-c", _MAIN, str(status)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == status, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "summary: the last line"


def test_train_module_ends_through_run_and_exit():
    """The training command's ``__main__`` is ``cli.run_and_exit(main)`` (so the test above is its exit)."""
    import ast
    import inspect

    from rollverify_jax import train

    tree = ast.parse(inspect.getsource(train))
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert [ast.unparse(s) for s in guard[0].body] == ["cli.run_and_exit(main)"]
