"""The main job: ``python -m rollverify_jax.train --gin_file=configs/tiny_rollverify.gin [--gin_param=...]``.

GRPO on the rollout engine, in one of three rollout modes (on-policy, naive partial, RollVerify), with
orbax checkpoints: running the same command again continues from the latest step of its workdir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import gin
import jax
import numpy as np

from rollverify_jax import mesh as mesh_lib
from rollverify_jax.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.cli import run_cli
from rollverify_jax.data.datasets import PromptIterator, get_dataset
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.evaluate import evaluate_policy
from rollverify_jax.metrics import MetricsWriter, ProgressBar, save_operative_config
from rollverify_jax.models import Tokenizer, init_model, load_pretrained, model_config
from rollverify_jax.models.hf import config_to_hf
from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.batch import build_batch, flatten_groups
from rollverify_jax.rl.filters import FilterInputs, apply_filter
from rollverify_jax.rl.partial_rollout import RolloutConfig, RolloutManager
from rollverify_jax.rollout.engine import Engine, EngineConfig
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.verify import SwitchConfig


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run is: its policy, data, length and bookkeeping. Component settings have their own gin
    configurables (RolloutConfig, EngineConfig, SamplingConfig, LearnerConfig, LossConfig, OptimizerConfig,
    SwitchConfig, CheckpointConfig, RewardScorer, make_mesh)."""

    run_name: str | None = None  # workdir = runs_root/run_name (default: the first gin file's stem)
    runs_root: str = "runs"
    policy_path: str | None = "assets/tiny_policy"  # HF-layout dir with tokenizer; None: random model_config()
    tokenizer_path: str | None = None  # defaults to policy_path
    param_dtype: str | None = None
    compute_dtype: str | None = None
    num_steps: int = 40
    seed: int = 0
    advantage: str = "grpo"
    # DAPO's group filter (without re-sampling): groups whose rewards are all equal have zero advantage, so
    # they leave the loss and its normaliser, and the packed train step skips their forward pass.
    skip_uniform_groups: bool = False
    train_dataset: str = "synthetic"
    train_dataset_kwargs: dict = dataclasses.field(default_factory=dict)
    eval_dataset: str = "synthetic"
    eval_dataset_kwargs: dict = dataclasses.field(default_factory=lambda: {"split": "test"})
    eval_size: int = 64
    eval_samples: int = 4
    eval_every: int = 10  # 0: never (besides the start and the end)
    time_budget_s: float = 0.0  # > 0: stop after the first step that ends past this wall-clock (for comparisons)
    chat_template: bool = False
    metrics_tensorboard: bool = True
    # A resume refuses settings that differ from the checkpoint's run (mode, thresholds, loss, B, G, ...);
    # True (or --allow_changed_settings) continues with the new ones, listing each difference.
    allow_changed_settings: bool = False

    def __post_init__(self):
        if self.num_steps < 0:
            raise ValueError(f"TrainConfig.num_steps={self.num_steps} must be >= 0.")
        adv_lib.get_advantage_fn(self.advantage)


def parse_gin(files: list[str], params: list[str]) -> None:
    """Parses gin files (their includes resolve from the repository root too) and bindings."""
    for f in files:
        if not Path(f).exists():
            raise FileNotFoundError(f"gin file {f} does not exist.")
        for root in (Path(f).resolve().parent, Path(f).resolve().parent.parent):
            gin.add_config_file_search_path(str(root))
    gin.parse_config_files_and_bindings(files, params)


@dataclasses.dataclass
class Run:
    """Everything a training or evaluation run holds, built by ``build``."""

    cfg: TrainConfig
    workdir: Path | None
    tokenizer: Tokenizer
    model: object
    mesh: object
    engine: Engine
    scorer: RewardScorer
    eval_records: list
    graphdef: object = None
    train_state: object = None
    train_step: object = None
    manager: RolloutManager | None = None
    iterator: PromptIterator | None = None
    checkpointer: Checkpointer | None = None
    learner_cfg: learner_lib.LearnerConfig | None = None
    ref_params: object = None
    wall_offset: float = 0.0
    step: int = 0  # completed training steps = the policy version the engine samples with

    def encode(self, record: dict) -> np.ndarray:
        return np.asarray(self.tokenizer.encode_prompt(record["prompt"], chat=self.cfg.chat_template), np.int32)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def evaluate(self) -> dict:
        rollout_cfg = RolloutConfig()
        return evaluate_policy(self.engine, self.eval_records, self.encode, self.decode, self.scorer,
                               self.cfg.eval_samples, rollout_cfg.max_new_tokens)

    def close(self) -> None:
        self.scorer.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def _load_policy(cfg: TrainConfig, mesh):
    if cfg.policy_path is None:
        return init_model(model_config(), seed=cfg.seed)
    return load_pretrained(cfg.policy_path, dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, mesh=mesh)


