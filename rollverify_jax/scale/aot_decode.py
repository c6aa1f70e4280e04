"""The decode program against the HBM roofline, for ``python -m rollverify_jax.aot`` (issue 26, item 2).

From the compiled decode dispatch it reads what the cost and memory analyses do not say: the collectives per
step (``hlo_stats``: count, bytes, loop trip counts applied) and the attention kernel's grid (whether it runs on
both TensorCores of a v4 / v5p chip). With the weights as the engine lays them out (``EngineConfig.
serving_layout``) and the KV the kernel reads at the config's length model (``AotConfig``; ``roofline``), it
prices one decode step two ways, per chip:

- roofline: the weights once over the slice plus the running slots' live KV at HBM bandwidth (or the useful
  FLOPs at peak, whichever binds);
- estimate: the weights as laid out, the KV blocks the kernel reads (inactive slots included, under the rule
  before issue 26 and now), every slot's FLOPs as compiled, and the collectives at ``AotConfig``'s ICI
  assumptions.

``decode_roofline_fraction`` = roofline / estimate over one on-policy phase of the config's batch (slots empty
as its queue drains, which is where inactive slots cost); ``full_slots`` is the same with every slot running
(partial rollout keeps them full). Every figure is an estimate from public peaks, not a measurement.
"""

from __future__ import annotations

import jax.numpy as jnp

from rollverify_jax.rollout import engine as engine_lib
from rollverify_jax.scale import hlo_stats, roofline

RULES = {"stale": "before issue 26: an inactive slot attends over its stale length",
         "one": "now: an inactive slot attends over one token"}


def forward_flops_per_token(cfg) -> float:
    """2 x (active parameters + output head): the matmul FLOPs of one token's forward pass."""
    active = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    if cfg.num_experts:
        sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        active -= sparse * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return 2.0 * (active + cfg.vocab_size * cfg.hidden_size)


def decode_report(compiled, program: dict, *, cfg, engine_cfg, rollout, aot, chip, layout, mesh, attention,
                  device_kind: str,
                  engine_param_bytes: int, model_param_bytes: int, num_devices: int) -> dict:
    """The decode section of the aot report (see the module docstring); ``program`` is ``aot._compile``'s entry."""
    hlo = compiled.as_text()
    k = engine_cfg.steps_per_dispatch
    coll = hlo_stats.summarize(hlo_stats.collectives(hlo), runs=k)
    kernels = [kk for kk in hlo_stats.mosaic_kernels(hlo) if "attention" in kk["name"]]
    two_cores = device_kind in engine_lib.MEGACORE_KINDS
    both = bool(kernels) and all(kk["grid"][:1] == [2] for kk in kernels)
    share = 1.0 if both or not two_cores else aot.one_core_hbm_share
    heads = cfg.num_key_value_heads // (mesh.shape[layout.heads_axis] if layout.heads_axis else 1)
    kv_token = 2 * cfg.num_hidden_layers * heads * cfg.head_dim * jnp.dtype(engine_cfg.kv_dtype).itemsize
    block = engine_cfg.page_size * attention.get("pages_per_compute_block", 4)  # paged_attention's knob
    ici = chip.ici_bandwidth * aot.collective_links / (2 * chip.ici_links)  # one way on each of the ring's links
    step = roofline.DecodeStep(
        weights=engine_param_bytes, weights_min=model_param_bytes / num_devices, kv_bytes_per_token=kv_token,
        shards=layout.num_shards, devices=num_devices, forward_flops_per_token=forward_flops_per_token(cfg),
        attn_flops_per_token_ctx=4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim,
        program_flops=program["flops"], collective_bytes=coll["bytes_sent"], collectives=coll["count"],
        hbm_bandwidth=chip.hbm_bandwidth, peak_flops=chip.peak_flops, ici_bandwidth=ici,
        collective_latency_s=aot.collective_latency_s, kernel_hbm_share=share)

    rows = rollout.batch_groups * rollout.group_size
    p = min(aot.prompt_len, engine_cfg.max_seq_len - 1)  # a context shorter than the length model's prompt
    cap = min(rollout.max_new_tokens, engine_cfg.max_seq_len - p)
    lengths = roofline.lognormal_lengths(aot.response_length_median, aot.response_length_sigma, cap, rows)
    steps = sum(lengths)
    context = roofline.running_context(lengths, p)
    kernel_context = sum(roofline.block_tokens_sum(p + 1, p + n, block) for n in lengths) / steps
    s = engine_cfg.num_slots
    full_roof = step.roofline_s(1, s, round(s * context))
    full_est = step.estimate_s(1, round(s * kernel_context))
    phase = roofline.on_policy_phase(lengths, s, p, engine_cfg.page_size, engine_cfg.max_seq_len, k, block)
    per_rule = {}
    for rule in RULES:
        roof, est = step.phase(phase, rule)
        per_rule[rule] = {"kv_read_ratio": phase.read_ratio(rule), "estimate_s": est,
                          "kv_bytes_per_step": phase.kernel_tokens(rule) / phase.steps / layout.num_shards * kv_token,
                          "decode_roofline_fraction": roof / est}
    roof, _ = step.phase(phase, "one")
    slots_chip = s / layout.num_shards
    return {
        "decode_roofline_fraction": per_rule["one"]["decode_roofline_fraction"],
        "serving_layout": engine_cfg.serving_layout,
        "attention_kernels": kernels, "kernel_on_both_cores": both, "two_cores_per_chip": two_cores,
        "weights_bytes_per_chip": engine_param_bytes, "weights_min_bytes_per_chip": model_param_bytes / num_devices,
        "kv_bytes_per_token_per_chip": kv_token, "kernel_block_tokens": block,
        "collectives_per_step": coll,
        "length_model": {"response_median": aot.response_length_median, "response_sigma": aot.response_length_sigma,
                         "max_new_tokens": cap, "prompt_len": p,
                         "mean_response": steps / rows, "running_context": context,
                         "kernel_context": kernel_context},
        "full_slots": {
            "roofline_s": full_roof, "estimate_s": full_est, "decode_roofline_fraction": full_roof / full_est,
            "live_kv_bytes_per_step": slots_chip * context * kv_token,
            "kernel_kv_bytes_per_step": slots_chip * kernel_context * kv_token,
            "roofline_tokens_per_s_per_chip": s / full_roof / num_devices,
            "estimate_tokens_per_s_per_chip": s / full_est / num_devices},
        "on_policy_phase": {
            "sequences": rows, "steps": phase.steps, "mean_running_slots": phase.running_slot_steps / phase.steps,
            "roofline_s": roof,
            "live_kv_bytes_per_step": phase.live_tokens / phase.steps / layout.num_shards * kv_token,
            "roofline_tokens_per_s_per_chip": phase.running_slot_steps / roof / num_devices,
            "estimate_tokens_per_s_per_chip": phase.running_slot_steps / per_rule["one"]["estimate_s"] / num_devices,
            "rules": per_rule},
        "assumptions": [
            f"response lengths: {rows} equal-probability quantiles of a lognormal (median "
            f"{aot.response_length_median:g}, sigma {aot.response_length_sigma:g}) capped at {cap} "
            f"(max_new_tokens within the context), prompts of {p} tokens",
            "the on-policy phase admits its sequences in a fixed shuffled order into the free slots at each dispatch "
            "and ends when the last one finishes",
            f"the kernel reads whole blocks of {block} tokens per slot (page_size x pages_per_compute_block)",
            "roofline weights: the model's bytes once over the slice (every expert read each step)",
            "estimate FLOPs: the compiled step's cost analysis (one loop body = one step; every slot computes) plus "
            "the attention kernel's FLOPs over the KV it reads",
            f"collectives: ring bytes over {aot.collective_links} of the chip's {chip.ici_links} ICI links "
            f"({ici / 1e9:.0f} GB/s one way), {aot.collective_latency_s * 1e6:g} us each, not overlapped",
            f"a kernel on one of two TensorCores reads HBM at {aot.one_core_hbm_share:g} of the chip's bandwidth",
            "not measured: no TPU was used",
        ],
    }


