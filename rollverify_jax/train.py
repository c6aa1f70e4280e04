"""The main job: ``python -m rollverify_jax.train --gin_file=configs/tiny_rollverify.gin [--gin_param=...]``.

GRPO on the rollout engine, in one of three rollout modes (on-policy, naive partial, RollVerify), with
orbax checkpoints: running the same command again continues from the latest step of its workdir.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from etils import epath

from rollverify_jax import compile_cache, distributed, storage
from rollverify_jax.checkpoint import COMMIT_FILE
from rollverify_jax.cli import run_cli
from rollverify_jax.evaluate import EvalConfig, evaluate_run
from rollverify_jax.metrics import MetricsConfig, MetricsWriter, open_progress, open_wandb, save_operative_config
from rollverify_jax.preemption import SKIPPED_EXIT_STATUS, Decision, StopRequest
from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.batch import build_batch, flatten_groups, pad_rows
from rollverify_jax.rl.filters import FilterInputs, apply_filter
from rollverify_jax.setup import Run, TrainConfig, build, parse_gin, run_state
from rollverify_jax.workdir_lock import WorkdirLock

__all__ = ["TrainConfig", "build", "learn", "main", "parse_gin", "score", "select", "train", "train_one_step"]


# ----------------------------------------------------------------------------------------------------
# One training step: rollout phase -> score -> select -> learn -> end of cycle


@dataclasses.dataclass
class Scored:
    """A phase's training batch with its rewards and advantages."""

    trajs: list  # [N] trajectories, group by group
    advantages: np.ndarray  # [N]
    uniform: np.ndarray  # bool[N]: the trajectory's group has all-equal rewards (zero advantage)
    metrics: dict


def score(run: Run, groups) -> Scored:
    """Rewards of every trajectory, then group advantages (whatever versions sampled the members)."""
    trajs = flatten_groups(groups)
    texts = [run.decode(t.tokens) for t in trajs]
    answers = [g.record["answer"] for g in groups for _ in g.finished]
    rewards, metrics = run.scorer.score(texts, answers, [t.num_tokens for t in trajs])
    g = run.manager.config.group_size
    rewards = np.asarray(rewards, np.float64).reshape(-1, g)
    adv = np.asarray(adv_lib.compute_advantages(rewards, run.cfg.advantage)).reshape(-1)
    uniform = np.repeat((rewards == rewards[:, :1]).all(axis=1), g)  # [N]
    return Scored(trajs, adv, uniform, {**metrics, "reward/mean": float(rewards.mean()),
                                        "reward/uniform_group_fraction": float(uniform.mean())})


def select(run: Run, scored: Scored) -> tuple[dict, dict]:
    """The learner's batch, with the trajectories the filters drop masked out of the loss: the configured
    filter of the registry, and DAPO's group filter when it is on. Adds the reference log-probs for the KL."""
    # Packed steps run the model on packed rows only, so the [B, T] layout can be the engine's fixed maximum
    # (one packed width, few compiled shapes); unpacked steps pad to the batch's power-of-two bucket.
    width = run.engine.config.max_seq_len if run.learner_cfg.pack_sequences else None
    batch = build_batch(scored.trajs, scored.advantages, max_len=width)
    response = batch["loss_mask"] > 0
    step_start_logp = functools.cache(lambda: distributed.fetch(learner_lib.compute_logprobs(
        run.graphdef, run.train_state.params, batch["tokens"], batch["attention_mask"], run.learner_cfg.temperature)))
    inputs = FilterInputs(
        versions=[t.versions for t in scored.trajs], current_version=run.engine.version,
        behavior_logp=batch["behavior_logp"], response_mask=response, current_logp=step_start_logp)
    keep = apply_filter(run.filter_cfg, inputs)
    if run.cfg.skip_uniform_groups:
        keep &= ~scored.uniform
    metrics = {}
    if run.learner_cfg.ratio_against == "step_start":  # the ablation: the ratio against pi_old instead of mu
        pi_old = np.asarray(step_start_logp(), np.float32)
        # The train-time OPS against mu, which the learner's metric (now against pi_old) no longer measures.
        log_ratio = np.clip(pi_old - batch["behavior_logp"], -20.0, 20.0)  # the loss's clip of the log-ratio
        metrics["ops/token_mean"] = float(np.abs(np.expm1(log_ratio))[response].mean())
        batch["behavior_logp"] = np.where(response, pi_old, batch["behavior_logp"])
    batch["loss_mask"] *= keep[:, None].astype(np.float32)
    if run.ref_params is not None:
        batch["ref_logp"] = distributed.fetch(learner_lib.compute_logprobs(
            run.graphdef, run.ref_params, batch["tokens"], batch["attention_mask"], run.learner_cfg.temperature))
    rollout = run.manager.config
    batch = pad_rows(batch, rollout.batch_groups * rollout.group_size)  # more than B groups: whole batches' shapes
    batch = learner_lib.pack_for_learner(batch, run.learner_cfg, run.mesh)
    return batch, {**metrics, "filter/kept_fraction": float(keep.mean()),
                   **learner_lib.packing_stats(batch, run.learner_cfg)}


