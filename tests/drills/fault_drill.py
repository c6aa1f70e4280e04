"""Fault drill: runs every fault the trainer must survive on the tiny RollVerify config and prints a matrix.

Each fault is a real launch of the CLI (``python -m rollverify_jax.train``, ``.export``; two processes for the
multi-host faults) in its own workdir under ``--root``, against an uninterrupted reference run of the same
settings (made when a case first needs it). "bit-identical" means the final checkpoint (parameters, optimizer
state, step, PRNG, data position) is bit-identical to the reference's and ``metrics.jsonl`` holds exactly one row
per step. Saves are asynchronous, as by default. The drill compiles into its own cache (``<root>/xla_cache``, or
``--cache``), so its first run compiles and the others load. The tool-use faults go through the run's own tool
environment (``ToolEnvironment.for_tokenizer`` over the tiny tool policy's tokenizer, real sandboxed python
calls), the lock race through ``WorkdirLock.acquire`` in racing processes, and the tool-use kill through the tiny
tool-use config (``configs/tiny_tool_rollverify.gin``).

    python tests/drills/fault_drill.py [--steps 6] [--kills 3] [--only kill9 hosts ...] [--out docs/reliability.md]
    python tests/drills/fault_drill.py --fresh_clone /tmp/drill_clone --out docs/reliability.md

``--fresh_clone DIR`` clones this checkout's HEAD (committed files only) into DIR and runs the drill there with
this interpreter (its installed packages, the clone's code); ``--out`` then rewrites the marked matrix of this
checkout's file. ``--gin_file``, ``--param`` and ``--policy`` replace the tiny run's settings (the suite runs the
injected faults on its own: ``tests/drills/test_drills.py``). Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The drill tests its own checkout's code, in its launches (run from ROOT) and in-process (the final states, the tool
# environment): not whatever copy of the package the interpreter has installed.
sys.path.insert(0, str(ROOT))

# The tiny RollVerify run, made small: a few steps of 8 groups x 4, a checkpoint every step (async, as default).
PARAMS = ["RolloutConfig.batch_groups = 8", "RolloutConfig.group_size = 4", "EngineConfig.num_slots = 16",
          "TrainConfig.eval_size = 16", "TrainConfig.eval_samples = 1", "TrainConfig.eval_every = 0",
          "TrainConfig.time_budget_s = 0.0", "CheckpointConfig.save_interval_steps = 1",
          "CheckpointConfig.max_to_keep = 3", "TrainConfig.metrics_tensorboard = False"]
GIN = "configs/tiny_rollverify.gin"
TOOL_GIN = "configs/tiny_tool_rollverify.gin"  # the tiny tool-use default: the calculator, in RollVerify mode
POLICY, TOOL_POLICY = ROOT / "assets" / "tiny_policy", ROOT / "assets" / "tiny_tool_policy"
TOOL_STEPS = 3  # the tool-use runs (a reference and a killed one): their steps are the drill's longest
ASYNC_GIN = "configs/tiny_rollverify_async.gin"  # the asynchronous mode: 4 rollout + 4 train CPU host devices
ASYNC_ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
CASES = ("kill9", "sigterm", "damage", "restore_error", "all_damaged", "nan", "nan_sigterm", "disk_full",
         "second_launch", "export", "changed_data", "hosts", "grader", "tool_load", "tool_tokens", "lock_race",
         "tool_kill9", "async_kill9")
SETTINGS: list[str] = []  # --param: bindings on top of PARAMS for the tiny RollVerify runs (the suite's settings)
DEVICES_PER_HOST = 2  # the two-host runs: 2 processes x 2 CPU devices, the tiny config's mesh (1, -1, 1)

# Runs the trainer with a fault injected from inside, for the faults no signal or file edit can cause: NaN
# advantages from a step on ("nan") or at one step ("nan_once"; "nan_once_sigterm" also sends itself SIGTERM during
# that step), patched into ``Trainer.learn`` (one of the step's five named calls); a full disk at a step's save; a
# permission error restoring a step (the drill runs as root, where chmod denies nothing). Each injection says so on
# stderr ("drill: injected ...") when it takes effect, and every case checks that line: an injection that no longer
# reaches the code it patches fails its case instead of passing unexercised.
INJECT = r"""
import errno, os, signal, sys
kind, at = sys.argv[1], int(sys.argv[2])

def injected(what):
    print(f"drill: injected {what}", file=sys.stderr, flush=True)

if kind.startswith("nan"):
    import numpy as np
    from rollverify_jax.run.trainer import Trainer
    real_learn = Trainer.learn
    def learn(self, batch):
        if self.step + 1 == at or (kind == "nan" and self.step + 1 >= at):
            batch = {**batch, "advantages": np.full_like(batch["advantages"], np.nan)}
            injected(f"NaN advantages at step {self.step + 1}")
        out = real_learn(self, batch)
        if kind == "nan_once_sigterm" and self.step == at:
            injected(f"SIGTERM during step {at}")
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    Trainer.learn = learn
elif kind == "disk_full":
    from orbax.checkpoint._src.path import atomicity
    from rollverify_jax.run.checkpoint import Checkpointer
    real_save = Checkpointer.save
    def save(self, step, *a, **kw):
        if step >= at:
            self.wait_until_finished()  # the earlier steps' commits are not the fault's
            async def no_space(_):
                injected(f"ENOSPC committing step {step}")
                raise OSError(errno.ENOSPC, "No space left on device")
            atomicity.AtomicRenameTemporaryPath.finalize = no_space
        return real_save(self, step, *a, **kw)
    Checkpointer.save = save
elif kind == "restore_error":  # raised where orbax reads the step's files, as a mount without read access would
    import orbax.checkpoint as ocp
    real_restore = ocp.CheckpointManager.restore
    def restore(self, step, *a, **kw):
        if step == at:
            injected(f"PermissionError restoring step {step}")
            raise PermissionError(errno.EACCES, "Permission denied", f"{self.directory}/{step}/state")
        return real_restore(self, step, *a, **kw)
    ocp.CheckpointManager.restore = restore
