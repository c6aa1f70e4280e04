"""Device check for one GPU, in one run under a time limit: speed against the roofline first, then the GPU kernels
against the jnp references and the engine end to end.

Sections, in the order they run (each in its own try/except; the JSON report is rewritten after every section,
so a run cut short still leaves what it measured; sections left when ``--budget-s`` is spent are skipped, and a
watchdog writes the report and exits at ``--hard-limit-s``):

- ``env``: versions, devices, the chip's datasheet figures (HBM bandwidth, bf16 peak) the rooflines use.
- ``paged_attention``: ``paged_attention(..., impl='pallas_gpu')`` (Pallas GPU kernel, compiled, not interpret)
  vs ``paged_attention_reference``, float32 and bf16, plus per-call times.
- ``long_context`` (gpu_speed.py): the GPU decode default at a 22,528-token context. One layer's attention,
  bf16 pages, 8 slots x 2 KV heads x head_dim 128 (one device's share of configs/qwen3_8b_dapo_8xh200.gin's
  heads): 'auto' for 'gpu' (the Pallas GPU kernel above 512 tokens a sequence), the reference (gathers the whole
  table) and 'chunked', against float32 truth, with times and compiled temporaries. Then the engine at that
  context (bench model, 8 slots of prompts filling it, greedy): decode tokens/s with the default and with the
  reference, against the roofline, and how many greedy tokens agree (bf16).
- ``decode_throughput`` (gpu_speed.py): generated tokens/s of the engine (prompts of 24-32 tokens,
  ``--new-tokens`` each, EOS off, T = 1) on a random bigger model, bf16, at each ``--concurrency``: the GPU
  default, the same with ``EngineConfig.dispatch_ahead`` (decode n + 1 dispatched before n is read), and the
  Pallas kernel forced (when it passed above); each against the HBM roofline (every weight plus the live KV once
  per step, at the datasheet bandwidth), with decode's own ms per step and the host's share of the wall.
- ``decode_fixed_cost`` (gpu_speed.py): where a decode step's fixed cost goes. Dispatch times at several
  ``steps_per_dispatch`` fitted to t = a + k b (a: per dispatch, b: per step), synced and back to back; the
  compiled step's launching ops (HLO of the scan body); a ``jax.profiler`` trace of three dispatches (device
  kernels per step, mean kernel time, the device's busy share of the span); and the same fit in a child process
  per ``--xla-variants`` entry (XLA_FLAGS, e.g. CUDA graphs for the loop body).
- ``train_step`` (gpu_speed.py): one GRPO train step (forward + backward + AdamW) per ``--train-presets`` model
  on a packed long-tailed batch (``packing.pack_for_learner``), float32 params, bf16 compute, cuDNN attention;
  MFU = model FLOPs of the real tokens / (step time x bf16 peak), and the packed positions' useful share.
- ``compile_config`` (gpu_speed.py, with ``--compile-config``): that config's train step, resume prefill and
  decode dispatch compiled on this machine's GPUs at ``--compile-layers`` decoder layers (its own mesh when the
  GPUs are there, else one GPU standing for one device of it); per-program memory, per-layer growth.
- ``engine_greedy``: Engine + Scheduler, greedy, on the tiny policy (``assets/tiny_policy``, else the random
  'tiny' preset): every generated token must be the argmax of a teacher-forced forward of the model over the
  engine's own sequence (up to a tolerance: ``regret`` = max logit - logit of the chosen token). Cases: float32
  with impl auto (cuDNN prefill), float32 with the reference prefill, bf16 compute with auto, and the Pallas
  decode kernel (float32 and bf16).
- ``ops_floor``: the OPS noise floor (``tests/gpu/bench_ops_floor.py``'s ``measure``): with unchanged weights, the
  resume prefill's log pi against decode's recorded log mu, on the tiny policy, float32 and bf16 (params, compute
  and KV), with the platform's kernels (cuDNN prefill; reference and, when it passed above, Pallas decode), with
  ``EngineConfig.logits_chunk`` unset and set. Verification's segment threshold is ds = 0.01; the floor must sit
  well below it (float32: mean segment OPS < ds / 10 passes; bf16 is recorded).
- ``prefill_attention``: ``causal_attention(..., 'cudnn')`` (cuDNN fused, ``jax.nn.dot_product_attention``) vs
  the 'reference' on packed rows (segments + padding), bf16 (cuDNN has no float32 kernel: the float32 attempt is
  recorded), forward and gradients, against the reference computed in float32 on the same bf16-rounded inputs;
  the bf16 reference's own error is the baseline the tolerance is set from.

Device run, one H200 (about 12 minutes; from the repo root; .whl holds the pure-Python wheels the device image
lacks, gin-config among them: `.venv/bin/pip download --no-deps -d .whl gin-config`, and `.whl/` in
.git/info/exclude, carried):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && XLA_PYTHON_CLIENT_MEM_FRACTION=.9 python3 tests/gpu/check_gpu.py --out $OUT/gpu_check.json --compile-config configs/qwen3_8b_dapo_8xh200.gin --compile-layers 1 2

CPU test of every code path (interpret-mode Pallas, XLA's dot_product_attention in place of cuDNN;
tests/test_check_gpu.py runs the speed sections this way):

    JAX_PLATFORMS=cpu .venv/bin/python tests/gpu/check_gpu.py --allow-cpu --small --out /tmp/gpu_check_cpu.json
"""  # noqa: E501  (the device command above is kept on one line, to be copied whole)

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("ROLLVERIFY_COMPILATION_CACHE", "0")  # measure compiles; write no cache into the tree
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gin  # noqa: E402
import gpu_speed  # noqa: E402  (a sibling: tests/gpu/ is on sys.path when this file runs)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from gpu_common import (  # noqa: E402
    elapsed,
    err_text,
    kernel_kwargs,
    max_abs,
    max_mag,
    on_gpu,
    over_budget,
    precision,
    reset_kernels,
    run_engine,
    timed,
    use_kernels,
)

