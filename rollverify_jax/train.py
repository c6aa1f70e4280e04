"""The main job: ``python -m rollverify_jax.train --gin_file=configs/tiny_rollverify.gin [--gin_param=...]``.

GRPO on the rollout engine, in one of three rollout modes (on-policy, naive partial, RollVerify), with
orbax checkpoints: running the same command again continues from the latest step of its workdir (with a fresh
``TrainConfig.time_budget_s``: the budget bounds one sitting); once the workdir holds a whole checkpoint of this
run at ``TrainConfig.num_steps`` the command says the run is complete and exits 0 without building anything.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

from rollverify_jax.infra import cli, storage
from rollverify_jax.run import run_dir
from rollverify_jax.run.metrics import MetricsWriter, open_progress, open_wandb, read_metrics, run_summary
from rollverify_jax.run.preemption import SKIPPED_EXIT_STATUS, Decision, StopRequest
from rollverify_jax.run.profiler import StepProfiler
from rollverify_jax.run.rollout_samples import write_rollout_samples
from rollverify_jax.run.spec import RunSpec, parse_gin
from rollverify_jax.run.trainer import Trainer

__all__ = ["main", "train", "train_one_step"]


def train_one_step(trainer: Trainer) -> dict:
    """rollout phase -> score -> select -> learn -> end of cycle."""
    t0 = time.perf_counter()
    phase = trainer.rollout()
    scored = trainer.score(phase.groups)
    batch, select_metrics = trainer.select(scored)
    trainer.check_agreement(batch)
    t1 = time.perf_counter()
    train_metrics = trainer.learn(batch)
    metrics_cfg = trainer.spec.metrics
    write_rollout_samples(trainer.workdir, trainer.step, scored, trainer.serving.tokenizer.decode,
                          metrics_cfg.rollout_samples_every, metrics_cfg.rollout_samples_logged)
    if "ops/token_mean" in select_metrics:  # ratio against pi_old: the learner's OPS is this step's drift only
        train_metrics["ops/token_mean_vs_step_start"] = train_metrics.pop("ops/token_mean")
    t2 = time.perf_counter()
    cycle_metrics = trainer.end_cycle(phase.metrics)
    lengths = [t.num_tokens for t in scored.trajs]
    if "time/update" in train_metrics:  # the asynchronous mode: how much of the step each device group worked
        step_s = t2 - t0
        busy = (phase.metrics["rollout/prefill_time"] + phase.metrics["rollout/decode_time"]
                + train_metrics["overlap/decode_time"])
        train_metrics["time/train_mesh_busy_fraction"] = min(train_metrics["time/update"] / max(step_s, 1e-9), 1.0)
        train_metrics["time/rollout_mesh_busy_fraction"] = min(busy / max(step_s, 1e-9), 1.0)
    return {**phase.metrics, **scored.metrics, **select_metrics, **train_metrics, **cycle_metrics,
            "time/train": t2 - t1, "time/step": t2 - t0,
            "time/verify_fraction": phase.metrics["time/verify"] / max(t2 - t0, 1e-9),
            "response/length_mean": float(np.mean(lengths)), "response/length_max": int(max(lengths)),
            "batch/groups": len(phase.groups)}


def train(spec: RunSpec, workdir) -> list[dict]:
    """Runs (or resumes) training in ``workdir`` (local or e.g. ``gs://``); returns the metrics written by this
    invocation. A workdir whose run reached ``TrainConfig.num_steps`` is left as it is (one line says so) once
    its last checkpoint is known whole and this run's (``run_dir.complete_step``: files, model, settings, as a
    resume checks them), without building or compiling anything; a damaged one is resumed, set aside and redone."""
    done = run_dir.complete_step(spec, workdir)
    if done is not None:
        print(f"run complete: {storage.absolute(workdir)} holds checkpoint step {done} (TrainConfig.num_steps = "
              f"{spec.train.num_steps}); to train further pass --gin_param=TrainConfig.num_steps=<more than {done}>"
              ", to start another run pass --workdir=<a new directory>.", flush=True)
        return []
    with run_dir.open_trainer(spec, workdir) as trainer:
        return _train_loop(trainer)


def _evaluation_skipped(workdir, step: int, eval_every: int) -> bool:
    """The resumed checkpoint's step was due an evaluation that a stop skipped (a stop's grace period is short):
    it runs first on resume, with that step's params and the same seeds, as a row of its own."""
    if not (step and eval_every and step % eval_every == 0):
        return False
    rows = read_metrics(workdir) if (storage.as_path(workdir) / "metrics.jsonl").exists() else []
    return not any(r["step"] == step and "eval/accuracy" in r for r in rows)


