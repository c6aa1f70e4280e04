"""A run's whole configuration as one frozen value, ``RunSpec``, read from gin once: the only module that reads gin.

Every configurable lives in its own module as a plain frozen dataclass or function and reads nothing: here it
is registered under the name the gin files use (``RolloutConfig.mode``, ``paged_attention.impl``,
``make_mesh.shape``), and ``RunSpec.from_gin()`` builds each part from its bindings. Components receive their
part as an argument, so a setting cannot reach one component and not another, kernel knobs are part of the
values the compiled functions are cached on, and the resume fingerprint (``RunSpec.settings``) is derived from
the spec: a new setting is compared on resume without anyone remembering to list it. ``RunSpec.to_json()`` writes
the spec as plain JSON (a workdir's ``spec.json``) and ``RunSpec.from_json()`` reads it back, equal, without gin;
the simulator reads that JSON as plain data, without this module (``rollverify_jax/infra/spec_json.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gin

from rollverify_jax import schedule_rules
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.data.synthetic import SyntheticTask
from rollverify_jax.infra import compile_cache, distributed, spec_json, storage
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import qwen3
from rollverify_jax.models.flash_attention import FlashConfig
from rollverify_jax.models.lora import LoraConfig
from rollverify_jax.rl import advantages as adv_lib
from rollverify_jax.rl.filters import FilterConfig
from rollverify_jax.rl.learner import LearnerConfig, OptimizerConfig
from rollverify_jax.rl.losses import LossConfig
from rollverify_jax.rl.partial_rollout import AsyncConfig, RolloutConfig
from rollverify_jax.rollout.attention import paged_attention
from rollverify_jax.rollout.engine import EngineConfig
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.rollout.tool_use import ToolUseConfig
from rollverify_jax.run.checkpoint import CheckpointConfig
from rollverify_jax.run.evaluation import EvalConfig
from rollverify_jax.run.metrics import MetricsConfig
from rollverify_jax.scale.aot_config import AotConfig
from rollverify_jax.sim.config import SimConfig
from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.tools import SandboxConfig
from rollverify_jax.verify import SwitchConfig, VerifyConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run is: its policy, data, length and bookkeeping. Component settings have their own gin
    configurables (RolloutConfig, EngineConfig, SamplingConfig, LearnerConfig, LossConfig, OptimizerConfig,
    SwitchConfig, CheckpointConfig, RewardScorer, make_mesh)."""

    run_name: str | None = None  # workdir = runs_root/run_name (default: the first gin file's stem)
    runs_root: str = "runs"  # where workdirs go: a local directory or e.g. gs://bucket/runs
    policy_path: str | None = "assets/tiny_policy"  # HF-layout dir with tokenizer; None: random model_config()
    tokenizer_path: str | None = None  # defaults to policy_path
    param_dtype: str | None = None  # params' dtype, e.g. 'bfloat16' (None: the checkpoint's, else float32)
    compute_dtype: str | None = None  # activations' dtype (None: param_dtype)
    num_steps: int = 40  # training steps (rollout + update) of the whole run, over all its launches
    seed: int = 0  # params of a random policy, data order, sampling keys
    advantage: str = "grpo"  # group advantage: 'grpo', 'drgrpo' or 'rloo'
    # DAPO's group filter (without re-sampling): groups whose rewards are all equal have zero advantage, so
    # they leave the loss and its normaliser, and the packed train step skips their forward pass.
    skip_uniform_groups: bool = False
    train_dataset: str = "synthetic"  # a name in data/datasets.py's DATASETS
    train_dataset_kwargs: dict = dataclasses.field(default_factory=dict)  # its loader's arguments, e.g. {'path': ...}
    eval_dataset: str = "synthetic"  # the held-out set (a DATASETS name)
    eval_dataset_kwargs: dict = dataclasses.field(default_factory=lambda: {"split": "test"})  # its arguments
    eval_size: int = 64  # problems of the held-out set evaluated (its first ones)
    eval_samples: int = 4  # samples per problem (k of avg@k, pass@k) unless EvalConfig sets it
    eval_every: int = 10  # 0: never (besides the start and the end)
    # More eval sets, each reported under its own name (eval/<name>/...): name -> {'name': dataset, 'size': problems
    # (default eval_size), 'k': samples per problem (default EvalConfig's n), and the dataset's arguments}, e.g.
    # {'aime24': {'name': 'aime_parquet', 'path': '/data/aime24.parquet', 'k': 16}}.
    eval_sets: dict = dataclasses.field(default_factory=dict)
    # > 0: stop (evaluate, checkpoint) after the first step that ends this many seconds into this launch's training
    # loop. It bounds one sitting: a resume gets a fresh budget (time/wall still counts the run's every launch).
    time_budget_s: float = 0.0
    # Compile the run's shape plan (every engine and learner program it will run: run/shape_plan.py) before the
    # first step, one thread per core, instead of each program at its first use mid-step (--no_warmup: off).
    warmup: bool = True
    chat_template: bool = False  # render prompts with the checkpoint's chat template (instruct models)
    # Chat prompts only (chat_template=True): a system message for the records that bring none of their own (a
    # record's own system message, in its `messages`, takes precedence).
    system_prompt: str | None = None
    # Chat prompts only: Qwen3's thinking switch, passed to the chat template as its `enable_thinking` variable
    # (False: Qwen3 answers without reasoning; None: left undefined, the template's default).
    enable_thinking: bool | None = None
    metrics_tensorboard: bool = True  # TensorBoard events under <workdir>/tensorboard besides metrics.jsonl
    # A resume refuses settings that differ from the checkpoint's run (mode, thresholds, loss, B, G, ...);
    # True (or --allow_changed_settings) continues with the new ones, listing each difference.
    allow_changed_settings: bool = False
    # Steps in a row whose updates were skipped for a NaN/Inf loss or gradient before the run stops (exit 3).
    max_skipped_steps: int = 3
    # A workdir with metric rows or set-aside checkpoints but no checkpoint to restore is refused; True (or
    # --restart_from_scratch) starts it at step 0 anyway (rollverify_jax/run/fresh_start.py).
    restart_from_scratch: bool = False

    def __post_init__(self):
        if self.num_steps < 0:
            raise ValueError(f"TrainConfig.num_steps={self.num_steps} must be >= 0.")
        if self.max_skipped_steps < 1:
            raise ValueError(f"TrainConfig.max_skipped_steps={self.max_skipped_steps} must be >= 1.")
        if isinstance(self.time_budget_s, bool) or not isinstance(self.time_budget_s, int | float) \
                or self.time_budget_s < 0:
            raise ValueError(f"TrainConfig.time_budget_s={self.time_budget_s!r} must be a number of seconds >= 0 "
                             "(0: no budget).")
        if self.eval_size < 1:  # a negative size would slice problems off the end in silence
            raise ValueError(f"TrainConfig.eval_size={self.eval_size} must be >= 1.")
        for name, entry in self.eval_sets.items():
            _check_eval_set(name, entry)
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"TrainConfig.system_prompt must be a string or None, got {self.system_prompt!r}.")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise ValueError(f"TrainConfig.enable_thinking must be True, False or None, got {self.enable_thinking!r}.")
        for name in ("system_prompt", "enable_thinking"):
            if getattr(self, name) is not None and not self.chat_template:
                raise ValueError(f"TrainConfig.{name} shapes the chat prompt: set TrainConfig.chat_template = True "
                                 "(a raw prompt has no system turn and no thinking switch), or leave it None.")
        adv_lib.get_advantage_fn(self.advantage)