from rollverify_jax.models import flash_attention as fa  # noqa: E402
from rollverify_jax.models import init_model, load_pretrained, model_config  # noqa: E402
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Trajectory  # noqa: E402
from rollverify_jax.rollout.attention import paged_attention, paged_attention_reference  # noqa: E402

POLICY = ROOT / "assets" / "tiny_policy"
SECTIONS = ("paged_attention", "long_context", "decode_throughput", "decode_fixed_cost", "train_step",
            "compile_config", "engine_greedy", "ops_floor", "prefill_attention")
CUDA_GRAPHS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"

# Sizes: (device default, --small). A flag given explicitly wins over both.
SIZES = {
    "attn_batch": (4, 2), "attn_len": (2048, 96), "attn_heads": (32, 4), "attn_kv_heads": (8, 2),
    "attn_head_dim": (128, 32),
    "paged_batch": (64, 3), "paged_heads": (8, 8), "paged_kv_heads": (2, 2), "paged_head_dim": (128, 32),
    "paged_page_size": (16, 4), "paged_pages_per_seq": (64, 8),
    "long_context": (22_528, 22_528), "long_slots": (8, 2), "long_heads": (8, 16), "long_kv_heads": (2, 1),
    "long_head_dim": (128, 16), "long_page": (64, 64),
    "long_engine_preset": ("bench_100m", "tiny"), "long_engine_context": (22_528, 1024), "long_engine_slots": (8, 2),
    "long_engine_new": (64, 8),
    "engine_requests": (12, 6), "engine_slots": (8, 4),
    "bench_preset": ("bench_100m", "tiny"), "concurrency": ([64, 256], [8]), "new_tokens": (128, 16),
    "decode_rounds": (2, 1),
    "fixed_steps": ([1, 8, 32], [1, 4]), "fixed_slots": (64, 4), "fixed_dispatches": (5, 2),
    "train_presets": (["bench_100m", "qwen3_0_6b"], ["tiny"]), "train_rows": (64, 8), "train_width": (2048, 128),
    "train_iters": (3, 1), "train_micro_batch": (4, 4),
    "floor_slots": (32, 4), "floor_new": (384, 16),
    "compile_layers": ([1, 2], [1]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON report path (default: $OUT/gpu_check.json, else gpu_check.json)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (CPU test of the code paths)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU test)")
    ap.add_argument("--budget-s", type=float, default=660.0,
                    help="wall-clock budget: the measurements still to run past it are skipped")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="the watchdog writes the report and exits (status 3) here (default: budget + 90 s)")
    ap.add_argument("--sections", nargs="+", default=None, choices=SECTIONS,
                    help="run only these sections (env always runs), in the order above")
    ap.add_argument("--compile-config", default=None, help="a gin config whose programs compile_config compiles")
    ap.add_argument("--no-profile", action="store_true", help="decode_fixed_cost: no profiler trace")
    ap.add_argument("--xla-variants", nargs="*", default=None,
                    help="decode_fixed_cost: XLA_FLAGS to rerun its fit with, one child process each "
                         "(default on a GPU: CUDA graphs for the loop body)")
    ap.add_argument("--no-xla-variants", action="store_true")
    for name, (default, _) in SIZES.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, list):
            ap.add_argument(flag, type=type(default[0]), nargs="+", default=None)
        else:
            ap.add_argument(flag, type=type(default), default=None)
    args = ap.parse_args(argv)
    for name, (default, small) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else default)
    if args.out is None:
        args.out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    if args.hard_limit_s is None:
        args.hard_limit_s = args.budget_s + 90
    if args.no_xla_variants:
        args.xla_variants = []
    elif args.xla_variants is None:
        args.xla_variants = [CUDA_GRAPHS]
    return args


