"""Building a run from its ``RunSpec``: ``build_policy`` (the policy's ``Serving`` parts and its ``Evaluator``:
what evaluation needs) and ``build_trainer`` (a ``Trainer``, resumed from its workdir's newest checkpoint when there
is one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from etils import epath
from jax.sharding import Mesh

from rollverify_jax import schedule_rules
from rollverify_jax.data.datasets import PromptIterator, records_fingerprint
from rollverify_jax.data.prompts import PromptRenderer, load_prompts
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.infra import storage
from rollverify_jax.models import Tokenizer, init_model, load_pretrained, lora, model_config
from rollverify_jax.models.hf import config_to_hf, read_config, weights_sha256
from rollverify_jax.models.qwen3 import Qwen3Config, expert_parallel_chunk
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.partial_rollout import RolloutManager
from rollverify_jax.rollout.engine import rollout_graphdef
from rollverify_jax.rollout.publish import WeightPublisher
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.tool_use import ToolEnvironment
from rollverify_jax.run.checkpoint import Checkpointer
from rollverify_jax.run.evaluation import EvalSet, Evaluator
from rollverify_jax.run.fresh_start import check_fresh_start
from rollverify_jax.run.programs import execution_config, make_engine_plan, make_learner, make_meshes
from rollverify_jax.run.spec import RunSpec, TrainConfig, check_resume_settings
from rollverify_jax.run.trainer import Serving, Trainer, run_settings


def prompt_renderer(train: TrainConfig, tokenizer: Tokenizer) -> PromptRenderer:
    """The run's prompts: ``tokenizer`` with ``TrainConfig``'s chat template, system prompt and thinking switch."""
    return PromptRenderer(tokenizer, chat=train.chat_template, system=train.system_prompt,
                          enable_thinking=train.enable_thinking)


def build_evaluator(spec: RunSpec, serving: Serving) -> Evaluator:
    """The evaluation of ``serving``'s engine on the spec's eval sets: ``TrainConfig.eval_dataset``'s first
    ``eval_size`` prompts, then each ``TrainConfig.eval_sets`` entry's first ``size`` (prompts too long for the
    engine dropped first), sampled as ``EvalConfig`` says. Its settings are checked here."""
    train, max_len = spec.train, spec.max_prompt_len()
    sets = [EvalSet("", load_prompts("eval", train.eval_dataset, spec.dataset_kwargs("eval"), serving.prompts,
                                     max_len)[: train.eval_size])]
    for name in train.eval_sets:
        dataset, kwargs, size = spec.eval_set_kwargs(name)
        records = load_prompts(f"eval set {name!r}", dataset, kwargs, serving.prompts, max_len)[:size]
        sets.append(EvalSet(name, records, train.eval_sets[name].get("k") or None))
    evaluator = Evaluator(engine=serving.engine, prompts=serving.prompts, scorer=serving.scorer, sets=tuple(sets),
                          config=spec.eval, samples_per_problem=train.eval_samples,
                          max_new_tokens=spec.rollout.max_new_tokens, tools=serving.tools)
    evaluator.settings()  # a bad evaluation setting fails here, not after hours of training or sampling
    return evaluator


def load_policy(spec: RunSpec, train, mesh):
    """The policy model: ``train.policy_path``'s HF checkpoint, or a random ``model_config`` one when it is None."""
    if train.policy_path is None:
        return init_model(execution_config(model_config(**spec.model), spec), seed=train.seed)
    try:
        return load_pretrained(train.policy_path, dtype=train.param_dtype, compute_dtype=train.compute_dtype,
                               mesh=mesh, axis_rules=spec.axis_rules.get("rules", ()),
                               expert_parallel_chunk=expert_parallel_chunk(**spec.moe))
    except FileNotFoundError as e:
        if not (storage.as_path(train.policy_path) / "config.json").exists():  # the policy, not a file inside it
            raise FileNotFoundError(f"TrainConfig.policy_path: {e}") from e
        raise


def model_fingerprint(model, policy_path: str | None = None) -> dict:
    """What a checkpoint's ``meta`` item holds, checked on restore (``config_fingerprint`` of ``model``)."""
    return config_fingerprint(model.cfg, lora.lora_config_of(model), policy_path)


