"""The deviceless compile of a run's programs for a TPU slice, and the fit report (``python -m
rollverify_jax.aot`` and ``train --dry_run`` of a config naming ``AotConfig.topology``, through
``run.programs.compile_run``, which assembles the programs; this module reads no spec).

For the config's mesh on that topology and at the config's real shapes it compiles the train step (one GRPO
update at the batch's worst case), the resume prefill (with verification log-probs, ``AotConfig.prefill_rows``
rows of ``max_seq_len`` tokens), one decode dispatch over every slot and, when the run has one, the log-prob pass of
``select`` (``logprobs``: the KL's reference policy, the OPS filter's and pi_old's step-start policy, on the same
packed batch as the train step); with ``kl_coef > 0`` the reference params are resident beside the train state.
It reports per device what XLA allocates,
the run's resident bytes and the peak against the chip's HBM (FITS or DOES NOT FIT), and roofline estimates of the
step times (analytic FLOPs at the chip's peak, not measurements).

When the engine's mesh shares no device with the learner's (the asynchronous mode: each host's chips split into a
rollout and a train group) each side is its own budget: the train chips hold the train state (and the reference
params) and run the train step and the log-prob pass; the rollout chips hold the serving weights, a second copy of
them while a publish is staged (``rollout.publish``), and the KV pool, and run prefill, decode and extend. The
report then states both meshes (``meshes``), each program's peak against the chip's HBM on its own mesh.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rl import packing
from rollverify_jax.scale import aot_decode
from rollverify_jax.scale.aot_config import CHIPS, AotConfig, Chip, GiB
from rollverify_jax.schedule_rules import batch_devices

LEARNER_PROGRAMS = ("train_step", "logprobs")  # the learner's mesh; the rest run on the engine's


def get_topology_devices(name: str) -> list:
    try:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing or an unknown name: both are the user's to fix
        raise ValueError(f"cannot describe TPU topology {name!r} ({e}). Install libtpu (pip install -e '.[tpu]') "
                         "and use a name like 'v5p:2x2x1', 'v5e:4x4' or 'v6e:4x8'.") from None


def per_device_bytes(tree) -> int:
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


def sample_lengths(rng: np.random.Generator, rows: int, width: int, max_new: int, aot: AotConfig) -> np.ndarray:
    """Sequence lengths (prompt + response) of one batch under the length model (`AotConfig`)."""
    response = np.exp(np.log(aot.response_length_median) + aot.response_length_sigma * rng.standard_normal(rows))
    return np.minimum(np.rint(np.minimum(response, max_new)).astype(np.int64) + aot.prompt_len, width)


def packed_train_estimate(cfg, learner_cfg, rows: int, width: int, max_new: int, aot: AotConfig, batch_devices: int,
                          batches: int = 16, seed: int = 0, adapter_params: int | None = None) -> dict:
    """What the train step computes at the length model: the packing of ``batches`` sampled batches (the host
    code that packs real batches), its useful share of positions and its FLOPs against the unpacked layout
    (every sequence a full row of its own, as `LearnerConfig.pack_sequences = False` lays it out).
    ``adapter_params``: a LoRA run's trainable parameters (``analytic_train_flops``)."""
    rng = np.random.default_rng(seed)
    useful = full = tail = micro = 0
    n = learner_cfg.num_minibatches
    for _ in range(batches):
        lengths = sample_lengths(rng, rows, width, max_new, aot)
        plans = packing.plan_batch(lengths, n, width, learner_cfg.micro_batch_size, learner_cfg.tail_row_width,
                                   one_per_row=not learner_cfg.pack_sequences)
        shape = packing.plan_shape(plans, rows, width, n, learner_cfg.micro_batch_size, learner_cfg.tail_row_width,
                                   batch_devices)
        f, t, m = packing.planned_positions(plans, shape)
        useful, full, tail, micro = useful + int(lengths.sum()), full + f, tail + t, micro + m
    tail_width = learner_cfg.tail_row_width or 0
    flops = (analytic_train_flops(cfg, full / batches, width, "none", adapter_params)
             + analytic_train_flops(cfg, tail / batches, tail_width, "none", adapter_params))  # no recompute
    unpacked = analytic_train_flops(cfg, rows * width, width, "none", adapter_params)
    return {"train_useful_token_fraction": useful / (full + tail),
            "train_positions_per_step": (full + tail) / batches,
            "train_micro_batches_per_update": micro / (batches * n),
            "train_model_flops_per_step": flops, "train_unpacked_model_flops_per_step": unpacked,
            "train_speedup_vs_unpacked": unpacked / flops}