# ------------------------------------------------------------------------------------------------------------
# Sections (the speed sections are in gpu_speed.py)


def section_env(args) -> dict:
    import flax
    import optax

    devices = jax.devices()
    out = {
        "python": sys.version.split()[0], "platform": platform.platform(), "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(), "flax": flax.__version__,
        "optax": optax.__version__, "gin": getattr(gin, "__version__", "?"), "backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices], "num_devices": len(devices),
        "small": args.small, "chip": gpu_speed.chip(),
    }
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415  (private: present only with the CUDA plugin)

        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001
        out["cudnn"] = f"unknown ({type(e).__name__})"
    return out


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return "?"


def _packed_segments(b: int, t: int) -> np.ndarray:
    """Rows packed with 3 segments each (ids 1..3) of different total lengths, then padding (0)."""
    fracs = [1.0, 0.73, 0.31, 0.04]
    segments = np.zeros((b, t), np.int32)
    for i in range(b):
        n = max(8, int(t * fracs[i % len(fracs)]))
        cuts = np.sort(np.random.default_rng(i).choice(np.arange(1, n), size=2, replace=False))
        segments[i, :n] = 1 + np.searchsorted(cuts, np.arange(n), side="right")
    return segments


def section_prefill_attention(args) -> dict:
    b, t, hq, hkv, d = args.attn_batch, args.attn_len, args.attn_heads, args.attn_kv_heads, args.attn_head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.float32)
    seg_np = _packed_segments(b, t)
    segments = jnp.asarray(seg_np)
    real = seg_np > 0
    weights = jnp.asarray(real, jnp.float32)[..., None, None]
    gpu = on_gpu()
    out: dict = {"shape": dict(batch=b, len=t, q_heads=hq, kv_heads=hkv, head_dim=d),
                 "real_tokens": int(real.sum()), "kernel": "cudnn" if gpu else "xla (implementation=None; CPU)"}

    def kernel(q, k, v, seg):
        if gpu:
            return fa.causal_attention(q, k, v, seg, "cudnn")
        return fa.cudnn_attention(q, k, v, seg, implementation=None)

    def reference(q, k, v, seg):
        return fa.causal_attention(q, k, v, seg, "reference")

    def loss(fn, seg):
        return lambda q, k, v: jnp.sum(weights * fn(q, k, v, seg).astype(jnp.float32) ** 2)

    grad = {name: jax.jit(jax.grad(loss(fn, segments), argnums=(0, 1, 2)))
            for name, fn in (("kernel", kernel), ("reference", reference))}
    fwd = {name: jax.jit(fn) for name, fn in (("kernel", kernel), ("reference", reference))}
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    q32, k32, v32 = (x.astype(jnp.float32) for x in (qb, kb, vb))  # the bf16 inputs, exactly, in float32

    # bf16: kernel vs float32 reference on the same inputs; the bf16 reference's error is the baseline.
    with precision("highest"):  # on GPU, float32 matmuls may otherwise run in TF32
        truth = fwd["reference"](q32, k32, v32, segments)
        plain_truth = fwd["reference"](q32, k32, v32, None)
        g_truth = grad["reference"](q32, k32, v32)
        truth32 = fwd["reference"](q, k, v, segments)
    got = fwd["kernel"](qb, kb, vb, segments)
    base = fwd["reference"](qb, kb, vb, segments)
    scale = max_mag(truth, real)
    e_k, e_b = max_abs(got, truth, real), max_abs(base, truth, real)
    tol = max(3 * e_b, 2e-2 * scale)
    bf16 = {"fwd_max_abs_err": e_k, "fwd_ref_bf16_max_abs_err": e_b, "fwd_max_abs_ref": scale, "fwd_tol": tol,
            "fwd_ok": bool(e_k <= tol)}
    # No segments: plain causal (the kernel's own causal mask, no dense mask).
    e_plain = max_abs(fwd["kernel"](qb, kb, vb, None), plain_truth)
    bf16.update(fwd_no_segments_max_abs_err=e_plain, fwd_no_segments_ok=bool(e_plain <= tol))
    # Gradients.
    g_got = grad["kernel"](qb, kb, vb)
    g_base = grad["reference"](qb, kb, vb)
    grads_ok = True
    for name, gt, gk, gb in zip("qkv", g_truth, g_got, g_base, strict=True):
        e_k, e_b, mag = max_abs(gk, gt), max_abs(gb, gt), max_mag(gt)
        gtol = max(3 * e_b, 2e-2 * mag)
        bf16[f"grad_{name}_max_abs_err"], bf16[f"grad_{name}_ref_bf16_max_abs_err"] = e_k, e_b
        bf16[f"grad_{name}_max_abs_ref"], bf16[f"grad_{name}_tol"] = mag, gtol
        grads_ok &= bool(e_k <= gtol and np.isfinite(np.asarray(gk, np.float32)).all())
    bf16["grads_ok"] = grads_ok
    out["bfloat16"] = bf16
    # Times (forward; forward + backward) at this shape, bf16.
    try:
        for name in ("kernel", "reference"):
            c, s = timed(fwd[name], qb, kb, vb, segments, iters=5)
            cg, sg = timed(grad[name], qb, kb, vb, iters=5)
            out[f"time_{name}"] = {"fwd_s": s, "fwd_first_s": c, "fwd_bwd_s": sg, "fwd_bwd_first_s": cg}
    except Exception as e:  # noqa: BLE001
        out["time_error"] = err_text(e)
    # float32: cuDNN has no float32 flash kernel (expected: NotImplementedError); XLA's path runs on CPU.
    try:
        got32 = fwd["kernel"](q, k, v, segments)
        e32 = max_abs(got32, truth32, real)
        out["float32"] = {"supported": True, "fwd_max_abs_err": e32, "fwd_ok": bool(e32 <= 1e-3)}
    except Exception as e:  # noqa: BLE001
        out["float32"] = {"supported": False, "error": f"{type(e).__name__}: {e}"[:600]}
    out["status"] = "ok" if bf16["fwd_ok"] and bf16["fwd_no_segments_ok"] and grads_ok else "fail"
    return out