def _check_eval_set(name: Any, entry: Any) -> None:
    """One ``TrainConfig.eval_sets`` entry: a metric-safe name and a dict naming its dataset."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"TrainConfig.eval_sets: set name {name!r} must be letters, digits, '_', '.' or '-' (it "
                         "names the set's metrics, eval/<name>/...).")
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise ValueError(f"TrainConfig.eval_sets[{name!r}] must be a dict with the dataset's 'name' (and its "
                         f"arguments), e.g. {{'name': 'aime_parquet', 'path': ...}}; got {entry!r}.")
    for key in ("size", "k"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"TrainConfig.eval_sets[{name!r}]['{key}']={value!r} must be an integer >= 1.")


def _freeze(value: Any) -> Any:
    """Lists (gin's tuples and lists alike) as tuples, so bound arguments can key a jit cache."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return Bindings.of(value)
    return value


@dataclasses.dataclass(frozen=True)
class Bindings(Mapping):
    """A configurable function's bound arguments: a frozen, hashable mapping (``fn(**bindings)``)."""

    items_: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Bindings:
        return cls(tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())))

    def __getitem__(self, key: str) -> Any:
        for k, v in self.items_:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(k for k, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)


# RunSpec field -> (the name gin files bind it by, what the bindings build). A class is built from its bindings;
# a function's bindings are kept as ``Bindings`` and handed to the code that calls it.
PARTS: dict[str, tuple[str, Any]] = {
    "train": ("TrainConfig", TrainConfig),
    "rollout": ("RolloutConfig", RolloutConfig),
    "async_rollout": ("AsyncConfig", AsyncConfig),
    "verify": ("VerifyConfig", VerifyConfig),
    "switch": ("SwitchConfig", SwitchConfig),
    "filter": ("FilterConfig", FilterConfig),
    "engine": ("EngineConfig", EngineConfig),
    "sampling": ("SamplingConfig", SamplingConfig),
    "flash": ("FlashConfig", FlashConfig),
    "attention": ("paged_attention", paged_attention),
    "loss": ("LossConfig", LossConfig),
    "learner": ("LearnerConfig", LearnerConfig),
    "optimizer": ("OptimizerConfig", OptimizerConfig),
    "lora": ("LoraConfig", LoraConfig),
    "checkpoint": ("CheckpointConfig", CheckpointConfig),
    "eval": ("EvalConfig", EvalConfig),
    "metrics": ("MetricsConfig", MetricsConfig),
    "aot": ("AotConfig", AotConfig),
    "reward": ("RewardScorer", RewardScorer),
    "mesh": ("make_mesh", mesh_lib.make_mesh),
    "axis_rules": ("logical_axis_rules", mesh_lib.logical_axis_rules),
    "model": ("model_config", qwen3.model_config),
    "moe": ("expert_parallel_chunk", qwen3.expert_parallel_chunk),
    "synthetic_task": ("SyntheticTask", SyntheticTask),
    "tool_use": ("ToolUseConfig", ToolUseConfig),
    "sandbox": ("SandboxConfig", SandboxConfig),
    "compile_cache": ("compilation_cache", compile_cache.compilation_cache),
    "distributed": ("initialize", distributed.initialize),
    "sim": ("SimConfig", SimConfig),
    "cost_model": ("CostModel", CostModel),
    "roofline": ("RooflineCosts", RooflineCosts),
}
# Arguments the code passes at each call (the devices, the platform, the cluster flags), never bound in gin.
_PER_CALL = {"mesh": {"devices"}, "attention": {"platform", "megacore"}, "sandbox": {"timeout_s"},
             "distributed": {"coordinator_address", "num_processes", "process_id"}}
