"""What the coupled verification rule (``VerifyConfig.rule = 'coupled'``) would cost at real scale, against the
two-stage rule and on-policy: the simulator's real-scale Qwen3-8B settings (8K, ~20K, 64K: ``sim_scale.SETTINGS``,
their shipped defaults, the 'keep' end of the cut-length bracket) replayed with the two-stage cut model
(``SimConfig.rule = 'two_stage'``, the paper-shaped acceptance of configs/sim/scale_common.gin) and the coupled one
(``SimConfig.rule = 'coupled'``) over a sweep of the per-token mismatch ``q`` at age 1 (older tokens:
``(1 - q) ** age``), plus a ``q`` fitted on each coupled run (``--runs``: ``calibrate.fit_coupled_mismatch``, the
tokens' ages from a replay of the run's own shape) or given (``--fitted_q``).

    python -m rollverify_jax.studies.coupled_cost --json docs/results/coupled_cost_model.json \\
        [--runs RUN_DIR ...] [--fitted_q Q ...] [--q 1e-5 1e-4 ...] [--steps N] [--jobs 2]

Both rules take the same late ramp of the hazard (from step ``SimConfig.fail_ramp_start``, each segment's, under
'coupled' each token's, log-survival doubling every ``fail_ramp_doubling`` steps) and the same switching rule;
the kept fraction is reported over the whole run and over the steps before the ramp (the steady state), and
``crossing`` is the ``q`` (log-interpolated on the sweep) at which the coupled rule keeps as many cached tokens
as the two-stage rule before the ramp.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
from pathlib import Path

from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim import predict as sim_predict
from rollverify_jax.sim.shape import sim_config
from rollverify_jax.studies import sim_scale

Q_SWEEP = (1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2)
LABELS = {8192: "8K", 20480: "~20K", 61440: "64K"}
SETTINGS = [s for s in sim_scale.SETTINGS if s[0] == "Qwen3-8B"]  # 8K, ~20K, 64K


def replay(files: list[str], params: list[str], mode: str, steps: int | None) -> dict:
    """One mode's summary (device-days, acceptance, switch) plus its kept fraction before the ramp."""
    shape, inputs, _, n = sim_scale._setup(files, params, steps)
    res = sim_predict.run_mode(mode, shape, inputs, n)
    ramp = inputs.cut_kwargs["ramp_start"] or n + 1
    pre = [s for s in res.steps if s.step < ramp and not s.on_policy]
    out = res.summary(inputs.num_devices)
    vt = sum(s.verified_tokens for s in pre)
    out["kept_before_ramp"] = sum(s.kept_tokens for s in pre) / vt if vt else float("nan")
    out["ramp_start"] = inputs.cut_kwargs["ramp_start"]
    out["cut_rule"] = inputs.cut_kwargs["rule"]
    out["mismatch"] = list(inputs.cut_kwargs["mismatch"])
    return out


