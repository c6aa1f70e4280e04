"""Validates a gin configuration without weights or accelerators: every configurable is built (so every
range check runs), the model architecture is instantiated abstractly, and the run's programs (``run.programs``:
the learner and the engine plan training builds) are laid out on an abstract mesh of the configured shape and
device count.

It also opens what the run will read: the policy checkpoint directory (a missing one is said, with what belongs
there, and the sizes are then those of the gin preset, labelled so), the tokenizer, and the train and eval data
(every row's schema, and prompt lengths against the room the engine leaves for a prompt). Problems with the data
or an incomplete checkpoint fail the dry run with one message listing them all.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import jax
from jax.sharding import AbstractMesh, AxisType

from rollverify_jax import schedule_rules
from rollverify_jax.data.datasets import get_dataset, length_summary
from rollverify_jax.data.prompts import lost_turns
from rollverify_jax.data.rewards import get_reward_spec
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import Tokenizer, model_config
from rollverify_jax.rollout.paged_cache import kv_bytes_per_page
from rollverify_jax.run import programs
from rollverify_jax.run.builder import prompt_renderer
from rollverify_jax.run.programs import architecture
from rollverify_jax.run.spec import RunSpec
from rollverify_jax.scale.fit import format_report, per_device_bytes


def dry_run(spec: RunSpec, num_devices: int | None = None) -> dict:
    """Checks the whole configuration without weights (``RunSpec.from_gin`` built and cross-checked every part).
    ``num_devices``: the device count the mesh is laid on (None: the mesh shape's own product, or the devices
    this machine has when the shape holds a -1, as training lays it)."""
    train_cfg, rollout, engine, learner_cfg = spec.train, spec.rollout, spec.engine, spec.learner
    get_reward_spec(spec.reward.get("name", "math"))
    policy, problems = check_policy(spec)
    cfg = architecture(spec)
    if num_devices is not None and num_devices < 1:
        raise ValueError(f"--dry_run_devices={num_devices} must be >= 1.")
    mesh, engine_mesh, hosts = abstract_meshes(spec, num_devices)
    # what training builds, laid out abstractly: the engine on the rollout mesh in the asynchronous mode
    run = programs.programs(spec, programs.abstract_model(cfg, spec.lora), mesh, engine_mesh)
    per_device = per_device_bytes(run.learner.abstract_state.params)
    spec.check_mesh(dict(mesh.shape))
    rows = rollout.batch_groups * rollout.group_size
    kv_per_seq = kv_bytes_per_page(cfg, engine.page_size, engine.kv_dtype) * math.ceil(engine.max_seq_len /
                                                                                      engine.page_size)
    tokenizer = load_tokenizer(train_cfg, cfg.vocab_size, problems)
    data = {role: check_dataset(role, spec, tokenizer, spec.max_prompt_len(), problems)
            for role in ("train", "eval")}
    if spec.train.eval_sets:
        data["eval_sets"] = {}
        for set_name in spec.train.eval_sets:
            dataset, kwargs, _ = spec.eval_set_kwargs(set_name)
            data["eval_sets"][set_name] = check_dataset(
                f"eval set {set_name!r}", spec, tokenizer, spec.max_prompt_len(), problems,
                source=(dataset, kwargs, f"TrainConfig.eval_sets[{set_name!r}]"))
    if problems:
        raise ValueError(f"dry run found {len(problems)} problem(s): "
                         + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, start=1)))
    meshes = ({"rollout_mesh": dict(engine_mesh.shape), "hosts": hosts,
               "rollout_devices_per_host": engine_mesh.size // hosts, "train_devices_per_host": mesh.size // hosts}
              if rollout.mode == schedule_rules.ASYNC_MODE else {})
    lora_part = ({"lora_rank": spec.lora.rank, "trainable_params": sum(x.size for x in
                  jax.tree.leaves(run.learner.abstract_state.params)),
                  "frozen_param_bytes_per_device": per_device_bytes(run.learner.frozen)} if spec.lora.enabled else {})
    return {"params": cfg.num_params(), "param_bytes_per_device": per_device, **lora_part, "mesh": dict(mesh.shape),
            **meshes,
            "rows_per_step": rows, "kv_bytes_per_sequence": kv_per_seq,
            "kv_bytes_all_slots": kv_per_seq * engine.num_slots,
            "full_length_sequences_in_kv_budget":
                (engine.kv_memory_bytes or kv_per_seq * engine.num_slots) // kv_per_seq,
            "mode": rollout.mode, "loss": learner_cfg.loss_name, **policy, "data": data}


@dataclasses.dataclass(frozen=True)
class _Device:
    """A stand-in for a device of the dry run's hosts: what ``split_local_devices`` reads of one."""

    id: int
    process_index: int


