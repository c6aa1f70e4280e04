"""The simulator at real scale beside the paper's Table 7: predicted device-days of on-policy, naive partial and
RollVerify for Qwen3-8B at 8K, ~20K (the main setting) and 64K contexts (and Qwen3-30B-A3B at ~20K), and a PNG
of the speed-up against context.

    python scripts/sim_scale.py --json docs/results/simulator_scale.json --plot docs/results/simulator_speedup.png

Each setting is the real config plus its cost file (configs/sim/*.gin: the compiled programs' cost analysis and
the stated assumptions); the 8K row is the ~20K config with ``RolloutConfig.max_new_tokens = 8192`` (no 8K
config was compiled: its per-token costs are the ~20K programs'). ``--sigmas`` reruns on-policy and RollVerify
with other length spreads; ``VARIANTS`` reruns RollVerify without the assumed acceptance schedule (no cuts, a
constant 0.95) or without re-verifying finished members, to show which assumption its saving depends on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gin

from rollverify_jax import simulate as sim

# (label, context tokens of the response cap, gin files, bindings)
SETTINGS = [
    ("Qwen3-8B 8K", 8192, ["configs/qwen3_8b_dapo.gin", "configs/sim/qwen3_8b_v5p.gin"],
     ["RolloutConfig.max_new_tokens = 8192", "EngineConfig.max_seq_len = 10240",
      "RewardScorer.max_response_length = 8192", "LossConfig.max_response_length = 8192"]),
    ("Qwen3-8B ~20K (main)", 20480, ["configs/qwen3_8b_dapo.gin", "configs/sim/qwen3_8b_v5p.gin"], []),
    ("Qwen3-8B 64K", 61440, ["configs/qwen3_8b_64k_dapo.gin", "configs/sim/qwen3_8b_64k_v5p.gin"], []),
    ("Qwen3-30B-A3B ~20K", 20480, ["configs/qwen3_30b_a3b_dapo.gin", "configs/sim/qwen3_30b_a3b_v5p.gin"], []),
]
# (label, bindings) of the RollVerify reruns at the Qwen3-8B contexts
VARIANTS = [
    ("acceptance 1.0 (no cuts, no switch)", ["SimConfig.acceptance_start = 1.0", "SimConfig.acceptance_slope = 0.0"]),
    ("acceptance 0.95 (no switch)", ["SimConfig.acceptance_start = 0.95", "SimConfig.acceptance_slope = 0.0"]),
    ("finished members not re-verified", ["VerifyConfig.verify_finished = False"]),
]
PAPER = {  # Table 7 and the main result (GPU days): on-policy, RollVerify
    8192: (16.6, 15.1), 20480: (98.1, 57.5), 61440: (261.0, 137.0)}


def predict(files: list[str], params: list[str], modes, steps: int | None) -> list[dict]:
    from rollverify_jax.setup import parse_gin

    gin.clear_config()
    parse_gin(files, params)
    cfg, shape = sim.SimConfig(), sim.read_run_shape()
    inputs = sim.build_inputs(cfg, shape, [])
    n = steps or cfg.num_steps or shape.num_steps
    return [sim.run_mode(m, shape, inputs, n).summary(inputs.num_devices) for m in modes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="default: each config's TrainConfig.num_steps")
    ap.add_argument("--sigmas", type=float, nargs="*", default=[0.75, 1.25])
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    out = {"settings": [], "sensitivity": [], "variants": []}
    for label, ctx, files, params in SETTINGS:
        rows = predict(files, params, sim.MODES, args.steps)
        by = {r["mode"]: r for r in rows}
        speed = by["on_policy"]["device_days"] / by["rollverify"]["device_days"]
        out["settings"].append({"label": label, "context": ctx, "files": files, "params": params, "modes": rows,
                                "speedup_rollverify": speed,
                                "speedup_partial": by["on_policy"]["device_days"] / by["partial"]["device_days"],
                                "paper": PAPER.get(ctx) if "8B" in label else None})
        print(f"{label}: on-policy {by['on_policy']['device_days']:.1f}, partial {by['partial']['device_days']:.1f}, "
              f"RollVerify {by['rollverify']['device_days']:.1f} device-days ({speed:.2f}x; switch step "
              f"{by['rollverify']['switch_step']}; on-policy rollout share {by['on_policy']['rollout_fraction']:.2f})",
              flush=True)
        if "8B" in label:
            for sigma in args.sigmas:
                r2 = predict(files, [*params, f"SimConfig.length_sigma = {sigma}"], ("on_policy", "rollverify"),
                             args.steps)
                out["sensitivity"].append({"label": label, "context": ctx, "sigma": sigma,
                                           "speedup_rollverify": r2[0]["device_days"] / r2[1]["device_days"],
                                           "on_policy_days": r2[0]["device_days"],
                                           "rollverify_days": r2[1]["device_days"]})
                print(f"  sigma {sigma}: {r2[0]['device_days']:.1f} -> {r2[1]['device_days']:.1f} "
                      f"({r2[0]['device_days'] / r2[1]['device_days']:.2f}x)", flush=True)
            out["variants"] += variants(label, ctx, files, params, by["on_policy"]["device_days"], args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(out, args.plot)


def variants(label: str, ctx: int, files: list[str], params: list[str], on_policy_days: float,
             steps: int | None) -> list[dict]:
    """RollVerify under each of ``VARIANTS`` against the setting's on-policy run (which they do not change)."""
    rows = []
    for name, bindings in VARIANTS:
        (r,) = predict(files, [*params, *bindings], ("rollverify",), steps)
        rows.append({"label": label, "context": ctx, "variant": name, "rollverify_days": r["device_days"],
                     "speedup_rollverify": on_policy_days / r["device_days"], "regen_tokens": r["regen_tokens"],
                     "tokens_generated": r["tokens_generated"], "acceptance": r["acceptance"],
                     "switch_step": r["switch_step"], "prefill_s": r["prefill_s"], "verify_s": r["verify_s"]})
        print(f"  RollVerify, {name}: {r['device_days']:.1f} ({on_policy_days / r['device_days']:.2f}x)", flush=True)
    return rows


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [s for s in out["settings"] if "8B" in s["label"]]
    ctx = [s["context"] / 1024 for s in dense]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ctx, [s["speedup_rollverify"] for s in dense], "o-", label="simulated RollVerify (sigma 1.0)")
    ax.plot(ctx, [s["speedup_partial"] for s in dense], "s:", label="simulated naive partial (sigma 1.0)")
    for sigma in sorted({r["sigma"] for r in out["sensitivity"]}):
        pts = [r for r in out["sensitivity"] if r["sigma"] == sigma]
        ax.plot([r["context"] / 1024 for r in pts], [r["speedup_rollverify"] for r in pts], "--", alpha=0.6,
                label=f"simulated RollVerify (sigma {sigma})")
    for name, _ in VARIANTS:
        pts = [r for r in out["variants"] if r["variant"] == name]
        ax.plot([r["context"] / 1024 for r in pts], [r["speedup_rollverify"] for r in pts], "x-.", alpha=0.8,
                label=f"simulated RollVerify, {name}")
    ax.plot([c / 1024 for c in PAPER], [a / b for a, b in PAPER.values()], "k^-", label="paper, Table 7 (GPU days)")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [f"{c:.0f}K" for c in ctx])
    ax.set_xlabel("response cap (tokens)")
    ax.set_ylabel("speed-up vs on-policy (device-days ratio)")
    ax.set_title("Qwen3-8B, 700 steps: predicted vs reported")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