_AS_BINDINGS = {"reward", "synthetic_task"}  # classes built later from these bindings (a grader pool; per split)

# A resume compares each setting of ``RunSpec.settings`` with the checkpoint's and treats a difference by its class:
# run-defining (what is trained: refused unless --allow_changed_settings), execution (how this machine or slice runs
# it: one warning line each, then followed) or bookkeeping (not compared). A setting named nowhere below is
# run-defining, so one added to a config class is refused on change without anyone listing it.

# Bookkeeping: how a run reports, saves, evaluates and is simulated; never compared.
NOT_COMPARED_PARTS = frozenset({"checkpoint", "eval", "metrics", "aot", "sim", "cost_model", "roofline"})
NOT_COMPARED = frozenset({
    "train.run_name", "train.runs_root", "train.num_steps", "train.time_budget_s", "train.warmup", "train.eval_size",
    "train.eval_samples", "train.eval_every", "train.eval_dataset", "train.eval_dataset_kwargs", "train.eval_sets",
    "train.metrics_tensorboard", "train.allow_changed_settings", "train.max_skipped_steps",
    "train.restart_from_scratch", "train.tokenizer_path",  # the tokenizer itself is compared by its hash
    "train.train_dataset", "train.train_dataset_kwargs",  # compared with the records' hash (Trainer.inputs)
})
# Execution: how the run executes on this machine or slice. None changes what is trained in exact arithmetic
# (only float rounding, memory, speed, or what waits on this machine's wall clock), so a resume on another
# machine, slice or kernel follows the new value and says so. Dtypes are not here: a precision is part of what
# is trained (the rollout's activation dtype decides what is sampled). Nor are the engine's scheduling inputs
# (num_slots, steps_per_dispatch, dispatch_ahead, page_size, page_reservation, kv_memory_bytes, max_seq_len):
# they decide which trajectories are admitted, preempted or finished by a phase's end, so which make a batch.
EXECUTION_PARTS = frozenset({
    "flash", "attention",  # attention kernels: implementation, tile and block sizes, interpret mode
    # The slice's layout: mesh shape and axis types, logical-axis sharding, the expert-parallel exchange's chunk.
    # (With a KV budget, EngineConfig.kv_memory_bytes, the pool's split over the batch devices can move when a
    # request is admitted; the budget itself is run-defining.)
    "mesh", "axis_rules", "moe",
    "compile_cache", "distributed",  # this machine's compilation cache; how its processes find each other
})
EXECUTION_SETTINGS = frozenset({
    # Decode/prefill compute buckets and the serving layout: which slots and page columns a decode computes over,
    # prefill padding, the resume prefill's log-prob chunk, where the engine's weights lie, TPU megacore.
    "engine.live_pages", "engine.live_slots", "engine.min_prefill_len", "engine.logits_chunk",
    "engine.serving_layout", "engine.megacore", "engine.bucket_ratio", "engine.prefill_token_budget",
    # The asynchronous mode's device split and its rollout mesh (how many devices decode, and their layout).
    "async_rollout.rollout_devices", "async_rollout.rollout_mesh",
    # The learner's memory / FLOP trade-offs, each "same result" (exact micro-batch accumulation, packing,
    # rematerialisation, scanned layers).
    "learner.micro_batch_size", "learner.pack_sequences", "learner.tail_row_width", "learner.logits_chunk",
    "learner.remat", "learner.scan_layers",
    # Worker pools and waits on this machine's wall clock: grader processes and how they start, the grace before
    # a hung grader is killed (its item is a timeout either way), tool calls running at once (the dispatch a
    # reply joins is ToolUseConfig.reply_dispatches, run-defining).
    "reward.num_workers", "reward.mp_context", "reward.startup_timeout_s", "reward.hard_timeout_grace_s",
    "tool_use.workers",
    # The host the sandbox runs on: the ids it runs as when the trainer is root, and whether a machine without
    # user namespaces may run it guarded (its limits, interpreter and replies are unchanged).
    "sandbox.sandbox_uid", "sandbox.sandbox_gid", "sandbox.allow_unsandboxed_network",
})
SETTINGS_FORMAT = 2  # checkpoints without "settings.format" hold the hand-kept list of earlier versions
# Earlier versions' keys -> this version's (checkpoints written before the fingerprint was derived). Format-2
# checkpoints (before the split into run-defining and execution settings) hold the same keys as now, less the
# compile_cache and distributed parts: a setting is classed by its key, so they resume as they are.
LEGACY_SETTINGS = {"loss.name": "learner.loss_name", "advantage": "train.advantage",
                   "skip_uniform_groups": "train.skip_uniform_groups", "policy_path": "train.policy_path",
                   "param_dtype": "train.param_dtype", "compute_dtype": "train.compute_dtype",
                   "engine.compute_dtype": "inputs.rollout_dtype"}