def _fingerprint(model) -> dict:
    raw = config_to_hf(model.cfg)
    return {k: raw[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}


def build(cfg: TrainConfig, workdir: Path | None = None, checkpoint: Path | None = None,
          for_training: bool = False) -> Run:
    """Builds the policy, tokenizer, engine, data, learner and checkpointer from the gin configuration.

    With ``checkpoint`` (evaluation), the params come from an orbax checkpoint (a workdir or one of its
    step directories) or from an HF-layout directory.
    """
    mesh = mesh_lib.make_mesh()
    hf_checkpoint = checkpoint is not None and (checkpoint / "config.json").exists()
    if hf_checkpoint:
        cfg = dataclasses.replace(cfg, policy_path=str(checkpoint),
                                  tokenizer_path=cfg.tokenizer_path or cfg.policy_path)
    model = _load_policy(cfg, mesh)
    tok_path = cfg.tokenizer_path or cfg.policy_path
    if tok_path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when policy_path is None.")
    tokenizer = Tokenizer.from_dir(tok_path, model_vocab_size=model.cfg.vocab_size)
    rollout_cfg = RolloutConfig()
    engine = Engine(model, EngineConfig(), SamplingConfig(), eos_ids=tokenizer.eos_ids, mesh=mesh)
    scorer = RewardScorer()
    eval_records = list(get_dataset(cfg.eval_dataset, **cfg.eval_dataset_kwargs))[: cfg.eval_size]
    if not eval_records:
        raise ValueError(f"Eval dataset {cfg.eval_dataset!r} with {cfg.eval_dataset_kwargs} is empty.")
    run = Run(cfg=cfg, workdir=workdir, tokenizer=tokenizer, model=model, mesh=mesh, engine=engine, scorer=scorer,
              eval_records=eval_records)
    if checkpoint is not None and not hf_checkpoint:
        _restore_params_only(run, checkpoint)
    if not for_training:
        return run

    learner_cfg = learner_lib.LearnerConfig().for_sampler(engine.sampling.logp_temperature)
    optimizer = learner_lib.make_optimizer()
    graphdef, _ = learner_lib.split_params(model)
    shardings = learner_lib.train_state_shardings(model, optimizer, mesh)
    run.graphdef, run.learner_cfg = graphdef, learner_cfg
    run.train_state = learner_lib.init_train_state(model, optimizer, mesh, seed=cfg.seed)
    run.train_step = learner_lib.make_train_step(graphdef, learner_cfg, optimizer, mesh, shardings)
    if learner_cfg.loss.kl_coef > 0:
        run.ref_params = jax.tree.map(lambda x: x.copy(), run.train_state.params)
    records = list(get_dataset(cfg.train_dataset, **cfg.train_dataset_kwargs))
    if not records:
        raise ValueError(f"Train dataset {cfg.train_dataset!r} with {cfg.train_dataset_kwargs} is empty.")
    run.iterator = PromptIterator(records, batch_size=1, seed=cfg.seed)
    scheduler = Scheduler(engine)
    run.manager = RolloutManager(rollout_cfg, scheduler, lambda: run.iterator.next_batch()[0], run.encode,
                                 seed=cfg.seed, switch=SwitchConfig())
    run.checkpointer = Checkpointer(workdir, CheckpointConfig(), model_fingerprint=_fingerprint(model))
    latest = run.checkpointer.latest_step()
    if latest is not None:
        abstract = learner_lib.abstract_train_state(model, optimizer, mesh)
        _, run.train_state, extra = run.checkpointer.restore(latest, abstract_state=abstract)
        check_resume_settings(extra.get("settings", {}), run_settings(run), allow=cfg.allow_changed_settings)
        load_run_state(run, extra)
    engine.update_params(run.train_state.params, version=run.step)
    return run


def _restore_params_only(run: Run, checkpoint: Path) -> None:
    """Evaluation from an orbax checkpoint: a workdir, its checkpoints/ dir, or checkpoints/<step>."""
    optimizer = learner_lib.make_optimizer()
    if checkpoint.name.isdigit():  # <workdir>/checkpoints/<step>
        root, step = checkpoint.parent.parent, int(checkpoint.name)
    else:  # <workdir> or <workdir>/checkpoints
        root, step = (checkpoint.parent if checkpoint.name == "checkpoints" else checkpoint), None
    if not (root / "checkpoints").is_dir():  # checked first: opening a Checkpointer would create the directory
        raise FileNotFoundError(f"No checkpoint under {checkpoint}; pass a workdir, a checkpoint step "
                                "directory or an HF-layout policy directory.")
    with Checkpointer(root, CheckpointConfig(), model_fingerprint=_fingerprint(run.model)) as ckpt:
        step = step if step is not None else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint under {checkpoint}; pass a workdir, a checkpoint step "
                                    "directory or an HF-layout policy directory.")
        abstract = learner_lib.abstract_train_state(run.model, optimizer, run.mesh)
        _, state, _ = ckpt.restore(step, abstract_state=abstract)
    run.engine.update_params(state.params, version=step)


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
    rc = run.manager.config
    # Packed steps run the model on packed rows only, so the [B, T] layout can be the engine's fixed maximum
    # (one packed width, few compiled shapes); unpacked steps pad to the batch's power-of-two bucket.
    width = run.engine.config.max_seq_len if run.learner_cfg.pack_sequences else None
    batch = build_batch(scored.trajs, scored.advantages, max_len=width)
    inputs = FilterInputs(
        versions=[t.versions for t in scored.trajs], current_version=run.engine.version,
        behavior_logp=batch["behavior_logp"], response_mask=batch["loss_mask"] > 0,
        current_logp=lambda: np.asarray(learner_lib.compute_logprobs(
            run.graphdef, run.train_state.params, batch["tokens"], batch["attention_mask"],
            run.learner_cfg.temperature)))
    keep = apply_filter(rc.filter, inputs, rc.s_max, rc.ops_threshold)
    if run.cfg.skip_uniform_groups:
        keep &= ~scored.uniform
    batch["loss_mask"] *= keep[:, None].astype(np.float32)
    if run.ref_params is not None:
        batch["ref_logp"] = np.asarray(learner_lib.compute_logprobs(
            run.graphdef, run.ref_params, batch["tokens"], batch["attention_mask"], run.learner_cfg.temperature))
    return learner_lib.pack_for_learner(batch, run.learner_cfg, run.mesh), {"filter/kept_fraction": float(keep.mean())}