def learn(run: Run, batch: dict) -> dict:
    """One jitted, sharded update; the engine samples with the new params as the next policy version."""
    run.train_state, metrics = run.train_step(run.train_state, batch)
    run.step += 1
    run.engine.update_params(run.train_state.params, version=run.step)
    return {k: float(v) for k, v in distributed.fetch(metrics).items()}


def train_one_step(run: Run) -> dict:
    t0 = time.perf_counter()
    phase = run.manager.run_phase()  # rollout, with paused trajectories verified inside their resume prefill
    scored = score(run, phase.groups)
    batch, select_metrics = select(run, scored)
    # Several hosts: the batch (scheduling, cuts, rewards), the data position and the rollout state (cache,
    # switching) are decided on each host and must agree before they become one global batch.
    distributed.check_same_on_every_process(run.step, batch=lambda: batch, data=run.iterator.get_state,
                                            rollout=run.manager.state_dict)
    t1 = time.perf_counter()
    train_metrics = learn(run, batch)
    if "ops/token_mean" in select_metrics:  # ratio against pi_old: the learner's OPS is this step's drift only
        train_metrics["ops/token_mean_vs_step_start"] = train_metrics.pop("ops/token_mean")
    t2 = time.perf_counter()
    cycle_metrics = run.manager.end_cycle(run.step, phase.metrics)
    lengths = [t.num_tokens for t in scored.trajs]
    return {**phase.metrics, **scored.metrics, **select_metrics, **train_metrics, **cycle_metrics,
            "time/train": t2 - t1, "time/step": t2 - t0,
            "time/verify_fraction": phase.metrics["time/verify"] / max(t2 - t0, 1e-9),
            "response/length_mean": float(np.mean(lengths)), "response/length_max": int(max(lengths)),
            "batch/groups": len(phase.groups)}


def workdir_for(cfg: TrainConfig, gin_files: list[str]) -> epath.Path:
    name = cfg.run_name or (Path(gin_files[0]).stem if gin_files else "default")
    return storage.as_path(cfg.runs_root) / name


def train(cfg: TrainConfig, workdir: storage.PathLike) -> list[dict]:
    """Runs (or resumes) training in ``workdir`` (local or e.g. ``gs://``); returns the metrics written by this
    invocation."""
    workdir = storage.as_path(workdir)
    metrics_cfg = MetricsConfig()  # its settings are checked (wandb installed?) before any work
    fresh = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    # Before anything touches the checkpoints: a second launch would remove this one's in-flight saves.
    lock = WorkdirLock.acquire(workdir)
    try:
        try:
            run = build(cfg, workdir=workdir, for_training=True)
        except BaseException:
            if fresh:  # a configuration error leaves no half-made workdir behind
                lock.release()
                storage.remove_tree(workdir)
            raise
        return _train_loop(cfg, workdir, run, metrics_cfg)
    finally:
        lock.release()


