"""Building a run from its ``RunSpec``: ``build_policy`` (what evaluation and export need) and ``build_trainer``
(a ``Trainer``, resumed from its workdir's newest checkpoint when there is one)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import numpy as np
from etils import epath

from rollverify_jax.data.datasets import PromptIterator, drop_long_prompts, get_dataset, records_fingerprint
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.infra import storage
from rollverify_jax.models import Tokenizer, init_model, load_pretrained, model_config
from rollverify_jax.models.hf import config_to_hf
from rollverify_jax.models.qwen3 import expert_parallel_chunk
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.partial_rollout import RolloutManager
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.scheduler import Scheduler
from rollverify_jax.rollout.tool_use import ToolEnvironment
from rollverify_jax.run.checkpoint import Checkpointer
from rollverify_jax.run.evaluation import eval_settings
from rollverify_jax.run.fresh_start import check_fresh_start
from rollverify_jax.run.programs import execution_config, make_learner, make_mesh
from rollverify_jax.run.spec import RunSpec, check_resume_settings
from rollverify_jax.run.trainer import Policy, Trainer


def prompt_lengths(tokenizer: Tokenizer, records: Sequence[dict], chat: bool, chunk: int = 4096, *,
                   system_prompt: str | None = None, enable_thinking: bool | None = None) -> np.ndarray:
    """Token counts of the prompts exactly as ``Policy.encode`` encodes them (``Tokenizer.render_prompt``: a
    record's own ``messages`` when it has them, the chat template, ``TrainConfig.system_prompt`` and
    ``enable_thinking``); each distinct prompt is rendered and encoded once (DAPO-Math-17k repeats its problems),
    in batches (``tokenizers`` runs them in Rust)."""
    keys = [_prompt_key(record) for record in records]
    unique = list(dict(zip(keys, records, strict=True)).items())
    counts: dict[str, int] = {}
    for start in range(0, len(unique), chunk):
        part = unique[start:start + chunk]
        rendered = [tokenizer.render_prompt(r["prompt"], chat=chat, messages=r.get("messages"), system=system_prompt,
                                            enable_thinking=enable_thinking) for _, r in part]
        counts.update(zip((k for k, _ in part), map(len, tokenizer.encode_batch(rendered)), strict=True))
    return np.asarray([counts[k] for k in keys], dtype=np.int64)


def prompt_options(train) -> dict:
    """The chat-prompt settings of a ``TrainConfig`` that ``prompt_lengths`` takes besides ``chat``."""
    return {"system_prompt": train.system_prompt, "enable_thinking": train.enable_thinking}


def _prompt_key(record: dict) -> str:
    """What a prompt's rendering depends on: its text, and its chat messages when it has them."""
    messages = record.get("messages")
    return record["prompt"] if messages is None else json.dumps([record["prompt"], messages], sort_keys=True)


def load_prompts(role: str, name: str, kwargs: dict, tokenizer: Tokenizer, chat: bool, max_len: int, *,
                 system_prompt: str | None = None, enable_thinking: bool | None = None) -> list[dict]:
    """A dataset's records without the prompts longer than ``max_len`` tokens (as ``prompt_lengths`` counts them),
    dropped once here with a warning: admitted mid-run, such a prompt would stop the run (the scheduler refuses
    it)."""
    records = list(get_dataset(name, **kwargs))
    if not records:
        raise ValueError(f"{role[0].upper() + role[1:]} dataset {name!r} with {kwargs} is empty.")
    lengths = prompt_lengths(tokenizer, records, chat, system_prompt=system_prompt, enable_thinking=enable_thinking)
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


def load_eval_sets(spec: RunSpec, tokenizer: Tokenizer, chat: bool) -> dict[str, list[dict]]:
    """The records of each ``TrainConfig.eval_sets`` entry, by name (its first ``size`` problems)."""
    sets = {}
    for name in spec.train.eval_sets:
        dataset, kwargs, size = spec.eval_set_kwargs(name)
        sets[name] = load_prompts(f"eval set {name!r}", dataset, kwargs, tokenizer, chat, spec.max_prompt_len(),
                                  **prompt_options(spec.train))[:size]
    return sets


def load_policy(spec: RunSpec, train, mesh):
    """The policy model: ``train.policy_path``'s HF checkpoint, or a random ``model_config`` one when it is None."""
    if train.policy_path is None:
        return init_model(execution_config(model_config(**spec.model), spec), seed=train.seed)
    return load_pretrained(train.policy_path, dtype=train.param_dtype, compute_dtype=train.compute_dtype, mesh=mesh,
                           axis_rules=spec.axis_rules.get("rules", ()),
                           expert_parallel_chunk=expert_parallel_chunk(**spec.moe))