else:
    raise SystemExit(f"unknown injection {kind!r}")
from rollverify_jax import train
train.main(sys.argv[3:])
"""


def injected(err: str, what: str = "") -> bool:
    """Whether an injected launch's stderr says its injection took effect (``what``: a part of its line)."""
    return any(line.startswith("drill: injected") and what in line for line in err.splitlines())


def train_cmd(workdir: Path, steps: int, extra=(), gin: str | None = None) -> list[str]:
    """A launch of the tiny RollVerify run (``gin`` None: ``GIN`` with ``SETTINGS``), or of the config ``gin``."""
    settings = (*PARAMS, *(SETTINGS if gin is None else ()), f"TrainConfig.num_steps = {steps}", *extra)
    gin = GIN if gin is None else gin
    return [*([f"--gin_file={gin}"] if gin else []), f"--workdir={workdir}",
            *[f"--gin_param={p}" for p in settings]]


def run(args: list[str], inject: tuple[str, int] | None = None, module: str = "rollverify_jax.train",
        timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", INJECT, *map(str, inject), *args] if inject else \
        [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def start(args: list[str], log: Path, inject: tuple[str, int] | None = None,
          env: dict | None = None) -> subprocess.Popen:
    """A training launch in the background; its stderr goes to ``log`` (a pipe nobody reads could fill)."""
    cmd = [sys.executable, "-c", INJECT, *map(str, inject), *args] if inject else \
        [sys.executable, "-m", "rollverify_jax.train", *args]
    with open(log, "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)


def start_hosts(per_host: list[list[str]], log_dir: Path) -> list[subprocess.Popen]:
    """One launch as ``len(per_host)`` JAX processes on this machine (as ``infra.multihost_local`` starts them),
    each with its own arguments; each process's output goes to ``log_dir/process_<i>.log``."""
    from rollverify_jax.infra.multihost_local import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}"}
    procs = []
    for i, args in enumerate(per_host):
        cmd = [sys.executable, "-m", "rollverify_jax.train", *args, f"--coordinator_address={address}",
               f"--num_processes={len(per_host)}", f"--process_id={i}"]
        with open(log_dir / f"process_{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 900) -> list[int | None]:
    """Exit statuses; a process still running at the deadline is killed and reads None."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def steps_logged(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def rows(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_for_step(procs, workdir: Path, step: int, timeout: float = 900) -> None:
    """Until ``metrics.jsonl`` has a row at ``step`` or later; RuntimeError if a process ends first."""
    procs = procs if isinstance(procs, list) else [procs]
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in steps_logged(workdir)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended (or stalled) before step {step}: exit {[p.poll() for p in procs]}")
        time.sleep(0.1)


def committed(workdir: Path) -> list[int]:
    root = workdir / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists()) \
        if root.is_dir() else []


def tree(path: Path) -> list[tuple[str, int, int]]:
    """Every file under ``path`` with its size and modification time: equal before and after = nothing touched."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def one_error_line(err: str) -> bool:
    """The CLI's refusal: a line starting 'error: ' and no traceback."""
    return "Traceback" not in err and any(line.startswith("error: ") for line in err.splitlines())


def final_state(workdir: Path, policy: Path | None = None):
    import jax

    from rollverify_jax.models import load_pretrained
    from rollverify_jax.run import builder
    from rollverify_jax.run.checkpoint import Checkpointer

    fingerprint = builder.model_fingerprint(load_pretrained(policy or POLICY))
    # Read-only, the newest committed step asked for by number: the drill looks, it never moves a damaged step aside
    # (a restore of the newest step would, and repair what the launch under test left behind).
    with Checkpointer(workdir, model_fingerprint=fingerprint, read_only=True) as ckpt:
        step, state, extra = ckpt.restore(ckpt.latest_step())
    leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
              for x in jax.tree.leaves(state)]
    return step, [jax.device_get(x) for x in leaves], extra


def final_state_with(env: dict | None, workdir: Path, policy: Path | None = None):
    """``final_state`` read by a process that sees ``env``'s devices (None: this one): a checkpoint saved over
    several devices (the asynchronous runs' train mesh) restores onto as many."""
    if env is None:
        return final_state(workdir, policy)
    code = ("import pickle, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import fault_drill; "
            "pickle.dump(fault_drill.final_state(Path(sys.argv[2]), Path(sys.argv[3])), open(sys.argv[4], 'wb'))")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pkl"
        done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(workdir),
                               str(policy or POLICY), str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise ValueError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
        return pickle.loads(out.read_bytes())


def equal_to_reference(workdir: Path, reference, steps: int, policy: Path | None = None,
                       env: dict | None = None) -> tuple[bool, str]:
    import numpy as np

    logged = steps_logged(workdir)
    if logged != list(range(steps + 1)):
        return False, f"metric rows {logged}"
    try:
        step, leaves, extra = final_state_with(env, workdir, policy)
    except (ValueError, OSError) as e:
        return False, f"the final checkpoint cannot be read: {str(e)[:200]}"
    ref_step, ref_leaves, ref_extra = reference
    if step != ref_step:
        return False, f"final checkpoint step {step}, reference {ref_step}"
    same = all(np.array_equal(a, b) for a, b in zip(leaves, ref_leaves, strict=True))
    if not same or extra["data"] != ref_extra["data"]:
        return False, "final state differs from the uninterrupted run"
    return True, "bit-identical to the uninterrupted run; one metric row per step"


class Reference:
    """An uninterrupted run, made the first time a case needs it (``--only`` runs no reference it does not need):
    its workdir and its final state."""

    def __init__(self, workdir: Path, steps: int, gin: str | None = None, policy: Path | None = None,
                 env: dict | None = None):
        self.dir, self.steps, self.gin, self.policy, self.env = workdir, steps, gin, policy, env
        self._state = None

    @property
    def state(self):
        if self._state is None:
            done = run(train_cmd(self.dir, self.steps, gin=self.gin), env=self.env)
            if done.returncode:
                raise RuntimeError(f"the reference run {self.dir.name} failed: {done.stderr[-3000:]}")
            self._state = final_state_with(self.env, self.dir, self.policy)
            print(f"reference {self.dir.name}: {self.steps} steps", flush=True)
        return self._state

    def equal(self, workdir: Path) -> tuple[bool, str]:
        return equal_to_reference(workdir, self.state, self.steps, self.policy, self.env)