def _train_loop(cfg: TrainConfig, workdir: epath.Path, run: Run, metrics_cfg: MetricsConfig) -> list[dict]:
    start = run.step
    save_operative_config(workdir)
    if distributed.is_main_process():
        (workdir / "policy.txt").write_text(json.dumps({"policy_path": cfg.policy_path}) + "\n")
    # Rows past the restored checkpoint are redone, so they are dropped first (with no checkpoint, every row is:
    # a run killed after its step-0 evaluation would otherwise log step 0 twice; build refused a fresh start in
    # a workdir with more history than that).
    writer = MetricsWriter(workdir, use_tensorboard=cfg.metrics_tensorboard, resume_step=start + 1 if start else 0,
                           wandb_run=open_wandb(metrics_cfg, workdir, start))
    written = []
    bad_steps: list[int] = []  # consecutive steps with skipped (non-finite) updates
    t_start = time.perf_counter() - run.wall_offset
    try:
        with open_progress(metrics_cfg, total_steps=cfg.num_steps, start_step=start,
                           mode=run.manager.config.mode) as bar, StopRequest() as stop:
            if start == 0 and EvalConfig().at_start:
                m = {**evaluate_run(run), "time/wall": time.perf_counter() - t_start}
                written.append(writer.write(0, m))
                bar.update(0, m)
            for step in range(start + 1, cfg.num_steps + 1):
                decision = stop.agree()
                if decision.stop:  # signalled after the last step's stop check (or during step 0)
                    if step > 1:  # the state in memory is step - 1's: save it (skipped if already saved)
                        run.checkpointer.save(step - 1, run.train_state,
                                              run_state(run, time.perf_counter() - t_start), force=True)
                    _stopped(decision, stop, run.checkpointer)
                metrics = train_one_step(run)
                skipped = _report_skipped(step, metrics, bad_steps)
                # One decision, the same on every host: a signal on any host, JAX's preemption sync point, any
                # host's clock past the budget, or too many skipped steps in a row.
                decision = stop.agree(
                    preempted=run.checkpointer.reached_preemption(step),
                    out_of_time=cfg.time_budget_s > 0 and time.perf_counter() - t_start >= cfg.time_budget_s,
                    too_many_skipped=len(bad_steps) >= cfg.max_skipped_steps)
                last = step == cfg.num_steps or decision.out_of_time
                interrupted = decision.stop and not last  # no evaluation: the grace period is short
                if last or (cfg.eval_every and step % cfg.eval_every == 0 and not interrupted):
                    metrics.update(evaluate_run(run))
                metrics["time/wall"] = time.perf_counter() - t_start
                written.append(writer.write(step, metrics))
                bar.update(step, metrics)
                # Every stop commits the state in memory. A skipped update changes no params or optimizer state,
                # so after a skipped step that state is still the last applied update's; only the interval saves
                # pass over skipped steps (a run of them must not rotate the good checkpoints out).
                if last or decision.stop or not skipped:
                    run.checkpointer.save(step, run.train_state, run_state(run, metrics["time/wall"]),
                                          force=last or decision.stop)
                if decision.too_many_skipped:
                    _too_many_skipped(bad_steps, metrics, run.checkpointer)
                if interrupted:
                    _stopped(decision, stop, run.checkpointer)
                if last:
                    break
    finally:
        writer.close()
        run.close()
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


def _error_files(e: OSError) -> list[str]:
    return [os.fsdecode(n) for n in (e.filename, e.filename2) if isinstance(n, str | bytes | os.PathLike)]


def _is_workdir_error(e: OSError, workdir: epath.Path) -> bool:
    """Whether an OSError is the workdir's (a full or unwritable disk): it names a file there, or none at all
    (orbax and tensorstore name none at save time). One that names another file is an input's."""
    files = _error_files(e)
    return not files or any(storage.is_within(f, workdir) for f in files)