def _paged_case(seed, b, hq, hkv, d, page, pps):
    rng = np.random.default_rng(seed)
    num_pages = b * pps + 1  # page 0 is nobody's
    lengths = rng.integers(1, page * pps + 1, size=b).astype(np.int32)
    lengths[0], lengths[-1] = page * pps, 1  # a full table and a single token
    table = rng.permutation(np.arange(1, num_pages))[: b * pps].reshape(b, pps).astype(np.int32)
    k_pages = rng.normal(size=(hkv, num_pages, page, d)).astype(np.float32)
    v_pages = rng.normal(size=(hkv, num_pages, page, d)).astype(np.float32)
    q = (rng.normal(size=(b, hq, d)) * d ** -0.5).astype(np.float32)  # already scaled, as the kernels expect
    return q, k_pages, v_pages, lengths, table


def section_paged_attention(args, state: dict) -> dict:
    b, hq, hkv, d = args.paged_batch, args.paged_heads, args.paged_kv_heads, args.paged_head_dim
    page, pps = args.paged_page_size, args.paged_pages_per_seq
    q, kp, vp, lengths, table = map(jnp.asarray, _paged_case(0, b, hq, hkv, d, page, pps))
    interpret = not on_gpu()
    out: dict = {"shape": dict(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=page, pages_per_seq=pps,
                               num_pages=int(kp.shape[1])), "interpret": interpret}
    ref = jax.jit(paged_attention_reference)
    pallas = jax.jit(lambda *a: paged_attention(*a, impl="pallas_gpu", interpret=interpret))
    ok_all = True
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        res: dict = {}
        qd, kd, vd = (x.astype(dtype) for x in (q, kp, vp))
        with precision("highest"):
            want = ref(*(x.astype(jnp.float32) for x in (qd, kd, vd)), lengths, table)
        base = max_abs(ref(qd, kd, vd, lengths, table), want)
        try:
            got = pallas(qd, kd, vd, lengths, table)
            e = max_abs(got, want)
            tol = 5e-3 if dtype == jnp.float32 else max(3 * base, 2e-2 * max_mag(want))
            res.update(max_abs_err=e, ref_same_dtype_max_abs_err=base, max_abs_ref=max_mag(want), tol=tol,
                       ok=bool(e <= tol))
            ok_all &= res["ok"]
            try:
                iters = 3 if interpret else 20
                c_ref, s_ref = timed(ref, qd, kd, vd, lengths, table, iters=iters)
                c_pal, s_pal = timed(pallas, qd, kd, vd, lengths, table, iters=iters)
                res.update(reference_s=s_ref, pallas_s=s_pal, reference_first_s=c_ref, pallas_first_s=c_pal)
            except Exception as e:  # noqa: BLE001
                res["time_error"] = err_text(e)
        except Exception as e:  # noqa: BLE001  (e.g. the kernel does not lower on this jax / GPU)
            res.update(err_text(e), ok=False)
            ok_all = False
        out[name] = res
    state["pallas_ok"] = ok_all
    out["status"] = "ok" if ok_all else "fail"
    return out