def abstract_meshes(spec: RunSpec, num_devices: int | None) -> tuple[AbstractMesh, AbstractMesh, int]:
    """(train mesh, rollout mesh, hosts) as training lays them (``programs.make_meshes``), abstract: one mesh twice
    over ``num_devices`` (None: the mesh shape's own product, or the devices this machine has when the shape holds
    a -1), or in the asynchronous mode the devices of ``hosts`` equal hosts split host by host
    (``mesh_lib.split_local_devices``). The hosts: the rollout mesh's devices over ``AsyncConfig.rollout_devices``
    when both are counts (the v5p config's 8 over 2 a host: 4 hosts), else one."""
    shape = mesh_lib.check_shape(mesh_shape(spec))  # a 0 or a negative entry used to divide by zero below
    if spec.rollout.mode != schedule_rules.ASYNC_MODE:
        if num_devices is None:
            num_devices = jax.device_count() if -1 in shape else math.prod(shape)
        mesh = _abstract(shape, num_devices, "make_mesh.shape")
        return mesh, mesh, 1
    per_host, rollout_shape = spec.async_rollout.rollout_devices, mesh_lib.check_shape(spec.async_rollout.rollout_mesh)
    if num_devices is None:
        num_devices = (jax.device_count() if -1 in shape or -1 in rollout_shape
                       else math.prod(shape) + math.prod(rollout_shape))
    hosts = 1
    if isinstance(per_host, int) and -1 not in rollout_shape:
        hosts, rest = divmod(math.prod(rollout_shape), per_host)
        if rest or not hosts or num_devices % hosts:
            raise ValueError(f"AsyncConfig.rollout_mesh={tuple(rollout_shape)} does not split into hosts of "
                             f"AsyncConfig.rollout_devices={per_host} rollout devices over {num_devices} devices.")
    local = num_devices // hosts
    rollout, train = mesh_lib.split_local_devices(
        per_host, [_Device(h * local + i, h) for h in range(hosts) for i in range(local)])
    return (_abstract(shape, len(train), "make_mesh.shape"),
            _abstract(rollout_shape, len(rollout), "AsyncConfig.rollout_mesh"), hosts)


