"""Building a run from the gin configuration: a policy to evaluate, or a whole training run.

Used by both entry points (``train`` and ``evaluate``). A training run's host-side state (data position, paused
cache, switching window, settings) is one dict, ``run_state``, that checkpoints hold beside the train state.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import gin
import jax
import numpy as np
from etils import epath

from rollverify_jax import mesh as mesh_lib
from rollverify_jax import storage
from rollverify_jax.aot_config import AotConfig  # noqa: F401  (registers the gin configurable)
from rollverify_jax.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.data.datasets import PromptIterator, drop_long_prompts, get_dataset, records_fingerprint
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.fresh_start import check_fresh_start
from rollverify_jax.metrics import MetricsConfig  # noqa: F401  (registers it for evaluate and aot too)
from rollverify_jax.models import Tokenizer, init_model, load_pretrained, model_config
from rollverify_jax.models.hf import config_to_hf
from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.filters import FilterConfig
from rollverify_jax.rl.partial_rollout import RolloutConfig, RolloutManager
from rollverify_jax.rollout.engine import Engine, EngineConfig
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.verify import SwitchConfig, VerifyConfig


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
    # Steps in a row whose updates were skipped for a NaN/Inf loss or gradient before the run stops (exit 3).
    max_skipped_steps: int = 3
    # A workdir with metric rows or set-aside checkpoints but no checkpoint to restore is refused; True (or
    # --restart_from_scratch) starts it at step 0 anyway (rollverify_jax/fresh_start.py).
    restart_from_scratch: bool = False

    def __post_init__(self):
        if self.num_steps < 0:
            raise ValueError(f"TrainConfig.num_steps={self.num_steps} must be >= 0.")
        if self.max_skipped_steps < 1:
            raise ValueError(f"TrainConfig.max_skipped_steps={self.max_skipped_steps} must be >= 1.")
        if self.eval_size < 1:  # a negative size would slice problems off the end in silence
            raise ValueError(f"TrainConfig.eval_size={self.eval_size} must be >= 1.")
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
    workdir: epath.Path | None
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
    filter_cfg: FilterConfig | None = None
    ref_params: object = None
    wall_offset: float = 0.0
    step: int = 0  # completed training steps = the policy version the engine samples with
    inputs: dict = dataclasses.field(default_factory=dict)  # input_identity: compared on resume (run_settings)

    def encode(self, record: dict) -> np.ndarray:
        return np.asarray(self.tokenizer.encode_prompt(record["prompt"], chat=self.cfg.chat_template), np.int32)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.scorer.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def cross_check_settings(rollout: RolloutConfig, engine: EngineConfig, learner_cfg: learner_lib.LearnerConfig,
                     mesh_shape: dict[str, int], filter_cfg: FilterConfig) -> None:
    """Cross-checks of settings that live in different configurables; run at every start and by --dry_run."""
    if filter_cfg.name != "none" and rollout.mode == "on_policy":
        raise ValueError(f"FilterConfig.name={filter_cfg.name!r} needs partial rollout: set RolloutConfig.mode = "
                         "'partial' (or 'rollverify'), or FilterConfig.name = 'none'.")
    max_prompt_len(rollout, engine)
    rows = rollout.batch_groups * rollout.group_size
    batch_devices = mesh_shape["data"] * mesh_shape["fsdp"]
    if rows % batch_devices:
        raise ValueError(f"batch_groups x group_size = {rows} rows do not divide over data x fsdp = {batch_devices}.")
    if rows % learner_cfg.num_minibatches:
        raise ValueError(f"{rows} rows do not split into LearnerConfig.num_minibatches={learner_cfg.num_minibatches}.")


def max_prompt_len(rollout: RolloutConfig, engine: EngineConfig) -> int:
    """The longest prompt the scheduler admits: the context must still hold ``max_new_tokens`` after it."""
    room = engine.max_seq_len - rollout.max_new_tokens
    if room < 1:
        raise ValueError(f"RolloutConfig.max_new_tokens={rollout.max_new_tokens} leaves no room for a prompt in "
                         f"EngineConfig.max_seq_len={engine.max_seq_len}.")
    return room


def prompt_lengths(tokenizer: Tokenizer, records: Sequence[dict], chat: bool, chunk: int = 4096) -> np.ndarray:
    """Token counts of the prompts exactly as ``Run.encode`` encodes them; each distinct prompt is encoded
    once (DAPO-Math-17k repeats its problems), in batches (``tokenizers`` runs them in Rust)."""
    texts = [record["prompt"] for record in records]
    unique = list(dict.fromkeys(texts))
    counts: dict[str, int] = {}
    for start in range(0, len(unique), chunk):
        part = unique[start:start + chunk]
        rendered = [tokenizer.apply_chat_template(t) if chat else t for t in part]
        counts.update(zip(part, map(len, tokenizer.encode_batch(rendered)), strict=True))
    return np.asarray([counts[t] for t in texts], dtype=np.int64)


def load_prompts(role: str, name: str, kwargs: dict, tokenizer: Tokenizer, chat: bool, max_len: int) -> list[dict]:
    """A dataset's records without the prompts longer than ``max_len`` tokens, dropped once here with a
    warning: admitted mid-run, such a prompt would stop the run (the scheduler refuses it)."""
    records = list(get_dataset(name, **kwargs))
    if not records:
        raise ValueError(f"{role.capitalize()} dataset {name!r} with {kwargs} is empty.")
    lengths = prompt_lengths(tokenizer, records, chat)
    kept, dropped = drop_long_prompts(records, lengths, max_len)
    where = (f"longer than {max_len} tokens (the room EngineConfig.max_seq_len - RolloutConfig.max_new_tokens "
             f"leaves; the longest has {int(lengths.max())})")
    if not kept:
        raise ValueError(f"Every prompt of the {role} dataset {name!r} with {kwargs} is {where}; raise "
                         "EngineConfig.max_seq_len or lower RolloutConfig.max_new_tokens.")
    if dropped:
        print(f"warning: {role} dataset {name!r}: dropped {dropped} of {len(records)} prompts {where}; "
              f"{len(kept)} remain.", flush=True)
    return kept


def load_policy(cfg: TrainConfig, mesh):
    if cfg.policy_path is None:
        return init_model(model_config(), seed=cfg.seed)
    return load_pretrained(cfg.policy_path, dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, mesh=mesh)


def model_fingerprint(model) -> dict:
    raw = config_to_hf(model.cfg)
    return {k: raw[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}


def build(cfg: TrainConfig, workdir: storage.PathLike | None = None, checkpoint: storage.PathLike | None = None,
          for_training: bool = False) -> Run:
    """Builds the policy, tokenizer, engine, data, learner and checkpointer from the gin configuration.

    With ``checkpoint`` (evaluation), the params come from an orbax checkpoint (a workdir or one of its
    step directories, local or e.g. ``gs://``) or from an HF-layout directory (local: its safetensors are mapped).
    """
    workdir = storage.as_path(workdir) if workdir is not None else None
    checkpoint = storage.as_path(checkpoint) if checkpoint is not None else None
    mesh = mesh_lib.make_mesh()
    hf_checkpoint = checkpoint is not None and (checkpoint / "config.json").exists()
    if hf_checkpoint:
        cfg = dataclasses.replace(cfg, policy_path=str(checkpoint),
                                  tokenizer_path=cfg.tokenizer_path or cfg.policy_path)
    model = load_policy(cfg, mesh)
    tok_path = cfg.tokenizer_path or cfg.policy_path
    if tok_path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when policy_path is None.")
    tokenizer = Tokenizer.from_dir(tok_path, model_vocab_size=model.cfg.vocab_size)
    rollout_cfg = RolloutConfig()
    engine = Engine(model, EngineConfig(), SamplingConfig(), eos_ids=tokenizer.eos_ids, mesh=mesh)
    scorer = RewardScorer()
    room = max_prompt_len(rollout_cfg, engine.config)
    eval_records = load_prompts("eval", cfg.eval_dataset, cfg.eval_dataset_kwargs, tokenizer, cfg.chat_template,
                                room)[: cfg.eval_size]
    if not eval_records:
        raise ValueError(f"TrainConfig.eval_size={cfg.eval_size} selects no eval problems.")
    run = Run(cfg=cfg, workdir=workdir, tokenizer=tokenizer, model=model, mesh=mesh, engine=engine, scorer=scorer,
              eval_records=eval_records)
    if checkpoint is not None and not hf_checkpoint:
        _restore_params_only(run, checkpoint)
    if not for_training:
        return run

    learner_cfg = learner_lib.LearnerConfig().for_sampler(engine.sampling.logp_temperature)
    run.filter_cfg = FilterConfig()
    cross_check_settings(rollout_cfg, engine.config, learner_cfg, dict(mesh.shape), run.filter_cfg)
    optimizer = learner_lib.make_optimizer()
    graphdef, _ = learner_lib.split_params(model)
    shardings = learner_lib.train_state_shardings(model, optimizer, mesh)
    run.graphdef, run.learner_cfg = graphdef, learner_cfg
    run.train_state = learner_lib.init_train_state(model, optimizer, mesh, seed=cfg.seed)
    run.train_step = learner_lib.make_train_step(graphdef, learner_cfg, optimizer, mesh, shardings)
    if learner_cfg.loss.kl_coef > 0:
        run.ref_params = jax.tree.map(lambda x: x.copy(), run.train_state.params)
    records = load_prompts("train", cfg.train_dataset, cfg.train_dataset_kwargs, tokenizer, cfg.chat_template, room)
    run.inputs = input_identity(cfg, records, tokenizer)
    run.iterator = PromptIterator(records, batch_size=1, seed=cfg.seed)
    scheduler = Scheduler(engine)
    run.manager = RolloutManager(rollout_cfg, scheduler, lambda: run.iterator.next_batch()[0], run.encode,
                                 seed=cfg.seed, switch=SwitchConfig(), verify=VerifyConfig())
    run.checkpointer = Checkpointer(workdir, CheckpointConfig(), model_fingerprint=model_fingerprint(model))
    restored = None
    if run.checkpointer.latest_step() is not None:
        abstract = learner_lib.abstract_train_state(model, optimizer, mesh)
        # The newest checkpoint that can be read (a damaged one is moved aside with a warning; any other error
        # stops here and moves nothing).
        restored = run.checkpointer.restore_newest(abstract_state=abstract)
    if restored is None:  # none to restore: refused when the workdir shows a run was there
        check_fresh_start(workdir, run.checkpointer, allow=cfg.restart_from_scratch)
        run.checkpointer.say_cleanup(None)
    else:
        _, run.train_state, extra = restored
        check_resume_settings(extra.get("settings", {}), run_settings(run), allow=cfg.allow_changed_settings)
        load_run_state(run, extra)
        print(f"resumed from checkpoint step {run.step}", flush=True)
    engine.update_params(run.train_state.params, version=run.step)
    return run


def resolve_checkpoint(checkpoint: storage.PathLike) -> tuple[epath.Path, int | None]:
    """(workdir, step; None for its latest) of a workdir, its checkpoints/ dir, or checkpoints/<step>. Checks
    the directory is there before anything opens it (opening would create it), so a typo is one clear error."""
    checkpoint = storage.as_path(checkpoint)
    if checkpoint.name.isdigit():  # <workdir>/checkpoints/<step>
        root, step = checkpoint.parent.parent, int(checkpoint.name)
    else:  # <workdir> or <workdir>/checkpoints
        root, step = (checkpoint.parent if checkpoint.name == "checkpoints" else checkpoint), None
    if not (root / "checkpoints").is_dir():
        raise FileNotFoundError(f"No checkpoint under {checkpoint}; pass a workdir, a checkpoint step "
                                "directory or an HF-layout policy directory.")
    return root, step


def restore_params(model, mesh, checkpoint: storage.PathLike) -> tuple[int, object]:
    """(step, params) of an orbax checkpoint (see ``resolve_checkpoint``), read read-only onto the shardings of
    ``model``'s params (an abstract model from ``nnx.eval_shape`` works): no optimizer state, no host state."""
    root, step = resolve_checkpoint(checkpoint)
    abstract = learner_lib.abstract_train_state(model, learner_lib.make_optimizer(), mesh).params
    with Checkpointer(root, CheckpointConfig(), model_fingerprint=model_fingerprint(model), read_only=True) as ckpt:
        step = step if step is not None else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint under {checkpoint}; pass a workdir, a checkpoint step "
                                    "directory or an HF-layout policy directory.")
        return step, ckpt.restore_params(step, abstract)