def _tiny_model(compute_dtype: str):
    if (POLICY / "config.json").exists():
        return load_pretrained(POLICY, compute_dtype=compute_dtype), str(POLICY.relative_to(ROOT))
    return init_model(model_config("tiny", dtype=compute_dtype), seed=0), "random tiny preset"


def _greedy_case(args, compute_dtype: str, prefill: str, paged: str, matmul_precision: str | None,
                 tol: float) -> dict:
    use_kernels(prefill, paged)
    model, source = _tiny_model(compute_dtype)
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    reqs = [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(6, 21)).astype(np.int32),
                       seed=1000 + i, max_new_tokens=int(rng.integers(24, 41))) for i in range(args.engine_requests)]
    cfg = EngineConfig(num_slots=args.engine_slots, page_size=8, max_seq_len=64, steps_per_dispatch=4)
    res: dict = {"model": source, "compute_dtype": compute_dtype, "prefill_impl": prefill, "paged_impl": paged,
                 "matmul_precision": matmul_precision or "default", "tol": tol}
    with precision(matmul_precision):
        engine = Engine(model, cfg, SamplingConfig(greedy=True), eos_ids=(), **kernel_kwargs())
        res["prefill_kernel"] = engine.static.kernel()["impl"]
        t0 = time.perf_counter()
        trajs = run_engine(engine, reqs)
        res["engine_s"] = time.perf_counter() - t0
        width = max(len(t.prompt) + t.num_tokens for t in trajs)
        x = np.zeros((len(trajs), width), np.int32)
        for i, t in enumerate(trajs):
            x[i, : len(t.prompt) + t.num_tokens] = np.concatenate([t.prompt, t.tokens])
        graphdef, params = nnx.split(model)
        # Teacher forcing with the model's own forward (reference attention); causal: right padding is unseen.
        logits = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x), np.float32)
    regrets, exact, total = [], 0, 0
    for i, t in enumerate(trajs):
        p = len(t.prompt)
        rows = logits[i, p - 1: p - 1 + t.num_tokens]
        chosen = rows[np.arange(t.num_tokens), t.tokens]
        regrets.append(rows.max(axis=-1) - chosen)
        exact += int((rows.argmax(axis=-1) == np.asarray(t.tokens)).sum())
        total += t.num_tokens
    regret = np.concatenate(regrets)
    res.update(tokens=total, argmax_equal=exact, argmax_equal_frac=exact / total, max_regret=float(regret.max()),
               tokens_over_tol=int((regret > tol).sum()), ok=bool(regret.max() <= tol))
    return res