def _abstract(shape: list[int], num_devices: int, binding: str) -> AbstractMesh:
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if num_devices % known:
            raise ValueError(f"{num_devices} devices do not divide over {binding}={shape}.")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(f"{binding}={shape} does not cover {num_devices} devices.")
    return AbstractMesh(tuple(shape), mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
CHECKPOINT_CONTENTS = ("config.json, model.safetensors (or model-*.safetensors shards with "
                       "model.safetensors.index.json), tokenizer.json, tokenizer_config.json, generation_config.json")


def note(text: str) -> None:
    """A finding that does not fail the dry run."""
    print(f"dry run: {text}", flush=True)


def message(e: Exception) -> str:
    """An error's own text, without the 'In call to configurable' lines gin appends to it."""
    return " ".join(line for line in str(e).splitlines() if not line.startswith("  In call to configurable"))


def preset_name(spec: RunSpec) -> str:
    """The gin preset ``architecture`` falls back to (``model_config.preset``, else its default)."""
    return spec.model.get("preset", inspect.signature(model_config).parameters["preset"].default)


def check_policy(spec: RunSpec) -> tuple[dict, list[str]]:
    """Where the architecture comes from, and whether the checkpoint a run loads is there.

    A missing directory is a note, not a failure (a dry run sizes a config on a machine without the weights),
    but it is said: the sizes then describe the preset. A directory lacking files is a problem: training
    would stop on it.
    """
    preset, train_cfg = preset_name(spec), spec.train
    if train_cfg.policy_path is None:
        note(f"TrainConfig.policy_path is None: a run starts from a random model_config() (preset {preset!r}).")
        return {"policy": "none", "architecture": f"preset {preset!r} (no policy_path)"}, []
    path = Path(train_cfg.policy_path)
    if not path.is_dir():
        note(f"the policy checkpoint directory {str(path)!r} is missing: put the policy's Hugging Face checkpoint "
             f"there ({CHECKPOINT_CONTENTS}) or bind TrainConfig.policy_path to where it is; training cannot start "
             f"without it. The sizes reported here are those of the gin preset {preset!r}, not of a checkpoint.")
        return {"policy": "missing", "architecture": f"preset {preset!r} (checkpoint missing)"}, []
    lacking = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        lacking.append(" or ".join(WEIGHT_FILES))
    if lacking:
        problem = (f"the policy checkpoint directory {str(path)!r} lacks {', '.join(lacking)}; it needs "
                   f"{CHECKPOINT_CONTENTS} (an HF checkpoint directory as downloaded, not the HF cache's root)")
        source = "checkpoint config.json" if "config.json" not in lacking else f"preset {preset!r} (no config.json)"
        return {"policy": "incomplete", "architecture": source}, [problem]
    return {"policy": "present", "architecture": f"checkpoint {path / 'config.json'}"}, []


def load_tokenizer(train_cfg, vocab_size: int, problems: list[str]) -> Tokenizer | None:
    """The run's tokenizer (``tokenizer_path``, else ``policy_path``), or None when its directory is absent."""
    path = train_cfg.tokenizer_path or train_cfg.policy_path
    if path is None:
        problems.append("TrainConfig.tokenizer_path is required when policy_path is None (a run needs a tokenizer)")
        return None
    if not Path(path, "tokenizer.json").is_file():
        note(f"prompt lengths are not checked: no tokenizer.json in {path!r} (TrainConfig.tokenizer_path, else "
             "TrainConfig.policy_path).")
        return None
    try:
        return Tokenizer.from_dir(path, model_vocab_size=vocab_size)
    except (ValueError, FileNotFoundError) as e:
        problems.append(f"tokenizer: {message(e)}")
        return None


def check_dataset(role: str, spec: RunSpec, tokenizer: Tokenizer | None, max_len: int, problems: list[str],
                  source: tuple[str, dict, str] | None = None) -> dict:
    """Opens a dataset as training will (every row's schema checked) and measures its prompts: the ``role``'s
    (train, eval) or ``source`` = (dataset, its arguments, the binding that set them), e.g. an eval set's."""
    train_cfg = spec.train
    name, kwargs, binding = source or (getattr(train_cfg, f"{role}_dataset"), spec.dataset_kwargs(role),
                                       f"TrainConfig.{role}_dataset_kwargs")
    label = f"{role} data {name!r}" + (f" ({kwargs['path']})" if "path" in kwargs else "")
    try:
        records = list(get_dataset(name, **kwargs))
    except TypeError as e:  # a keyword the loader does not take
        problems.append(f"{label}: {binding}={kwargs} do not fit the loader: {message(e)}")
        return {"dataset": name, "error": message(e)}
    except (ValueError, FileNotFoundError) as e:  # DatasetSchemaError is a ValueError
        problems.append(f"{label}: {message(e)}")
        return {"dataset": name, "error": message(e)}
    part = {"dataset": name, "records": len(records)}
    if tokenizer is None:
        note(f"{label}: {len(records)} prompts, schema OK.")
        return part
    renderer = prompt_renderer(train_cfg, tokenizer)
    if lost := lost_turns(records, renderer):
        note(f"warning: {label}: {lost}")
    try:
        stats = length_summary(renderer.lengths(records), max_len)
    except ValueError as e:  # text the tokenizer cannot encode
        problems.append(f"{label}: {message(e)}")
        return part
    part["prompt_tokens"] = stats
    note(f"{label}: {len(records)} prompts, schema OK; prompt tokens min {stats['min']}, median {stats['p50']}, "
         f"mean {stats['mean']}, p99 {stats['p99']}, max {stats['max']}; "
         f"{stats['over_limit']} longer than the {max_len}-token limit.")
    if stats["over_limit"] == len(records):
        problems.append(f"{label}: every prompt is longer than {max_len} tokens (EngineConfig.max_seq_len - "
                        "RolloutConfig.max_new_tokens); raise EngineConfig.max_seq_len or lower max_new_tokens")
    elif stats["over_limit"]:
        note(f"warning: {stats['over_limit']} of {len(records)} {role} prompts are longer than {max_len} tokens "
             "(EngineConfig.max_seq_len - RolloutConfig.max_new_tokens); training drops them at start.")
    return part


def mesh_shape(spec: RunSpec) -> list[int]:
    """``make_mesh.shape`` as configured (its default when unbound)."""
    return list(spec.mesh.get("shape", (1, -1, 1)))


def dry_run_cli(spec: RunSpec, num_devices: int | None) -> None:
    """``train --dry_run``: the checks, their report, and the deviceless compile when the config names a slice."""
    report = dry_run(spec, num_devices)
    print("dry run OK: " + json.dumps(report))
    compile_for_topology(spec)


def compile_for_topology(spec: RunSpec) -> None:
    """A config that names its TPU slice (``AotConfig.topology``) is compiled for it when libtpu is installed:
    the dry run then proves the run fits, not only that the settings parse."""
    import importlib.util

    if not spec.is_bound("AotConfig.topology"):
        return
    if spec.aot.topology is None:  # a GPU config: JAX has no deviceless GPU compile
        print("dry run: AotConfig.topology = None (a GPU config): no deviceless compile proves a GPU fit, so this "
              "dry run checked the settings only. The memory arithmetic is in docs/scale.md; on the GPUs, "
              "`tests/gpu/check_gpu.py --compile-config <this file>` compiles its programs at reduced layer count.")
        return
    if importlib.util.find_spec("libtpu") is None:
        print("dry run: AotConfig.topology is set but libtpu is not installed (pip install -e '.[tpu]'); "
              "skipping the compile for it.")
        return
    report = programs.compile_run(spec)
    print(format_report(report))
    if not report["fits"]:
        raise SystemExit(1)