for _name, _target in PARTS.values():  # the names the gin files bind; the classes themselves stay plain
    gin.external_configurable(_target, name=_name)


def parse_gin(files: list[str], params: list[str]) -> None:
    """Makes the gin configuration these files (their includes resolve from the repository root too) and
    bindings, and nothing else: a tool run twice in one process (a test, a notebook) never inherits the bindings
    of the first run."""
    gin.clear_config()
    for f in files:
        if not Path(f).exists():
            raise FileNotFoundError(f"gin file {f} does not exist.")
        for root in (Path(f).resolve().parent, Path(f).resolve().parent.parent):
            gin.add_config_file_search_path(str(root))
    try:
        gin.parse_config_files_and_bindings(files, params)
    except ValueError as e:
        hint = _did_you_mean(str(e))
        if hint:
            raise ValueError(f"{e}\n{hint}") from e
        raise


def _settings_of(target: Any) -> list[str]:
    if dataclasses.is_dataclass(target):
        return [f.name for f in dataclasses.fields(target) if f.init]
    return list(inspect.signature(target).parameters)


def _did_you_mean(message: str) -> str | None:
    """A gin error about a misspelt configurable or setting, answered with the closest real names."""
    names = {name: target for name, target in PARTS.values()}
    if m := re.match(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", message):
        part, field = m.groups()
        if part in names:
            close = difflib.get_close_matches(field, _settings_of(names[part]), n=3, cutoff=0.6)
            return (f"did you mean {', '.join(f'{part}.{c}' for c in close)}? " if close else "") + \
                f"Every setting of {part} is in docs/config_reference.md."
    if m := re.match(r"No configurable matching '([\w.]+)'", message):
        close = difflib.get_close_matches(m.group(1), list(names), n=3, cutoff=0.6)
        return (f"did you mean {', '.join(close)}? " if close else "") + \
            "The configurables a run reads are listed in docs/config_reference.md."
    return None


def _bindings(name: str) -> dict:
    return dict(gin.get_bindings(name))


def _build(field: str) -> Any:
    name, target = PARTS[field]
    kwargs = _bindings(name)
    per_call = sorted(_PER_CALL.get(field, set()) & set(kwargs))
    if per_call:
        raise ValueError(f"{name}.{per_call[0]} is set by the code at each call, not in gin: remove the binding.")
    if not isinstance(target, type) or field in _AS_BINDINGS:
        return Bindings.of(kwargs)
    try:
        return target(**kwargs)
    except TypeError as e:  # e.g. a string bound to a step count: the user's input, said as such
        raise ValueError(f"a value bound to {name} has the wrong type ({e}): check the bindings of {name}.") from e


def _defaults(field: str) -> dict:
    """The keyword defaults of the configurable function (or class) whose bindings a spec part holds: a value
    bound to its default and one left unbound are the same setting."""
    params = inspect.signature(PARTS[field][1]).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in _PER_CALL.get(field, ())}