def section_engine_greedy(args, state: dict) -> dict:
    cases = [
        # name, compute dtype, prefill impl, paged impl, matmul precision, tolerance on the regret
        ("float32_auto", "float32", "auto", "auto", "highest", 1e-3),  # on GPU: cuDNN has no float32 kernel
        ("float32_reference_prefill", "float32", "reference", "auto", "highest", 1e-3),
        ("bfloat16_auto", "bfloat16", "auto", "auto", None, 0.15),
        ("float32_pallas_decode", "float32", "reference", "pallas_gpu", "highest", 1e-2),
        ("bfloat16_pallas_decode", "bfloat16", "auto", "pallas_gpu", None, 0.15),
    ]
    out: dict = {"cases": {}}
    ok = True
    for name, dtype, prefill, paged, matmul_precision, tol in cases:
        print(f"   engine case {name}", flush=True)
        try:
            res = _greedy_case(args, dtype, prefill, paged, matmul_precision, tol)
        except Exception as e:  # noqa: BLE001
            res = {"ok": False, **err_text(e)}
        out["cases"][name] = res
        ok &= res["ok"]
        print(f"     -> {_case_line(res)}", flush=True)
    reset_kernels()
    out["status"] = "ok" if ok else "fail"
    return out


def _case_line(res: dict) -> str:
    if "error" in res:
        return "ERROR " + res["error"].splitlines()[0][:160]
    return (f"{'ok' if res['ok'] else 'FAIL'}: {res['argmax_equal']}/{res['tokens']} tokens = argmax, max regret "
            f"{res['max_regret']:.3g} (tol {res['tol']:g}), prefill {res['prefill_kernel']}")