def fit_from_runs(paths: list[str]) -> tuple[float, dict]:
    """``q1`` fitted on coupled runs (their spec's shape replayed for the tokens' ages)."""
    from rollverify_jax import simulate as sim

    runs = [cal.read_run(p) for p in paths]
    coupled = [r for r in runs if cal.verify_rule(r) == "coupled" and r.mode == "rollverify"]
    if not coupled:
        raise ValueError("--runs holds no coupled RollVerify run (VerifyConfig.rule = 'coupled').")
    spec = coupled[0].spec
    shape, cfg = sim.shape_of(spec), sim_config(spec)
    inputs = sim_predict.build_inputs(cfg, shape, [])
    (q,), fit = sim_predict._fit_mismatch(shape, inputs, coupled, cfg)
    return q, {**fit, "runs": [str(r.path) for r in coupled]}


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """The ``q`` at which the kept fraction (falling with q) crosses ``target``, log-linear between the sweep's
    bracketing points (None outside the sweep)."""
    pts = sorted((q, k) for q, k in points if q > 0 and not math.isnan(k))
    for (q0, k0), (q1, k1) in zip(pts, pts[1:], strict=False):
        if (k0 - target) * (k1 - target) <= 0 and k0 != k1:
            t = (k0 - target) / (k0 - k1)
            return math.exp(math.log(q0) + t * (math.log(q1) - math.log(q0)))
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the table here")
    ap.add_argument("--runs", nargs="+", default=[],
                    help="coupled runs, each fitting a q of its own (calibrate.fit_coupled_mismatch) for the sweep")
    ap.add_argument("--fitted_q", type=float, nargs="+", default=[], help="fitted q values to add to the sweep")
    ap.add_argument("--q", type=float, nargs="*", default=list(Q_SWEEP),
                    help="per-token mismatch values at age 1 (none: only the fitted one)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the config's)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    fitted = {q: "--fitted_q" for q in args.fitted_q}
    fits = {}
    for path in args.runs:
        q, fits[path] = fit_from_runs([path])
        fitted[q] = path
    qs = sorted(set(args.q) | set(fitted))
    jobs = []
    for model, ctx, files, params in SETTINGS:
        jobs.append((model, ctx, "on_policy", None, files, params, "on_policy"))
        jobs.append((model, ctx, "two_stage", None, files, params, "rollverify"))
        for q in qs:
            jobs.append((model, ctx, "coupled", q, files,
                         [*params, "SimConfig.rule = 'coupled'", f"SimConfig.coupled_mismatch_per_token = ({q!r},)"],
                         "rollverify"))
    ctx_mp = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx_mp) as pool:
        futures = [pool.submit(replay, j[4], j[5], j[6], args.steps) for j in jobs]
        rows = [{"model": j[0], "context": j[1], "rule": j[2], "q": j[3], **f.result()}
                for j, f in zip(jobs, futures, strict=True)]
    report = {"fitted_q": fitted, "fits": fits, "q_sweep": qs, "rows": rows, "crossing": {}}
    for _, ctx, _, _ in SETTINGS:
        two = next(r for r in rows if r["context"] == ctx and r["rule"] == "two_stage")
        pts = [(r["q"], r["kept_before_ramp"]) for r in rows if r["context"] == ctx and r["rule"] == "coupled"]
        report["crossing"][ctx] = crossing(pts, two["kept_before_ramp"])
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")


def format_table(report: dict) -> str:
    out = ["| context | rule | q (age 1) | device-days | vs on-policy | vs two-stage | kept, before ramp | "
           "kept, whole run | switch step |", "| --- " * 9 + "|"]
    for _, ctx, _, _ in SETTINGS:
        rows = [r for r in report["rows"] if r["context"] == ctx]
        base = next(r for r in rows if r["rule"] == "on_policy")
        two = next(r for r in rows if r["rule"] == "two_stage")
        for r in rows:
            q = "-" if r["q"] is None else f"{r['q']:.3g}" + (" (fitted)" if r["q"] in report["fitted_q"] else "")
            kept = "-" if r["rule"] == "on_policy" else f"{r['kept_before_ramp']:.3f}"
            acc = "-" if math.isnan(r["acceptance"]) else f"{r['acceptance']:.3f}"
            sw = r["switch_step"] if r["switch_step"] >= 0 else "-"
            out.append(f"| {LABELS[ctx]} | {r['rule']} | {q} | {r['device_days']:.2f} | "
                       f"{base['wall_s'] / r['wall_s']:.2f}x | {two['wall_s'] / r['wall_s']:.2f}x | {kept} | {acc} | "
                       f"{sw} |")
    cross = ", ".join(f"{LABELS[ctx]}: " + ("outside the sweep" if q is None else f"q = {q:.2g}")
                      for ctx, q in report["crossing"].items())
    return "\n".join(out) + f"\n\nCoupled keeps as much as two-stage (before the ramp) at: {cross}"


if __name__ == "__main__":
    main()