def analytic_train_flops(cfg, tokens: int, width: int, remat: str, adapter_params: int | None = None) -> float:
    """Matmul FLOPs of one pass over ``tokens`` tokens in rows of ``width``: forward 2N, backward 4N per token
    for the active parameters, plus causal attention (backward twice the forward); full remat adds a second
    forward of the layers. With ``adapter_params`` (LoRA: the base frozen) the backward of the base weights is
    the input gradient alone, 2N, and the adapters cost 6 FLOPs per parameter per token."""
    active = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        active -= sparse * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    head = cfg.vocab_size * cfg.hidden_size
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * width  # causal: half of 4 T D H
    dense, attention = 2 * (active + head) * tokens, attn * tokens
    dense_passes = 3 if adapter_params is None else 2
    total = dense * dense_passes + 3 * attention + 6 * (adapter_params or 0) * tokens
    return total + (dense + attention if remat == "full" else 0)


def chip_for(device_kind: str) -> Chip:
    """The HBM and peak figures of a TPU device kind."""
    chip = CHIPS.get(device_kind)
    if chip is None:
        raise ValueError(f"no HBM figure for {device_kind!r}; known: {sorted(CHIPS)}.")
    return chip


def compile_programs(learner, plan, model, rollout, aot: AotConfig, *, topology: str, devices: Sequence,
                     logprob_users: Sequence[str] = (), extend_width: int | None = None) -> dict:
    """Compiles the run's programs -> the fit report: ``learner``'s (`rl.learner.Learner`) train step and, when
    ``logprob_users`` names a user, its log-prob pass, at the rollout batch (``RolloutConfig``) at its largest
    packed layout; ``plan``'s (`rollout.engine.EnginePlan`) resume prefill (``AotConfig.prefill_rows`` rows of
    ``max_seq_len`` tokens, default one per batch device), one decode dispatch and, with ``extend_width``, the
    extend of every slot's tool reply. ``model``: the abstract model (its params, in the engine's layout).
    Everything run-specific comes in assembled (``run.programs.compile_run``): this reads no spec."""
    chip = chip_for(devices[0].device_kind)
    mesh, cfg, engine_cfg, learner_cfg = learner.mesh, plan.model_cfg, plan.config, learner.cfg
    programs = {}

    # Train step and the log-prob pass of select (reference and/or step-start params: the train state's layout)
    rows, width = rollout.batch_groups * rollout.group_size, engine_cfg.max_seq_len
    state = learner.abstract_state
    programs["train_step"], _ = _compile("train_step", lambda: learner.lower_train_step(rows, width))
    if logprob_users:
        programs["logprobs"], _ = _compile(f"logprobs ({', '.join(logprob_users)})",
                                           lambda: learner.lower_logprobs(rows, width))

    # Resume prefill, one decode dispatch and the tool replies' extend, on the engine's weights
    _, params = nnx.split(model)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    model_param_bytes = sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
                            for v in jax.tree.leaves(params, is_leaf=is_var))
    train_layout = jax.tree.leaves(mesh_lib.param_shardings(params, plan.mesh, cfg.rules()))
    copied = any(a != b for a, b in zip(jax.tree.leaves(plan.param_shardings(params)), train_layout, strict=True))
    params = plan.abstract_params(params)
    decode_state = plan.abstract_state()
    prefill_rows = aot.prefill_rows or batch_devices(plan.mesh.shape)
    programs["prefill"], _ = _compile("prefill", lambda: plan.lower_prefill(params, prefill_rows))
    programs["decode"], decode_compiled = _compile("decode", lambda: plan.lower_decode(params))
    if extend_width is not None:
        programs["extend"], _ = _compile("extend", lambda: plan.lower_extend(params, extend_width))

    # Resident and peak bytes per device
    state_bytes, kv_bytes = per_device_bytes(state), per_device_bytes(decode_state.pages)
    param_bytes = per_device_bytes(state.params)
    serving_bytes = per_device_bytes(params)
    # LoRA: the frozen base, an argument of the learner's programs and (one mesh, its layout) the engine's own weights
    frozen_bytes = per_device_bytes(learner.frozen)
    adapter_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)) if frozen_bytes else None
    publish_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
    # kl_coef > 0: the reference params (a copy of the initial params, the train state's layout) stay resident.
    ref_bytes = param_bytes if learner_cfg.loss.kl_coef > 0 else 0
    split = set(mesh.devices.flat).isdisjoint(plan.mesh.devices.flat)  # the asynchronous mode's two meshes
    if split:
        # The train chips hold the train state (and the reference); the rollout chips the serving weights, the
        # publish's staging copy (both at once while a publish is staged) and the KV pool.
        copy_bytes = serving_bytes
        staging_bytes = serving_bytes - (per_device_bytes(plan.abstract_params(learner.frozen)) if frozen_bytes else 0)
        sides = {"train": state_bytes + ref_bytes + frozen_bytes, "rollout": copy_bytes + staging_bytes + kv_bytes}
        outside = {"train_step": ref_bytes, "logprobs": sides["train"] - param_bytes - frozen_bytes,
                   **dict.fromkeys(("prefill", "decode", "extend"), staging_bytes)}
    else:
        # A serving layout other than the train state's is a copy the engine holds through the train step too.
        copy_bytes, staging_bytes = (serving_bytes if copied else 0), 0
        resident = state_bytes + kv_bytes + copy_bytes + ref_bytes + (0 if copied else frozen_bytes)
        engine_outside = state_bytes - (0 if copied else param_bytes)  # the train state the engine does not take
        outside = {"train_step": kv_bytes + copy_bytes + ref_bytes, "prefill": engine_outside + ref_bytes,
                   "decode": engine_outside + ref_bytes, "extend": engine_outside + ref_bytes,
                   # its params argument is one of the resident sets (the reference's or the train state's)
                   "logprobs": resident - param_bytes - frozen_bytes}
        if copied:  # the learner's base besides the engine's copy
            outside = {k: v + (frozen_bytes if k in ("prefill", "decode", "extend") else 0) for k, v in outside.items()}
            resident += frozen_bytes
    peaks = {k: p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"] + outside[k]
             for k, p in programs.items()}
    peak = max(peaks.values())
    budget = int(chip.hbm_bytes * aot.hbm_fraction)
    meshes = {}
    if split:
        resident = max(sides.values())
        for side, m in (("train", mesh), ("rollout", plan.mesh)):
            own = {k: v for k, v in peaks.items() if k in LEARNER_PROGRAMS} if side == "train" else {
                k: v for k, v in peaks.items() if k not in LEARNER_PROGRAMS}
            meshes[side] = {"mesh": dict(m.shape), "num_devices": int(m.devices.size),
                            "devices": sorted(int(d.id) for d in m.devices.flat),
                            "resident_bytes_per_device": sides[side], "peak_bytes_by_program": own,
                            "peak_bytes_per_device": max(own.values()), "peak_program": max(own, key=own.get),
                            "fits": max(own.values()) <= budget}
    train_devices = int(mesh.devices.size)
    train = packed_train_estimate(cfg, learner_cfg, rows, width, rollout.max_new_tokens, aot,
                                  batch_devices(mesh.shape), adapter_params=adapter_params)
    decode = aot_decode.decode_report(
        decode_compiled, programs["decode"], cfg=cfg, engine_cfg=engine_cfg, rollout=rollout, aot=aot, chip=chip,
        layout=plan.layout, mesh=plan.mesh, attention=dict(plan.attention), device_kind=devices[0].device_kind,
        engine_param_bytes=per_device_bytes(params),
        model_param_bytes=model_param_bytes, num_devices=int(plan.mesh.devices.size))
    return {
        "topology": topology, "device_kind": devices[0].device_kind, "num_devices": len(devices),
        "mesh": dict(mesh.shape), "params": cfg.num_params(), "context": engine_cfg.max_seq_len,
        "rows_per_step": rows, "hbm_bytes_per_device": chip.hbm_bytes,
        "budget_bytes_per_device": budget, "resident_bytes_per_device": resident,
        "resident": {"train_state": state_bytes, "params": param_bytes, "kv_pool": kv_bytes,
                     "serving_params": copy_bytes, "staging_params": staging_bytes, "ref_params": ref_bytes,
                     "frozen_base": frozen_bytes},
        # What a weight publish moves (whole slice): the trained params, a LoRA run's adapters alone (their share of
        # the base's bytes, what a full-parameter publish would move).
        "publish_bytes": publish_bytes, "model_param_bytes": model_param_bytes,
        **({"lora": {"trainable_params": adapter_params,
                     "publish_fraction": publish_bytes / (model_param_bytes - publish_bytes)}}
           if adapter_params else {}),
        **({"rollout_mesh": dict(plan.mesh.shape), "meshes": meshes} if split else {}),
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
            "train_step_s": train["train_model_flops_per_step"] / (train_devices * chip.peak_flops * aot.train_mfu),
            # a forward is a third of a forward + backward; one pass per user, on the train step's rows
            "logprob_passes_s": len(logprob_users) * train["train_model_flops_per_step"] / 3
            / (train_devices * chip.peak_flops * aot.train_mfu),
        },
    }


