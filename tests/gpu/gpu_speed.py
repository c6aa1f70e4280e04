"""The speed sections of tests/gpu/check_gpu.py (issue 26): decode against the HBM roofline, where a decode step's
fixed cost goes, the GPU decode default at a 22.5K context, the train step's MFU on packed rows, and a config's
programs compiled on the GPU at reduced layer count. Every rate is measured; every roofline and peak is the
datasheet's (``gpu_common.CHIPS``)."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gpu_common import (
    bench_requests,
    chip,
    err_text,
    kernel_kwargs,
    max_abs,
    max_mag,
    on_gpu,
    over_budget,
    precision,
    reset_kernels,
    run_engine,
    skipped,
    timed,
    use_kernels,
)

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import flash_attention as fa
from rollverify_jax.models import init_model, model_config
from rollverify_jax.rl import learner, packing
from rollverify_jax.rl.batch import build_batch
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.attention import paged_attention, paged_attention_reference, resolve_impl
from rollverify_jax.schedule_rules import batch_devices

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------------------
# Arithmetic


def param_bytes(model) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(model)))


def kv_bytes_per_token(cfg, kv_dtype: str) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize


def decode_roofline(cfg, weights: int, slots: int, context: float, kv_dtype: str, bandwidth: float) -> dict:
    """The fastest a decode step can be: every weight read once plus each running slot's live KV, at HBM speed."""
    step = weights + slots * context * kv_bytes_per_token(cfg, kv_dtype)
    return {"step_bytes": step, "step_s": step / bandwidth, "tokens_per_s": slots * bandwidth / step,
            "mean_context": context}


def train_model_flops(cfg, lengths) -> float:
    """Model FLOPs of one train step over sequences of ``lengths`` tokens: forward 2 x matmul parameters per token
    plus causal attention (QK and PV over half of L^2), backward twice the forward; no recompute counted."""
    if cfg.num_experts:
        raise ValueError("train_model_flops counts dense models only")
    matmul = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    matmul += cfg.vocab_size * cfg.hidden_size  # the output head
    tokens = float(sum(lengths))
    attn = sum(2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n for n in lengths)
    return 3.0 * (2.0 * matmul * tokens + attn)


# ------------------------------------------------------------------------------------------------------------
# The GPU decode default at a long context


