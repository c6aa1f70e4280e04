"""The deviceless compile of a run's programs for a TPU slice, and the fit report (``python -m
rollverify_jax.aot`` and ``train --dry_run`` of a config naming ``AotConfig.topology``).

For the config's mesh on that topology and at the config's real shapes it compiles the train step (one GRPO
update at the batch's worst case), the resume prefill (with verification log-probs, ``AotConfig.prefill_rows``
rows of ``max_seq_len`` tokens), one decode dispatch over every slot and, when the run has one, the log-prob pass of
``select`` (``logprobs``: the KL's reference policy, the OPS filter's and pi_old's step-start policy, on the same
packed batch as the train step); with ``kl_coef > 0`` the reference params are resident beside the train state.
It reports per device what XLA allocates,
the run's resident bytes and the peak against the chip's HBM (FITS or DOES NOT FIT), and roofline estimates of the
step times (analytic FLOPs at the chip's peak, not measurements).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rollverify_jax import schedule_rules
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import Qwen3ForCausalLM
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.rl import packing
from rollverify_jax.rollout import engine as engine_lib
from rollverify_jax.run.builder import architecture, make_mesh
from rollverify_jax.run.spec import RunSpec
from rollverify_jax.scale import aot_decode
from rollverify_jax.scale.aot_config import CHIPS, AotConfig, GiB


def get_topology_devices(name: str) -> list:
    try:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing or an unknown name: both are the user's to fix
        raise ValueError(f"cannot describe TPU topology {name!r} ({e}). Install libtpu (pip install -e '.[tpu]') "
                         "and use a name like 'v5p:2x2x1', 'v5e:4x4' or 'v6e:4x8'.") from None


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape)
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def _compile(name: str, lowered_fn) -> tuple[dict, object]:
    t0 = time.perf_counter()
    compiled = lowered_fn().compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    out = {"temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
           "output_bytes": int(mem.output_size_in_bytes), "alias_bytes": int(mem.alias_size_in_bytes),
           "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
           "compile_s": round(time.perf_counter() - t0, 1)}
    print(f"  {name}: compiled in {out['compile_s']} s, temporaries {out['temp_bytes'] / GiB:.2f} GiB, "
          f"arguments {out['argument_bytes'] / GiB:.2f} GiB per device", flush=True)
    return out, compiled


def _sds(shape, dtype, mesh, spec: PartitionSpec | None = None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or PartitionSpec()))


def train_batch(rows: int, width: int, mesh, learner_cfg) -> dict:
    """The train step's batch at its largest packed layout (`packing.largest_shape`): one program serves
    every batch, since each minibatch loops over only the micro-batches its tokens fill."""
    def b(shape, dtype):
        return _sds(shape, dtype, mesh, PartitionSpec(mesh_lib.BATCH_AXES, *([None] * (len(shape) - 1))))
    batch = {"tokens": b((rows, width), jnp.int32), "loss_mask": b((rows, width), jnp.float32),
             "behavior_logp": b((rows, width), jnp.float32), "advantages": b((rows,), jnp.float32),
             "attention_mask": b((rows, width), bool)}
    if learner_cfg.loss.kl_coef > 0:  # the reference log-probs, from the log-prob pass
        batch["ref_logp"] = b((rows, width), jnp.float32)
    if not learner_cfg.pack_sequences:
        return batch
    shape = packing.largest_shape(rows, width, learner_cfg.num_minibatches, learner_cfg.micro_batch_size,
                                  learner_cfg.tail_row_width, _batch_devices(mesh))
    return {**batch, **{k: b(s, jnp.int32) for k, s in shape.shapes(rows).items()}}


def _batch_devices(mesh) -> int:
    return math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)


def sample_lengths(rng: np.random.Generator, rows: int, width: int, max_new: int, aot: AotConfig) -> np.ndarray:
    """Sequence lengths (prompt + response) of one batch under the length model (`AotConfig`)."""
    response = np.exp(np.log(aot.response_length_median) + aot.response_length_sigma * rng.standard_normal(rows))
    return np.minimum(np.rint(np.minimum(response, max_new)).astype(np.int64) + aot.prompt_len, width)


def packed_train_estimate(cfg, learner_cfg, rows: int, width: int, max_new: int, aot: AotConfig, batch_devices: int,
                          batches: int = 16, seed: int = 0) -> dict:
    """What the train step computes at the length model: the packing of ``batches`` sampled batches (the host
    code that packs real batches), its useful share of positions and its FLOPs against the unpacked layout
    (every sequence a full row of its own, which the step ran before micro-batches were made of packed rows)."""
    rng = np.random.default_rng(seed)
    useful = full = tail = micro = 0
    n = learner_cfg.num_minibatches
    for _ in range(batches):
        lengths = sample_lengths(rng, rows, width, max_new, aot)
        if not learner_cfg.pack_sequences:
            useful, full, micro = useful + int(lengths.sum()), full + rows * width, micro + rows
            continue
        plans = packing.plan_batch(lengths, n, width, learner_cfg.micro_batch_size, learner_cfg.tail_row_width)
        shape = packing.plan_shape(plans, rows, width, n, learner_cfg.micro_batch_size, learner_cfg.tail_row_width,
                                   batch_devices)
        f, t, m = packing.planned_positions(plans, shape)
        useful, full, tail, micro = useful + int(lengths.sum()), full + f, tail + t, micro + m
    tail_width = learner_cfg.tail_row_width or 0
    flops = (analytic_train_flops(cfg, full / batches, width, "none")
             + analytic_train_flops(cfg, tail / batches, tail_width, "none"))  # model FLOPs, no recompute
    unpacked = analytic_train_flops(cfg, rows * width, width, "none")
    return {"train_useful_token_fraction": useful / (full + tail),
            "train_positions_per_step": (full + tail) / batches,
            "train_micro_batches_per_update": micro / (batches * n),
            "train_model_flops_per_step": flops, "train_unpacked_model_flops_per_step": unpacked,
            "train_speedup_vs_unpacked": unpacked / flops}


def analytic_train_flops(cfg, tokens: int, width: int, remat: str) -> float:
    """Matmul FLOPs of one pass over ``tokens`` tokens in rows of ``width``: forward 2N, backward 4N per token
    for the active parameters, plus causal attention; full remat adds a second forward of the layers."""
    active = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        active -= sparse * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    head = cfg.vocab_size * cfg.hidden_size
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * width  # causal: half of 4 T D H
    forward = 2 * (active + head) * tokens + attn * tokens
    return forward * (4 if remat == "full" else 3)


def logprob_pass_users(spec: RunSpec) -> list[str]:
    """What runs the packed log-prob pass (`learner.make_logprob_fn`) in ``select``: 'reference' (the KL's
    ref_logp, kl_coef > 0), 'step_start' (the OPS filter, the pi_old ablation); empty: the run has no such pass."""
    users = ["reference"] if spec.loss.kl_coef > 0 else []
    if spec.filter.name == "ops" or spec.learner.ratio_against == "step_start":  # the readers of current_logp
        users.append("step_start")
    return users


def compile_run(spec: RunSpec, topology: str | None = None) -> dict:
    """Compiles the run's programs for ``topology`` (default: AotConfig.topology) -> the report: the train step,
    prefill, decode and, when ``logprob_pass_users`` names a user, the log-prob pass."""
    aot = spec.aot
    topology = topology or aot.topology
    devices = get_topology_devices(topology)
    chip = CHIPS.get(devices[0].device_kind)
    if chip is None:
        raise ValueError(f"no HBM figure for {devices[0].device_kind!r}; known: {sorted(CHIPS)}.")
    mesh = make_mesh(spec, devices=devices)
    rollout, engine_cfg, sampling, learner_cfg = spec.rollout, spec.engine, spec.sampling, spec.learner
    cfg = architecture(spec)
    flash = dataclasses.replace(spec.flash, impl=spec.flash.resolved_impl("tpu"))
    print(f"{topology}: {len(devices)} x {devices[0].device_kind}, mesh {dict(mesh.shape)}, "
          f"{cfg.num_params() / 1e9:.2f}B parameters", flush=True)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    optimizer = learner_lib.make_optimizer(spec.optimizer)
    programs = {}

    # Train step
    state = learner_lib.abstract_train_state(model, optimizer, mesh)
    rows, width = rollout.batch_groups * rollout.group_size, engine_cfg.max_seq_len
    train_graphdef = learner_lib.split_params(model)[0]
    state_shardings = learner_lib.train_state_shardings(model, optimizer, mesh)
    step = learner_lib.make_train_step(train_graphdef, learner_cfg, optimizer, mesh, state_shardings, flash)
    programs["train_step"], _ = _compile("train_step", lambda: step.lower(state, train_batch(rows, width, mesh,
                                                                                             learner_cfg)))
    # The log-prob pass of select (reference and/or step-start params: the train state's shapes and shardings)
    logprob_users = logprob_pass_users(spec)
    if logprob_users:
        logprobs = learner_lib.make_logprob_fn(train_graphdef, learner_cfg, mesh, state_shardings.params, flash)
        programs["logprobs"], _ = _compile(f"logprobs ({', '.join(logprob_users)})", lambda: logprobs.lower(
            state.params, train_batch(rows, width, mesh, learner_cfg)))

    # Resume prefill and one decode dispatch
    layout = engine_lib.PoolLayout.for_mesh(mesh, engine_cfg.num_slots, cfg.num_key_value_heads,
                                            cfg.num_attention_heads, engine_cfg.megacore)
    num_pages = engine_lib.pool_pages(cfg, engine_cfg, layout.num_shards)
    decode_state = engine_lib.abstract_decode_state(cfg, engine_cfg, layout, num_pages)
    _, params = nnx.split(model)
    graphdef = engine_lib.rollout_graphdef(model, engine_cfg.compute_dtype)  # the engine's activation dtype
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    model_param_bytes = sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
                            for v in jax.tree.leaves(params, is_leaf=is_var))
    rules = cfg.rules()
    serving = engine_lib.serving_param_shardings(params, mesh, engine_cfg.serving_layout, rules)  # as the engine
    train_layout = jax.tree.leaves(mesh_lib.param_shardings(params, mesh, rules))
    copied = any(a != b for a, b in zip(jax.tree.leaves(serving), train_layout, strict=True))
    params = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), params,
                          serving, is_leaf=is_var)
    static = engine_lib.EngineStatic(graphdef, sampling, (-1,), layout, engine_cfg.logits_chunk, flash,
                                     tuple(sorted(spec.attention.items())))
    n = aot.prefill_rows or math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    packed = engine_lib.PackedPrefill(*[_sds((n, width), jnp.int32, mesh)] * 5, *[_sds((n,), jnp.int32, mesh)] * 3)
    programs["prefill"], _ = _compile("prefill", lambda: engine_lib.lower_prefill(
        static, params, decode_state, packed))
    programs["decode"], decode_compiled = _compile("decode", lambda: engine_lib.lower_decode(
        static, params, decode_state, engine_cfg.steps_per_dispatch))
    if spec.tool_use.enabled:  # every slot's reply at once: the reply cap plus 16 tokens of frame and closing tag
        width = schedule_rules.pow2_bucket(spec.tool_use.max_reply_tokens + 16, 1, engine_cfg.max_seq_len)
        programs["extend"], _ = _compile("extend", lambda: engine_lib.lower_extend(
            static, params, decode_state, engine_cfg.num_slots, width, mesh_lib.replicated(mesh)))

    # Resident and peak bytes per device
    state_bytes, kv_bytes = _per_device_bytes(state), _per_device_bytes(decode_state.pages)
    param_bytes = _per_device_bytes(state.params)
    # A serving layout other than the train state's is a copy the engine holds through the train step too.
    copy_bytes = _per_device_bytes(params) if copied else 0
    # kl_coef > 0: the reference params (a copy of the initial params, the train state's layout) stay resident.
    ref_bytes = param_bytes if spec.loss.kl_coef > 0 else 0
    resident = state_bytes + kv_bytes + copy_bytes + ref_bytes
    engine_outside = state_bytes - (0 if copied else param_bytes)  # the train state the engine does not take
    outside = {"train_step": kv_bytes + copy_bytes + ref_bytes, "prefill": engine_outside + ref_bytes,
               "decode": engine_outside + ref_bytes, "extend": engine_outside + ref_bytes,
               # its params argument is one of the resident sets (the reference's or the train state's)
               "logprobs": resident - param_bytes}
    peaks = {k: p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"] + outside[k]
             for k, p in programs.items()}
    peak = max(peaks.values())
    budget = int(chip.hbm_bytes * aot.hbm_fraction)
    train = packed_train_estimate(cfg, learner_cfg, rows, width, rollout.max_new_tokens, aot, _batch_devices(mesh))
    decode = aot_decode.decode_report(
        decode_compiled, programs["decode"], cfg=cfg, engine_cfg=engine_cfg, rollout=rollout, aot=aot, chip=chip,
        layout=layout, mesh=mesh, attention=spec.attention, device_kind=devices[0].device_kind,
        engine_param_bytes=_per_device_bytes(params),
        model_param_bytes=model_param_bytes, num_devices=len(devices))
    return {
        "topology": topology, "device_kind": devices[0].device_kind, "num_devices": len(devices),
        "mesh": dict(mesh.shape), "params": cfg.num_params(), "context": engine_cfg.max_seq_len,
        "rows_per_step": rows, "hbm_bytes_per_device": chip.hbm_bytes,
        "budget_bytes_per_device": budget, "resident_bytes_per_device": resident,
        "resident": {"train_state": state_bytes, "params": param_bytes, "kv_pool": kv_bytes,
                     "serving_params": copy_bytes, "ref_params": ref_bytes},
        "logprobs_for": logprob_users,
        "peak_bytes_per_device": peak, "peak_program": max(peaks, key=peaks.get), "fits": peak <= budget,
        "peak_bytes_by_program": peaks,
        "programs": programs,
        "train_useful_token_fraction": train["train_useful_token_fraction"],
        "decode_roofline_fraction": decode["decode_roofline_fraction"],
        "decode": decode,
        "train": train,
        "estimate": {  # from the chips' public peaks at stated efficiencies, not a measurement
            "train_mfu": aot.train_mfu,
            "train_step_s": train["train_model_flops_per_step"] / (len(devices) * chip.peak_flops * aot.train_mfu),
            # a forward is a third of a forward + backward; one pass per user, on the train step's rows
            "logprob_passes_s": len(logprob_users) * train["train_model_flops_per_step"] / 3
            / (len(devices) * chip.peak_flops * aot.train_mfu),
        },
    }


def format_report(r: dict) -> str:
    lines = [f"{r['topology']} ({r['num_devices']} x {r['device_kind']}), mesh {r['mesh']}:"]
    for name, p in r["programs"].items():
        lines.append(f"  {name:<10} temporaries {p['temp_bytes'] / GiB:7.2f} GiB  arguments "
                     f"{p['argument_bytes'] / GiB:7.2f} GiB  outputs {p['output_bytes'] / GiB:7.2f} GiB  "
                     f"aliased {p['alias_bytes'] / GiB:7.2f} GiB  compile {p['compile_s']} s")
    res = r["resident"]
    lines.append(f"  resident per device: {r['resident_bytes_per_device'] / GiB:.2f} GiB (train state "
                 f"{res['train_state'] / GiB:.2f}, KV pool {res['kv_pool'] / GiB:.2f}"
                 + (f", serving copy of the weights {res['serving_params'] / GiB:.2f}" if res.get("serving_params")
                    else "")
                 + (f", reference params {res['ref_params'] / GiB:.2f}" if res.get("ref_params") else "") + ")")
    if r.get("logprobs_for"):
        lines.append(f"  logprobs: select's packed log-prob pass, for {' and '.join(r['logprobs_for'])}")
    lines.append(f"  peak per device: {r['peak_bytes_per_device'] / GiB:.2f} GiB ({r['peak_program']}) of "
                 f"{r['hbm_bytes_per_device'] / GiB:.0f} GiB HBM (plan: {r['budget_bytes_per_device'] / GiB:.1f})")
    e = r["estimate"]
    t = r["train"]
    lines.append(f"  train step at the length model: {t['train_useful_token_fraction']:.1%} of positions useful, "
                 f"{t['train_micro_batches_per_update']:.2f} micro-batches per update, "
                 f"{t['train_speedup_vs_unpacked']:.2f}x fewer FLOPs than one full row per sequence")
    lines.append(f"  estimate (not measured): train step {e['train_step_s']:.1f} s at {e['train_mfu']:.0%} MFU "
                 "(model FLOPs of the positions it computes)"
                 + (f", log-prob passes {e['logprob_passes_s']:.1f} s" if e.get("logprob_passes_s") else ""))
    if r.get("decode"):
        lines.extend(aot_decode.format_decode(r["decode"]))
    if r.get("compilation_cache"):
        lines.append(f"  compile times may be loads from the compilation cache {r['compilation_cache']}")
    lines.append("  FITS" if r["fits"] else "  DOES NOT FIT")
    return "\n".join(lines)