def format_report(r: dict) -> str:
    meshes = r.get("meshes")
    lines = [f"{r['topology']} ({r['num_devices']} x {r['device_kind']}), mesh {r['mesh']}"
             + (f" (train), rollout mesh {r['rollout_mesh']}:" if meshes else ":")]
    for name, p in r["programs"].items():
        lines.append(f"  {name:<10} temporaries {p['temp_bytes'] / GiB:7.2f} GiB  arguments "
                     f"{p['argument_bytes'] / GiB:7.2f} GiB  outputs {p['output_bytes'] / GiB:7.2f} GiB  "
                     f"aliased {p['alias_bytes'] / GiB:7.2f} GiB  compile {p['compile_s']} s")
    res = r["resident"]
    if r.get("lora"):
        lines.append(f"  LoRA: {r['lora']['trainable_params'] / 1e6:.1f}M trainable parameters; the frozen base "
                     f"{res['frozen_base'] / GiB:.2f} GiB per chip, held once; a publish moves "
                     f"{r['publish_bytes'] / 2**20:.1f} MiB ({r['lora']['publish_fraction']:.2%} of the weights)")
    if meshes:
        train, rollout = meshes["train"], meshes["rollout"]
        lines.append(f"  train chips: resident {train['resident_bytes_per_device'] / GiB:.2f} GiB (train state "
                     f"{res['train_state'] / GiB:.2f}"
                     + (f", reference params {res['ref_params'] / GiB:.2f}" if res.get("ref_params") else "") + ")")
        lines.append(f"  rollout chips: resident {rollout['resident_bytes_per_device'] / GiB:.2f} GiB (serving weights "
                     f"{res['serving_params'] / GiB:.2f}, their staging copy while a publish is staged "
                     f"{res['staging_params'] / GiB:.2f}, KV pool {res['kv_pool'] / GiB:.2f})")
        for side, m in meshes.items():
            per = ", ".join(f"{k} {v / GiB:.2f}" for k, v in m["peak_bytes_by_program"].items())
            lines.append(f"  {side} mesh {m['mesh']} on {m['num_devices']} chips: peak per chip {per} GiB of "
                         f"{r['hbm_bytes_per_device'] / GiB:.0f} GiB HBM (plan: "
                         f"{r['budget_bytes_per_device'] / GiB:.1f}): {'fits' if m['fits'] else 'DOES NOT FIT'}")
    else:
        lines.append(f"  resident per device: {r['resident_bytes_per_device'] / GiB:.2f} GiB (train state "
                     f"{res['train_state'] / GiB:.2f}, KV pool {res['kv_pool'] / GiB:.2f}"
                     + (f", serving copy of the weights {res['serving_params'] / GiB:.2f}"
                        if res.get("serving_params") else "")
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
    if r.get("shape_plan"):
        lines.append(f"  shape plan: {r['shape_plan']} (aot --plan lists them, --plan_compile times each)")
    if r.get("compilation_cache"):
        lines.append(f"  compile times may be loads from the compilation cache {r['compilation_cache']}")
    lines.append("  FITS" if r["fits"] else "  DOES NOT FIT")
    return "\n".join(lines)