def section_ops_floor(args, state: dict) -> dict:
    """bench_ops_floor.measure per dtype and kernel pair (see the module docstring)."""
    import bench_ops_floor  # noqa: PLC0415  (a sibling: tests/gpu/ is on sys.path when this file runs)

    name = "policy" if (POLICY / "config.json").exists() else "random"
    cases = [  # name, (param, compute, KV) dtypes, prefill impl, paged impl
        ("float32", bench_ops_floor.DTYPES["float32"], "auto", "auto"),
        ("bfloat16", bench_ops_floor.DTYPES["bfloat16"], "auto", "auto"),
    ]
    if state.get("pallas_ok"):
        cases.append(("bfloat16_pallas_decode", bench_ops_floor.DTYPES["bfloat16"], "auto", "pallas_gpu"))
    out: dict = {"model": name, "slots": args.floor_slots, "new_tokens": args.floor_new, "ds": bench_ops_floor.DS,
                 "cases": {}}
    ok = True
    for case, (param, compute, kv), prefill, paged in cases:
        if over_budget(args):
            out["cases"][case] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            continue
        use_kernels(prefill, paged)
        try:
            res = bench_ops_floor.measure(bench_ops_floor.load_model(name, param, compute), kv, args.floor_slots,
                                          args.floor_new, (None, 64))
            res = {"dtypes": [param, compute, kv], "prefill_impl": res["prefill_impl"], "paged_impl": paged,
                   "chunk_unset": res[None], "chunk_64": res[64]}
            if case == "float32":
                ok &= max(res["chunk_unset"]["segment_mean"], res["chunk_64"]["segment_mean"]) < out["ds"] / 10
        except Exception as e:  # noqa: BLE001
            res = err_text(e)
            ok = False
        out["cases"][case] = res
        print(f"     {case}: {_floor_line(res)}", flush=True)
    reset_kernels()
    out["status"] = "ok" if ok else "fail"
    return out


def _floor_line(res: dict) -> str:
    if "error" in res or "skipped" in res:
        return res.get("skipped") or "ERROR " + res["error"].splitlines()[0][:160]
    return "; ".join(f"{k}: token OPS mean {r['token_mean']:.2e} max {r['token_max']:.2e}, segment OPS mean "
                     f"{r['segment_mean']:.2e} max {r['segment_max']:.2e}, {r['segments_cut']}/{r['segments']} >= ds"
                     for k, r in (("unset", res["chunk_unset"]), ("chunk 64", res["chunk_64"]))) + (
        f" (prefill {res['prefill_impl']}, decode {res['paged_impl']})")


# ------------------------------------------------------------------------------------------------------------
# Driver


_WRITE = threading.Lock()


def write_report(report: dict, path: str) -> None:
    with _WRITE:
        report["elapsed_s"] = round(elapsed(), 2)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(path)


def start_watchdog(report: dict, args) -> None:
    """At ``--hard-limit-s`` (a compile or kernel that hangs), the report as it stands is written with the
    section in progress named, and the process exits with status 3: the run always ends inside its limit."""
    def fire():
        report["watchdog"] = (f"hard limit of {args.hard_limit_s:.0f} s reached during section "
                              f"{report.get('running')!r}; exited")
        write_report(report, args.out)
        print("ERROR: " + report["watchdog"], file=sys.stderr, flush=True)
        os._exit(3)
    timer = threading.Timer(max(1.0, args.hard_limit_s - elapsed()), fire)
    timer.daemon = True
    timer.start()


