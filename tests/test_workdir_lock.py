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


# Racing takeovers ---------------------------------------------------------------------------------------------

# Runs in a fresh interpreter (no JAX, nothing forked from a process with JAX's threads): forked racers, held in
# step by a barrier, call the lock's own ``_take`` on one stale lock per trial and stay alive until every trial is
# checked (a holder that exited would make its lock stale). A random pause of up to 0.5 ms around each filesystem
# call lets the racers interleave in many orders: without it, two cores order them much the same way each time
# (the rename-aside takeover failed 2 of 300 trials with 4 racers; with it, 46 of 200).
_RACE = r'''
import io, json, multiprocessing as mp, os, random, sys, time
from rollverify_jax.run import workdir_lock as wl

def jitter():
    def wrap(mod, name, skip=False):
        real = getattr(mod, name)
        def call(*a, **k):
            time.sleep(random.random() * 5e-4)
            try:
                return None if skip else real(*a, **k)
            finally:
                time.sleep(random.random() * 5e-4)
        setattr(mod, name, call)
    for name in ("open", "rename", "replace", "link", "unlink", "close"):
        wrap(os, name)
    wrap(os, "fsync", skip=True)  # durability is not what races; an fsync costs ~10 ms here
    wrap(io, "open")

def racer(barrier, results, root, trials):
    sys.stderr = open(os.devnull, "w")
    jitter()
    for t in range(trials):
        barrier.wait()
        try:
            held = wl._take(wl.epath.Path(root, str(t), wl.LOCK_FILE))
            results.put((t, "held", held))
        except ValueError as e:
            results.put((t, "refused", str(e)))
    barrier.wait()

root, trials, racers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = mp.get_context("fork")
dead = ctx.Process(target=int)
dead.start()
dead.join()
for t in range(trials):
    os.makedirs(os.path.join(root, str(t)))
    with open(os.path.join(root, str(t), wl.LOCK_FILE), "w") as f:
        f.write(json.dumps({"pid": dead.pid, "host": wl.socket.gethostname(), "started": time.time() - 60,
                            "started_utc": "-", "command": "killed"}) + "\n")
barrier, results = ctx.Barrier(racers + 1), ctx.Queue()
procs = [ctx.Process(target=racer, args=(barrier, results, root, trials)) for _ in range(racers)]
for p in procs:
    p.start()
outcomes = []
for t in range(trials):
    barrier.wait()
    got = [results.get(timeout=60) for _ in range(racers)]
    lock = os.path.join(root, str(t), wl.LOCK_FILE)
    outcomes.append({"held": [g[2] for g in got if g[1] == "held"],
                     "refused": [g[2] for g in got if g[1] == "refused"],
                     "lock": open(lock).read() if os.path.exists(lock) else None,
                     "files": sorted(os.listdir(os.path.join(root, str(t))))})
barrier.wait()
for p in procs:
    p.join()
print(json.dumps(outcomes))
'''


def test_racing_takeovers_of_a_stale_lock_leave_exactly_one_holder(tmp_path):
    """Launches racing over a lock left by a killed launch: exactly one holds it, the lock is its holder's whole
    record, and nothing else is left beside it. ~2 s (80 trials of 4 racers); the rename-aside takeover this
    replaced failed about 1 trial in 4 here (1 in 10 with 3 racers): two holders, or a lock of ``{}`` that refused
    every later launch."""
    trials, racers = 80, 4
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _RACE, str(tmp_path), str(trials), str(racers)], cwd=root,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    outcomes = json.loads(out.stdout)
    bad = [(t, o) for t, o in enumerate(outcomes)
           if len(o["held"]) != 1 or o["lock"] is None or json.loads(o["lock"]) != o["held"][0]
           or o["files"] != [LOCK_FILE]]
    assert not bad, f"{len(bad)} of {trials} trials: {bad[:3]}"
    refusals = [r for o in outcomes for r in o["refused"]]
    assert len(refusals) == trials * (racers - 1)
    assert all("is in use by another launch" in r or "is being taken over by another launch" in r
               for r in refusals), refusals[:3]


def test_a_damaged_lock_is_refused_with_how_to_clear_it(tmp_path):
    """A lock is written whole, so one that records no launch was cut short or edited: it is said so (it used to
    read as "a launch that is writing it now", forever), with how to clear it."""
    (tmp_path / LOCK_FILE).write_text("{}\n")
    with pytest.raises(ValueError, match=f"{tmp_path / LOCK_FILE} is damaged .*remove {tmp_path / LOCK_FILE} "
                                         "and run again"):
        WorkdirLock.acquire(tmp_path)


def test_a_takeover_killed_midway_leaves_nothing_that_blocks(tmp_path, capsys):
    """A launch killed while it took over a stale lock leaves its takeover marker: the next launch passes over a
    dead creator's marker, takes the lock, and removes the leftovers (markers, a dead process's temporary file)."""
    stale = _lock_of(tmp_path, pid=_dead_pid())
    text = (tmp_path / LOCK_FILE).read_text()
    from rollverify_jax.run.workdir_lock import _marker

    marker = _marker(tmp_path / LOCK_FILE, text, 1)
    marker.write_text(json.dumps({**stale, "pid": _dead_pid()}) + "\n")
    lock = WorkdirLock.acquire(tmp_path)
    assert "warning: taking over the lock" in capsys.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
    lock.release()


def test_a_takeover_in_progress_by_a_live_launch_is_not_joined(tmp_path, live_process):
    """Another live launch holds a takeover marker of this stale lock (the second: the first one's creator died):
    it is taking over now, so this launch is refused and leaves the stale lock and both markers alone (removing the
    dead one would let a third launch in beside the live one)."""
    stale = _lock_of(tmp_path, pid=_dead_pid())
    text = (tmp_path / LOCK_FILE).read_text()
    from rollverify_jax.run.workdir_lock import _marker

    dead, live = _marker(tmp_path / LOCK_FILE, text, 1), _marker(tmp_path / LOCK_FILE, text, 2)
    dead.write_text(json.dumps({**stale, "pid": _dead_pid()}) + "\n")
    live.write_text(json.dumps({**stale, "pid": live_process.pid, "started": time.time()}) + "\n")
    with pytest.raises(ValueError, match=f"is being taken over by another launch \\(pid {live_process.pid} "):
        WorkdirLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == text and dead.exists() and live.exists()
