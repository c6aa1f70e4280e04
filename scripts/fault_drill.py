"""Fault drill: runs every fault the trainer must survive on the tiny RollVerify config and prints a matrix.

Each fault runs in its own workdir under ``--root`` against an uninterrupted reference run of the same
settings. "equal" means the final checkpoint (parameters, optimizer state, step, PRNG) is bit-identical to the
reference's and ``metrics.jsonl`` holds exactly one row per step.

    python scripts/fault_drill.py [--steps 6] [--kills 3] [--out docs/reliability.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The tiny RollVerify run, made small: a few steps of 8 groups x 4, a checkpoint every step (async, as default).
PARAMS = ["RolloutConfig.batch_groups = 8", "RolloutConfig.group_size = 4", "EngineConfig.num_slots = 16",
          "TrainConfig.eval_size = 16", "TrainConfig.eval_samples = 1", "TrainConfig.eval_every = 0",
          "TrainConfig.time_budget_s = 0.0", "CheckpointConfig.save_interval_steps = 1",
          "CheckpointConfig.max_to_keep = 3", "TrainConfig.metrics_tensorboard = False"]

# Runs the trainer with a fault injected from inside (NaN batches, a full disk), for the faults no signal or
# file edit can cause.
INJECT = r'''
import errno, sys
import numpy as np
from rollverify_jax import train
kind, at = sys.argv[1], int(sys.argv[2])
if kind == "nan":
    real = train.learn
    def learn(run, batch):
        if run.step + 1 >= at:
            batch = {**batch, "advantages": np.full_like(batch["advantages"], np.nan)}
        return real(run, batch)
    train.learn = learn
if kind == "disk_full":
    from orbax.checkpoint._src.path import atomicity
    from rollverify_jax.checkpoint import Checkpointer
    real_save = Checkpointer.save
    def save(self, step, *a, **kw):
        if step >= at:
            async def no_space(_):
                raise OSError(errno.ENOSPC, "No space left on device")
            atomicity.AtomicRenameTemporaryPath.finalize = no_space
        return real_save(self, step, *a, **kw)
    Checkpointer.save = save
train.main(sys.argv[3:])
'''


def train_cmd(workdir: Path, steps: int, extra=()) -> list[str]:
    return ["--gin_file=configs/tiny_rollverify.gin", f"--workdir={workdir}",
            *[f"--gin_param={p}" for p in (*PARAMS, f"TrainConfig.num_steps = {steps}", *extra)]]


def run(args: list[str], inject: tuple[str, int] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", INJECT, *map(str, inject), *args] if inject else \
        [sys.executable, "-m", "rollverify_jax.train", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollverify_jax.train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps_logged(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(proc: subprocess.Popen, workdir: Path, step: int) -> None:
    while not any(s >= step for s in steps_logged(workdir)):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)


def final_state(workdir: Path):
    import jax

    from rollverify_jax import setup
    from rollverify_jax.checkpoint import Checkpointer
    from rollverify_jax.models import load_pretrained

    fingerprint = setup.model_fingerprint(load_pretrained(ROOT / "assets" / "tiny_policy"))
    with Checkpointer(workdir, model_fingerprint=fingerprint) as ckpt:
        step, state, extra = ckpt.restore()
    leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
              for x in jax.tree.leaves(state)]
    return step, [jax.device_get(x) for x in leaves], extra


def equal_to_reference(workdir: Path, reference, steps: int) -> tuple[bool, str]:
    import numpy as np

    logged = steps_logged(workdir)
    if logged != list(range(steps + 1)):
        return False, f"metric rows {logged}"
    step, leaves, extra = final_state(workdir)
    ref_step, ref_leaves, ref_extra = reference
    if step != ref_step:
        return False, f"final checkpoint step {step}, reference {ref_step}"
    same = all(np.array_equal(a, b) for a, b in zip(leaves, ref_leaves, strict=True))
    if not same or extra["data"] != ref_extra["data"]:
        return False, "final state differs from the uninterrupted run"
    return True, "bit-identical to the uninterrupted run; one metric row per step"


def drill(args) -> list[tuple[str, bool, str]]:
    root = Path(args.root).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    steps, rows = args.steps, []
    rng = random.Random(args.seed)

    def record(name, ok, detail):
        rows.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    ref_dir = root / "reference"
    done = run(train_cmd(ref_dir, steps))
    if done.returncode:
        raise SystemExit(f"the reference run failed:\n{done.stderr[-3000:]}")
    reference = final_state(ref_dir)
    print(f"reference: {steps} steps", flush=True)

    def wanted(name):
        return not args.only or name in args.only

    for k in range(args.kills if wanted("kill9") else 0):  # kill -9 at random points (mid-step, mid-commit)
        work = root / f"kill9_{k}"
        proc = start(train_cmd(work, steps))
        wait_for_step(proc, work, rng.randint(0, steps - 2))
        time.sleep(rng.uniform(0.0, 4.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = max(steps_logged(work), default=-1)
        resumed = run(train_cmd(work, steps))
        ok, detail = equal_to_reference(work, reference, steps) if resumed.returncode == 0 else \
            (False, f"resume failed: {resumed.stderr[-500:]}")
        record(f"kill -9 after step {killed_at} (+{rng.random():.1f} s), resume", ok, detail)

    if wanted("sigterm"):
        sigterm(root, steps, reference, record)
    if wanted("damage"):
        damaged(root, ref_dir, steps, reference, record)
    if wanted("nan"):
        nan(root, steps, record)
    if wanted("disk_full"):
        disk_full(root, steps, record)
    if wanted("grader"):
        record(*grader_load(args.grader_items))
    return rows


def sigterm(root, steps, reference, record):
    work = root / "sigterm"
    proc = start(train_cmd(work, steps))
    wait_for_step(proc, work, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    saved = "stopped by SIGTERM: checkpoint" in err and "committed" in err
    resumed = run(train_cmd(work, steps))
    ok, detail = equal_to_reference(work, reference, steps) if resumed.returncode == 0 else (False, "resume failed")
    record("SIGTERM mid-run, resume", ok and proc.returncode == 143 and saved,
           f"exit {proc.returncode}, checkpoint committed: {saved}; {detail}")


def damaged(root, ref_dir, steps, reference, record):
    for damage in ("truncated array file", "missing item", "no commit marker"):
        work = root / damage.replace(" ", "_")
        shutil.copytree(ref_dir, work)
        newest = work / "checkpoints" / str(steps)
        if damage == "truncated array file":
            for f in (p for p in (newest / "state").rglob("*") if p.is_file() and p.parent.name == "d"):
                if f.stat().st_size > 1000:
                    f.write_bytes(f.read_bytes()[:64])
        elif damage == "missing item":
            (newest / "extra" / "metadata").unlink()
        else:
            (newest / "commit_success.txt").unlink()
        (work / "metrics.jsonl").write_text("\n".join((work / "metrics.jsonl").read_text().splitlines()[:-1]) + "\n")
        resumed = run(train_cmd(work, steps))
        aside = [p.name for p in (work / "checkpoints").iterdir() if not p.name.isdigit()]
        said = any(w in resumed.stderr for w in ("cannot be read", "never committed"))
        ok, detail = equal_to_reference(work, reference, steps) if resumed.returncode == 0 else \
            (False, f"resume failed: {resumed.stderr[-500:]}")
        record(f"newest checkpoint damaged ({damage}), resume", ok and said and bool(aside),
               f"warned: {said}, kept aside: {aside}; {detail}")

    work = root / "interrupted_commit"
    shutil.copytree(ref_dir, work)
    (work / "checkpoints" / f"{steps + 1}.orbax-checkpoint-tmp").mkdir()
    resumed = run(train_cmd(work, steps + 1))
    said = "interrupted before it committed" in resumed.stderr
    record("interrupted commit (tmp directory) on disk, resume", resumed.returncode == 0 and said,
           f"exit {resumed.returncode}, named in one line: {said}")


def nan(root, steps, record):
    work = root / "nan"
    done = run(train_cmd(work, steps, ("TrainConfig.max_skipped_steps = 2",)), inject=("nan", 3))
    latest = final_state(work)[0] if (work / "checkpoints").exists() else None
    said = "updates skipped (non-finite loss" in done.stderr and "in a row had non-finite" in done.stderr
    # Steps 3 and 4 are skipped; the stop commits step 4's state, which holds step 2's params.
    record("NaN loss injected from step 3", done.returncode == 3 and latest == 4 and said,
           f"exit {done.returncode}, latest checkpoint {latest}, reported: {said}")


def disk_full(root, steps, record):
    work = root / "disk_full"
    done = run(train_cmd(work, steps), inject=("disk_full", 3))
    latest = final_state(work)[0] if (work / "checkpoints").exists() else None
    clean = "No space left on device" in done.stderr and "Traceback" not in done.stderr
    record("disk full at step 3's checkpoint", done.returncode == 2 and latest == 2 and clean,
           f"exit {done.returncode}, latest intact checkpoint {latest}, one message: {clean}")


def grader_load(n: int) -> tuple[str, bool, str]:
    """``n`` responses, 5% hanging and 5% crashing graders: every other reward lands on its own item."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from test_rewards import faulty_grader  # noqa: E402  (the module-level faulty grader the tests use)

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
            f"{metrics['reward/grader_errors']:.0f} errors, {metrics['reward/grader_pool_restarts']:.0f} pool "
            f"restarts, {elapsed:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--grader_items", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default="runs/fault_drill")
    ap.add_argument("--out", default=None, help="also write the matrix to this markdown file")
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only these faults: kill9 sigterm damage nan disk_full grader (default: all)")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.time()
    rows = drill(args)
    passed = sum(ok for _, ok, _ in rows)
    summary = f"fault drill: {passed} of {len(rows)} checks pass ({time.time() - t0:.0f} s)"
    print(summary)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        lines = [f"Measured at commit `{commit}` with `python scripts/fault_drill.py --out {args.out}`.", "",
                 "| fault | result | detail |", "| --- | --- | --- |"]
        lines += [f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |" for name, ok, detail in rows]
        lines += ["", summary]
        text = Path(args.out).read_text() if Path(args.out).exists() else ""
        marker = "<!-- fault drill -->"
        block = marker + "\n" + "\n".join(lines) + "\n" + marker
        if marker in text:
            before, _, rest = text.partition(marker)
            text = before + block + rest.partition(marker)[2]
        else:
            text += "\n" + block + "\n"
        Path(args.out).write_text(text)
    raise SystemExit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()