def _warmup(configured: bool) -> bool:
    """``TrainConfig.warmup``, unless the environment variable ``ROLLVERIFY_WARMUP`` says otherwise (0 / off / false:
    off; anything else: on), as the test suite does to compile only what each test's run uses."""
    value = os.environ.get("ROLLVERIFY_WARMUP")
    return configured if value is None else value.strip().lower() not in ("0", "off", "false", "no", "")


def _train_loop(trainer: Trainer) -> list[dict]:
    spec, cfg = trainer.spec, trainer.spec.train
    start, workdir = trainer.step, trainer.workdir
    # Rows past the restored checkpoint are redone, so they are dropped first (with no checkpoint, every row is:
    # a run killed after its step-0 evaluation would otherwise log step 0 twice; build refused a fresh start in
    # a workdir with more history than that).
    writer = MetricsWriter(workdir, use_tensorboard=cfg.metrics_tensorboard, resume_step=start + 1 if start else 0,
                           wandb_run=open_wandb(spec.metrics, workdir, start, spec.gin_text))
    written = []
    bad_steps: list[int] = []  # consecutive steps with skipped (non-finite) updates
    t_start = time.perf_counter() - trainer.wall_offset  # time/wall is the run's, summed over its launches
    sitting = time.perf_counter()  # TrainConfig.time_budget_s bounds this launch: a resume gets a fresh budget
    checkpointer = trainer.checkpointer
    profiler = StepProfiler(spec.metrics.profile_steps, workdir)
    if _warmup(cfg.warmup) and start < cfg.num_steps:
        ahead = trainer.compile_ahead()
        print(f"compiled {ahead['programs']} programs of the shape plan ahead in {ahead['wall_s']:.0f} s "
              f"({ahead['seconds']:.0f} s of compiling)", flush=True)
    try:
        with open_progress(spec.metrics, total_steps=cfg.num_steps, start_step=start,
                           mode=spec.rollout.mode) as bar, StopRequest() as stop:
            if (start == 0 and spec.eval.at_start) or _evaluation_skipped(workdir, start, cfg.eval_every):
                m = {**trainer.evaluate(), "time/wall": time.perf_counter() - t_start}
                written.append(writer.write(start, m))
                bar.update(start, m)
            for step in range(start + 1, cfg.num_steps + 1):
                decision = stop.agree()
                if decision.stop:  # signalled after the last step's stop check (or during step 0)
                    if step > 1:  # the state in memory is step - 1's: save it (skipped if already saved)
                        checkpointer.save(step - 1, trainer.train_state,
                                          trainer.state_dict(time.perf_counter() - t_start), force=True)
                    _stopped(decision, stop, checkpointer)
                with profiler.step(step):
                    metrics = train_one_step(trainer)
                skipped = _report_skipped(step, metrics, bad_steps)
                # One decision, the same on every host: a signal on any host, JAX's preemption sync point, any
                # host's clock past the budget, or too many skipped steps in a row.
                decision = stop.agree(
                    preempted=checkpointer.reached_preemption(step),
                    out_of_time=cfg.time_budget_s > 0 and time.perf_counter() - sitting >= cfg.time_budget_s,
                    too_many_skipped=len(bad_steps) >= cfg.max_skipped_steps)
                last = step == cfg.num_steps or decision.out_of_time
                interrupted = decision.stop and not last  # no evaluation: the grace period is short
                if last or (cfg.eval_every and step % cfg.eval_every == 0 and not interrupted):
                    metrics.update(trainer.evaluate())
                metrics["time/wall"] = time.perf_counter() - t_start
                written.append(writer.write(step, metrics))
                bar.update(step, metrics)
                # Every stop commits the state in memory. A skipped update changes no params or optimizer state,
                # so after a skipped step that state is still the last applied update's; only the interval saves
                # pass over skipped steps (a run of them must not rotate the good checkpoints out).
                if last or decision.stop or not skipped:
                    checkpointer.save(step, trainer.train_state, trainer.state_dict(metrics["time/wall"]),
                                      force=last or decision.stop)
                if decision.too_many_skipped:
                    _too_many_skipped(bad_steps, metrics, checkpointer)
                if interrupted:
                    _stopped(decision, stop, checkpointer)
                if last:
                    break
    finally:
        profiler.stop()
        writer.close()
    return written


def _nonfinite(metrics: dict) -> str:
    return " and ".join(name for name, key in (("loss", "train/nonfinite_loss"), ("gradient", "train/nonfinite_grad"))
                        if metrics.get(key))


def _report_skipped(step: int, metrics: dict, bad_steps: list[int]) -> bool:
    """Reports a step whose updates were skipped for a NaN/Inf loss or gradient, and keeps the run of such steps
    in ``bad_steps`` (the stop after ``TrainConfig.max_skipped_steps`` of them is agreed by every host)."""
    skipped = int(metrics.get("train/skipped_updates", 0))
    if not skipped:
        bad_steps.clear()
        return False
    bad_steps.append(step)
    print(f"step {step}: {skipped} of {int(metrics['train/num_updates'])} updates skipped (non-finite "
          f"{_nonfinite(metrics)}); not checkpointed unless the run stops here", file=sys.stderr, flush=True)
    return True