def _storage_error(e: OSError, workdir: epath.Path) -> None:
    """A full or unwritable disk at save time: one message, the checkpoints already committed named, exit 2."""
    root = workdir / "checkpoints"
    committed = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / COMMIT_FILE).exists()) \
        if root.is_dir() else []
    kept = f"The committed checkpoints are intact (latest: step {committed[-1]})" if committed else \
        "No checkpoint was committed yet"
    print(f"error: could not write to {storage.absolute(workdir)}: {e}. {kept}; free space or fix the permissions, "
          "then run the same command to resume.", file=sys.stderr, flush=True)
    raise SystemExit(2)


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
    print(f"stopped by {name}: {where}{took}; run the same command to resume.", file=sys.stderr, flush=True)
    raise SystemExit(decision.exit_status)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. TrainConfig.num_steps=5")
    ap.add_argument("--workdir", default=None, help="override runs_root/run_name")
    ap.add_argument("--dry_run", action="store_true", help="validate the configuration, load no weights")
    distributed.add_cli_flags(ap)
    ap.add_argument("--dry_run_devices", type=int, default=None,
                    help="device count the dry run lays the mesh on (default: the config's mesh, or 8)")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    ap.add_argument("--allow_changed_settings", action="store_true",
                    help="resume even though run-defining settings differ from the checkpoint's (listed)")
    ap.add_argument("--restart_from_scratch", action="store_true",
                    help="start at step 0 although the workdir has metrics or set-aside checkpoints but no "
                         "checkpoint that can be restored (refused otherwise)")
    args = ap.parse_args(argv)
    if args.allow_changed_settings:
        args.gin_param.append("TrainConfig.allow_changed_settings = True")
    if args.restart_from_scratch:
        args.gin_param.append("TrainConfig.restart_from_scratch = True")
    run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    parse_gin(args.gin_file, args.gin_param)
    compile_cache.compilation_cache()  # before anything compiles
    distributed.initialize_from_flags(args)
    cfg = TrainConfig()
    if args.dry_run:
        from rollverify_jax.dry_run import dry_run

        report = dry_run(cfg, args.dry_run_devices)
        print("dry run OK: " + json.dumps(report))
        _compile_for_topology()
        return
    workdir = storage.as_path(args.workdir) if args.workdir else workdir_for(cfg, args.gin_file)
    print(f"workdir: {storage.absolute(workdir)}")
    try:
        metrics = train(cfg, workdir)
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # a missing input file: the CLI's usual one-line error
            raise
        if not _is_workdir_error(e, workdir):  # e.g. an unreadable data file: said as it is, not as a full disk
            raise ValueError(f"cannot use {_error_files(e)[0]}: {e.strerror or e}. It is one of the run's inputs "
                             f"(data, policy, tokenizer), not its workdir {storage.absolute(workdir)}: check the "
                             "path and its permissions.") from e
        _storage_error(e, workdir)
    evals = [m for m in metrics if "eval/accuracy" in m]
    if evals:
        first, last = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
        print(f"held-out accuracy: {first:.3f} (step {evals[0]['step']}) -> {last:.3f} (step {evals[-1]['step']}), "
              f"{100 * (last - first):+.1f} points")
    for line in run_summary(metrics):
        print(line)
    print(f"metrics: {workdir / 'metrics.jsonl'}")


def run_summary(metrics: list[dict]) -> list[str]:
    """What the rollout mode did over the run: steps in partial mode (and the switch), slot utilization per mode
    and where the time went; the lines a person checks first after a run."""
    steps = [m for m in metrics if "time/step" in m]
    if not steps:
        return []
    partial = [m for m in steps if m.get("mode/on_policy") == 0]
    on_policy = [m for m in steps if m.get("mode/on_policy") == 1]
    switch = next((m["mode/switch_step"] for m in steps if m.get("mode/switch_step") is not None), None)
    total = sum(m["time/step"] for m in steps)
    partial_time = sum(m["time/step"] for m in partial)
    lines = [f"rollout mode: partial for {len(partial)} of {len(steps)} steps ({partial_time / max(total, 1e-9):.0%} "
             "of the step time)" + (f", switched to on-policy at step {switch}" if switch is not None else "")]
    util = [f"{name} {sum(m['rollout/slot_utilization'] for m in group) / len(group):.2f}"
            for name, group in (("partial", partial), ("on-policy", on_policy)) if group]
    lines.append("slot utilization: " + ", ".join(util))
    split = {k: sum(m.get(f"time/{k}", 0.0) for m in steps) for k in ("rollout", "verify", "train")}
    lines.append(f"time: {total:.0f} s in steps: " + ", ".join(
        f"{k} {v:.0f} s ({v / max(total, 1e-9):.0%})" for k, v in split.items()))
    accepted = [m["verify/acceptance"] for m in partial if m.get("verify/num_verified")]
    if accepted:
        lines.append(f"verification: mean cycle acceptance {sum(accepted) / len(accepted):.2f} over "
                     f"{len(accepted)} cycles")
    return lines


def _compile_for_topology() -> None:
    """A config that names its TPU slice (``AotConfig.topology``) is compiled for it when libtpu is installed:
    the dry run then proves the run fits, not only that the settings parse."""
    import importlib.util

    import gin

    from rollverify_jax.dry_run import gin_bound

    if not gin_bound("AotConfig.topology"):
        return
    if gin.query_parameter("AotConfig.topology") is None:  # a GPU config: JAX has no deviceless GPU compile
        print("dry run: AotConfig.topology = None (a GPU config): no deviceless compile proves a GPU fit, so this "
              "dry run checked the settings only. The memory arithmetic is in docs/scale.md; on the GPUs, "
              "`scripts/check_gpu.py --compile-config <this file>` compiles its programs at reduced layer count.")
        return
    if importlib.util.find_spec("libtpu") is None:
        print("dry run: AotConfig.topology is set but libtpu is not installed (pip install -e '.[tpu]'); "
              "skipping the compile for it.")
        return
    from rollverify_jax import aot

    report = aot.compile_run()
    print(aot.format_report(report))
    if not report["fits"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