def learn(run: Run, batch: dict) -> dict:
    """One jitted, sharded update; the engine samples with the new params as the next policy version."""
    run.train_state, metrics = run.train_step(run.train_state, batch)
    run.step += 1
    run.engine.update_params(run.train_state.params, version=run.step)
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def train_one_step(run: Run) -> dict:
    t0 = time.perf_counter()
    phase = run.manager.run_phase()  # rollout, with paused trajectories verified inside their resume prefill
    scored = score(run, phase.groups)
    batch, select_metrics = select(run, scored)
    t1 = time.perf_counter()
    train_metrics = learn(run, batch)
    t2 = time.perf_counter()
    cycle_metrics = run.manager.end_cycle(run.step)
    lengths = [t.num_tokens for t in scored.trajs]
    return {**phase.metrics, **scored.metrics, **select_metrics, **train_metrics, **cycle_metrics,
            "time/train": t2 - t1, "time/step": t2 - t0, "time/verify_fraction": phase.metrics["time/verify"] / max(
                t2 - t0, 1e-9),
            "response/length_mean": float(np.mean(lengths)), "response/length_max": int(max(lengths))}


def run_settings(run: Run) -> dict:
    """The settings that define what a run trains (saved in every checkpoint, compared on resume)."""
    rc, sw, lc = run.manager.config, run.manager.switch_cfg, run.learner_cfg
    sampling = run.engine.sampling
    return {
        "rollout.mode": rc.mode, "rollout.batch_groups": rc.batch_groups, "rollout.group_size": rc.group_size,
        "rollout.max_new_tokens": rc.max_new_tokens, "filter.name": rc.filter, "filter.s_max": rc.s_max,
        "filter.ops_threshold": rc.ops_threshold, "verify.ds": rc.ds, "verify.dt": rc.dt,
        "verify.verify_finished": rc.verify_finished, "switch.enabled": sw.enabled, "switch.window": sw.window,
        "switch.threshold": sw.threshold, "loss.name": lc.loss_name,
        **{f"loss.{k}": v for k, v in dataclasses.asdict(lc.loss).items()},
        "advantage": run.cfg.advantage, "skip_uniform_groups": run.cfg.skip_uniform_groups,
        "sampling.temperature": sampling.temperature, "sampling.top_p": sampling.top_p,
        "sampling.top_k": sampling.top_k, "sampling.greedy": sampling.greedy,
        "learner.temperature": lc.temperature, "policy_path": run.cfg.policy_path,
        "param_dtype": run.cfg.param_dtype, "compute_dtype": run.cfg.compute_dtype,
    }


