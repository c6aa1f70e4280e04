"""OPS noise floor: with unchanged weights, how far the resume prefill's log pi is from decode's log mu.

Verification compares ``log pi(y_t)`` from the resume prefill (dense causal attention over prompt + cached
tokens) with ``log mu(y_t)`` recorded by the decode loop (paged attention, one token per step). With the same
weights both are the same distribution, so any OPS between them is kernel noise, not policy shift; it must sit
well below the segment threshold ``ds = 0.01`` or the segment stage cuts on-policy tokens.

For each model and dtype: decode ``--slots`` trajectories of exactly ``--new`` tokens (EOS off, T = 1) with the
Engine + Scheduler, then resume every one of them (``Scheduler.resume``, as a partial-rollout phase does): its
keep function sees the prefill's ``log pi`` next to the recorded ``log mu`` and keeps everything. Each resume runs
twice: ``EngineConfig.logits_chunk`` unset (whole logits) and set (the chunked log-prob path the shipped
configs use). A trajectory is one segment (one policy version), so its segment OPS is its mean token OPS.

The kernels are the platform's defaults (``FlashConfig.impl`` / ``paged_attention.impl`` 'auto': the jnp
references on CPU, cuDNN prefill on GPU, splash + Pallas paged attention on TPU where head_dim allows);
``--paged-impl pallas_gpu`` opts the decode into the Pallas GPU kernel. ``tests/gpu/check_gpu.py`` runs
``measure`` in its ``ops_floor`` section.

Usage: python tests/gpu/bench_ops_floor.py [--slots 32] [--new 384] [--chunk 64] [--no-doc]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from gpu_common import kernel_kwargs, use_kernels  # a sibling: tests/gpu/ is on sys.path when this file runs

from rollverify_jax.models import init_model, load_pretrained, model_config
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.verify.ops import token_ops

ROOT = Path(__file__).resolve().parents[2]

POLICY = ROOT / "assets" / "tiny_policy"
DS = 0.01  # VerifyConfig.ds

# name -> (param dtype, compute dtype, KV dtype) of the model and cache. 'bfloat16' is what configs/qwen3_*_dapo.gin
# run; the mixed rows split its floor between bf16 activations and the bf16 KV cache, and 'bf16 params, f32
# compute' keeps bf16 weights and KV (the memory) with a float32-activation model.
ENGINE_F32 = "bf16 params and KV, EngineConfig.compute_dtype = 'float32'"
DTYPES = {
    "float32": ("float32", "float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "bf16 model, f32 KV": ("bfloat16", "bfloat16", "float32"),
    "f32 model, bf16 KV": ("float32", "float32", "bfloat16"),
    "bf16 params, f32 compute, bf16 KV": ("bfloat16", "float32", "bfloat16"),
    ENGINE_F32: ("bfloat16", "bfloat16", "bfloat16"),
}
# name -> EngineConfig.compute_dtype (unset: None, the model's own): the shipped bf16 model, its rollout run with
# float32 activations by the engine (the learner's model stays bf16).
ENGINE_COMPUTE = {ENGINE_F32: "float32"}
# XLA CPU runs some dots through YNNPACK and others (by shape and fusion) through its own emitter, which sum in
# different orders; this run of the bf16 rows without YNNPACK separates that CPU artifact from the rest.
CPU_SAME_DOTS = "--xla_cpu_experimental_ynn_fusion_type="


def load_model(name: str, param_dtype: str, compute_dtype: str):
    """'random': the tiny preset at init; 'policy': the trained tiny policy (assets/tiny_policy)."""
    if name == "policy":
        return load_pretrained(POLICY, dtype=param_dtype, compute_dtype=compute_dtype)
    return init_model(model_config("tiny", param_dtype=param_dtype, dtype=compute_dtype), seed=0)


def requests(n: int, new: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """Random in-vocabulary prompts of 24-32 tokens (ids 4 and up: the tiny policy's specials are 0-3)."""
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(24, 33)).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=new) for i in range(n)]


def decode(engine: Engine, reqs: list[Trajectory]) -> list[Trajectory]:
    """Every request generated to its length (log mu recorded by insert for the first token, decode after)."""
    sched = Scheduler(engine)
    sched.submit(reqs)
    sched.run()
    done = sorted(sched.take_finished(), key=lambda t: t.uid)
    assert len(done) == len(reqs), f"{len(done)} of {len(reqs)} finished"
    return done


def resume_ops(engine: Engine, trajs: list[Trajectory]) -> list[np.ndarray]:
    """Token OPS of every trajectory under a resume: prefill with log-probs, then the keep function, which here
    records OPS and keeps everything (finished trajectories then need no decode). -> float32[n_i] each."""
    rows: list[np.ndarray] = []

    def record(new_logp, behavior, versions, lengths):
        ops = np.asarray(token_ops(new_logp, behavior))
        rows.extend(ops[i, :n] for i, n in enumerate(lengths) if n)
        return lengths

    sched = Scheduler(engine)
    sched.resume(copy.deepcopy(trajs), keep=record)
    sched.run()
    assert len(rows) == len(trajs) and not sched.slots, "every resume is verified and none decodes"
    return rows


