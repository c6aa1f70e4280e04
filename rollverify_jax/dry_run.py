"""Validates a gin configuration without weights or accelerators: every configurable is built (so every
range check runs), the model architecture is instantiated abstractly, and its parameters are laid out on an
abstract mesh of the configured shape and device count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gin
import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from rollverify_jax import mesh as mesh_lib
from rollverify_jax.checkpoint import CheckpointConfig
from rollverify_jax.data.rewards import get_reward_spec
from rollverify_jax.models import Qwen3ForCausalLM, model_config
from rollverify_jax.models.hf import config_from_hf
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl.filters import FilterConfig
from rollverify_jax.rl.losses import get_loss_fn
from rollverify_jax.rl.partial_rollout import RolloutConfig
from rollverify_jax.rollout.engine import EngineConfig
from rollverify_jax.rollout.paged_cache import kv_bytes_per_page
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.setup import cross_check_settings
from rollverify_jax.verify import SwitchConfig, VerifyConfig


def dry_run(train_cfg, num_devices: int) -> dict:
    rollout, engine = RolloutConfig(), EngineConfig()
    SamplingConfig(), SwitchConfig(), VerifyConfig(), CheckpointConfig()
    learner_cfg = learner_lib.LearnerConfig().for_sampler(SamplingConfig().logp_temperature)
    get_loss_fn(learner_cfg.loss_name)
    learner_lib.make_optimizer()
    reward_name = gin.query_parameter("RewardScorer.name") if gin_bound("RewardScorer.name") else "math"
    get_reward_spec(reward_name)
    cfg = architecture(train_cfg)
    shape = mesh_shape()
    if -1 in shape:
        shape[shape.index(-1)] = num_devices // math.prod(s for s in shape if s != -1)
    if math.prod(shape) != num_devices:
        raise ValueError(f"make_mesh.shape={shape} does not cover {num_devices} devices.")
    mesh = AbstractMesh(tuple(shape), mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    specs = nnx.to_flat_state(mesh_lib.param_specs(nnx.state(abstract), mesh))
    params = dict(nnx.to_flat_state(nnx.state(abstract)))
    per_device = 0
    for path, spec in specs:
        v = params[path]
        split = math.prod(mesh.shape[a] for s in spec if s for a in ((s,) if isinstance(s, str) else s))
        per_device += math.prod(v.shape) * jax.numpy.dtype(v.dtype).itemsize // split
    cross_check_settings(rollout, engine, learner_cfg, dict(mesh.shape), FilterConfig())
    rows = rollout.batch_groups * rollout.group_size
    kv_per_seq = kv_bytes_per_page(cfg, engine.page_size, engine.kv_dtype) * math.ceil(engine.max_seq_len /
                                                                                      engine.page_size)
    return {"params": cfg.num_params(), "param_bytes_per_device": per_device, "mesh": dict(mesh.shape),
            "rows_per_step": rows, "kv_bytes_per_sequence": kv_per_seq,
            "kv_bytes_all_slots": kv_per_seq * engine.num_slots,
            "full_length_sequences_in_kv_budget":
                (engine.kv_memory_bytes or kv_per_seq * engine.num_slots) // kv_per_seq,
            "mode": rollout.mode, "loss": learner_cfg.loss_name}


def architecture(train_cfg):
    """The policy's architecture without loading weights: the checkpoint's config.json when present, else the
    gin-configured preset (the layout a run on a machine without the checkpoint is sized by)."""
    hf_config = Path(train_cfg.policy_path or "", "config.json")
    if train_cfg.policy_path and hf_config.exists():
        return config_from_hf(json.loads(hf_config.read_text()), dtype=train_cfg.param_dtype)
    dtype = train_cfg.param_dtype or "float32"
    return model_config(param_dtype=dtype, dtype=train_cfg.compute_dtype or dtype)


def mesh_shape() -> list[int]:
    """``make_mesh.shape`` as configured (its default when unbound)."""
    return list(gin.query_parameter("make_mesh.shape")) if gin_bound("make_mesh.shape") else [1, -1, 1]


def gin_bound(name: str) -> bool:
    """Whether the parsed gin config binds ``name`` (e.g. 'AotConfig.topology')."""
    try:
        gin.query_parameter(name)
        return True
    except ValueError:
        return False