def config_fingerprint(cfg: Qwen3Config, lora_cfg: lora.LoraConfig | None = None,
                       policy_path: str | None = None) -> dict:
    """The architecture and, for an adapted model (an enabled ``lora_cfg``), the adapters' config and the identity
    of the base they train on (``policy_path``'s weights' hash, compared, and the path, kept for the record):
    adapters restored onto another base would run silently."""
    raw = config_to_hf(cfg)
    out = {k: raw[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}
    if lora_cfg is not None and lora_cfg.enabled:
        out.update(lora_rank=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_target_modules=lora_cfg.target_modules,
                   lora_base_path=policy_path,
                   lora_base_sha256=weights_sha256(policy_path) if policy_path is not None else None)
    return out


def policy_config(spec: RunSpec) -> Qwen3Config:
    """The policy's config as ``load_policy`` builds it (architecture and dtypes), read without its weights:
    ``TrainConfig.policy_path``'s config.json, or the random policy's ``model_config``."""
    train = spec.train
    if train.policy_path is None:
        return execution_config(model_config(**spec.model), spec)
    try:
        return read_config(train.policy_path, train.param_dtype, train.compute_dtype)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"TrainConfig.policy_path: {e}") from e


def resume_settings(spec: RunSpec) -> tuple[dict, dict]:
    """(the model fingerprint, ``Trainer.settings``) of the run ``spec`` builds, without building it: what a
    complete workdir's last checkpoint is compared with. Reads the policy's config.json, the tokenizer and the
    train data (the records the trainer would load, for their hash); builds no model and compiles nothing."""
    cfg = policy_config(spec)
    tok_path = spec.train.tokenizer_path or spec.train.policy_path
    if tok_path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when policy_path is None.")
    tokenizer = Tokenizer.from_dir(tok_path, model_vocab_size=cfg.vocab_size)
    records = load_prompts("train", spec.train.train_dataset, spec.dataset_kwargs("train"),
                           prompt_renderer(spec.train, tokenizer), spec.max_prompt_len())
    settings = run_settings(spec, input_identity(spec, records, tokenizer), spec.engine.compute_dtype or cfg.dtype)
    return config_fingerprint(cfg, spec.lora, spec.train.policy_path), settings


def build_policy(spec: RunSpec, checkpoint: storage.PathLike | None = None, mesh: Mesh | None = None,
                 model_mesh: Mesh | None = None) -> tuple[Serving, Evaluator]:
    """The policy of a spec as it samples and is graded (model, engine, tokenizer, prompt renderer, reward
    scorer, tool runner), and its evaluator (``build_evaluator``).

    ``mesh``: the engine's, ``model_mesh``: where the model's weights are loaded (default: the run's meshes,
    ``programs.make_meshes``: the spec's mesh over every device twice, or the asynchronous mode's rollout and train
    meshes). With ``checkpoint`` (evaluation, export),
    the params come from an orbax checkpoint (a workdir or one of its step directories, local or e.g. ``gs://``) or
    from an HF-layout directory (local: its safetensors are mapped).
    """
    checkpoint = storage.as_path(checkpoint) if checkpoint is not None else None
    if mesh is None:  # the run's own meshes: evaluating or exporting an asynchronous run splits its devices as it did
        model_mesh, mesh = make_meshes(spec)
    train = spec.train
    hf_checkpoint = checkpoint is not None and (checkpoint / "config.json").exists()
    if hf_checkpoint:
        train = dataclasses.replace(train, policy_path=str(checkpoint),
                                    tokenizer_path=train.tokenizer_path or train.policy_path)
    model = lora.adapt(load_policy(spec, train, model_mesh or mesh), spec.lora)  # LoraConfig.rank 0: as loaded
    tok_path = train.tokenizer_path or train.policy_path
    if tok_path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when policy_path is None.")
    tokenizer = Tokenizer.from_dir(tok_path, model_vocab_size=model.cfg.vocab_size)
    tools = ToolEnvironment.for_tokenizer(spec.tool_use, tokenizer, spec.sandbox) if spec.tool_use.enabled else None
    engine = make_engine_plan(spec, model.cfg, mesh, eos_ids=tokenizer.eos_ids,
                              stop_ids=(tools.call_end_id,) if tools else (),
                              graphdef=rollout_graphdef(model, spec.engine.compute_dtype)).engine(model)
    scorer = RewardScorer(**spec.reward)
    serving = Serving(model=model, mesh=mesh, engine=engine, tokenizer=tokenizer,
                      prompts=prompt_renderer(train, tokenizer), scorer=scorer, tools=tools)
    try:
        evaluator = build_evaluator(spec, serving)
        if checkpoint is not None and not hf_checkpoint:
            step, params = restore_params(model, mesh, checkpoint, spec)
            engine.update_params(params, version=step)
    except BaseException:
        serving.close()
        raise
    return serving, evaluator


def build_trainer(spec: RunSpec, workdir: storage.PathLike) -> Trainer:
    """A training run in ``workdir``: the policy, the learner's state and compiled step, the data, the rollout
    manager and the checkpointer; resumed from the newest readable checkpoint when there is one (its settings
    compared with the spec's, ``Trainer.settings``)."""
    workdir = storage.as_path(workdir)
    train_mesh, rollout_mesh = make_meshes(spec)  # one mesh twice, or the asynchronous mode's two
    # The model's weights are loaded where the learner trains them; the engine copies them to its own devices.
    serving, evaluator = build_policy(spec, mesh=rollout_mesh, model_mesh=train_mesh)
    try:
        return _training(spec, serving, evaluator, workdir, train_mesh)
    except BaseException:
        serving.close()
        raise