def _restore_params_only(run: Run, checkpoint: epath.Path) -> None:
    """Evaluation from an orbax checkpoint: a workdir, its checkpoints/ dir, or checkpoints/<step>."""
    step, params = restore_params(run.model, run.mesh, checkpoint)
    run.engine.update_params(params, version=step)


def input_identity(cfg: TrainConfig, records: Sequence[dict], tokenizer: Tokenizer) -> dict:
    """What the run reads besides its settings: the train dataset (its name and arguments, the path among them;
    the count and content hash of the records it draws from) and the tokenizer's hash. Part of run_settings, so
    a resume on a data file edited in place or on another tokenizer is refused like a changed setting."""
    data = records_fingerprint(records)
    return {"data.train_dataset": cfg.train_dataset, "data.train_dataset_kwargs": cfg.train_dataset_kwargs,
            "data.train_records": data["records"], "data.train_sha256": data["sha256"],
            "tokenizer.sha256": tokenizer.fingerprint()}


def run_settings(run: Run) -> dict:
    """The settings that define what a run trains (saved in every checkpoint, compared on resume)."""
    rc, sw, lc = run.manager.config, run.manager.switch_cfg, run.learner_cfg
    vc, fc = run.manager.verify_cfg, run.filter_cfg
    sampling = run.engine.sampling
    return {
        "rollout.mode": rc.mode, "rollout.batch_groups": rc.batch_groups, "rollout.group_size": rc.group_size,
        "rollout.max_new_tokens": rc.max_new_tokens, "rollout.extra_complete_groups": rc.extra_complete_groups,
        "filter.name": fc.name, "filter.s_max": fc.s_max,
        "filter.ops_threshold": fc.ops_threshold, "verify.ds": vc.ds, "verify.dt": vc.dt,
        "verify.verify_finished": vc.verify_finished, "switch.enabled": sw.enabled, "switch.window": sw.window,
        "switch.threshold": sw.threshold, "loss.name": lc.loss_name,
        **{f"loss.{k}": v for k, v in dataclasses.asdict(lc.loss).items()},
        "advantage": run.cfg.advantage, "skip_uniform_groups": run.cfg.skip_uniform_groups,
        "sampling.temperature": sampling.temperature, "sampling.top_p": sampling.top_p,
        "sampling.top_k": sampling.top_k, "sampling.greedy": sampling.greedy,
        "learner.temperature": lc.temperature, "learner.ratio_against": lc.ratio_against,
        "policy_path": run.cfg.policy_path,
        "param_dtype": run.cfg.param_dtype, "compute_dtype": run.cfg.compute_dtype,
        # The rollout's activation dtype (EngineConfig.compute_dtype, else the model's): it changes what is sampled.
        "engine.compute_dtype": run.engine.compute_dtype,
        **run.inputs,
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