def format_decode(d: dict) -> list[str]:
    """Report lines for ``decode_report``'s dict."""
    c, f, ph = d["collectives_per_step"], d["full_slots"], d["on_policy_phase"]
    kern = ", ".join(f"{k['name']} grid {k['grid']}" for k in d["attention_kernels"]) or "no Pallas kernel"
    gib = 2**30
    lines = [
        f"  decode ({d['serving_layout']} layout): weights {d['weights_bytes_per_chip'] / gib:.2f} GiB/chip (least "
        f"{d['weights_min_bytes_per_chip'] / gib:.2f}); {c['count']:.0f} collectives / "
        f"{c['bytes_sent'] / 2**20:.1f} MiB sent per step; attention {kern}"
        + (" (both TensorCores)" if d["kernel_on_both_cores"] else " (one TensorCore)" if d["two_cores_per_chip"]
           else ""),
        f"  decode per step, every slot running: roofline {f['roofline_s'] * 1e3:.2f} ms "
        f"({f['roofline_tokens_per_s_per_chip']:,.0f} tok/s/chip), estimate {f['estimate_s'] * 1e3:.2f} ms "
        f"({f['estimate_tokens_per_s_per_chip']:,.0f} tok/s/chip): fraction {f['decode_roofline_fraction']:.2f}",
    ]
    rules = ph["rules"]
    one, stale = rules["one"], rules["stale"]
    lines.append(
        f"  decode over an on-policy phase ({ph['sequences']} sequences, {ph['steps']:,} steps, "
        f"{ph['mean_running_slots']:.0f} slots running on average): the kernel reads {one['kv_read_ratio']:.2f}x the "
        f"live KV ({stale['kv_read_ratio']:.2f}x if inactive slots read their stale lengths, as before); "
        f"decode_roofline_fraction {one['decode_roofline_fraction']:.2f} ({stale['decode_roofline_fraction']:.2f} "
        "with stale lengths)")
    return lines