def run_section(report: dict, name: str, fn, args, *extra) -> None:
    print(f"== {name} (at {elapsed():.0f} s)", flush=True)
    report["running"] = name
    t0 = time.perf_counter()
    try:
        res = fn(args, *extra) or {}
        res.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001
        res = {"status": "error", **err_text(e)}
        print("   ERROR " + res["error"].splitlines()[0][:300], flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    report["sections"][name] = res
    write_report(report, args.out)
    print(f"   {name}: {res['status']} ({res['seconds']:.1f} s)", flush=True)


def summary(report: dict) -> str:
    s = report["sections"]
    lines = ["", "==== summary ===="]
    env = s.get("env", {})
    lines.append(f"jax {env.get('jax')} / jaxlib {env.get('jaxlib')}, backend {env.get('backend')}, "
                 f"devices {env.get('devices')}, cudnn {env.get('cudnn')}")
    for name, res in s.items():
        if name == "env":
            continue
        lines.append(f"{name}: {res.get('status')} ({res.get('seconds', 0):.1f} s)"
                     + (f"  ERROR {res['error'].splitlines()[0][:200]}" if "error" in res else ""))
        if name == "prefill_attention" and "bfloat16" in res:
            b = res["bfloat16"]
            lines.append(f"  bf16 fwd err {b['fwd_max_abs_err']:.3g} (bf16 ref {b['fwd_ref_bf16_max_abs_err']:.3g}, "
                         f"tol {b['fwd_tol']:.3g}); no-segments {b['fwd_no_segments_max_abs_err']:.3g}; grads "
                         + ", ".join(f"d{x} {b[f'grad_{x}_max_abs_err']:.3g}/{b[f'grad_{x}_tol']:.3g}" for x in "qkv"))
            f32 = res.get("float32", {})
            lines.append("  float32: " + (f"err {f32.get('fwd_max_abs_err'):.3g}" if f32.get("supported")
                                          else f"unsupported: {str(f32.get('error'))[:160]}"))
            for impl in ("kernel", "reference"):
                if f"time_{impl}" in res:
                    t = res[f"time_{impl}"]
                    lines.append(f"  {impl}: fwd {t['fwd_s'] * 1e3:.2f} ms, fwd+bwd {t['fwd_bwd_s'] * 1e3:.2f} ms")
        if name == "paged_attention":
            for dt in ("float32", "bfloat16"):
                r = res.get(dt, {})
                if "error" in r:
                    lines.append(f"  {dt}: ERROR {r['error'].splitlines()[0][:200]}")
                elif r:
                    t = (f", reference {r['reference_s'] * 1e3:.3f} ms vs pallas {r['pallas_s'] * 1e3:.3f} ms"
                         if "pallas_s" in r else "")
                    lines.append(f"  {dt}: err {r['max_abs_err']:.3g} (tol {r['tol']:.3g}) "
                                 f"{'ok' if r['ok'] else 'FAIL'}{t}")
        if name == "engine_greedy":
            for case, r in res.get("cases", {}).items():
                lines.append(f"  {case}: {_case_line(r)}")
        if name == "ops_floor":
            for case, r in res.get("cases", {}).items():
                lines.append(f"  {case}: {_floor_line(r)}")
        if name == "long_context":
            lines += gpu_speed.long_context_lines(res)
        if name == "decode_throughput":
            for r in res.get("runs", []):
                lines.append(f"  {gpu_speed.decode_run_line(r)}")
        if name == "decode_fixed_cost":
            lines += gpu_speed.fixed_cost_lines(res)
        if name == "train_step":
            for r in res.get("runs", []):
                lines.append(f"  {gpu_speed.train_line(r)}")
        if name == "compile_config":
            for r in res.get("by_layers", []):
                lines.append(f"  {gpu_speed.compile_line(r)}")
    lines.append(f"total {report.get('elapsed_s', elapsed()):.1f} s; report: {report.get('out')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {"args": vars(args), "out": args.out, "sections": {}}
    start_watchdog(report, args)
    run_section(report, "env", lambda a: section_env(a), args)
    if not on_gpu() and not args.allow_cpu:
        report["error"] = f"no GPU: JAX backend is {jax.default_backend()!r} ({jax.devices()}); --allow-cpu to test"
        write_report(report, args.out)
        print("ERROR: " + report["error"], file=sys.stderr)
        return 2
    state: dict = {}
    fns = {"paged_attention": section_paged_attention, "long_context": gpu_speed.section_long_context,
           "decode_throughput": gpu_speed.section_decode_throughput,
           "decode_fixed_cost": gpu_speed.section_decode_fixed_cost, "train_step": gpu_speed.section_train_step,
           "compile_config": gpu_speed.section_compile_config, "engine_greedy": section_engine_greedy,
           "ops_floor": section_ops_floor, "prefill_attention": lambda a, _: section_prefill_attention(a)}
    for name in SECTIONS:
        if args.sections and name not in args.sections:
            continue
        if over_budget(args):
            report["sections"][name] = {"status": "skipped", "skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            write_report(report, args.out)
            continue
        run_section(report, name, fns[name], args, state)
    report.pop("running", None)
    write_report(report, args.out)
    print(summary(report), flush=True)
    failed = [n for n, r in report["sections"].items() if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