def _plain(value: Any) -> Any:
    """A part as it is written in the resume fingerprint and the operative config (JSON-able)."""
    if isinstance(value, Bindings):
        return {k: _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Every part of a run's configuration; components take the part they need (``spec.rollout``, ...)."""

    train: TrainConfig
    rollout: RolloutConfig
    async_rollout: AsyncConfig  # RolloutConfig.mode = 'async': the device split, the overlap and the swap
    verify: VerifyConfig
    switch: SwitchConfig
    filter: FilterConfig
    engine: EngineConfig
    sampling: SamplingConfig
    flash: FlashConfig
    attention: Bindings  # paged_attention's kernel knobs (impl, pages_per_compute_block, ...)
    loss: LossConfig
    learner: LearnerConfig  # scoring at the sampler's temperature; its ``loss`` is ``loss``
    optimizer: OptimizerConfig
    lora: LoraConfig  # rank > 0: train low-rank adapters on a frozen base instead of every weight
    checkpoint: CheckpointConfig
    eval: EvalConfig
    metrics: MetricsConfig
    aot: AotConfig
    reward: Bindings  # RewardScorer's arguments (its grader pool is started by the builder)
    mesh: Bindings  # make_mesh's shape and axis types
    axis_rules: Bindings  # logical_axis_rules' rules
    model: Bindings  # model_config's preset, dtypes and overrides (the random-init policy)
    moe: Bindings  # expert_parallel_chunk's tokens
    synthetic_task: Bindings  # SyntheticTask's bindings, merged into the synthetic datasets' arguments
    tool_use: ToolUseConfig  # multi-turn tool use in the rollout (off by default)
    sandbox: SandboxConfig  # the python tool's limits (its wall clock is ToolUseConfig.timeout_s)
    compile_cache: Bindings
    distributed: Bindings
    sim: SimConfig
    cost_model: CostModel
    roofline: RooflineCosts
    gin_text: str = ""  # the parsed gin configuration as the user wrote it (config_str)
    bound: frozenset[str] = frozenset()  # "Name.param" of every binding the user made

    @classmethod
    def from_gin(cls) -> RunSpec:
        """The spec of the parsed gin configuration (``parse_gin``), cross-checked (``check``)."""
        parts = {field: _build(field) for field in PARTS}
        bound = frozenset(f"{name}.{param}" for name, _ in PARTS.values() for param in _bindings(name))
        return cls(**parts, gin_text=gin.config_str(), bound=bound)._derived()

    def _derived(self) -> RunSpec:
        """The values derived from other parts (the learner's loss and temperature, the response cap), checked."""
        learner = dataclasses.replace(self.learner, loss=self.loss).for_sampler(self.sampling.logp_temperature)
        spec = dataclasses.replace(self, learner=learner).with_response_cap()
        spec.check()
        return spec

    def with_bindings(self, params: list[str]) -> RunSpec:
        """This spec with gin ``params`` (``Name.param = value``) bound on top, as if they ended its gin files:
        a part's other values stay this spec's, and the derived values are derived again (``evaluate`` of a
        workdir's ``spec.json`` with other eval settings)."""
        if not params:
            return self
        parse_gin([], params)
        parts, added = {}, set()
        for field, (name, _) in PARTS.items():
            kwargs = _bindings(name)
            if not kwargs:
                continue
            added |= {f"{name}.{k}" for k in kwargs}
            per_call = sorted(_PER_CALL.get(field, set()) & set(kwargs))
            if per_call:
                raise ValueError(f"{name}.{per_call[0]} is set by the code at each call, not in gin: remove it.")
            old = getattr(self, field)
            parts[field] = Bindings.of({**old, **kwargs}) if isinstance(old, Bindings) else \
                dataclasses.replace(old, **kwargs)
        gin.clear_config()
        bound = self.bound | added
        spec = dataclasses.replace(self, **parts, bound=bound,
                                   gin_text=self.gin_text + "".join(f"{p}\n" for p in params))
        # Derived values follow their sources again unless bound: e.g. an evaluation at another temperature.
        learner = spec.learner if "LearnerConfig.temperature" in bound else \
            dataclasses.replace(spec.learner, temperature=None)
        loss = spec.loss if "LossConfig.max_response_length" in bound else \
            dataclasses.replace(spec.loss, max_response_length=None)
        reward = spec.reward if "RewardScorer.max_response_length" in bound else \
            Bindings.of({k: v for k, v in spec.reward.items() if k != "max_response_length"})
        return dataclasses.replace(spec, learner=learner, loss=loss, reward=reward)._derived()

    def to_json(self) -> str:
        """Every part's values (a function part's bindings as bound), the gin text and the bound names, as plain
        JSON (``infra/spec_json.py``): the workdir's ``spec.json``, which ``from_json`` reads back equal."""
        plain = {"format": spec_json.SPEC_FORMAT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            plain[f.name] = sorted(value) if f.name == "bound" else spec_json.to_plain(value, f.name)
        return spec_json.dumps(plain)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any], where: str = "spec.json") -> RunSpec:
        """The spec ``to_json`` wrote (its text, or that text's parsed object), rebuilt without reading gin: each
        part by its class, a function part as its ``Bindings``; a part missing from it takes its defaults."""
        plain = spec_json.loads(text, where) if isinstance(text, str) else dict(text)
        spec_json.check_format(plain, where)
        unknown = sorted(set(plain) - {f.name for f in dataclasses.fields(cls)} - {"format"})
        if unknown:
            raise ValueError(f"{where}: a run spec has no part {unknown[0]!r} (was it written by another version "
                             "of the code?).")
        parts = {}
        for field, (_, target) in PARTS.items():
            value = plain.get(field, {})
            if not isinstance(target, type) or field in _AS_BINDINGS:
                parts[field] = Bindings.of(spec_json.from_plain(value))
            else:
                parts[field] = spec_json.dataclass_from_plain(target, value, f"{where}: {field}")
        spec = cls(**parts, gin_text=plain.get("gin_text", ""), bound=frozenset(plain.get("bound", ())))
        spec.check()
        return spec

    def is_bound(self, name: str) -> bool:
        return name in self.bound

    def with_response_cap(self) -> RunSpec:
        """The response cap bound once (``RolloutConfig.max_new_tokens``) and derived for the reward's overlong
        penalty and Dr. GRPO's divisor; a different value bound there is refused."""
        cap = self.rollout.max_new_tokens
        for name, value in (("RewardScorer.max_response_length", self.reward.get("max_response_length")),
                            ("LossConfig.max_response_length", self.loss.max_response_length)):
            if value is not None and value != cap:
                raise ValueError(f"{name}={value} differs from RolloutConfig.max_new_tokens={cap}: the response "
                                 f"cap is bound once; remove the {name} binding.")
        loss = dataclasses.replace(self.loss, max_response_length=cap)
        return dataclasses.replace(self, loss=loss, learner=dataclasses.replace(self.learner, loss=loss),
                                   reward=Bindings.of({**self.reward, "max_response_length": cap}))

    def check(self) -> None:
        """Cross-checks of settings that live in different parts (the mesh's own check needs its devices)."""
        if self.filter.name != "none" and self.rollout.mode == "on_policy":
            raise ValueError(f"FilterConfig.name={self.filter.name!r} needs partial rollout: set RolloutConfig.mode "
                             "= 'partial' (or 'rollverify'), or FilterConfig.name = 'none'.")
        self.max_prompt_len()
        rows = self.rollout.batch_groups * self.rollout.group_size
        if rows % self.learner.num_minibatches:
            raise ValueError(f"{rows} rows do not split into LearnerConfig.num_minibatches="
                             f"{self.learner.num_minibatches}.")

    def check_mesh(self, mesh_shape: Mapping[str, int]) -> None:
        rows = self.rollout.batch_groups * self.rollout.group_size
        batch_devices = schedule_rules.batch_devices(mesh_shape)
        if rows % batch_devices:
            raise ValueError(f"batch_groups x group_size = {rows} rows do not divide over data x fsdp = "
                             f"{batch_devices}.")

    def max_prompt_len(self) -> int:
        """The longest prompt the scheduler admits: the context must still hold ``max_new_tokens`` after it."""
        room = self.engine.max_seq_len - self.rollout.max_new_tokens
        if room < 1:
            raise ValueError(f"RolloutConfig.max_new_tokens={self.rollout.max_new_tokens} leaves no room for a "
                             f"prompt in EngineConfig.max_seq_len={self.engine.max_seq_len}.")
        return room

    def dataset_kwargs(self, role: str) -> dict:
        """A dataset's arguments; the synthetic task's own bindings (``SyntheticTask.*``) join the synthetic one's."""
        name = getattr(self.train, f"{role}_dataset")
        kwargs = dict(getattr(self.train, f"{role}_dataset_kwargs"))
        if name == "synthetic":
            kwargs = {**self.synthetic_task, **kwargs}
        return kwargs

    def eval_set_kwargs(self, name: str) -> tuple[str, dict, int]:
        """(dataset, its arguments, problems) of ``TrainConfig.eval_sets[name]``; a synthetic set gets the synthetic
        task's bindings like ``dataset_kwargs``."""
        entry = dict(self.train.eval_sets[name])
        dataset, size = entry.pop("name"), entry.pop("size", None) or self.train.eval_size
        entry.pop("k", None)
        if dataset == "synthetic":  # held out unless told otherwise, as the primary eval set's default
            entry = {**self.synthetic_task, "split": "test", **entry}
        return dataset, entry, size

    def axis_rules_dict(self) -> dict[str, tuple[str, ...]]:
        return mesh_lib.logical_axis_rules(**self.axis_rules)

    def settings(self) -> dict:
        """The resume fingerprint: every setting of the compared parts, less the bookkeeping ones
        (``NOT_COMPARED``); what the run reads (data, tokenizer) is added by the trainer. A resume refuses a
        run-defining difference and follows an execution one (``resume_class``)."""
        out: dict[str, Any] = {"settings.format": SETTINGS_FORMAT}
        for field in PARTS:
            if field in NOT_COMPARED_PARTS:
                continue
            value = self._part(field)
            if field == "learner":
                value = {k: v for k, v in value.items() if k != "loss"}  # the loss is its own part
            for key, v in value.items():
                name = f"{field}.{key}"
                if name not in NOT_COMPARED:
                    out[name] = v
        return out

    def operative_text(self) -> str:
        """Every value the run used, bound or default, in gin syntax (the workdir's ``operative_config.gin``)."""
        lines = []
        for field, (name, _) in PARTS.items():
            for key, v in self._part(field).items():
                if (field == "learner" and key == "loss") or key in _PER_CALL.get(field, ()):
                    continue  # the loss has its own part; a per-call value is the code's, never a binding
                lines.append(f"{name}.{key} = {v!r}")
        return "\n".join(lines) + "\n"

    def _part(self, field: str) -> dict:
        """A part's every setting as plain values; a function's unbound arguments at their defaults."""
        value = getattr(self, field)
        if isinstance(value, Bindings):
            return _plain(Bindings.of({**_defaults(field), **value}))
        return _plain(value)

    def workdir(self, gin_files: list[str]) -> Any:
        name = self.train.run_name or (Path(gin_files[0]).stem if gin_files else "default")
        return storage.as_path(self.train.runs_root) / name