def _too_many_skipped(bad_steps: list[int], metrics: dict, checkpointer) -> None:
    """Ends a run after ``TrainConfig.max_skipped_steps`` non-finite steps in a row (exit status 3), once the state
    of its last step is committed: the skipped updates changed nothing, so it holds the last applied update."""
    checkpointer.wait_until_finished()
    latest = checkpointer.latest_step()
    kept = f"checkpoint step {latest} is committed (skipped updates change nothing: it holds the params of the " \
        "last update applied)" if latest is not None else "no checkpoint was committed"
    print(f"error: steps {bad_steps} in a row had non-finite {_nonfinite(metrics)}; stopping. The {kept}: lower "
          "OptimizerConfig.learning_rate or check the data, then run the same command to resume from it.",
          file=sys.stderr, flush=True)
    raise SystemExit(SKIPPED_EXIT_STATUS)


def _stopped(decision: Decision, stop: StopRequest, checkpointer) -> None:
    """Ends a run stopped by a signal or JAX's preemption notice: waits for the checkpoint commit, says which step
    is saved and how long the stop took in one line, and exits with the signal's status (143 for SIGTERM and for
    JAX's notice)."""
    checkpointer.wait_until_finished()
    latest = checkpointer.latest_step()
    name = "JAX's preemption notice" if decision.signum is None else signal.Signals(decision.signum).name
    where = f"checkpoint {checkpointer.directory / str(latest)} committed" if latest is not None else \
        "no checkpoint yet (the run starts over)"
    took = stop.seconds_since_signal()
    took = f" {took:.0f} s after the signal" if took is not None else ""
    again = "resume" if latest is not None else "start it again"
    print(f"stopped by {name}: {where}{took}; run the same command to {again}.", file=sys.stderr, flush=True)
    raise SystemExit(decision.exit_status)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. TrainConfig.num_steps=5")
    ap.add_argument("--workdir", default=None, help="override runs_root/run_name")
    ap.add_argument("--dry_run", action="store_true", help="validate the configuration, load no weights")
    cli.add_process_flags(ap)
    ap.add_argument("--dry_run_devices", type=int, default=None,
                    help="device count the dry run lays the mesh on (default: the config's mesh, or 8)")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    ap.add_argument("--allow_changed_settings", action="store_true",
                    help="resume even though run-defining settings differ from the checkpoint's (listed)")
    ap.add_argument("--restart_from_scratch", action="store_true",
                    help="start at step 0 although the workdir has metrics or set-aside checkpoints but no "
                         "checkpoint that can be restored (refused otherwise)")
    ap.add_argument("--warmup", action="store_true", help="compile the run's whole shape plan before step 1, "
                    "threads in parallel (TrainConfig.warmup, on by default)")
    ap.add_argument("--no_warmup", action="store_true",
                    help="compile each program at its first use instead of the whole shape plan before step 1")
    args = ap.parse_args(argv)
    if args.allow_changed_settings:
        args.gin_param.append("TrainConfig.allow_changed_settings = True")
    if args.restart_from_scratch:
        args.gin_param.append("TrainConfig.restart_from_scratch = True")
    if args.warmup or args.no_warmup:
        args.gin_param.append(f"TrainConfig.warmup = {not args.no_warmup}")
    cli.run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    parse_gin(args.gin_file, args.gin_param)
    spec = RunSpec.from_gin()
    cli.start_process(spec, args)  # before anything compiles
    if args.dry_run:
        from rollverify_jax.run.dry_run import dry_run_cli

        dry_run_cli(spec, args.dry_run_devices)
        return
    workdir = run_dir.resolve(spec, args.workdir, args.gin_file)
    try:
        metrics = train(spec, workdir)
    except OSError as e:
        run_dir.explain_os_error(e, workdir)
    if not metrics:  # complete already (said), or nothing to run
        return
    # The whole run's story, not only this launch's: a resume that ran the last few steps shows where it began.
    path = workdir / "metrics.jsonl"
    for line in run_summary(read_metrics(path) if path.exists() else metrics):
        print(line)
    print(f"metrics: {path}")
    if metrics[-1]["step"] < spec.train.num_steps:  # the loop ends early only at the time budget
        print(f"stopped at step {metrics[-1]['step']} of {spec.train.num_steps}: this launch's time budget "
              f"(TrainConfig.time_budget_s = {spec.train.time_budget_s:g} s) ran out. The run is not finished: the "
              "same command continues it from this step with a fresh budget.")


if __name__ == "__main__":
    cli.run_and_exit(main)