def drill(args) -> list[tuple[str, bool, str]]:
    root = Path(args.root).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # Every launch below shares one compilation cache: the drill's own, or the one --cache names.
    os.environ["ROLLVERIFY_COMPILATION_CACHE"] = str(Path(args.cache).absolute() if args.cache else root / "xla_cache")
    steps, out = args.steps, []

    def record(name, ok, detail):
        out.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    ref = Reference(root / "reference", steps)
    tool_ref = Reference(root / "tool_reference", TOOL_STEPS, TOOL_GIN, TOOL_POLICY)
    async_ref = Reference(root / "async_reference", TOOL_STEPS, ASYNC_GIN, POLICY, env=ASYNC_ENV)
    rng = random.Random(args.seed)
    cases = {"kill9": lambda: kill9(root, ref, record, rng, args.kills),
             "sigterm": lambda: sigterm(root, ref, record),
             "damage": lambda: damaged(root, ref, record),
             "restore_error": lambda: restore_error(root, ref, record),
             "all_damaged": lambda: all_damaged(root, ref, record),
             "nan": lambda: nan(root, steps, record),
             "nan_sigterm": lambda: nan_sigterm(root, record),
             "disk_full": lambda: disk_full(root, steps, record),
             "second_launch": lambda: second_launch(root, ref, record),
             "export": lambda: export_into_the_run(root, ref, record),
             "changed_data": lambda: changed_data(root, record),
             "hosts": lambda: hosts(root, steps, record),
             "grader": lambda: record(*grader_load(args.grader_items)),
             "tool_load": lambda: record(*tool_load(args.tool_calls)),
             "tool_tokens": lambda: record(*tool_tokens()),
             "lock_race": lambda: record(*lock_race(root, args.lock_trials)),
             "tool_kill9": lambda: tool_kill9(root, tool_ref, record, rng),
             "async_kill9": lambda: async_kill9(root, async_ref, record, rng)}
    for name in CASES:
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        try:
            cases[name]()
        except Exception as e:  # noqa: BLE001  (a drill that breaks is a failed case, not the end of the drill)
            record(f"{name} (the drill itself)", False, f"{type(e).__name__}: {e}")
        print(f"  [{name}: {time.monotonic() - t0:.0f} s]", flush=True)
    return out


def kill9(root, ref, record, rng, kills):
    """kill -9 at points spread over the run (after step 0 .. steps - 3's metrics row, then a random delay:
    mid-step, mid-commit, mid-write); the resume also takes over the dead launch's lock with a warning."""
    steps = ref.steps
    ref.state  # noqa: B018  (the reference first: its compile fills the cache the timed launches load from)
    for k in range(kills):
        work = root / f"kill9_{k}"
        proc = start(train_cmd(work, steps), root / f"kill9_{k}.log")
        after = k * (steps - 3) // max(kills - 1, 1) if kills > 1 else rng.randint(0, steps - 3)
        delay = rng.uniform(0.0, 3.0)
        wait_for_step(proc, work, after)
        time.sleep(delay)
        running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = max(steps_logged(work), default=-1)
        resumed = run(train_cmd(work, steps))
        took_over = "warning: taking over the lock" in resumed.stderr and "is not running" in resumed.stderr
        ok, detail = ref.equal(work) if resumed.returncode == 0 else \
            (False, f"resume failed: {resumed.stderr[-500:]}")
        if not running:
            ok, detail = False, "the run had ended before the kill (drill timing: fewer --steps after the kill)"
        record(f"kill -9 {delay:.1f} s after step {after}'s row (last row: step {killed_at}), resume",
               ok and took_over, f"{detail}; stale lock taken over with a warning: {took_over}")


def sigterm(root, ref, record):
    steps = ref.steps
    ref.state  # noqa: B018
    work = root / "sigterm"
    proc = start(train_cmd(work, steps), root / "sigterm.log")
    wait_for_step(proc, work, 2)
    proc.send_signal(signal.SIGTERM)
    wait_all([proc], 600)
    err = (root / "sigterm.log").read_text()
    saved = "stopped by SIGTERM: checkpoint" in err and "committed" in err
    resumed = run(train_cmd(work, steps))
    ok, detail = ref.equal(work) if resumed.returncode == 0 else (False, "resume failed")
    record("SIGTERM mid-run, resume", ok and proc.returncode == 143 and saved,
           f"exit {proc.returncode}, checkpoint committed: {saved}; {detail}")


def damaged(root, ref, record):
    """The LAST checkpoint (at ``TrainConfig.num_steps``) damaged, the same command launched again: it must not
    take the run for complete, but set the step aside (saying why), redo it and end bit-identical to the
    reference. A run-complete shortcut that trusts the checkpoint listing fails the first two."""
    steps = ref.steps
    ref.state  # noqa: B018
    for damage in ("truncated array file", "missing item", "no commit marker"):
        work = root / damage.replace(" ", "_")
        shutil.copytree(ref.dir, work)
        newest = work / "checkpoints" / str(steps)
        if damage == "truncated array file":
            for f in (p for p in (newest / "state").rglob("*") if p.is_file() and p.parent.name == "d"):
                if f.stat().st_size > 1000:
                    f.write_bytes(f.read_bytes()[:64])
        elif damage == "missing item":
            shutil.rmtree(newest / "extra")
        else:
            (newest / "commit_success.txt").unlink()
        resumed = run(train_cmd(work, steps))
        complete = "run complete" in resumed.stdout + resumed.stderr
        aside = [p.name for p in (work / "checkpoints").iterdir() if not p.name.isdigit()]
        said = any(w in resumed.stderr for w in ("cannot be read", "never committed", "damaged"))
        redone = f"resumed from checkpoint step {steps - 1}" in resumed.stdout
        ok, detail = ref.equal(work) if resumed.returncode == 0 else \
            (False, f"exit {resumed.returncode}: {resumed.stderr[-300:]}")
        record(f"last checkpoint (step {steps} = TrainConfig.num_steps) damaged ({damage}), the same command again",
               ok and said and bool(aside) and redone and not complete,
               f"said 'run complete': {complete}; warned: {said}, kept aside: {aside}, step {steps} redone from "
               f"step {steps - 1}: {redone}; {detail}")

    work = root / "interrupted_commit"
    shutil.copytree(ref.dir, work)
    (work / "checkpoints" / f"{steps + 1}.orbax-checkpoint-tmp").mkdir()
    resumed = run(train_cmd(work, steps + 1))
    said = "interrupted before it committed" in resumed.stderr
    record("interrupted commit (tmp directory) on disk, resume", resumed.returncode == 0 and said,
           f"exit {resumed.returncode}, named in one line: {said}")


