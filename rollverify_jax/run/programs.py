"""What a run compiles, assembled once from its spec: the learner (``rl.learner.Learner``) and the engine's plan
(``rollout.engine.EnginePlan``), each on the mesh it is given.

The builder trains with these programs, ``train --dry_run`` lays them out on an abstract mesh, and ``aot``
compiles them deviceless for a TPU slice (``compile_run``): like MaxText's train_compile, the compile
lowers the very train step, log-prob pass, prefill and decode that training builds. ``scale/fit`` only analyses
what it is handed; it never reads a spec.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from rollverify_jax import schedule_rules
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import Qwen3Config, Qwen3ForCausalLM, lora, model_config
from rollverify_jax.models.flash_attention import FlashConfig
from rollverify_jax.models.hf import config_from_hf
from rollverify_jax.models.lora import LoraConfig
from rollverify_jax.models.qwen3 import expert_parallel_chunk
from rollverify_jax.rl.learner import Learner
from rollverify_jax.rollout.engine import EnginePlan, rollout_graphdef
from rollverify_jax.run import shape_plan
from rollverify_jax.run.spec import RunSpec
from rollverify_jax.scale import fit


def execution_config(cfg: Qwen3Config, spec: RunSpec) -> Qwen3Config:
    """A model config with the spec's logical-axis rules and expert-parallel chunk (how it runs on the mesh)."""
    return cfg.replace(axis_rules=spec.axis_rules.get("rules", ()), expert_parallel_chunk=expert_parallel_chunk(
        **spec.moe))


def architecture(spec: RunSpec) -> Qwen3Config:
    """The policy's architecture without loading weights: the checkpoint's config.json when present, else the
    gin-configured preset (the layout a run on a machine without the checkpoint is sized by), with the run's
    execution settings (logical-axis rules, expert-parallel chunk)."""
    train_cfg = spec.train
    hf_config = Path(train_cfg.policy_path or "", "config.json")
    if train_cfg.policy_path and hf_config.exists():
        cfg = config_from_hf(json.loads(hf_config.read_text()), dtype=train_cfg.param_dtype)
    else:
        dtype = train_cfg.param_dtype or "float32"
        cfg = model_config(**{**spec.model, "param_dtype": dtype, "dtype": train_cfg.compute_dtype or dtype})
    return execution_config(cfg, spec)