def _training(spec: RunSpec, serving: Serving, evaluator: Evaluator, workdir: epath.Path, mesh: Mesh) -> Trainer:
    model, engine = serving.model, serving.engine
    spec.check_mesh(dict(mesh.shape))
    learner = make_learner(spec, model, mesh)  # the programs the deviceless compile lowers too
    train_state = learner.init_state(model, seed=spec.train.seed)
    ref_params = jax.tree.map(lambda x: x.copy(), train_state.params) if spec.loss.kl_coef > 0 else None
    records = load_prompts("train", spec.train.train_dataset, spec.dataset_kwargs("train"), serving.prompts,
                           spec.max_prompt_len())
    iterator = PromptIterator(records, batch_size=1, seed=spec.train.seed)
    manager = RolloutManager(spec.rollout, Scheduler(engine, serving.tools, coupled=spec.verify.rule == "coupled",
                                                       coupled_tolerance=spec.verify.coupled_tolerance),
                             iterator.next_record,
                             serving.prompts.encode, seed=spec.train.seed, switch=spec.switch, verify=spec.verify,
                             asynchronous=spec.async_rollout)
    asynchronous = spec.rollout.mode == schedule_rules.ASYNC_MODE
    checkpointer = Checkpointer(workdir, spec.checkpoint,
                              model_fingerprint=model_fingerprint(model, spec.train.policy_path))
    trainer = Trainer(spec=spec, serving=serving, evaluator=evaluator, workdir=workdir, graphdef=learner.graphdef,
                      train_state=train_state, train_step=learner.train_step, manager=manager, iterator=iterator,
                      checkpointer=checkpointer, ref_params=ref_params, logprob_fn=learner.logprob_fn, learner=learner,
                      inputs=input_identity(spec, records, serving.tokenizer),
                      train_mesh=mesh if asynchronous else None,
                      publisher=WeightPublisher(engine) if asynchronous else None)
    try:
        _restore(trainer, learner.abstract_state)
    except BaseException:
        checkpointer.close()
        raise
    engine.update_params(trainer.train_state.params, version=trainer.step)
    return trainer


def _restore(trainer: Trainer, abstract) -> None:
    """The newest checkpoint that can be read (a damaged one is moved aside with a warning; any other error stops
    here and moves nothing); with none, a fresh start is refused when the workdir shows a run was there."""
    checkpointer = trainer.checkpointer
    restored = checkpointer.restore_newest(abstract_state=abstract) if checkpointer.latest_step() is not None else None
    if restored is None:
        check_fresh_start(trainer.workdir, checkpointer, allow=trainer.spec.train.restart_from_scratch)
        checkpointer.say_cleanup(None)
        return
    _, trainer.train_state, extra = restored
    check_resume_settings(extra.get("settings", {}), trainer.settings(),
                          allow=trainer.spec.train.allow_changed_settings)
    trainer.load_state_dict(extra)
    print(f"resumed from checkpoint step {trainer.step}", flush=True)


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


def restore_params(model, mesh, checkpoint: storage.PathLike, spec: RunSpec) -> tuple[int, object]:
    """(step, params) of an orbax checkpoint (see ``resolve_checkpoint``), read read-only onto the shardings of
    ``model``'s params (an abstract model from ``nnx.eval_shape`` works): no optimizer state, no host state."""
    root, step = resolve_checkpoint(checkpoint)
    abstract = learner_lib.abstract_params(model, mesh)
    with Checkpointer(root, spec.checkpoint, model_fingerprint=model_fingerprint(model, spec.train.policy_path),
                      read_only=True) as ckpt:
        step = step if step is not None else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint under {checkpoint}; pass a workdir, a checkpoint step "
                                    "directory or an HF-layout policy directory.")
        return step, ckpt.restore_params(step, abstract)


def input_identity(spec: RunSpec, records: Sequence[dict], tokenizer: Tokenizer) -> dict:
    """What the run reads besides its settings: the train dataset (its name and arguments, the path among them;
    the count and content hash of the records it draws from) and the tokenizer's hash. Part of run_settings, so
    a resume on a data file edited in place or on another tokenizer is refused like a changed setting."""
    data = records_fingerprint(records)
    return {"data.train_dataset": spec.train.train_dataset, "data.train_dataset_kwargs": spec.dataset_kwargs("train"),
            "data.train_records": data["records"], "data.train_sha256": data["sha256"],
            "tokenizer.sha256": tokenizer.fingerprint()}