def restore_error(root, ref, record):
    """A permission error restoring the newest step of a run that goes on (``num_steps`` one more) is not damage:
    one line, exit 2, nothing renamed; without the fault the same command resumes from that very step."""
    steps = ref.steps
    ref.state  # noqa: B018
    work = root / "restore_error"
    shutil.copytree(ref.dir, work)
    before = tree(work)
    done = run(train_cmd(work, steps + 1), inject=("restore_error", steps))
    said = f"checkpoints/{steps} could not be restored" in done.stderr and "Permission denied" in done.stderr \
        and "nothing was moved" in done.stderr and one_error_line(done.stderr)
    took = injected(done.stderr, f"restoring step {steps}")
    untouched = tree(work) == before
    again = run(train_cmd(work, steps + 1))
    resumed = again.returncode == 0 and f"resumed from checkpoint step {steps}" in again.stdout
    record(f"permission error restoring the newest step ({steps}), twice the same command (fault, then none)",
           done.returncode == 2 and took and said and untouched and resumed,
           f"exit {done.returncode}, injected: {took}, one line naming the step and the error: {said}, workdir "
           f"untouched (nothing renamed, metrics.jsonl as it was): {untouched}; without the fault: exit "
           f"{again.returncode}, resumed from step {steps}: {resumed}")


def all_damaged(root, ref, record):
    """Every checkpoint damaged (the last one at ``num_steps`` too): the first start sets them aside and refuses
    to start over, so does the second; metrics.jsonl is kept whole; --restart_from_scratch starts at step 0 and
    keeps the old rows aside."""
    steps = ref.steps
    ref.state  # noqa: B018
    work = root / "all_damaged"
    shutil.copytree(ref.dir, work)
    for step in committed(work):
        (work / "checkpoints" / str(step) / "extra" / "metadata").unlink()
    history = (work / "metrics.jsonl").read_text()
    first, second = run(train_cmd(work, steps)), run(train_cmd(work, steps))
    aside = sorted(p.name for p in (work / "checkpoints").iterdir())
    refused = [c.returncode for c in (first, second)] == [2, 2] and all(
        "has no checkpoint that can be restored, but a run was there" in c.stderr and one_error_line(c.stderr)
        for c in (first, second))
    kept = (work / "metrics.jsonl").read_text() == history
    scratch = run([*train_cmd(work, 1), "--restart_from_scratch"])
    old = work / "metrics.before_restart.jsonl"
    restarted = scratch.returncode == 0 and steps_logged(work) == [0, 1] and old.exists() and \
        old.read_text() == history
    record("every checkpoint damaged: start twice, then --restart_from_scratch",
           refused and kept and bool(aside) and all(a.endswith(".corrupt") for a in aside) and restarted,
           f"exit {first.returncode} then {second.returncode} (one line: {refused}), set aside: {aside}, "
           f"metrics.jsonl whole: {kept}; --restart_from_scratch: exit {scratch.returncode}, steps "
           f"{steps_logged(work)}, old rows kept as {old.name}: {restarted}")


def nan(root, steps, record, at: int = 2):
    """NaN advantages from step ``at`` on with ``max_skipped_steps = 2``: steps ``at`` and ``at + 1`` are skipped
    (their rows report a non-finite loss), the stop commits step ``at + 1``'s state (step ``at - 1``'s params)."""
    work = root / "nan"
    done = run(train_cmd(work, steps, ("TrainConfig.max_skipped_steps = 2",)), inject=("nan", at))
    latest = final_state(work)[0] if committed(work) else None
    said = "updates skipped (non-finite loss" in done.stderr and "in a row had non-finite" in done.stderr
    took = injected(done.stderr, f"NaN advantages at step {at}")
    flagged = {r["step"]: bool(r.get("train/nonfinite_loss")) and bool(r.get("train/skipped_updates"))
               for r in rows(work) if r["step"] > 0} if (work / "metrics.jsonl").exists() else {}
    seen = flagged == {s: s >= at for s in range(1, at + 2)}
    record(f"NaN loss injected from step {at}", done.returncode == 3 and latest == at + 1 and said and took and seen,
           f"exit {done.returncode}, latest checkpoint {latest}, reported: {said}; injected: {took}, rows with "
           f"train/nonfinite_loss and train/skipped_updates: {sorted(s for s, f in flagged.items() if f)}")