def make_mesh(spec: RunSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The spec's mesh (``make_mesh.shape``) over ``devices`` (default: every device JAX sees)."""
    return mesh_lib.make_mesh(**spec.mesh, **({"devices": devices} if devices is not None else {}))


def make_meshes(spec: RunSpec, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
    """(train mesh, rollout mesh) over ``devices`` (default: every device JAX sees): the same mesh twice, or in
    the asynchronous mode (``RolloutConfig.mode = 'async'``) each host's devices split by
    ``AsyncConfig.rollout_devices``, the train mesh shaped by ``make_mesh.shape`` and the rollout mesh by
    ``AsyncConfig.rollout_mesh``."""
    if spec.rollout.mode != schedule_rules.ASYNC_MODE:
        mesh = make_mesh(spec, devices)
        return mesh, mesh
    rollout, train = mesh_lib.split_local_devices(spec.async_rollout.rollout_devices, devices)
    return (make_mesh(spec, train),
            mesh_lib.make_mesh(spec.async_rollout.rollout_mesh, spec.mesh.get("axis_types", "auto"), rollout))


def abstract_model(cfg: Qwen3Config, lora_cfg: LoraConfig | None = None) -> Qwen3ForCausalLM:
    """A model of ``cfg`` whose arrays are ShapeDtypeStructs (``nnx.eval_shape``): nothing is allocated. With an
    enabled ``lora_cfg``, the adapted model (``models.lora``)."""
    return lora.structure(cfg, lora_cfg)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The run's two halves: the learner on its mesh and the engine's plan on its own (the same mesh, or in the
    asynchronous mode the rollout mesh)."""

    learner: Learner
    engine: EnginePlan


def make_learner(spec: RunSpec, model: nnx.Module, mesh: Mesh, flash: FlashConfig | None = None) -> Learner:
    """The spec's learner of ``model`` (concrete or abstract) on ``mesh``."""
    return Learner.create(model, spec.learner, spec.optimizer, mesh, flash or spec.flash)


def make_engine_plan(spec: RunSpec, model_cfg: Qwen3Config, mesh: Mesh, *, eos_ids: tuple[int, ...] = (),
                     stop_ids: tuple[int, ...] = (), flash: FlashConfig | None = None,
                     graphdef: nnx.GraphDef | None = None) -> EnginePlan:
    """The spec's engine plan for a model of ``model_cfg`` on ``mesh``; ``graphdef``: a concrete model's
    ``rollout_graphdef`` (None: derived from ``model_cfg``)."""
    return EnginePlan.of(model_cfg, spec.engine, spec.sampling, mesh, eos_ids=eos_ids, stop_ids=stop_ids,
                         flash=flash or spec.flash, attention=spec.attention, graphdef=graphdef)


def programs(spec: RunSpec, model: nnx.Module, mesh: Mesh, engine_mesh: Mesh | None = None, *,
             flash: FlashConfig | None = None) -> Programs:
    """The learner and the engine plan of ``model`` (concrete or abstract); the engine on ``engine_mesh``
    (default: the learner's ``mesh``). ``flash``: the attention kernel (default: the spec's). The engine merges
    its params into ``model``'s own graph: a LoRA-adapted model's holds the adapters, which a graph derived from
    ``model.cfg`` lacks (its programs then could not take the adapted params)."""
    return Programs(learner=make_learner(spec, model, mesh, flash),
                    engine=make_engine_plan(spec, model.cfg, mesh if engine_mesh is None else engine_mesh,
                                           flash=flash, graphdef=rollout_graphdef(model, spec.engine.compute_dtype)))


def logprob_pass_users(spec: RunSpec) -> list[str]:
    """What runs the packed log-prob pass (``Learner.logprob_fn``) in ``select``: 'reference' (the KL's
    ref_logp, kl_coef > 0), 'step_start' (the OPS filter, the pi_old ablation); empty: the run has no such pass."""
    users = ["reference"] if spec.loss.kl_coef > 0 else []
    if spec.filter.name == "ops" or spec.learner.ratio_against == "step_start":  # the readers of current_logp
        users.append("step_start")
    return users


def compile_run(spec: RunSpec, topology: str | None = None) -> dict:
    """Compiles the run's programs for ``topology`` (default: AotConfig.topology) deviceless -> the fit report
    (``scale.fit.compile_programs``): the train step, prefill, decode, the extend of a tool-use run and, when
    ``logprob_pass_users`` names a user, the log-prob pass. In the asynchronous mode the topology's chips are split
    host by host as training splits them (``make_meshes``: a topology's devices carry their process index), the
    learner's programs compiled on the train mesh and the engine's on the rollout mesh, and the report states both."""
    topology = topology or spec.aot.topology
    devices = fit.get_topology_devices(topology)
    fit.chip_for(devices[0].device_kind)  # an unknown chip fails before anything is built
    mesh, engine_mesh = make_meshes(spec, devices=devices)
    cfg = architecture(spec)
    hosts = len({d.process_index for d in devices})
    split = (f" (train, {mesh.devices.size} chips), rollout mesh {dict(engine_mesh.shape)} ({engine_mesh.devices.size}"
             f" chips, {engine_mesh.devices.size // hosts} of each host's {len(devices) // hosts})"
             if spec.rollout.mode == schedule_rules.ASYNC_MODE else "")
    print(f"{topology}: {len(devices)} x {devices[0].device_kind} on {hosts} host(s), mesh {dict(mesh.shape)}{split}, "
          f"{cfg.num_params() / 1e9:.2f}B parameters", flush=True)
    model = abstract_model(cfg, spec.lora)
    flash = dataclasses.replace(spec.flash, impl=spec.flash.resolved_impl("tpu"))
    run = programs(spec, model, mesh, engine_mesh, flash=flash)
    # A tool-use run extends every slot's reply at once: the reply cap plus 16 tokens of frame and closing tag.
    extend = (schedule_rules.smallest_holding(run.engine.extend_widths(), spec.tool_use.max_reply_tokens
                                              + shape_plan.REPLY_FRAME_TOKENS) if spec.tool_use.enabled else None)
    report = fit.compile_programs(run.learner, run.engine, model, spec.rollout, spec.aot, topology=topology,
                                  devices=devices, logprob_users=logprob_pass_users(spec), extend_width=extend)
    plan = shape_plan.plan_run(spec, run.engine, spec.eval.sampling(spec.sampling), run.learner.abstract_state,
                               logprob_pass_users(spec))
    return {**report, "shape_plan": plan.summary()}


def plan_for(spec: RunSpec, topology: str | None = None):
    """The shape plan of ``spec`` laid out on ``topology``'s chips (deviceless; default: AotConfig.topology), with
    the programs that build it: (plan, learner, engine plan, abstract model)."""
    devices = fit.get_topology_devices(topology or spec.aot.topology)
    mesh, engine_mesh = make_meshes(spec, devices=devices)
    model = abstract_model(architecture(spec), spec.lora)
    flash = dataclasses.replace(spec.flash, impl=spec.flash.resolved_impl("tpu"))
    run = programs(spec, model, mesh, engine_mesh, flash=flash)
    return (shape_plan.plan_run(spec, run.engine, spec.eval.sampling(spec.sampling), run.learner.abstract_state,
                                logprob_pass_users(spec)), run, model)


def compile_plan(spec: RunSpec, topology: str | None = None, threads: int = 4) -> dict:
    """Compiles every engine and learner program of ``spec``'s shape plan deviceless for ``topology``, ``threads``
    at a time (XLA compiles outside the GIL) -> {'programs': [{label, compile_s}], 'total_s', 'wall_s', ...}.
    The verifier and the engine's bookkeeping helpers are left out (host-sized: a few ms each)."""
    import concurrent.futures
    import time

    from tqdm import tqdm

    plan, run, model = plan_for(spec, topology)
    engine, learner = run.engine, run.learner
    params = engine.abstract_params(nnx.split(model)[1])
    rows, width = spec.rollout.batch_groups * spec.rollout.group_size, spec.engine.max_seq_len

    def lowering(p):
        d = dict(p.dims)
        family = p.family.removeprefix("eval_")
        if family == "prefill":
            return lambda: engine.lower_prefill(params, d["rows"], d["width"])
        if family == "decode":
            slots = None if d["slots"] == spec.engine.num_slots else d["slots"]
            return lambda: engine.lower_decode(params, d["pages"], slots)
        if family == "extend":
            return lambda: engine.lower_extend(params, d["width"])
        if family == "train_step":
            return lambda: learner.lower_train_step(rows, width)
        if family == "logprob":
            return lambda: learner.lower_logprobs(rows, width)
        if p.name == "_activate_fn":
            return engine.lower_activate
        return None

    todo = [(p, lowering(p)) for p in plan.programs]
    todo = [(p, fn) for p, fn in todo if fn is not None]

    def one(item):
        p, fn = item
        t0 = time.perf_counter()
        fn().compile()
        return {"program": p.label(), "compile_s": round(time.perf_counter() - t0, 2)}

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        out = list(tqdm(pool.map(one, todo), total=len(todo), desc="compiling the shape plan", unit="program"))
    return {"topology": topology or spec.aot.topology, "plan": len(plan), "summary": plan.summary(),
            "compiled": len(out), "programs": out, "total_s": round(sum(r["compile_s"] for r in out), 1),
            "wall_s": round(time.perf_counter() - t0, 1), "threads": threads}
