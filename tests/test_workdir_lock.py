"""One launch per workdir: the lock names its holder, refuses a second launch, and a dead holder's lock is taken
over with a warning."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from rollverify_jax.run.workdir_lock import LOCK_FILE, WorkdirLock


def _lock_of(tmp_path, **holder):
    entry = {"pid": 1, "host": socket.gethostname(), "started": time.time(), "started_utc": "2026-01-01 00:00:00 UTC",
             "command": "python -m rollverify_jax.train --workdir=run", "slurm_job_id": None,
             "slurm_restart_count": "0", **holder}
    (tmp_path / LOCK_FILE).write_text(json.dumps(entry) + "\n")
    return entry


@pytest.fixture
def live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


def test_the_lock_names_its_holder_and_is_released(tmp_path):
    lock = WorkdirLock.acquire(tmp_path)
    held = json.loads((tmp_path / LOCK_FILE).read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and "started_utc" in held
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_launch_is_refused_naming_the_holder(tmp_path, live_process):
    _lock_of(tmp_path, pid=live_process.pid)
    with pytest.raises(ValueError, match=f"is in use by another launch \\(pid {live_process.pid} on host "):
        WorkdirLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == live_process.pid  # untouched


def test_a_lock_held_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
    _lock_of(tmp_path, pid=os.getpid() + 1, host="node-17")
    with pytest.raises(ValueError, match=f"on host node-17.*if it is gone .*remove {tmp_path / LOCK_FILE}"):
        WorkdirLock.acquire(tmp_path)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("case", ["dead pid", "this pid (restarted container)", "pid reused later",
                                  "requeued SLURM job"])
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys, monkeypatch, live_process, case):
    holder = {"dead pid": lambda: {"pid": _dead_pid()},
              "this pid (restarted container)": lambda: {"pid": os.getpid()},
              "pid reused later": lambda: {"pid": live_process.pid, "started": time.time() - 3600},
              "requeued SLURM job": lambda: {"pid": 4242, "host": "node-3", "slurm_job_id": "777"}}[case]()
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _lock_of(tmp_path, **holder)
    lock = WorkdirLock.acquire(tmp_path)
    assert "warning: taking over the lock" in capsys.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_release_leaves_a_lock_another_launch_took(tmp_path):
    lock = WorkdirLock.acquire(tmp_path)
    _lock_of(tmp_path, pid=12345, host="other")
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "other"