def nan_sigterm(root, record, steps: int = 4, at: int = 2):
    """SIGTERM during a step whose update is skipped (NaN at that step only): the stop commits that step (its
    state is the last applied update's) and the resume equals a run that was never stopped."""
    ref = root / "nan_once_reference"
    done = run(train_cmd(ref, steps), inject=("nan_once", at))
    if done.returncode:
        raise RuntimeError(f"the reference run with a NaN at step {at} failed: {done.stderr[-500:]}")
    reference = final_state(ref)
    work = root / "nan_sigterm"
    stopped = run(train_cmd(work, steps), inject=("nan_once_sigterm", at))
    took = injected(done.stderr, f"NaN advantages at step {at}") and \
        injected(stopped.stderr, f"SIGTERM during step {at}")
    said = f"stopped by SIGTERM: checkpoint {work / 'checkpoints' / str(at)} committed" in stopped.stderr
    skipped = [r.get("train/skipped_updates") for r in rows(work) if r["step"] > 0]
    saved = committed(work)
    resumed = run(train_cmd(work, steps), inject=("nan_once", at))
    ok, detail = equal_to_reference(work, reference, steps) if resumed.returncode == 0 else \
        (False, f"resume failed: {resumed.stderr[-500:]}")
    record(f"SIGTERM on a NaN-skipped step ({at}), resume",
           stopped.returncode == 143 and took and said and saved[-1:] == [at] and skipped[-1:] == [1] and ok,
           f"exit {stopped.returncode}, injected: {took}, step {at} (skipped: {skipped[-1:] == [1]}) committed: "
           f"{said}; {detail} (with the same NaN)")


def disk_full(root, steps, record, at: int = 2):
    """ENOSPC committing step ``at``'s checkpoint: one message, exit 2, step ``at - 1`` the latest intact one."""
    work = root / "disk_full"
    done = run(train_cmd(work, steps), inject=("disk_full", at))
    latest = final_state(work)[0] if committed(work) else None
    clean = "No space left on device" in done.stderr and "Traceback" not in done.stderr
    took = injected(done.stderr, f"ENOSPC committing step {at}")
    record(f"disk full at step {at}'s checkpoint", done.returncode == 2 and latest == at - 1 and clean and took,
           f"exit {done.returncode}, latest intact checkpoint {latest}, one message: {clean}, injected: {took}")


def second_launch(root, ref, record):
    """The same command again while the first launch trains (saving every step, asynchronously): refused naming
    the first; the first ends bit-identical to the reference, every save of its own committed."""
    steps = ref.steps
    ref.state  # noqa: B018
    work = root / "second_launch"
    first = start(train_cmd(work, steps), root / "second_launch.log")
    wait_for_step(first, work, 1)
    second = run(train_cmd(work, steps))
    was_running = first.poll() is None
    wait_all([first], 900)
    refused = second.returncode == 2 and f"is in use by another launch (pid {first.pid} on host" in second.stderr \
        and one_error_line(second.stderr)
    ok, detail = ref.equal(work) if first.returncode == 0 else \
        (False, f"the first launch failed: exit {first.returncode}")
    record("a second launch into a running workdir", refused and was_running and ok,
           f"exit {second.returncode}, naming the first launch's pid: {refused}; the first, running throughout: "
           f"{was_running}, exit {first.returncode}, {detail}")


def export_into_the_run(root, ref, record):
    """``export --overwrite`` with ``--out`` the workdir, its checkpoints, a directory inside them, or a parent:
    each refused in one line, nothing touched; an export elsewhere then succeeds."""
    ref.state  # noqa: B018
    parent = root / "export"
    work = parent / "run"
    shutil.copytree(ref.dir, work)
    before = tree(parent)
    refusals = []
    for out, what in ((work, "is the run's workdir"), (work / "checkpoints", "is the run's checkpoints"),
                      (work / "checkpoints" / "hf", "lies inside the run's checkpoints"),
                      (parent, "holds the run's workdir")):
        done = run([f"--checkpoint={work}", f"--out={out}", "--overwrite"], module="rollverify_jax.export")
        refusals.append(done.returncode == 2 and what in done.stderr and one_error_line(done.stderr))
    untouched = tree(parent) == before
    elsewhere = root / "export_elsewhere"
    done = run([f"--checkpoint={work}", f"--out={elsewhere}"], module="rollverify_jax.export")
    exported = done.returncode == 0 and (elsewhere / "config.json").exists()
    record("export --overwrite into the run (--out: the workdir, checkpoints/, inside it, a parent)",
           all(refusals) and untouched and exported,
           f"refused in one line, exit 2: {refusals}; workdir untouched: {untouched}; an export elsewhere: exit "
           f"{done.returncode}")


def changed_data(root, record):
    """The train data file rewritten in place with other prompts, same row count: the resume is refused naming
    the data's hash, nothing trained."""
    from rollverify_jax.data.datasets import load_synthetic

    data, work = root / "changed_data.jsonl", root / "changed_data"

    def write(seed):
        records = load_synthetic(n=64, seed=seed, split="train", max_steps=6)
        data.write_text("".join(json.dumps({"problem": r["prompt"], "answer": r["answer"]}) + "\n" for r in records))

    extra = ("TrainConfig.train_dataset = 'aime_jsonl'",
             f"TrainConfig.train_dataset_kwargs = {{'path': '{data}', 'apply_template': False}}")
    write(0)
    first = run(train_cmd(work, 1, extra))
    if first.returncode:
        raise RuntimeError(f"the run on {data} failed: {first.stderr[-500:]}")
    before, lines = tree(work), len(data.read_text().splitlines())
    write(1)
    resumed = run(train_cmd(work, 2, extra))
    named = re.search(r"data\.train_sha256: checkpoint '[0-9a-f]{64}', now '[0-9a-f]{64}'", resumed.stderr) is not None
    same_rows = len(data.read_text().splitlines()) == lines
    untouched = tree(work) == before
    record("train data file edited in place (same row count), resume",
           resumed.returncode == 2 and named and same_rows and untouched and one_error_line(resumed.stderr),
           f"exit {resumed.returncode}, names data.train_sha256: {named}, nothing trained or written: {untouched}")


