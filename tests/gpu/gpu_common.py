"""Helpers shared by tests/gpu/check_gpu.py and the speed sections it runs (gpu_speed.py)."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import jax
import numpy as np

from rollverify_jax.models.flash_attention import FlashConfig
from rollverify_jax.rollout import Engine, Scheduler, Trajectory

T0 = time.perf_counter()

# Public datasheet figures per GPU kind: HBM bandwidth (bytes/s), bf16 dense peak (FLOP/s), HBM (bytes). KINDS.md
# of this workplace measured about 4.3 TB/s of copy bandwidth and 770-800 TFLOP/s of bf16 matmul on an H200.
CHIPS = {
    "NVIDIA H200": (4.8e12, 989e12, 141e9),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12, 80e9),
}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def elapsed() -> float:
    return time.perf_counter() - T0


def chip() -> dict:
    """This device's public peaks; an H200's, labelled assumed, where its kind has none here (the CPU test)."""
    kind = jax.devices()[0].device_kind
    bw, peak, hbm = CHIPS.get(kind, CHIPS["NVIDIA H200"])
    return {"device_kind": kind, "hbm_bandwidth": bw, "peak_flops": peak, "hbm_bytes": hbm,
            "figures": "datasheet" if kind in CHIPS else f"assumed: an H200's ({kind!r} has none here)"}


def err_text(e: BaseException, lines: int = 25) -> dict:
    tb = traceback.format_exc().rstrip().splitlines()
    return {"error": f"{type(e).__name__}: {e}"[:3000], "traceback": "\n".join(tb[-lines:])}


def max_abs(a, b, where=None) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if where is not None:
        a, b = a[where], b[where]
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def max_mag(a, where=None) -> float:
    a = np.asarray(a, np.float32)
    if where is not None:
        a = a[where]
    return float(np.max(np.abs(a))) if a.size else 0.0


def timed(fn, *a, iters: int = 10) -> tuple[float, float]:
    """(first-call seconds incl. compile, median seconds of ``iters`` further calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*a))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


_KERNELS: dict = {"flash": FlashConfig(), "attention": {"impl": "auto"}}


def use_kernels(prefill: str = "auto", paged: str = "auto") -> None:
    """The prefill (``FlashConfig.impl``) and paged-decode (``paged_attention.impl``) implementations of the
    engines built next with ``kernel_kwargs()``; both are part of the engine's jit key. Off a GPU the Pallas GPU
    kernel runs in interpret mode."""
    _KERNELS["flash"] = FlashConfig(impl=prefill)
    _KERNELS["attention"] = {"impl": paged, "interpret": paged == "pallas_gpu" and not on_gpu()}


def kernel_kwargs() -> dict:
    """``Engine(..., **kernel_kwargs())``: the kernels ``use_kernels`` chose."""
    return {"flash": _KERNELS["flash"], "attention": dict(_KERNELS["attention"])}


def reset_kernels() -> None:
    use_kernels("auto", "auto")


def precision(name: str | None):
    """``jax.default_matmul_precision(name)`` as a context (none when ``name`` is None or JAX lacks it)."""
    fn = getattr(jax, "default_matmul_precision", None)
    return fn(name) if name and fn is not None else contextlib.nullcontext()


def over_budget(args) -> bool:
    return elapsed() > args.budget_s


def skipped(args) -> dict:
    return {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}


def run_engine(engine: Engine, reqs: list[Trajectory], stats: list | None = None) -> list[Trajectory]:
    """Every request through a fresh scheduler to its end; its RolloutStats appended to ``stats``."""
    sched = Scheduler(engine)
    sched.submit(reqs)
    sched.run()
    done = sorted(sched.take_finished(), key=lambda t: t.uid)
    if len(done) != len(reqs):
        raise RuntimeError(f"{len(done)} of {len(reqs)} requests finished")
    if stats is not None:
        stats.append(sched.stats)
    return done


def bench_requests(n: int, new: int, seed: int, vocab: int, prompt: tuple[int, int] = (24, 33)) -> list[Trajectory]:
    """n random prompts of ``prompt`` tokens (half-open range), each forced to ``new`` tokens (EOS off)."""
    rng = np.random.default_rng(seed)
    hi = min(vocab, 30_000)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, hi, size=rng.integers(*prompt)).astype(np.int32),
                       seed=seed * 100_000 + i, max_new_tokens=new) for i in range(n)]