def model_fingerprint(model) -> dict:
    raw = config_to_hf(model.cfg)
    return {k: raw[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}


def build_policy(spec: RunSpec, checkpoint: storage.PathLike | None = None) -> Policy:
    """The policy, tokenizer, engine, reward scorer and eval records of a spec.

    With ``checkpoint`` (evaluation, export), the params come from an orbax checkpoint (a workdir or one of its
    step directories, local or e.g. ``gs://``) or from an HF-layout directory (local: its safetensors are mapped).
    """
    checkpoint = storage.as_path(checkpoint) if checkpoint is not None else None
    mesh = make_mesh(spec)
    train = spec.train
    hf_checkpoint = checkpoint is not None and (checkpoint / "config.json").exists()
    if hf_checkpoint:
        train = dataclasses.replace(train, policy_path=str(checkpoint),
                                    tokenizer_path=train.tokenizer_path or train.policy_path)
    model = load_policy(spec, train, mesh)
    tok_path = train.tokenizer_path or train.policy_path
    if tok_path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when policy_path is None.")
    tokenizer = Tokenizer.from_dir(tok_path, model_vocab_size=model.cfg.vocab_size)
    tools = ToolEnvironment.for_tokenizer(spec.tool_use, tokenizer, spec.sandbox) if spec.tool_use.enabled else None
    engine = Engine(model, spec.engine, spec.sampling, eos_ids=tokenizer.eos_ids, mesh=mesh, flash=spec.flash,
                    attention=spec.attention, stop_ids=(tools.call_end_id,) if tools else ())
    scorer = RewardScorer(**spec.reward)
    try:
        eval_records = load_prompts("eval", train.eval_dataset, spec.dataset_kwargs("eval"), tokenizer,
                                    train.chat_template, spec.max_prompt_len(),
                                    **prompt_options(train))[: train.eval_size]
        policy = Policy(spec=spec, tokenizer=tokenizer, model=model, mesh=mesh, engine=engine, scorer=scorer,
                        eval_records=eval_records, eval_sets=load_eval_sets(spec, tokenizer, train.chat_template),
                        tools=tools)
        eval_settings(policy)  # a bad evaluation setting fails here, not after hours of training or sampling
        if checkpoint is not None and not hf_checkpoint:
            step, params = restore_params(model, mesh, checkpoint, spec)
            engine.update_params(params, version=step)
    except BaseException:
        scorer.close()
        if tools is not None:
            tools.close()
        raise
    return policy


def build_trainer(spec: RunSpec, workdir: storage.PathLike) -> Trainer:
    """A training run in ``workdir``: the policy, the learner's state and compiled step, the data, the rollout
    manager and the checkpointer; resumed from the newest readable checkpoint when there is one (its settings
    compared with the spec's, ``Trainer.settings``)."""
    workdir = storage.as_path(workdir)
    policy = build_policy(spec)
    try:
        return _training(policy, workdir)
    except BaseException:
        policy.close()
        raise


def _training(policy: Policy, workdir: epath.Path) -> Trainer:
    spec, model, mesh, engine = policy.spec, policy.model, policy.mesh, policy.engine
    spec.check_mesh(dict(mesh.shape))
    learner = make_learner(spec, model, mesh)  # the programs the deviceless compile lowers too
    train_state = learner.init_state(model, seed=spec.train.seed)
    ref_params = jax.tree.map(lambda x: x.copy(), train_state.params) if spec.loss.kl_coef > 0 else None
    records = load_prompts("train", spec.train.train_dataset, spec.dataset_kwargs("train"), policy.tokenizer,
                           spec.train.chat_template, spec.max_prompt_len(), **prompt_options(spec.train))
    iterator = PromptIterator(records, batch_size=1, seed=spec.train.seed)
    manager = RolloutManager(spec.rollout, Scheduler(engine, policy.tools), lambda: iterator.next_batch()[0],
                             policy.encode, seed=spec.train.seed, switch=spec.switch, verify=spec.verify)
    checkpointer = Checkpointer(workdir, spec.checkpoint, model_fingerprint=model_fingerprint(model))
    trainer = Trainer(policy=policy, workdir=workdir, graphdef=learner.graphdef, train_state=train_state,
                      train_step=learner.train_step, manager=manager, iterator=iterator, checkpointer=checkpointer,
                      ref_params=ref_params, logprob_fn=learner.logprob_fn,
                      inputs=input_identity(spec, records, policy.tokenizer))
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
    with Checkpointer(root, spec.checkpoint, model_fingerprint=model_fingerprint(model), read_only=True) as ckpt:
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