def hosts(root, steps, record):
    """Two processes of one run: SIGTERM to process 1 only stops both after the same step, both commit it and exit
    143, and the two-process resume completes; process 1's time budget alone (1 s) ends both after one step."""
    work = root / "hosts_sigterm"
    procs = start_hosts([train_cmd(work, steps)] * 2, root / "hosts_sigterm_logs")
    try:
        wait_for_step(procs, work, 2)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    procs[1].send_signal(signal.SIGTERM)
    codes = wait_all(procs, 900)
    logs = [(root / "hosts_sigterm_logs" / f"process_{i}.log").read_text() for i in range(2)]
    said = [re.findall(r"stopped by SIGTERM: checkpoint \S+/checkpoints/(\d+) committed", log) for log in logs]
    saved = committed(work)
    last = max(steps_logged(work), default=None)
    same = all(s == [str(last)] for s in said) and saved[-1:] == [last]
    procs = start_hosts([train_cmd(work, steps)] * 2, root / "hosts_resume_logs")
    resumed = wait_all(procs, 900)
    complete = resumed == [0, 0] and steps_logged(work) == list(range(steps + 1))
    record("SIGTERM to one of two hosts, then a two-host resume", codes == [143, 143] and same and complete,
           f"exit {codes}, both committed step {[s[0] if s else None for s in said]} (last row {last}, latest "
           f"checkpoint {saved[-1:]}); resume: exit {resumed}, one row per step: {complete}")

    work = root / "hosts_budget"
    procs = start_hosts([train_cmd(work, steps), train_cmd(work, steps, ("TrainConfig.time_budget_s = 1.0",))],
                        root / "hosts_budget_logs")
    codes = wait_all(procs, 600)  # before the agreed budget, process 0 hung in the next step's collectives
    logged = steps_logged(work)
    ended = logged[-1:] == [1] and committed(work)[-1:] == [1] and "eval/accuracy" in rows(work)[-1]
    record("the time budget passed on one of two hosts' clocks only (process 1: 1 s, process 0: none)",
           codes == [0, 0] and ended,
           f"exit {codes}, both ended after step {logged[-1] if logged else None} with its evaluation and "
           f"checkpoint: {ended}")