def summarize(rows: list[np.ndarray]) -> dict:
    """Token OPS distribution and per-trajectory (= per-segment) mean OPS."""
    tok = np.concatenate(rows).astype(np.float64)
    seg = np.asarray([r.mean() for r in rows], np.float64)
    return {"tokens": int(tok.size), "token_mean": float(tok.mean()), "token_p50": float(np.median(tok)),
            "token_p99": float(np.quantile(tok, 0.99)), "token_max": float(tok.max()),
            "segments": int(seg.size), "segment_mean": float(seg.mean()), "segment_max": float(seg.max()),
            "segments_cut": int((seg >= DS).sum())}


def measure(model, kv_dtype: str, slots: int = 32, new: int = 384, chunks=(None, 64), seed: int = 0,
            compute_dtype: str | None = None) -> dict:
    """Decode once, resume under each ``logits_chunk`` in ``chunks`` -> {chunk: summarize(...)} plus the
    kernels used; ``compute_dtype``: ``EngineConfig.compute_dtype``. The kernels ``gpu_common.use_kernels`` chose
    (the platform's defaults unless told otherwise)."""
    vocab = model.cfg.vocab_size
    reqs = requests(slots, new, vocab, seed)
    longest = max(len(r.prompt) for r in reqs) + new
    cfg = EngineConfig(num_slots=slots, page_size=16, max_seq_len=-(-longest // 64) * 64, steps_per_dispatch=8,
                       kv_dtype=kv_dtype, compute_dtype=compute_dtype)
    sampling = SamplingConfig(temperature=1.0)
    base = Engine(model, cfg, sampling, eos_ids=(), **kernel_kwargs())
    trajs = decode(base, reqs)
    out: dict = {"prefill_impl": base.flash.resolved_impl(base.layout.platform),
                 "paged_impl": dict(base.attention).get("impl", "auto")}
    for chunk in chunks:
        engine = base if chunk == cfg.logits_chunk else Engine(model, dataclasses.replace(cfg, logits_chunk=chunk),
                                                               sampling, eos_ids=(), **kernel_kwargs())
        out[chunk] = summarize(resume_ops(engine, trajs))
    return out


def row(model: str, dtype: str, chunk, s: dict) -> str:
    return (f"| {model} | {dtype} | {chunk or 'unset'} | {s['token_mean']:.2e} | {s['token_p50']:.2e} | "
            f"{s['token_p99']:.2e} | {s['token_max']:.2e} | {s['segment_mean']:.2e} | {s['segment_max']:.2e} | "
            f"{s['segments_cut']}/{s['segments']} |")


def table(args, label_suffix: str = "") -> tuple[list[str], str]:
    """One row per model x dtype x logits_chunk -> (rows, the kernels used)."""
    rows, kernels = [], ""
    for name in args.models:
        if name == "policy" and not (POLICY / "config.json").exists():
            print(f"no {POLICY}; skipping the trained policy")
            continue
        label = "random tiny" if name == "random" else "tiny policy"
        for dtype in args.dtypes:
            param, compute, kv = DTYPES[dtype]
            res = measure(load_model(name, param, compute), kv, args.slots, args.new, (None, args.chunk),
                          compute_dtype=ENGINE_COMPUTE.get(dtype))
            kernels = f"prefill `{res['prefill_impl']}`, paged decode `{res['paged_impl']}`"
            for chunk in (None, args.chunk):
                rows.append(row(label, dtype + label_suffix, chunk, res[chunk]))
                print(rows[-1], flush=True)
    return rows, kernels


def same_dots_rows(args) -> list[str]:
    """The bf16 rows again in a child process whose XLA CPU sends every dot down one path (``CPU_SAME_DOTS``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--no-doc", "--no-cpu-diagnostic", "--rows-out", str(out), "--dtypes",
               "bfloat16", "--slots", str(args.slots), "--new", str(args.new), "--chunk", str(args.chunk),
               "--models", *args.models, "--paged-impl", args.paged_impl, "--suffix", ", CPU dots on one path"]
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + CPU_SAME_DOTS).strip()}
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--new", type=int, default=384)
    ap.add_argument("--chunk", type=int, default=64, help="EngineConfig.logits_chunk of the chunked resume")
    ap.add_argument("--models", nargs="+", default=["random", "policy"], choices=["random", "policy"])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--paged-impl", default="auto", help="paged_attention.impl of the decode")
    ap.add_argument("--no-doc", action="store_true", help="print only; do not update docs/benchmarks.md")
    ap.add_argument("--no-cpu-diagnostic", action="store_true", help=f"on CPU, skip the rerun with {CPU_SAME_DOTS}")
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--suffix", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_kernels("auto", args.paged_impl)
    rows, kernels = table(args, args.suffix)
    if args.rows_out:
        Path(args.rows_out).write_text(json.dumps(rows))
    if jax.default_backend() == "cpu" and not args.no_cpu_diagnostic and "bfloat16" in args.dtypes:
        rows += same_dots_rows(args)
    head = ["| model | dtypes | logits_chunk | token OPS mean | p50 | p99 | max | segment OPS mean | max | "
            "segments >= ds |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    body = "\n".join(head + rows) + "\n\n" + notes(args, kernels)
    if not args.no_doc:
        from rollverify_jax.studies import benchlib

        benchlib.write_section("OPS noise floor: resume prefill vs decode (bench_ops_floor.py)", body)


def notes(args, kernels: str) -> str:
    return (
        f"Same weights for decode and resume, so every OPS here is numerical noise between the two paths; the "
        f"segment stage cuts a segment whose mean OPS is >= ds = {DS}. {args.slots} trajectories per row, each "
        f"exactly {args.new} tokens after a 24-32-token random prompt (EOS off, T = 1); one trajectory = one "
        f"segment. Resume = `Scheduler.resume` (Engine.prefill with log-probs, `Prefix.response_logp`). dtypes: "
        f"'float32' everything float32; 'bfloat16' = bf16 params, bf16 compute and `EngineConfig.kv_dtype = "
        f"'bfloat16'`, as `configs/qwen3_*_dapo.gin` run; the mixed rows are diagnostics; 'CPU dots on one path' "
        f"reruns the bf16 rows with `XLA_FLAGS={CPU_SAME_DOTS}` (XLA CPU then sums every dot in one order, whatever "
        f"its shape). Kernels on this machine ({jax.default_backend()}): {kernels}. The GPU (cuDNN prefill, Pallas "
        f"paged decode) and TPU (splash, Pallas paged attention) kernels were not available here and are "
        f"unmeasured; this script picks up the platform's kernels where they exist, and `tests/gpu/check_gpu.py` "
        f"runs it in its `ops_floor` section. The tiny models have vocabularies of 40-64 tokens and 4 layers; a "
        f"real model's floor is not implied by these rows.\n\n"
        f"Before the fixes (commit 089be0f, same workload) the tiny policy's bf16 floor was a mean segment OPS of "
        f"8.8e-3 with 12 of 32 on-policy trajectories cut, f32 compute with a bf16 KV cache 2.7e-3, the random "
        f"model's bf16 1.2e-3. What differed between the paths, and is now the same: RMSNorm's product rounded once "
        f"(`models/qwen3.py`; XLA had kept or dropped HF's middle rounding per fused shape); every bf16 rounding "
        f"kept as written in the engine's programs (`xla_allow_excess_precision = False`); decode scales q in "
        f"float32 as the prefill scales its float32 scores; both references keep the attention probabilities "
        f"float32 into the PV product; the prefill attends over K/V rounded to `kv_dtype`, as decode reads them; "
        f"logits, log-softmax and the temperature division were already float32 in both. What remains in bf16 is "
        f"the order of float32 sums (dots and softmax over different shapes and key counts), a last-bit difference "
        f"that bf16 rounding turns into whole-ulp flips now and then; the K/V cache carries each flip to every later "
        f"token, so the floor grows with length (random tiny model, 8 x 64 tokens: 3.9e-4). No precision choice "
        f"inside bf16 compute removes it (a float32 residual stream left it at 1.8e-3); float32 activations with "
        f"bf16 weights and KV do (the 'bf16 params, f32 compute' rows), at an accelerator's float32 matmul cost, "
        f"unmeasured here.\n\n"
        f"A run asks for them with `EngineConfig.compute_dtype = 'float32'` (its rows above): the model stays the "
        f"qwen3 configs' bf16 one, its weights bf16 in memory and the KV cache in `kv_dtype`, the learner's forward "
        f"and backward bf16; only the engine's prefill, insert and decode programs run float32 activations (the "
        f"engine merges the same params into a graph whose `Qwen3Config.dtype` is float32). Its floor is the "
        f"float32-activation model's (the 'bf16 params, f32 compute' rows, a model built with float32 activations). "
        f"What it costs: in the prefill, float32 activations and float32 matmuls (a fraction of the MXU's or tensor "
        f"cores' bf16 throughput) at real scale, unmeasured here; decode reads every weight and the KV cache each "
        f"step and is bound by those reads, which stay bf16, so its cost there should be small (also unmeasured). "
        f"On TPU (and on GPUs with TF32) a float32 dot at JAX's default precision rounds its inputs to "
        f"bf16 (TF32), which this CPU measurement does not: the accelerator floor with the option is unmeasured. "
        f"Memory at scale, from the deviceless compile of `configs/qwen3_8b_dapo.gin` (v5p:2x2x4, `python -m "
        f"rollverify_jax.aot` with and without `--gin_param=\"EngineConfig.compute_dtype = 'float32'\"`): the "
        f"resume prefill's temporaries 3.14 -> 3.09 GiB per chip, its outputs 51.39 -> 51.57 GiB (the float32 "
        f"hidden states it hands to insert), decode's temporaries 0.18 GiB either way, the peak 73.38 GiB per chip "
        f"either way (the train step's): it fits. The shipped qwen3 configs keep bf16 activations all the same: the "
        f"option's prefill throughput and its floor on the accelerators' kernels are unmeasured.")


if __name__ == "__main__":
    main()