def resume_class(name: str) -> str:
    """What a resume does when setting ``name`` (``part.key``, as ``RunSpec.settings`` names it) differs from the
    checkpoint's: ``'refuses'`` (run-defining, also every key of what the run reads), ``'warns'`` (execution:
    reported and followed) or ``'no'`` (bookkeeping: not compared)."""
    part = name.split(".", 1)[0]
    if part in NOT_COMPARED_PARTS or name in NOT_COMPARED:
        return "no"
    if part in EXECUTION_PARTS or name in EXECUTION_SETTINGS:
        return "warns"
    return "refuses"


def check_resume_settings(saved: dict, current: dict, allow: bool, source: str = "checkpoint",
                          report_execution: bool = True) -> None:
    """Refuses a resume whose run-defining settings differ from the ``source``'s (the checkpoint's, or the
    workdir's ``spec.json``: its last launch's), naming every difference; ``allow`` continues with a warning
    listing them. A changed execution setting is followed, one warning line each (``report_execution``: the
    spec.json check leaves them to the checkpoint's, so each is said once)."""
    if "settings.format" not in saved:
        saved = {LEGACY_SETTINGS.get(k, k): v for k, v in saved.items()}
    changed = [k for k in sorted(saved) if json.dumps(saved[k]) != json.dumps(current.get(k))]
    diffs = [f"  {k}: {source} {saved[k]!r}, now {current.get(k)!r}" for k in changed
             if resume_class(k) == "refuses"]  # one an older version compared that is bookkeeping now: skipped
    if diffs:
        listing = "\n".join(diffs)
        if not allow:
            what = "checkpoint was trained" if source == "checkpoint" else f"{source} (its last launch) holds"
            raise ValueError(f"This workdir's {what} with other run-defining settings:\n{listing}\nResume with "
                             "the checkpoint's settings, use a new workdir, or pass --allow_changed_settings to "
                             "continue with the new ones.")
        print(f"warning: resuming with changed settings (--allow_changed_settings):\n{listing}", flush=True)
    if report_execution:  # followed: said once the resume goes ahead
        for k in changed:
            if resume_class(k) == "warns":
                print(f"warning: execution setting {k} changed ({source} {saved[k]!r}, now {current.get(k)!r}): "
                      "followed, it changes how the run executes here, not what it trains", flush=True)