def grader_load(n: int) -> tuple[str, bool, str]:
    """``n`` responses, 5% hanging and 5% crashing graders: every other reward lands on its own item."""
    import numpy as np
    from drill_grader import faulty_grader  # a sibling: tests/drills/ is on sys.path when this file runs

    from rollverify_jax.data.rewards import RewardScorer, RewardSpec

    scorer = RewardScorer("math", timeout_s=1.0, num_workers=4, hard_timeout_grace_s=2.0)
    scorer.spec = RewardSpec(fn=faulty_grader, isolated=True)
    faults = np.random.default_rng(0).permutation(n)[: n // 10]
    answers = [str(i + (i % 2)) for i in range(n)]
    for k, i in enumerate(faults):
        answers[i] = "hang" if k % 2 else "crash"
    t0 = time.monotonic()
    got, metrics = scorer.score([f"Answer: {i}" for i in range(n)], answers)
    elapsed = time.monotonic() - t0
    scorer.close()
    want = np.asarray([float(i % 2 == 0) for i in range(n)], np.float32)
    want[faults] = 0.0
    ok = bool((got == want).all()) and metrics["reward/grader_timeouts"] == n // 20
    return (f"grader faults under load ({n} responses, 5% hang, 5% crash)", ok,
            f"{int((got == want).sum())}/{n} rewards right, {metrics['reward/grader_timeouts']:.0f} timeouts, "
            f"{metrics['reward/grader_errors']:.0f} errors, {metrics['reward/grader_worker_restarts']:.0f} worker "
            f"restarts, {metrics['reward/grader_pool_restarts']:.0f} pool restarts, {elapsed:.0f} s")


def _tool_environment(tools: tuple[str, ...], timeout_s: float):
    """A tool environment over the tiny tool policy's tokenizer (a character vocabulary with ``<|endoftext|>``,
    ``<|im_end|>`` ... as special tokens), built as a run builds it (``ToolEnvironment.for_tokenizer``)."""
    from rollverify_jax.models import Tokenizer
    from rollverify_jax.rollout.tool_use import ToolEnvironment, ToolUseConfig

    tokenizer = Tokenizer.from_dir(TOOL_POLICY)
    config = ToolUseConfig(enabled=True, tools=tools, call_end_token="</calculator>", timeout_s=timeout_s,
                           max_reply_tokens=512)
    return tokenizer, ToolEnvironment.for_tokenizer(config, tokenizer)


def _call(tokenizer, i: int, text: str):
    """A parked trajectory whose turn ends with the call ``text``, as the scheduler hands it to ``request``."""
    import numpy as np

    from rollverify_jax.rollout.trajectory import Trajectory

    return Trajectory(uid=i, group_id=i, prompt=np.zeros(1, np.int32), seed=i, max_new_tokens=2048,
                      tokens=tokenizer.encode(text))


def _replies(env, requests, deadline_s: float) -> list[list[int] | None]:
    """Polls every request as the scheduler does between decode dispatches, until each has its reply."""
    replies: list[list[int] | None] = [None] * len(requests)
    deadline = time.monotonic() + deadline_s
    while any(r is None for r in replies) and time.monotonic() < deadline:
        for i, request in enumerate(requests):
            if replies[i] is None:
                replies[i] = env.reply(request, 1024)
        time.sleep(0.005)
    return replies


def tool_load(n: int, seconds: float = 0.35, timeout_s: float = 2.0) -> tuple[str, bool, str]:
    """``n`` python-tool calls of ``seconds`` each (a sleep, then a print of the call's own number), requested at
    once as ``n`` slots parked on a call would, through the run's tool environment, with a timeout a few times a
    call's run time: no call may be answered as a timeout (the time a call waits for a worker is not its run
    time) and every reply must hold its own call's output (the call ran)."""
    tokenizer, env = _tool_environment(("python",), timeout_s)
    code = "import time; time.sleep({s}); print('ran call {i}')"
    t0 = time.monotonic()
    try:
        requests = [env.request(_call(tokenizer, i, f"<python>{code.format(s=seconds, i=i)}</python>"))
                    for i in range(n)]
        replies = _replies(env, requests, n * seconds + 300)
    finally:
        env.close()
    elapsed = time.monotonic() - t0
    texts = [tokenizer.decode(r) if r is not None else None for r in replies]
    unanswered = sum(t is None for t in texts)
    errors = sum(t is not None and "Error" in t for t in texts)
    timeouts = sum(t is not None and ("ran past" in t or "timed out" in t or "timeout" in t.lower()) for t in texts)
    ran = sum(t is not None and f"ran call {i}" in t for i, t in enumerate(texts))
    ok = unanswered == 0 and errors == 0 and ran == n
    example = next((t.strip() for t in texts if t is not None and "Error" in t), "")
    return (f"tool calls under load ({n} python calls of {seconds:g} s at once, timeout {timeout_s:g} s)", ok,
            f"{ran}/{n} ran (their own output in the reply), {timeouts} answered as a timeout, {errors} error "
            f"replies, {unanswered} unanswered, {elapsed:.0f} s" + (f"; e.g. {example[:80]!r}" if example else ""))


def tool_tokens() -> tuple[str, bool, str]:
    """A python-tool call whose output holds the special tokens' text (``<|endoftext|>``, ``<|im_end|>``,
    ``<|im_start|>``, as any program output, web page or file may): the reply (the trajectory's environment span)
    holds no special token id, and the output around them reaches the policy."""
    tokenizer, env = _tool_environment(("python",), 10.0)
    # Written split, so that the call itself holds no special token: only the program's output does.
    code = "print('a <|endof' + 'text|> b <|im_' + 'end|> c <|im_st' + 'art|>assistant d')"
    try:
        reply = _replies(env, [env.request(_call(tokenizer, 0, f"<python>{code}</python>"))], 60)[0]
    finally:
        env.close()
    if reply is None:
        return "special tokens in a tool reply", False, "no reply within 60 s"
    special = set(tokenizer.special_tokens.values())
    found = sorted({tokenizer.decode([i], skip_special_tokens=False) for i in reply if i in special})
    text = tokenizer.decode(reply, skip_special_tokens=False)
    around = all(f" {c}" in text for c in "bcd") and "a " in text
    kept = "<|endoftext|>" in text and "<|im_end|>" in text
    return ("special tokens in a tool reply (program output with <|endoftext|>, <|im_end|>, <|im_start|>)",
            not found and around and "Error" not in text,
            f"special ids in the environment span: {found or 'none'}; the output around them kept: {around}; "
            f"the strings kept as text: {kept}")


# One launch's lock acquisition, repeated: each line on stdin names a workdir and a start time; the racer spins
# until that time (so the racers start within microseconds of the times they were given), tries the lock, and
# answers "held" or "refused".
RACER = r"""
import sys, time
from rollverify_jax.run.workdir_lock import WorkdirLock
print("ready", flush=True)
for line in sys.stdin:
    workdir, at = line.split()
    while time.time() < float(at):
        pass
    try:
        WorkdirLock.acquire(workdir)
        print("held", flush=True)
    except ValueError:
        print("refused", flush=True)
"""


def lock_race(root, trials: int, racers: int = 4) -> tuple[str, bool, str]:
    """``trials`` times, ``racers`` launches (processes) take the workdir lock at the same instant over a stale
    lock left by a killed launch (a dead pid on this host): exactly one holds it each time, and the lock file then
    names that holder (none left empty, which would refuse every later launch)."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"pid": dead.pid, "host": socket.gethostname(), "started": time.time() - 60,
             "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() - 60)),
             "command": "python -m rollverify_jax.train (killed)", "slurm_job_id": None, "slurm_restart_count": "0"}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", RACER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(racers)]
    two, none, wrong = 0, 0, 0
    examples = []
    rng = random.Random(0)
    t0 = time.monotonic()
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a racer did not start")
        for k in range(trials):
            work = root / "lock_race" / str(k)
            work.mkdir(parents=True)
            (work / "run.lock").write_text(json.dumps(stale) + "\n")
            # Start times spread over a millisecond: one takeover (rename aside, check, remove, create) takes some
            # hundred microseconds, so the racers meet at every stage of each other's takeover.
            at = time.time() + 0.02
            for p in procs:
                p.stdin.write(f"{work} {at + rng.uniform(0.0, 0.001)}\n")
                p.stdin.flush()
            held = [p.pid for p in procs if p.stdout.readline().strip() == "held"]
            try:
                left = json.loads((work / "run.lock").read_text())
            except (OSError, ValueError):
                left = None
            two += len(held) > 1
            none += not held
            bad = not (len(held) == 1 and isinstance(left, dict) and left.get("pid") == held[0])
            wrong += bad
            if bad and len(examples) < 3:
                examples.append(f"trial {k}: holders {held}, lock holds {left}")
            shutil.rmtree(work)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    return (f"racing stale-lock takeovers ({trials} trials of {racers} launches over a dead launch's lock)",
            wrong == 0,
            f"{two} trials with two or more holders, {none} with none, {wrong} where the lock file does not name "
            f"the one holder, {time.monotonic() - t0:.0f} s" + (f"; {'; '.join(examples)}" if examples else ""))


def kill9_after_first_commit(root, ref, name: str, delay: float) -> tuple[bool, str, int, Path]:
    """Launches ``ref``'s config in ``root/name``, kill -9s it ``delay`` s after step 1's checkpoint commits (the
    resume starts from it), reruns the same command and compares with ``ref``: (ok, detail, last row before the
    kill, workdir)."""
    ref.state  # noqa: B018
    work = root / name
    cmd = train_cmd(work, ref.steps, gin=ref.gin)
    proc = start(cmd, root / f"{name}.log", env=ref.env)
    wait_for_step(proc, work, 1)
    while 1 not in committed(work) and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(delay)
    running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(steps_logged(work), default=-1)
    resumed = run(cmd, env=ref.env)
    ok, detail = ref.equal(work) if resumed.returncode == 0 else \
        (False, f"resume failed: {resumed.stderr[-500:]}")
    if not running:
        ok, detail = False, "the run had ended before the kill"
    return ok, detail, killed_at, work


def logged(work: Path, key: str) -> list:
    """``key`` of every training step's metrics row (none when the run wrote none)."""
    return [r.get(key) for r in rows(work) if r["step"] > 0] if (work / "metrics.jsonl").exists() else []


def tool_kill9(root, ref, record, rng):
    """kill -9 during a tool-use run (``configs/tiny_tool_rollverify.gin``: calculator calls in the rollout), a
    moment after step 1's checkpoint commits (mid-rollout of step 2: the rollout is most of a step), then the same
    command: bit-identical to an uninterrupted tool-use run (which needs tool-use batches that do not depend on
    thread timing)."""
    delay = rng.uniform(0.0, 1.5)
    ok, detail, killed_at, work = kill9_after_first_commit(root, ref, "tool_kill9", delay)
    record(f"kill -9 in a tool-use rollout ({delay:.1f} s after step 1's commit, last row: step {killed_at}), resume",
           ok, f"{detail}; tool calls per step {logged(work, 'tools/calls')}")


def async_kill9(root, ref, record, rng):
    """kill -9 during an asynchronous run (``configs/tiny_rollverify_async.gin`` on 4 + 4 CPU host devices) a
    moment after step 1's checkpoint commits (step 2's rollout, its update or the overlap decoding beside it),
    then the same command: bit-identical to an uninterrupted run (paused trajectories, groups in flight and the
    published version all come back from the checkpoint)."""
    delay = rng.uniform(0.0, 3.0)
    ok, detail, killed_at, work = kill9_after_first_commit(root, ref, "async_kill9", delay)
    record(f"kill -9 in an asynchronous run ({delay:.1f} s after step 1's commit, last row: step {killed_at}), "
           "resume", ok, f"{detail}; published versions {logged(work, 'publish/version')}")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def write_matrix(path: Path, rows: list[tuple[str, bool, str]], summary: str, how: str, load: float) -> None:
    """Replaces the block between the two ``<!-- fault drill -->`` markers of ``path`` (appends one if none)."""
    dirty = git("status", "--porcelain", "--untracked-files=no")
    state = "a clean tree" if not dirty else f"uncommitted changes in {len(dirty.splitlines())} tracked files"
    lines = [f"Measured at commit `{git('rev-parse', '--short', 'HEAD')}` ({state}) {how}, on {os.cpu_count()} CPU "
             f"cores (load average {load:.1f} at the start).", "",
             "| fault | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |" for name, ok, detail in rows]
    lines += ["", summary]
    text = path.read_text() if path.exists() else ""
    marker = "<!-- fault drill -->"
    block = marker + "\n" + "\n".join(lines) + "\n" + marker
    if marker in text:
        before, _, rest = text.partition(marker)
        text = before + block + rest.partition(marker)[2]
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


def fresh_clone(args) -> None:
    """Clones HEAD into ``args.fresh_clone`` and runs the drill there (this interpreter, the clone's code)."""
    clone = Path(args.fresh_clone).absolute()
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    cmd = [sys.executable, str(clone / "tests" / "drills" / "fault_drill.py"), f"--steps={args.steps}",
           f"--kills={args.kills}", f"--grader_items={args.grader_items}", f"--seed={args.seed}",
           f"--tool_calls={args.tool_calls}", f"--lock_trials={args.lock_trials}",
           *[f"--param={p}" for p in args.param], *([f"--policy={args.policy}"] if args.policy else []),
           *([f"--cache={args.cache}"] if args.cache else []), f"--gin_file={args.gin_file}",
           f"--root={clone / 'runs' / 'fault_drill'}", *(["--only", *args.only] if args.only else [])]
    if args.out:
        cmd += [f"--out={Path(args.out).absolute()}",
                f"--how=on a fresh clone (`python tests/drills/fault_drill.py --fresh_clone {args.fresh_clone} --out "
                f"{args.out}`: `git clone` of HEAD, run by `{sys.executable}` on the clone's code)"]
    env = {**os.environ, "PYTHONPATH": str(clone)}
    print(f"fault drill in a fresh clone of {git('rev-parse', '--short', 'HEAD')}: {clone}", flush=True)
    raise SystemExit(subprocess.run(cmd, cwd=clone, env=env).returncode)


def main() -> None:
    global POLICY, GIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--grader_items", type=int, default=1000)
    ap.add_argument("--tool_calls", type=int, default=128, help="tool_load: python-tool calls at once")
    ap.add_argument("--lock_trials", type=int, default=2000, help="lock_race: trials of 4 racing launches")
    ap.add_argument("--cache", default=None, help="the launches' compilation cache (default: <root>/xla_cache)")
    ap.add_argument("--param", action="append", default=[], metavar="BINDING",
                    help="a gin binding on top of the drill's for its tiny RollVerify runs (repeatable)")
    ap.add_argument("--policy", default=None, help="the policy of those runs (default: assets/tiny_policy)")
    ap.add_argument("--gin_file", default=GIN, help="their config ('': none, the defaults and --param alone)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default="runs/fault_drill")
    ap.add_argument("--out", default=None, help="also write the matrix into this markdown file (a marked block)")
    ap.add_argument("--only", nargs="*", default=[], choices=CASES, metavar="CASE",
                    help=f"run only these faults: {' '.join(CASES)} (default: all)")
    ap.add_argument("--fresh_clone", default=None, metavar="DIR",
                    help="clone HEAD into DIR (replacing it) and run the drill there")
    ap.add_argument("--how", default=None, help=argparse.SUPPRESS)  # how the run was made, for --out
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be >= 4 (the kills land after step 0 .. steps - 3, SIGTERM after step 2)")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    GIN = args.gin_file
    if args.policy:
        POLICY = Path(args.policy).absolute()
        SETTINGS.append(f"TrainConfig.policy_path = '{POLICY}'")
    SETTINGS.extend(args.param)
    if args.fresh_clone:
        fresh_clone(args)
    t0, load = time.time(), os.getloadavg()[0]
    rows = drill(args)
    passed = sum(ok for _, ok, _ in rows)
    summary = f"fault drill: {passed} of {len(rows)} checks pass ({time.time() - t0:.0f} s)"
    print(summary)
    if args.out:
        how = args.how or f"with `python tests/drills/fault_drill.py --out {args.out}`"
        write_matrix(Path(args.out), rows, summary, how, load)
    raise SystemExit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()