def check_resume_settings(saved: dict, current: dict, allow: bool) -> None:
    """Refuses a resume whose run-defining settings differ from the checkpoint's, naming every difference."""
    diffs = [f"  {k}: checkpoint {saved[k]!r}, now {current.get(k)!r}" for k in sorted(saved)
             if json.dumps(saved[k]) != json.dumps(current.get(k))]
    if not diffs:
        return
    listing = "\n".join(diffs)
    if not allow:
        raise ValueError(f"This workdir's checkpoint was trained with other settings:\n{listing}\nResume with the "
                         "checkpoint's settings, use a new workdir, or pass --allow_changed_settings to continue "
                         "with the new ones.")
    print(f"warning: resuming with changed settings (--allow_changed_settings):\n{listing}", flush=True)


def run_state(run: Run, wall: float) -> dict:
    """The host-side state of a run that a checkpoint holds beside the train state (params, optimizer, PRNG)."""
    return {"step": run.step, "data": run.iterator.get_state(), "rollout": run.manager.state_dict(),
            "wall_time": wall, "settings": run_settings(run)}


def load_run_state(run: Run, extra: dict) -> None:
    run.iterator.set_state(extra["data"])
    run.manager.load_state_dict(extra["rollout"])
    run.wall_offset = float(extra["wall_time"])
    run.step = int(extra["step"])


def workdir_for(cfg: TrainConfig, gin_files: list[str]) -> Path:
    name = cfg.run_name or (Path(gin_files[0]).stem if gin_files else "default")
    return Path(cfg.runs_root) / name


def train(cfg: TrainConfig, workdir: Path) -> list[dict]:
    """Runs (or resumes) training in ``workdir``; returns the metrics written by this invocation."""
    fresh = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run = build(cfg, workdir=workdir, for_training=True)
    except BaseException:
        if fresh:  # a configuration error leaves no half-made workdir behind
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    start = run.step
    save_operative_config(workdir)
    (workdir / "policy.txt").write_text(json.dumps({"policy_path": cfg.policy_path}) + "\n")
    writer = MetricsWriter(workdir, use_tensorboard=cfg.metrics_tensorboard, resume_step=start + 1)
    written = []
    t_start = time.perf_counter() - run.wall_offset
    try:
        with ProgressBar(total_steps=cfg.num_steps, start_step=start) as bar:
            if start == 0:
                m = {**run.evaluate(), "time/wall": time.perf_counter() - t_start}
                written.append(writer.write(0, m))
                bar.update(0, m)
            for step in range(start + 1, cfg.num_steps + 1):
                metrics = train_one_step(run)
                last = step == cfg.num_steps or (
                    cfg.time_budget_s > 0 and time.perf_counter() - t_start >= cfg.time_budget_s)
                if last or (cfg.eval_every and step % cfg.eval_every == 0):
                    metrics.update(run.evaluate())
                metrics["time/wall"] = time.perf_counter() - t_start
                written.append(writer.write(step, metrics))
                bar.update(step, metrics)
                run.checkpointer.save(step, run.train_state, run_state(run, metrics["time/wall"]), force=last)
                if last:
                    break
    finally:
        writer.close()
        run.close()
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. TrainConfig.num_steps=5")
    ap.add_argument("--workdir", default=None, help="override runs_root/run_name")
    ap.add_argument("--dry_run", action="store_true", help="validate the configuration, load no weights")
    ap.add_argument("--distributed", action="store_true",
                    help="multi-host: call jax.distributed.initialize() (every host runs the same command)")
    ap.add_argument("--dry_run_devices", type=int, default=8, help="device count the dry run lays the mesh on")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    ap.add_argument("--allow_changed_settings", action="store_true",
                    help="resume even though run-defining settings differ from the checkpoint's (listed)")
    args = ap.parse_args(argv)
    if args.allow_changed_settings:
        args.gin_param.append("TrainConfig.allow_changed_settings = True")
    run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    if args.distributed:
        jax.distributed.initialize()
    parse_gin(args.gin_file, args.gin_param)
    cfg = TrainConfig()
    if args.dry_run:
        from rollverify_jax.dry_run import dry_run

        report = dry_run(cfg, args.dry_run_devices)
        print("dry run OK: " + json.dumps(report))
        return
    workdir = Path(args.workdir) if args.workdir else workdir_for(cfg, args.gin_file)
    print(f"workdir: {workdir.resolve()}")
    metrics = train(cfg, workdir)
    evals = [m for m in metrics if "eval/accuracy" in m]
    if evals:
        print(f"held-out accuracy: {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> "
              f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})")
    print(f"metrics: {workdir / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