def _long_case(args):
    b, hq, hkv, d = args.long_slots, args.long_heads, args.long_kv_heads, args.long_head_dim
    page, context = args.long_page, args.long_context
    pps = context // page
    rng = np.random.default_rng(5)
    num_pages = b * pps + 1
    table = np.zeros((b, pps), np.int32)
    live = max(1, b - 1)  # the last slot is inactive: 1 token, its table on the scratch page, as the engine leaves it
    table[:live] = rng.permutation(np.arange(1, num_pages))[: live * pps].reshape(live, pps)
    lengths = rng.integers(context // 2, context + 1, size=b).astype(np.int32)
    lengths[0], lengths[-1] = context, 1
    if b > 2:
        lengths[1] = context - 37  # ends inside its last page
    k = jnp.asarray(rng.normal(size=(hkv, num_pages, page, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(hkv, num_pages, page, d)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(b, hq, d)) * d ** -0.5, jnp.float32)
    return q, k, v, jnp.asarray(lengths), jnp.asarray(table)


def _long_attention(args) -> dict:
    """One layer's decode attention at the long context, bf16 pages: the GPU default ('auto' resolved for 'gpu')
    against the reference (which gathers the whole table) and 'chunked', each against float32 truth."""
    q, k, v, lengths, table = _long_case(args)
    interpret = not on_gpu()
    default = resolve_impl("auto", "gpu", q.shape[-1], k.shape[2], table.shape[1], 512)
    out: dict = {"shape": dict(slots=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[0], head_dim=q.shape[-1],
                               page_size=k.shape[2], pages_per_seq=table.shape[1], context=args.long_context),
                 "gpu_default_impl": default, "interpret": interpret,
                 "gathered_table_bytes": 2 * q.shape[0] * k.shape[0] * args.long_context * q.shape[-1] * 2}
    with precision("highest"):
        truth = jax.jit(paged_attention_reference)(q, k.astype(jnp.float32), v.astype(jnp.float32), lengths, table)
    fns = {"gpu_default": jax.jit(lambda *a: paged_attention(*a, platform="gpu", interpret=interpret)),
           "reference": jax.jit(paged_attention_reference),
           "chunked": jax.jit(lambda *a: paged_attention(*a, impl="chunked"))}
    errs = {}
    for name, fn in fns.items():
        res: dict = {}
        try:
            compiled = fn.lower(q, k, v, lengths, table).compile()
            res["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            got = compiled(q, k, v, lengths, table)
            errs[name] = res["max_abs_err"] = max_abs(got, truth)
            _, res["call_s"] = timed(compiled, q, k, v, lengths, table, iters=2 if interpret else 20)
        except Exception as e:  # noqa: BLE001
            res.update(err_text(e))
        out[name] = res
    # The kernel takes the query in the pages' type (bf16) and rounds its probabilities to it: tolerance from
    # the reference's own bf16 error, or 2% of the output's scale.
    tol = max(3 * errs.get("reference", 0.0), 2e-2 * max_mag(truth))
    out["tol"] = tol
    out["ok"] = bool("gpu_default" in errs and errs["gpu_default"] <= tol and errs.get("chunked", 1.0) <= tol)
    return out


def _long_engine(args) -> dict:
    """The engine at the long context: prompts filling it, greedy decode with the GPU default (on CPU: the
    Pallas GPU kernel in interpret mode, which is what 'auto' picks there on a GPU) and with the reference."""
    cfg = model_config(args.long_engine_preset, param_dtype="bfloat16", dtype="bfloat16")
    model = init_model(cfg, seed=0)
    context, n, new = args.long_engine_context, args.long_engine_slots, args.long_engine_new
    page = 64
    reqs = bench_requests(n, new, 11, cfg.vocab_size, prompt=(context - new - 8, context - new + 1))
    chipf = chip()
    out: dict = {"model": args.long_engine_preset, "params": cfg.num_params(), "context": context, "slots": n,
                 "new_tokens": new, "page_size": page, "runs": {}}
    tokens = {}
    for name, impl in (("gpu_default", "auto" if on_gpu() else "pallas_gpu"), ("reference", "reference")):
        if over_budget(args):
            out["runs"][name] = skipped(args)
            continue
        use_kernels("auto", impl)
        run: dict = {"paged_impl": impl}
        try:
            ecfg = EngineConfig(num_slots=n, page_size=page, max_seq_len=context, steps_per_dispatch=8,
                                kv_dtype="bfloat16", min_prefill_len=512)
            engine = Engine(model, ecfg, SamplingConfig(greedy=True), eos_ids=(), **kernel_kwargs())
            t0 = time.perf_counter()
            run_engine(engine, [dataclasses.replace(t, tokens=[], logps=[], versions=[]) for t in reqs])
            run["compile_and_first_s"] = time.perf_counter() - t0
            stats: list = []
            done = run_engine(engine, [dataclasses.replace(t, tokens=[], logps=[], versions=[]) for t in reqs], stats)
            st = stats[0]
            run["decode_s_per_step"] = st.decode_time / max(1, st.decode_steps)
            run["decode_tokens_per_s"] = n / run["decode_s_per_step"]
            roof = decode_roofline(cfg, param_bytes(model), n, context - new / 2, "bfloat16", chipf["hbm_bandwidth"])
            run["roofline_tokens_per_s"] = roof["tokens_per_s"]
            run["roofline_fraction"] = run["decode_tokens_per_s"] / roof["tokens_per_s"]
            tokens[name] = {t.uid: t.tokens for t in done}
        except Exception as e:  # noqa: BLE001
            run.update(err_text(e))
        out["runs"][name] = run
    reset_kernels()
    if len(tokens) == 2:  # bf16: a near-tie may go either way; the counts say how often
        a, b = tokens["gpu_default"], tokens["reference"]
        out["sequences_equal"] = sum(a[u] == b[u] for u in a)
        out["tokens_equal_fraction"] = sum(x == y for u in a for x, y in zip(a[u], b[u], strict=True)) / (n * new)
    return out


def section_long_context(args, state: dict) -> dict:
    out: dict = {"attention": _long_attention(args)}
    state["gpu_default_ok"] = out["attention"]["ok"]
    out["engine"] = skipped(args) if over_budget(args) else _long_engine(args)
    runs = out["engine"].get("runs", {})
    ok = out["attention"]["ok"] and all("error" not in r for r in runs.values())
    out["status"] = "ok" if ok else "fail"
    return out


def long_context_lines(res: dict) -> list[str]:
    lines = []
    att = res.get("attention", {})
    for name in ("gpu_default", "reference", "chunked"):
        r = att.get(name, {})
        if "error" in r:
            lines.append(f"  {name}: ERROR {r['error'].splitlines()[0][:160]}")
        elif r:
            label = f"{name} ({att['gpu_default_impl']})" if name == "gpu_default" else name
            lines.append(f"  attention {label}: "
                         f"err {r['max_abs_err']:.3g} (tol {att['tol']:.3g}), {r['call_s'] * 1e3:.3f} ms, "
                         f"temporaries {r['temp_bytes'] / 2**20:.1f} MiB")
    eng = res.get("engine", {})
    for name, r in eng.get("runs", {}).items():
        if "decode_tokens_per_s" in r:
            lines.append(f"  engine {name} ({r['paged_impl']}) at {eng['context']:,} tokens x {eng['slots']}: "
                         f"{r['decode_tokens_per_s']:.0f} tok/s decode, {r['roofline_fraction']:.1%} of the roofline")
        else:
            why = r.get("skipped") or "ERROR " + r.get("error", "?").splitlines()[0][:160]
            lines.append(f"  engine {name}: {why}")
    if "tokens_equal_fraction" in eng:
        lines.append(f"  greedy tokens equal: {eng['tokens_equal_fraction']:.3f} ({eng['sequences_equal']}/"
                     f"{eng['slots']} sequences identical)")
    return lines


# ------------------------------------------------------------------------------------------------------------
# Decode tokens/s against the roofline


def _decode_run(args, model, n: int, max_len: int, prefill: str, ahead: bool) -> dict:
    """Compile (warm-up + one rollout), then ``decode_rounds`` timed rollouts of n requests."""
    vocab = model.cfg.vocab_size
    ecfg = EngineConfig(num_slots=n, page_size=16, max_seq_len=max_len, steps_per_dispatch=8, kv_dtype="bfloat16",
                        dispatch_ahead=ahead)
    engine = Engine(model, ecfg, SamplingConfig(temperature=1.0), eos_ids=(), **kernel_kwargs())
    run: dict = {"prefill_kernel": engine.static.kernel()["impl"]}
    t0 = time.perf_counter()
    engine.warmup()
    run_engine(engine, bench_requests(n, args.new_tokens, 999, vocab))  # compiles every shape used below
    run["compile_and_first_rollout_s"] = time.perf_counter() - t0
    rates, per_step, host, prefill_share = [], [], [], []
    for r in range(args.decode_rounds):
        stats: list = []
        t0 = time.perf_counter()
        done = run_engine(engine, bench_requests(n, args.new_tokens, r, vocab), stats)
        wall = time.perf_counter() - t0
        st = stats[0]
        rates.append(sum(t.num_tokens for t in done) / wall)
        per_step.append(st.decode_time / max(1, st.decode_steps))
        host.append(st.host_time / wall)
        prefill_share.append(st.prefill_time / wall)
    run.update(tokens_per_s=statistics.median(rates), tokens_per_s_rounds=rates,
               tokens_per_round=n * args.new_tokens, decode_s_per_step=statistics.median(per_step),
               host_share=statistics.median(host), prefill_share=statistics.median(prefill_share))
    return run


def section_decode_throughput(args, state: dict) -> dict:
    """Generated tokens/s of the engine on the bench model (bf16), at each concurrency: the GPU default, the same
    with decode dispatched ahead, and the Pallas kernel forced; each against the per-step HBM roofline."""
    cfg = model_config(args.bench_preset, param_dtype="bfloat16", dtype="bfloat16")
    model = init_model(cfg, seed=0)
    chipf = chip()
    weights = param_bytes(model)
    context = 28 + (args.new_tokens + 1) / 2  # mean prompt + the mean number of tokens generated so far
    out: dict = {"model": args.bench_preset, "params": cfg.num_params(), "weight_bytes": weights,
                 "dtype": "bfloat16 params and compute", "kv_dtype": "bfloat16", "new_tokens": args.new_tokens,
                 "chip": chipf, "runs": []}
    variants = [("auto", False), ("auto", True)] + ([("pallas_gpu", False)] if state.get("pallas_ok") else [])
    if not state.get("pallas_ok"):
        out["pallas_gpu"] = "skipped: the kernel did not pass paged_attention"
    max_len = -(-(32 + args.new_tokens) // 64) * 64  # pages of 16: live-page buckets stay multiples of 4
    ok = True
    for impl, ahead in variants:
        use_kernels("auto", impl)
        for n in args.concurrency:
            run = {"paged_impl": impl, "dispatch_ahead": ahead, "concurrent": n}
            if over_budget(args):
                out["runs"].append({**run, **skipped(args)})
                continue
            try:
                run.update(_decode_run(args, model, n, max_len, "auto", ahead))
                roof = decode_roofline(cfg, weights, n, context, "bfloat16", chipf["hbm_bandwidth"])
                run.update(roofline_tokens_per_s=roof["tokens_per_s"], roofline_step_s=roof["step_s"],
                           roofline_fraction=run["tokens_per_s"] / roof["tokens_per_s"],
                           decode_only_roofline_fraction=roof["step_s"] / run["decode_s_per_step"])
            except Exception as e:  # noqa: BLE001
                run.update(err_text(e))
                ok = False
            out["runs"].append(run)
            print(f"   {decode_run_line(run)}", flush=True)
    reset_kernels()
    out["status"] = "ok" if ok else "fail"
    return out


def _unfinished(run: dict) -> str | None:
    """A run that raised or was skipped, in a few words (None: it has results)."""
    if "error" in run:
        return "ERROR " + run["error"].splitlines()[0][:160]
    if "skipped" in run:
        return "skipped (" + run["skipped"] + ")"
    return None


def decode_run_line(run: dict) -> str:
    head = (f"{run['paged_impl']:>10}{' ahead' if run.get('dispatch_ahead') else '      '} x {run['concurrent']:>4}"
            " concurrent: ")
    if unfinished := _unfinished(run):
        return head + unfinished
    return head + (f"{run['tokens_per_s']:.0f} tok/s = {run['roofline_fraction']:.1%} of the roofline "
                   f"({run['roofline_tokens_per_s']:.0f}); decode {run['decode_s_per_step'] * 1e6:.0f} us/step vs "
                   f"{run['roofline_step_s'] * 1e6:.1f} at the roofline; host {run['host_share']:.1%}, prefill "
                   f"{run['prefill_share']:.1%} of the wall (compile + first "
                   f"{run['compile_and_first_rollout_s']:.0f} s)")


# ------------------------------------------------------------------------------------------------------------
# Where a decode step's fixed cost goes


FREE_OPS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
            "replica-id", "opt-barrier"}


def _opcode(line: str) -> str | None:
    """The opcode of one HLO instruction line (``%x = TYPE opcode(...)``), or None."""
    if " = " not in line:
        return None
    rest = line.split(" = ", 1)[1].lstrip()
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    return m.group(1) if m else None


def loop_body_ops(hlo: str) -> dict:
    """The instructions of the largest while loop's body in a compiled HLO text (the decode scan's step): each
    one that is not free (FREE_OPS) launches work, so their count bounds the kernels of one step."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    best: dict = {}
    for name in bodies:
        m = re.search(rf"^%?{re.escape(name)} \(.*?\{{\n(.*?)\n\}}", hlo, re.S | re.M)
        if not m:
            continue
        counts: dict[str, int] = {}
        for line in m.group(1).splitlines():
            op = _opcode(line)
            if op:
                counts[op] = counts.get(op, 0) + 1
        if sum(counts.values()) > sum(best.get("ops", {}).values()):
            best = {"body": name, "ops": counts}
    ops = best.get("ops", {})
    best["launching"] = sum(v for k, v in ops.items() if k not in FREE_OPS)
    best["top"] = sorted(((k, v) for k, v in ops.items() if k not in FREE_OPS), key=lambda kv: -kv[1])[:12]
    return best


def summarize_trace(trace_dir: str, steps: int) -> dict:
    """Device kernels in a ``jax.profiler`` perfetto trace: how many per decode step, how long they ran, and
    how much of the traced span the device sat idle between them."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return {"error": "no perfetto_trace.json.gz written"}
    data = json.load(gzip.open(paths[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "/device:GPU" in name or "GPU:" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device
               and threads.get((e["pid"], e.get("tid")), "").lower().startswith("stream")
               and not re.search(r"memcpy|memset", e.get("name", ""), re.I)]
    if not kernels:
        return {"kernels": 0, "device_processes": sorted(procs[p] for p in device),
                "note": "no device kernel events (on CPU there are none)"}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e.get("dur", 0) for e in kernels)
    busy = sum(e.get("dur", 0) for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:90], []).append(e.get("dur", 0))
    top = sorted(((k, len(v), sum(v)) for k, v in by_name.items()), key=lambda x: -x[2])[:15]
    return {"kernels": len(kernels), "kernels_per_step": len(kernels) / steps, "busy_us": busy, "span_us": end - start,
            "busy_fraction": busy / max(end - start, 1e-9), "mean_kernel_us": busy / len(kernels),
            "top": [{"name": k, "count": c, "total_us": t} for k, c, t in top]}


def _active_engine(model, n: int, k: int, new: int) -> Engine:
    """An engine with n slots decoding (prompts admitted, every page reserved up front so generate() alone can
    run dispatch after dispatch at one shape)."""
    ecfg = EngineConfig(num_slots=n, page_size=16, max_seq_len=-(-(40 + new) // 64) * 64, steps_per_dispatch=k,
                        kv_dtype="bfloat16", page_reservation="full")
    engine = Engine(model, ecfg, SamplingConfig(temperature=1.0), eos_ids=(), **kernel_kwargs())
    sched = Scheduler(engine)
    sched.submit(bench_requests(n, new, 3, model.cfg.vocab_size))
    sched.step()  # admits every request (prefill, first token) and decodes once; generate() is driven by hand next
    return engine


def section_decode_fixed_cost(args, state: dict) -> dict:
    """Per-dispatch time at several ``steps_per_dispatch`` (a fit t = a + k b splits the fixed cost of a
    dispatch, a, from a step's, b), back-to-back dispatches without a host sync in between, the compiled
    step's launching ops, and a profile of a few dispatches (device kernels per step, busy fraction)."""
    cfg = model_config(args.bench_preset, param_dtype="bfloat16", dtype="bfloat16")
    model = init_model(cfg, seed=0)
    chipf = chip()
    n, reps = args.fixed_slots, args.fixed_dispatches
    new = max(args.fixed_steps) * (reps + 3) + 8
    roof = decode_roofline(cfg, param_bytes(model), n, 28 + new / 2, "bfloat16", chipf["hbm_bandwidth"])
    out: dict = {"model": args.bench_preset, "slots": n, "roofline_step_s": roof["step_s"], "per_k": {}}
    for k in args.fixed_steps:
        if over_budget(args):
            out["per_k"][str(k)] = skipped(args)
            continue
        res: dict = {}
        try:
            engine = _active_engine(model, n, k, new)
            engine.generate()  # compile
            synced = []
            for _ in range(reps):
                t0 = time.perf_counter()
                engine.generate()
                synced.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pending = [engine.dispatch_generate() for _ in range(reps)]
            for p in pending:
                p.fetch()
            res.update(dispatch_s=statistics.median(synced), back_to_back_dispatch_s=(time.perf_counter() - t0) / reps)
            if k == max(args.fixed_steps):
                hlo = engine.plan.lower_decode(engine.params, engine.live_pages()).compile().as_text()
                out["step_ops"] = loop_body_ops(hlo)
                if not args.no_profile and not over_budget(args):
                    with tempfile.TemporaryDirectory() as tmp:
                        with jax.profiler.trace(tmp, create_perfetto_trace=True):
                            for _ in range(3):
                                engine.generate()
                        out["profile"] = summarize_trace(tmp, 3 * k)
        except Exception as e:  # noqa: BLE001
            res.update(err_text(e))
        out["per_k"][str(k)] = res
    ks = [int(k) for k, r in out["per_k"].items() if "dispatch_s" in r]
    if len(ks) >= 2:
        a, b = _fit([(k, out["per_k"][str(k)]["dispatch_s"]) for k in ks])
        a2, b2 = _fit([(k, out["per_k"][str(k)]["back_to_back_dispatch_s"]) for k in ks])
        out["fit"] = {"per_dispatch_s": a, "per_step_s": b, "back_to_back_per_dispatch_s": a2,
                      "back_to_back_per_step_s": b2, "per_step_over_roofline_s": b - roof["step_s"],
                      "roofline_fraction_per_step": roof["step_s"] / b if b > 0 else None}
    if on_gpu() and args.xla_variants and not over_budget(args):
        out["xla_variants"] = [_xla_variant(args, flags) for flags in args.xla_variants]
    out["status"] = "ok" if "fit" in out else "fail"
    return out


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a + k b."""
    k = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    b, a = np.polyfit(k, t, 1)
    return float(a), float(b)


def _xla_variant(args, flags: str) -> dict:
    """The fixed-cost measurement again in a child process with more XLA_FLAGS (e.g. CUDA graphs for the loop
    body), its own report read back."""
    with tempfile.TemporaryDirectory() as tmp:
        child = os.path.join(tmp, "child.json")
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
        cmd = [sys.executable, str(Path(__file__).with_name("check_gpu.py")), "--sections", "decode_fixed_cost",
               "--no-profile", "--no-xla-variants", "--out", child, "--budget-s", "150",
               "--fixed-steps", *map(str, args.fixed_steps[:2]), "--fixed-slots", str(args.fixed_slots),
               "--bench-preset", args.bench_preset]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)
            rep = json.loads(Path(child).read_text()) if Path(child).exists() else {}
            sec = rep.get("sections", {}).get("decode_fixed_cost", {})
            return {"flags": flags, "returncode": done.returncode, "fit": sec.get("fit"), "per_k": sec.get("per_k"),
                    "stderr_tail": done.stderr[-1500:] if done.returncode else ""}
        except Exception as e:  # noqa: BLE001
            return {"flags": flags, **err_text(e)}


def fixed_cost_lines(res: dict) -> list[str]:
    lines = []
    for k, r in res.get("per_k", {}).items():
        if "dispatch_s" in r:
            lines.append(f"  k={k}: {r['dispatch_s'] * 1e3:.2f} ms per dispatch synced, "
                         f"{r['back_to_back_dispatch_s'] * 1e3:.2f} back to back")
        else:
            lines.append(f"  k={k}: " + (r.get("skipped") or "ERROR " + r.get("error", "?").splitlines()[0][:160]))
    f = res.get("fit")
    if f:
        lines.append(f"  fit: {f['per_dispatch_s'] * 1e3:.2f} ms per dispatch + {f['per_step_s'] * 1e3:.3f} ms per "
                     f"step (roofline {res['roofline_step_s'] * 1e6:.1f} us); back to back "
                     f"{f['back_to_back_per_step_s'] * 1e3:.3f} ms per step")
    ops = res.get("step_ops")
    if ops:
        top = ", ".join(f"{k} {v}" for k, v in ops["top"])
        lines.append(f"  compiled step: {ops['launching']} launching ops: {top}")
    p = res.get("profile")
    if p and p.get("kernels"):
        lines.append(f"  profile: {p['kernels_per_step']:.0f} kernels per step, mean {p['mean_kernel_us']:.1f} us, "
                     f"device busy {p['busy_fraction']:.1%} of the span")
    for v in res.get("xla_variants", []):
        fit = v.get("fit") or {}
        lines.append(f"  XLA_FLAGS {v['flags']}: " + (f"{fit['per_step_s'] * 1e3:.3f} ms per step" if fit
                                                      else f"no fit (rc {v.get('returncode')})"))
    return lines


# ------------------------------------------------------------------------------------------------------------
# The train step's MFU on packed rows


def _train_batch(rows: int, width: int, vocab: int) -> dict:
    """Long-tailed rows like RL's: prompts of 32-96 tokens, responses lognormal (median ~width/5), cut to fit."""
    rng = np.random.default_rng(7)
    trajs = []
    for i in range(rows):
        p = int(rng.integers(min(32, width // 4), min(97, width // 2)))
        r = int(np.clip(rng.lognormal(np.log(width / 5), 0.7), 4, width - p))
        trajs.append(Trajectory(uid=i, group_id=i // 8, prompt=rng.integers(4, vocab, size=p).astype(np.int32),
                                seed=0, max_new_tokens=r, tokens=rng.integers(4, vocab, size=r).tolist(),
                                logps=(-rng.exponential(1.0, size=r)).tolist()))
    advantages = rng.normal(size=rows).astype(np.float32)
    return build_batch(trajs, advantages, max_len=width)


def _train_case(args, preset: str, impl: str) -> dict:
    cfg = model_config(preset, param_dtype="float32", dtype="bfloat16")
    model = init_model(cfg, seed=0)
    mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    lcfg = learner.LearnerConfig(micro_batch_size=args.train_micro_batch,
                                 logits_chunk=1024 if cfg.vocab_size > 65_536 else None)
    run_learner = learner.Learner.create(model, lcfg, learner.OptimizerConfig(learning_rate=1e-5), mesh,
                                         flash=fa.FlashConfig(impl=impl))
    raw = _train_batch(args.train_rows, args.train_width, cfg.vocab_size)
    batch = packing.pack_for_learner(raw, lcfg, mesh)
    lengths = np.asarray(raw["attention_mask"]).astype(bool).sum(axis=1)
    flops = train_model_flops(cfg, lengths.tolist())
    chipf = chip()
    run: dict = {"model": preset, "params": cfg.num_params(), "attention_impl": impl, "rows": args.train_rows,
                 "width": args.train_width, "real_tokens": int(lengths.sum()), "model_flops": flops,
                 **packing.packing_stats(batch, lcfg)}
    step = run_learner.train_step
    train_state = run_learner.init_state(model, seed=0)
    t0 = time.perf_counter()
    train_state, m = step(train_state, batch)
    jax.block_until_ready(m)
    run["compile_and_first_step_s"] = time.perf_counter() - t0
    times = []
    for _ in range(args.train_iters):
        t0 = time.perf_counter()
        train_state, m = step(train_state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
    run.update(step_s=statistics.median(times), step_s_all=times, loss=metrics.get("loss"),
               grad_norm=metrics.get("grad_norm"))
    run["mfu"] = flops / (run["step_s"] * chipf["peak_flops"])
    run["finite"] = bool(np.isfinite(run["loss"]) and np.isfinite(run["grad_norm"]))
    return run


def section_train_step(args, state: dict) -> dict:
    """One GRPO train step (forward + backward + AdamW) per preset on a packed long-tailed batch (float32 params,
    bf16 compute; 'cudnn' attention on GPU): time, and MFU = model FLOPs on the real tokens / (time x peak)."""
    out: dict = {"dtype": "float32 params, bfloat16 compute", "chip": chip(), "runs": []}
    impl = "cudnn" if on_gpu() else "reference"
    if not on_gpu():
        out["note"] = "CPU: 'cudnn' cannot run here; the reference impl exercises the same step code"
    ok = True
    for preset in args.train_presets:
        if over_budget(args):
            out["runs"].append({"model": preset, **skipped(args)})
            continue
        try:
            run = _train_case(args, preset, impl)
            ok &= run["finite"]
        except Exception as e:  # noqa: BLE001
            run = {"model": preset, "attention_impl": impl, **err_text(e)}
            ok = False
        out["runs"].append(run)
        print(f"   {train_line(run)}", flush=True)
    out["status"] = "ok" if ok else "fail"
    return out


def train_line(run: dict) -> str:
    head = f"{run['model']} ({run.get('attention_impl', '?')}): "
    if unfinished := _unfinished(run):
        return head + unfinished
    return head + (f"step {run['step_s']:.3f} s, MFU {run['mfu']:.1%} ({run['real_tokens']:,} real tokens, "
                   f"{run.get('train/useful_token_fraction', float('nan')):.1%} of positions useful; compile + "
                   f"first {run['compile_and_first_step_s']:.1f} s), loss {run['loss']:.4g}")


# ------------------------------------------------------------------------------------------------------------
# A config's programs compiled on the GPU at reduced layer count


def _compile(lowered) -> dict:
    t0 = time.perf_counter()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    return {"temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes), "alias_bytes": int(mem.alias_size_in_bytes),
            "compile_s": round(time.perf_counter() - t0, 1)}


def compile_config(path: str, layers: int) -> dict:
    """The config's train step, resume prefill and decode dispatch, assembled as the run assembles them
    (``run.programs``), compiled for this machine's GPUs with the model cut to ``layers`` decoder layers. On as
    many GPUs as the config's mesh: that mesh, exactly. On fewer: one GPU standing for one device of that mesh:
    attention heads, KV heads and the MLP divided by the mesh's 'tensor' size, slots, rows and micro-batch rows by
    its batch axes, the KV budget by its devices (so the pool has the per-device pages). Heads and rows then match
    a device of the mesh; the weights and moments of the cut layers are whole on the one GPU (on the mesh they
    are split over every device), an upper bound."""
    from rollverify_jax.run import programs
    from rollverify_jax.run.dry_run import mesh_shape
    from rollverify_jax.run.spec import RunSpec, parse_gin
    from rollverify_jax.scale.fit import per_device_bytes as per_device

    gin.clear_config()
    parse_gin([path], [])
    spec = RunSpec.from_gin()
    rollout, engine_cfg, learner_cfg = spec.rollout, spec.engine, spec.learner
    full = programs.architecture(spec)
    shape = mesh_shape(spec)
    devices = jax.devices()
    cfg = dataclasses.replace(full, num_hidden_layers=layers)
    rows = rollout.batch_groups * rollout.group_size
    kv_scale = layers / full.num_hidden_layers  # bytes per page scale with the layers: keep the page count
    if -1 in shape:  # the config's mesh takes every device of the run it names: this machine's
        shape[shape.index(-1)] = max(1, len(devices) // math.prod(x for x in shape if x != -1))
    exact = len(devices) >= math.prod(shape)
    if exact:
        mesh = programs.make_mesh(spec, devices=devices[: math.prod(shape)])  # the run's mesh, exactly
    else:
        tensor, batch = shape[2], shape[0] * shape[1]
        cfg = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tensor,
                                  num_key_value_heads=max(1, cfg.num_key_value_heads // tensor),
                                  intermediate_size=cfg.intermediate_size // tensor)
        engine_cfg = dataclasses.replace(engine_cfg, num_slots=max(1, engine_cfg.num_slots // batch),
                                         kv_memory_bytes=engine_cfg.kv_memory_bytes and
                                         engine_cfg.kv_memory_bytes // math.prod(shape))
        learner_cfg = dataclasses.replace(learner_cfg, micro_batch_size=learner_cfg.micro_batch_size and
                                          max(1, learner_cfg.micro_batch_size // batch))
        rows = max(learner_cfg.num_minibatches, rows // batch)
        mesh = mesh_lib.make_mesh((1, 1, 1), devices=devices[:1])
    if engine_cfg.kv_memory_bytes:
        engine_cfg = dataclasses.replace(engine_cfg, kv_memory_bytes=int(engine_cfg.kv_memory_bytes * kv_scale))
    flash = dataclasses.replace(spec.flash, impl=spec.flash.resolved_impl(devices[0].platform))
    # What the run builds (run/programs.py), of the cut model and the per-device engine and learner settings.
    model = programs.abstract_model(cfg)
    run = programs.programs(dataclasses.replace(spec, engine=engine_cfg, learner=learner_cfg), model, mesh,
                            flash=flash)
    out: dict = {"config": path, "layers": layers, "full_layers": full.num_hidden_layers, "exact_mesh": exact,
                 "mesh": dict(mesh.shape), "config_mesh": list(shape), "num_slots": engine_cfg.num_slots,
                 "rows": rows, "micro_batch_size": learner_cfg.micro_batch_size, "programs": {}}
    state = run.learner.abstract_state
    out["programs"]["train_step"] = _compile(run.learner.lower_train_step(rows, engine_cfg.max_seq_len))
    params = run.engine.abstract_params(nnx.split(model)[1])
    decode_state = run.engine.abstract_state()
    out["programs"]["prefill"] = _compile(run.engine.lower_prefill(params, batch_devices(mesh.shape)))  # a row each
    out["programs"]["decode"] = _compile(run.engine.lower_decode(params))
    out["resident"] = {"train_state": per_device(state), "kv_pool": per_device(decode_state.pages)}
    out["peak_bytes"] = max(p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
                            for p in out["programs"].values()) + out["resident"]["kv_pool"]
    gin.clear_config()
    return out


def section_compile_config(args, state: dict) -> dict:
    if not args.compile_config:
        return {"status": "ok", "skipped": "no --compile-config"}
    out: dict = {"config": args.compile_config, "chip": chip(), "by_layers": []}
    ok = True
    for layers in args.compile_layers:
        if over_budget(args):
            out["by_layers"].append({"layers": layers, **skipped(args)})
            continue
        try:
            res = compile_config(args.compile_config, layers)
        except Exception as e:  # noqa: BLE001
            res = {"layers": layers, **err_text(e)}
            ok = False
        out["by_layers"].append(res)
        print("   " + compile_line(res), flush=True)
    done = [r for r in out["by_layers"] if "programs" in r]
    if len(done) >= 2:  # per decoder layer, per program: what the full model adds on top of the compiled cut
        a, b = done[0], done[-1]
        extra = {k: (b["programs"][k]["temp_bytes"] - a["programs"][k]["temp_bytes"]) / (b["layers"] - a["layers"])
                 for k in a["programs"]}
        out["temp_bytes_per_layer"] = extra
        more = b["full_layers"] - b["layers"]
        out["temp_bytes_at_full_layers"] = {k: b["programs"][k]["temp_bytes"] + extra[k] * more for k in extra}
    reset_kernels()
    out["status"] = "ok" if ok else "fail"
    return out


def compile_line(res: dict) -> str:
    if "error" in res:
        return f"{res['layers']} layers: ERROR " + res["error"].splitlines()[0][:200]
    if "skipped" in res:
        return f"{res['layers']} layers: skipped ({res['skipped']})"
    progs = ", ".join(f"{k} temporaries {p['temp_bytes'] / 2**30:.2f} GiB ({p['compile_s']:.0f} s)"
                      for k, p in res["programs"].items())
    return (f"{res['layers']} of {res['full_layers']} layers on mesh {res['mesh']}"
            f"{'' if res['exact_mesh'] else ' (one GPU standing for one device of ' + str(res['config_mesh']) + ')'}: "
            f"{progs}; KV pool {res['resident']['kv_pool'] / 2**30:.2f} GiB, peak {res['peak_bytes'] / 2**30:.2f} GiB")
