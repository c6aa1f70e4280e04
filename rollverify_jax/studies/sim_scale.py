"""The simulator at real scale beside the paper's Table 7: predicted device-days of on-policy, naive partial and
RollVerify for Qwen3-8B at 8K, ~20K (the main setting) and 64K contexts (and Qwen3-30B-A3B at ~20K), the
fully-asynchronous modes on the same devices beside verl's and AReaL's published speed-ups, and a PNG of the
speed-up against context.

    python -m rollverify_jax.studies.sim_scale --json docs/results/simulator_scale.json \
        --plot docs/results/simulator_speedup.png \
        [--tables] [--jobs 2]

Every setting's shipped defaults (``default`` rows) are the unfavourable end of the cut-length bracket
(``SimConfig.cut_length = 'keep'``: a cut trajectory keeps its drawn length); ``redraw`` rows are the other end (a
fresh length given the kept prefix). The async rows (``ASYNC_MODES``: ``sim/async_replay.py``) split the same
chips into a rollout and a train group: the split is searched (``predict.best_split``, async RollVerify over the
first ``--search_steps`` steps, every whole slot shard) and all three async modes run at it for the full run.

Each setting is the real config plus its cost file (configs/sim/*.gin: the compiled programs' aot reports, a
decode step priced as their decode estimate prices it, and the stated assumptions; the train step's packed rows
follow the real config's own LearnerConfig); the 8K row is
the ~20K config with ``RolloutConfig.max_new_tokens = 8192`` (no 8K config was compiled: its per-token costs are
the ~20K programs'). RollVerify runs under two acceptances:
``default`` (the shipped defaults and the paper-shaped acceptance of configs/sim/scale_common.gin) and
``tiny_acceptance`` (the per-segment failure probability fitted on ``--fit_runs``, by default every finished
RollVerify run under ``--runs`` that logs the segment statistics, else on the segment counts the published
``docs/results/simulator_scale.json`` recorded (``--fit_json``: the published table is reproduced without its
runs), else 0.1 at every age (also with an empty ``--fit_runs``): a one-segment trajectory then passes with 0.9,
the tiny runs' measured cycle acceptance; no ramp). On-policy and naive partial do not
verify, so they are run once per setting. ``DIAGNOSTICS`` and ``--sigmas`` rerun RollVerify (and on-policy for
the sigmas) at the Qwen3-8B contexts to show what its saving depends on, and every row carries its cost terms
in device-days.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
from pathlib import Path

from rollverify_jax import simulate as sim
from rollverify_jax.schedule_rules import MODES
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim import predict as sim_predict
from rollverify_jax.sim.shape import sim_config, sim_costs

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "results" / "simulator_scale.json"

# (model, context tokens of the response cap, gin files, bindings)
SETTINGS = [
    ("Qwen3-8B", 8192, ["configs/qwen3_8b_dapo.gin", "configs/sim/qwen3_8b_v5p.gin"],
     ["RolloutConfig.max_new_tokens = 8192", "EngineConfig.max_seq_len = 10240",
      "RewardScorer.max_response_length = 8192", "LossConfig.max_response_length = 8192"]),
    ("Qwen3-8B", 20480, ["configs/qwen3_8b_dapo.gin", "configs/sim/qwen3_8b_v5p.gin"], []),
    ("Qwen3-8B", 61440, ["configs/qwen3_8b_64k_dapo.gin", "configs/sim/qwen3_8b_64k_v5p.gin"], []),
    ("Qwen3-30B-A3B", 20480, ["configs/qwen3_30b_a3b_dapo.gin", "configs/sim/qwen3_30b_a3b_v5p.gin"], []),
]
TINY_FAIL_PROB = (0.1,)  # without runs that log segment statistics: the tiny runs' ~0.9 acceptance
# (variant, bindings) of the RollVerify reruns at the Qwen3-8B contexts (paper-shaped acceptance unless said)
DIAGNOSTICS = [
    ("no_cuts", ["SimConfig.segment_fail_prob = (0.0,)", "SimConfig.fail_ramp_start = 0"]),
    ("p_0.1", ["SimConfig.segment_fail_prob = (0.1,)", "SimConfig.fail_ramp_start = 0"]),
    ("verify_finished", ["VerifyConfig.verify_finished = True"]),
]
PAPER = {8192: (16.6, 15.1), 20480: (98.1, 57.5), 61440: (261.0, 137.0)}  # Table 7 (GPU days): on-policy, RV
GOAL = {8192: 1.1, 20480: 1.5, 61440: 1.8}  # issue 25: RollVerify speed-up wanted for Qwen3-8B
ASYNC_MODES = ("async_rollverify", "async_unverified", "async_keep_kv")
ASYNC_GOAL = {20480: 2.4, 61440: 2.8}  # issue 46: async RollVerify wanted for Qwen3-8B (unfavourable end)
# published async speed-ups against each system's synchronous baseline (their hardware and baselines, not ours)
PUBLISHED_ASYNC = {"Qwen3-8B": "verl 2.35-2.67x (Qwen2.5-Math-7B, DAPO, 28K, 128 GPUs); AReaL 2.27-2.77x",
                   "Qwen3-30B-A3B": "verl 1.72x (Qwen3-30B-A3B, 8K)"}
SEARCH_STEPS = 100
REDRAW = "SimConfig.cut_length = 'redraw'"  # the favourable end of the cut-length bracket
TERMS = ("prefill_s", "prefill_attn_s", "decode_s", "verify_s", "train_s", "overhead_s")


def _setup(files: list[str], params: list[str], steps: int | None):
    spec = sim.spec_from_gin(files, params)
    cfg, shape, roofline = sim_config(spec), sim.shape_of(spec), sim_costs(spec)
    inputs = sim_predict.build_inputs(cfg, shape, [], costs=roofline)
    return shape, inputs, roofline, steps or cfg.num_steps or shape.num_steps


def predict(files: list[str], params: list[str], modes, steps: int | None) -> list[dict]:
    shape, inputs, _, n = _setup(files, params, steps)
    return [with_terms(sim_predict.run_mode(m, shape, inputs, n).summary(inputs.num_devices),
                       inputs.costs.decode_per_step_s()) for m in modes]


def predict_async(files: list[str], params: list[str], modes, steps: int | None, rollout_devices: int | None = None,
                  search_steps: int = SEARCH_STEPS) -> tuple[list[dict], dict]:
    """The async ``modes`` at ``rollout_devices`` (None: the best split for async RollVerify over ``search_steps``
    steps), and the search (every candidate's wall clock)."""
    shape, inputs, roofline, n = _setup(files, params, steps)
    search = {}
    if rollout_devices is None:
        rollout_devices, walls = sim_predict.best_split("async_rollverify", shape, inputs, roofline,
                                                        min(search_steps, n))
        search = {"steps": min(search_steps, n), "wall_s": walls}
    return [async_terms(sim_predict.run_async(m, shape, inputs, n, roofline, rollout_devices).summary())
            for m in modes], {"rollout_devices": rollout_devices, **search}


def async_terms(summary: dict) -> dict:
    """An async summary plus its device time by use: each group's busy chip-days (rollout: prefill, decode,
    verification, publish; learner: train step and overhead), and ``busy_days`` (their sum: what a perfectly
    balanced split of the same work would cost; the rest of the device-days is a group waiting on the other)."""
    r, t = summary["rollout_devices"], summary["train_devices"]
    day = 86400.0
    sync_days = summary["sync_wall_s"] * summary["num_devices"] / day
    rollout = summary["rollout_busy_s"] * r / day
    learner = summary["learner_busy_s"] * t / day
    return {**summary, "busy_days": {"rollout": rollout, "learner": learner, "synchronous": sync_days,
                                     "total": rollout + learner + sync_days}}


def with_terms(summary: dict, decode_per_step: dict | None = None) -> dict:
    """The summary plus each cost term in device-days (``prefill_attn`` is part of ``prefill``; ``decode_step``,
    the part of each decode step no length changes (``CostModel.decode_per_step_s``: the weights' read, the
    collectives, host time), is part of ``decode``, the rest of which is the KV the attention kernel reads;
    ``decode_collectives`` is part of ``decode_step``). Every real config's dispatch runs all its slots, so
    these are the all-slot step's parts."""
    scale = summary["num_devices"] / 86400.0
    terms = {t.removesuffix("_s"): summary[t] * scale for t in TERMS}
    parts = decode_per_step or {}
    steps = summary["decode_steps"] * scale
    terms["decode_step"] = sum(parts.values()) * steps
    terms["decode_collectives"] = parts.get("collectives", 0.0) * steps
    return {**summary, "terms_days": terms}


def logs_segments(run: cal.RunData) -> bool:
    return run.mode == "rollverify" and any(k.startswith("verify/segments_checked/") for r in run.steps for k in r)


def finished_runs(root: Path) -> list[Path]:
    """RollVerify runs under ``root`` that log segment statistics and reached their TrainConfig.num_steps."""
    out = []
    for metrics in sorted(root.glob("**/metrics.jsonl")) if root.is_dir() else []:
        try:
            run = cal.read_run(metrics.parent)
        except (ValueError, FileNotFoundError):  # not a training run's directory, or one without its spec.json
            continue
        steps = run.spec.get("train", {}).get("num_steps")
        if logs_segments(run) and steps is not None and run.steps[-1]["step"] >= int(steps):
            out.append(metrics.parent)
    return out


def tiny_fail_prob(fit_runs: list[Path]) -> tuple[tuple[float, ...], dict]:
    """p(c) fitted on ``fit_runs`` (their segment statistics), else the constant of the tiny runs' acceptance."""
    runs = [cal.read_run(p) for p in fit_runs]
    if not runs:
        return TINY_FAIL_PROB, {"source": "no run logs verify/segments_checked: p(c) = 0.1 at every age"}
    missing = [str(r.path) for r in runs if not logs_segments(r)]
    if missing:
        raise ValueError(f"{missing} log no verify/segments_checked: not RollVerify runs with segment statistics.")
    p, fit = cal.fit_segment_fail_prob(runs)
    return p, {"source": "fitted", "runs": [str(r.path) for r in runs], **fit}


def fail_prob_from_json(path: Path) -> tuple[tuple[float, ...], dict]:
    """p(c) refitted from the segment counts an earlier ``--json`` recorded (its ``tiny_source``): the published
    table's tiny-run acceptance, reproducible without the runs it was fitted on."""
    src = json.loads(Path(path).read_text()).get("tiny_source", {})
    if "checked" not in src:
        raise ValueError(f"{path} records no segment counts (tiny_source {src.get('source')!r}): fit on runs instead.")
    p = cal.fail_prob_from_counts({int(a): n for a, n in src["checked"].items()},
                                  {int(a): n for a, n in src["failed"].items()})
    return p, {**src, "refitted_from": str(path)}


def row(model: str, ctx: int, variant: str, r: dict, on_policy_days: float) -> dict:
    return {"model": model, "context": ctx, "mode": r["mode"], "variant": variant, "device_days": r["device_days"],
            "speedup_vs_on_policy": on_policy_days / r["device_days"]}


def shortfall(on: dict, rv: dict, ctx: int) -> dict | None:
    """For a Qwen3-8B row below its goal: the device-days missing, and RollVerify's cost terms against
    on-policy's (what it saves on each, and what it spends more)."""
    goal = GOAL.get(ctx)
    if goal is None:
        return None
    need = on["device_days"] / goal
    return {"goal": goal, "met": rv["device_days"] <= need, "needed_days": need,
            "missing_days": max(0.0, rv["device_days"] - need),
            "terms_on_policy": on["terms_days"], "terms_rollverify": rv["terms_days"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="default: each config's TrainConfig.num_steps")
    ap.add_argument("--sigmas", type=float, nargs="*", default=[0.75, 1.25])
    ap.add_argument("--runs", default="runs", help="where to look for runs with segment statistics")
    ap.add_argument("--fit_runs", nargs="*", default=None, help="the runs to fit p(c) on (default: every finished "
                    "RollVerify run under --runs that logs segment statistics)")
    ap.add_argument("--fit_json", default=None, help="refit p(c) from the segment counts an earlier --json "
                    "recorded instead of runs (default, when no run is found: docs/results/simulator_scale.json)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--plot_only", action="store_true", help="redraw --plot (and --tables) from the --json of an "
                    "earlier run")
    ap.add_argument("--tables", action="store_true", help="print the markdown tables of docs/results/simulator.md")
    ap.add_argument("--search_steps", type=int, default=SEARCH_STEPS, help="steps each candidate split of the async "
                    "search runs")
    ap.add_argument("--jobs", type=int, default=1, help="settings run in parallel processes (the results are the "
                    "same)")
    args = ap.parse_args()
    if args.plot_only:
        out = json.loads(Path(args.json).read_text())
        if args.plot:
            plot(out, args.plot)
        if args.tables:
            print(tables(out))
            print("\n" + async_tables(out))
        return
    if args.fit_json:
        tiny_p, tiny_source = fail_prob_from_json(Path(args.fit_json))
    else:
        fit_runs = finished_runs(Path(args.runs)) if args.fit_runs is None else [Path(p) for p in args.fit_runs]
        if not fit_runs and args.fit_runs is None and PUBLISHED.is_file():  # a clone without the runs
            tiny_p, tiny_source = fail_prob_from_json(PUBLISHED)
        else:
            tiny_p, tiny_source = tiny_fail_prob(fit_runs)
    tiny = [f"SimConfig.segment_fail_prob = {tuple(round(x, 6) for x in tiny_p)!r}", "SimConfig.fail_ramp_start = 0"]
    out = {"rows": [], "settings": [], "tiny_fail_prob": list(tiny_p), "tiny_source": tiny_source}
    print(f"tiny acceptance: p(c) = {tuple(round(x, 3) for x in tiny_p)} ({tiny_source.get('runs', tiny_source)})",
          flush=True)
    jobs = [(model, ctx, files, params, tiny, args) for model, ctx, files, params in SETTINGS]
    if args.jobs > 1:  # settings are independent: one process each (spawned: gin and JAX state are per process)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            done = list(pool.map(run_setting, *zip(*jobs, strict=True)))
    else:
        done = [run_setting(*job) for job in jobs]
    for setting, rows in done:
        out["settings"].append(setting)
        out["rows"] += rows
    if args.json:
        Path(args.json).write_text(json.dumps(_finite(out), indent=1) + "\n")
    if args.plot:
        plot(out, args.plot)
    if args.tables:
        print(tables(out))
        print("\n" + async_tables(out))


def run_setting(model: str, ctx: int, files: list[str], params: list[str], tiny: list[str], args) -> tuple[dict, list]:
    """One setting: the synchronous modes (both ends of the cut-length bracket, the tiny-run acceptance), the async
    modes at the best split, and (Qwen3-8B) the diagnostics. Returns its JSON entry and its rows."""
    rows: list[dict] = []
    on, partial, rv = predict(files, params, MODES, args.steps)
    (rv_tiny,) = predict(files, [*params, *tiny], ("rollverify",), args.steps)
    (rv_redraw,) = predict(files, [*params, REDRAW], ("rollverify",), args.steps)
    days = on["device_days"]
    for variant, rv_row in (("default", rv), ("tiny_acceptance", rv_tiny)):
        rows += [row(model, ctx, variant, r, days) for r in (on, partial, rv_row)]
    rows.append(row(model, ctx, "redraw", rv_redraw, days))
    asyncs, split = predict_async(files, params, ASYNC_MODES, args.steps, search_steps=args.search_steps)
    (arv_redraw,) = predict_async(files, [*params, REDRAW], ("async_rollverify",), args.steps,
                                  split["rollout_devices"])[0]
    rows += [row(model, ctx, "default", r, days) for r in asyncs]
    rows.append(row(model, ctx, "redraw", arv_redraw, days))
    setting = {"model": model, "context": ctx, "files": files, "params": params,
               "modes": {"on_policy": on, "partial": partial, "rollverify": rv, "rollverify_tiny": rv_tiny,
                         "rollverify_redraw": rv_redraw},
               "async": {"split": split, "modes": {**{r["mode"]: r for r in asyncs},
                                                   "async_rollverify_redraw": arv_redraw}},
               "paper": PAPER.get(ctx) if model == "Qwen3-8B" else None,
               "shortfall": shortfall(on, rv, ctx) if model == "Qwen3-8B" else None}
    arv = asyncs[0]
    print(f"{model} {ctx}: on-policy {days:.2f}, partial {partial['device_days']:.2f} "
          f"({days / partial['device_days']:.2f}x), "
          f"RollVerify {rv['device_days']:.2f} ({days / rv['device_days']:.2f}x, switch {rv['switch_step']}, "
          f"acceptance {rv['acceptance']:.3f}; redraw end {days / rv_redraw['device_days']:.2f}x), tiny acceptance "
          f"{rv_tiny['device_days']:.2f} ({days / rv_tiny['device_days']:.2f}x, switch {rv_tiny['switch_step']}, "
          f"acceptance {rv_tiny['acceptance']:.3f}); async split {split}: "
          + ", ".join(f"{r['mode']} {r['device_days']:.2f} ({days / r['device_days']:.2f}x)" for r in asyncs)
          + f", async RollVerify redraw end {days / arv_redraw['device_days']:.2f}x (switch {arv['switch_step']}, "
          f"acceptance {arv['acceptance']:.3f})", flush=True)
    if model == "Qwen3-8B":
        setting["diagnostics"] = diagnostics(model, ctx, files, params, days, args, rows, split["rollout_devices"])
    return setting, rows


def diagnostics(model: str, ctx: int, files: list[str], params: list[str], on_days: float, args, rows: list,
                rollout_devices: int) -> dict:
    """RollVerify under each of ``DIAGNOSTICS``, and on-policy and RollVerify at each of ``--sigmas``."""
    found = {}
    for variant, bindings in DIAGNOSTICS:
        (r,) = predict(files, [*params, *bindings], ("rollverify",), args.steps)
        rows.append(row(model, ctx, variant, r, on_days))
        found[variant] = r
        print(f"  RollVerify, {variant}: {r['device_days']:.2f} ({on_days / r['device_days']:.2f}x)", flush=True)
    for sigma in args.sigmas:
        on, rv = predict(files, [*params, f"SimConfig.length_sigma = {sigma}"], ("on_policy", "rollverify"),
                         args.steps)
        rows += [row(model, ctx, f"sigma_{sigma}", r, on["device_days"]) for r in (on, rv)]
        found[f"sigma_{sigma}"] = {"on_policy": on, "rollverify": rv}
        print(f"  sigma {sigma}: {on['device_days']:.2f} -> {rv['device_days']:.2f} "
              f"({on['device_days'] / rv['device_days']:.2f}x)", flush=True)
    # on-policy, RollVerify and async RollVerify (at the split) with independent members (no prompt part of the
    # length), and with 3 ms of host and dispatch time per decode step (a dearer on-policy tail)
    for variant, binding in (("group_share_0", "SimConfig.length_group_share = 0.0"),
                             ("host_3ms", "RooflineCosts.decode_host_s = 0.003")):
        changed = [*params, binding]
        on, rv = predict(files, changed, ("on_policy", "rollverify"), args.steps)
        (arv,) = predict_async(files, changed, ("async_rollverify",), args.steps, rollout_devices)[0]
        rows += [row(model, ctx, variant, r, on["device_days"]) for r in (on, rv, arv)]
        found[variant] = {"on_policy": on, "rollverify": rv, "async_rollverify": arv}
        print(f"  {variant}: {on['device_days']:.2f} -> {rv['device_days']:.2f} "
              f"({on['device_days'] / rv['device_days']:.2f}x), async {arv['device_days']:.2f} "
              f"({on['device_days'] / arv['device_days']:.2f}x)", flush=True)
    return found


def _label(setting: dict) -> str:
    ctx = {8192: "8K", 20480: "~20K", 61440: "64K"}[setting["context"]]
    return f"{setting['model']}, {ctx}"


def tables(out: dict) -> str:
    """The markdown tables of docs/results/simulator.md's real-scale section from a run's output."""
    lines = ["| setting | chips | on-policy | naive partial | RollVerify | naive partial speed-up | RollVerify "
             "speed-up | RollVerify, redraw end | goal | RollVerify, tiny-run p(c) | paper: on-policy -> RollVerify "
             "(speed-up) |",
             "| --- " * 11 + "|"]
    for st in out["settings"]:
        m = st["modes"]
        on, pa, rv, tiny, rd = (m[k]["device_days"] for k in ("on_policy", "partial", "rollverify", "rollverify_tiny",
                                                               "rollverify_redraw"))
        paper = st.get("paper")
        ptxt = (f"{paper[0]:g} -> {paper[1]:g} ({paper[0] / paper[1]:.2f}x)" if paper
                else "(1.7x reported for the MoE model)")
        goal = f"{GOAL[st['context']]}x" if st["model"] == "Qwen3-8B" else "-"
        lines.append(f"| {_label(st)} | {m['on_policy']['num_devices']} | {on:.2f} | {pa:.2f} | {rv:.2f} | "
                     f"{on / pa:.2f}x | {on / rv:.2f}x | {rd:.2f} ({on / rd:.2f}x) | {goal} | {tiny:.2f} "
                     f"({on / tiny:.2f}x) | {ptxt} |")
    lines += ["", "| setting | mode | prefill (of which attention) | decode (weights + collectives + KV reads) | "
              "verify | train | overhead | total | prefill tokens: padded / computed / copied | prefill calls | "
              "decoded tokens | trained response tokens | train positions (useful share) | cut tokens | acceptance | "
              "switch |",
              "| --- " * 16 + "|"]
    names = {"on_policy": "on-policy", "partial": "naive partial", "rollverify": "RollVerify",
             "rollverify_tiny": "RollVerify, tiny-run p(c)"}
    for st in out["settings"]:
        for key, name in names.items():
            r = st["modes"][key]
            t = r["terms_days"]
            acc = "-" if r["acceptance"] is None or r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.3f}"
            sw = r["switch_step"] if r["switch_step"] >= 0 else "-"
            positions = (f"{r['train_positions'] / 1e6:,.0f}M ({r['train_useful_fraction']:.2f})"
                         if "train_positions" in r else "-")  # a --json from before the packed train step
            coll = t.get("decode_collectives", 0.0)  # a --json from before the kernel decode has none
            lines.append(
                f"| {_label(st)} | {name} | {t['prefill']:.2f} ({t['prefill_attn']:.2f}) | {t['decode']:.2f} "
                f"({t['decode_step'] - coll:.2f} + {coll:.2f} + {t['decode'] - t['decode_step']:.2f}) | "
                f"{t['verify']:.2f} | "
                f"{t['train']:.2f} | {t['overhead']:.2f} | {r['device_days']:.2f} | "
                f"{r['prefill_padded_tokens'] / 1e6:,.0f}M / {r['prefill_tokens'] / 1e6:,.0f}M / "
                f"{r['shared_prompt_tokens'] / 1e6:,.0f}M | {r['prefill_calls'] / 1e3:,.0f}K | "
                f"{r['tokens_generated'] / 1e6:,.0f}M | {r['batch_tokens'] / 1e6:,.0f}M | {positions} | "
                f"{r['removed_tokens'] / 1e6:,.0f}M | {acc} | {sw} |")
    lines += ["", "| setting | sigma 0.75 | sigma 1.0 (table) | sigma 1.25 | nothing cut (p = 0, no switch) | "
              "p(c) = 0.1, no ramp (no switch) | verify finished members too | group share 0: RollVerify, async "
              "RollVerify | 3 ms host time per decode step: RollVerify, async RollVerify |", "| --- " * 9 + "|"]
    for st in out["settings"]:
        d = st.get("diagnostics")
        if not d:
            continue
        on = st["modes"]["on_policy"]["device_days"]

        def cell(v):
            return f"{v['on_policy']['device_days'] / v['rollverify']['device_days']:.2f}x" if v else "-"
        vf = d["verify_finished"]
        rv = st["modes"]["rollverify"]["device_days"]
        def pair(v):
            return (f"{v['on_policy']['device_days'] / v['rollverify']['device_days']:.2f}x, "
                    f"{v['on_policy']['device_days'] / v['async_rollverify']['device_days']:.2f}x")
        lines.append(f"| {_label(st)} | {cell(d.get('sigma_0.75'))} | {on / rv:.2f}x | {cell(d.get('sigma_1.25'))} | "
                     f"{on / d['no_cuts']['device_days']:.2f}x | {on / d['p_0.1']['device_days']:.2f}x | "
                     f"{on / vf['device_days']:.2f}x (switch {vf['switch_step']}) | {pair(d['group_share_0'])} | "
                     f"{pair(d['host_3ms'])} |")
    return "\n".join(lines)


def async_tables(out: dict) -> str:
    """The async tables of docs/results/simulator.md: device-days and speed-ups on the same chips, then where each
    async mode's device time goes."""
    lines = ["| setting | chips: rollout + train (K) | on-policy | RollVerify (synchronous) | async RollVerify | "
             "async unverified | async keep-KV | async RollVerify, redraw end | balanced-split bound | goal | "
             "published (against their own baselines) |", "| --- " * 11 + "|"]
    for st in out["settings"]:
        m, a = st["modes"], st["async"]["modes"]
        on = m["on_policy"]["device_days"]
        arv = a["async_rollverify"]

        def cell(r, on=on):
            return f"{r['device_days']:.2f} ({on / r['device_days']:.2f}x)"
        goal = f"{ASYNC_GOAL[st['context']]}x" if st["model"] == "Qwen3-8B" and st["context"] in ASYNC_GOAL else "-"
        lines.append(f"| {_label(st)} | {arv['rollout_devices']} + {arv['train_devices']} "
                     f"({arv['overlap_dispatches']:,}) | {on:.2f} | {cell(m['rollverify'])} | {cell(arv)} | "
                     f"{cell(a['async_unverified'])} | {cell(a['async_keep_kv'])} | "
                     f"{cell(a['async_rollverify_redraw'])} | {on / arv['busy_days']['total']:.2f}x | {goal} | "
                     f"{PUBLISHED_ASYNC[st['model']]} |")
    lines += ["", "| setting | mode | device-days | rollout group busy | learner busy | busy chip-days: rollout + "
              "learner + synchronous | re-prefill at swaps (chip-days) | publish (chip-days) | rollout waits for the "
              "update / idle (h) | learner waits (h) | trained response tokens | acceptance | staleness: mean / max "
              "| switch |", "| --- " * 14 + "|"]
    for st in out["settings"]:
        for key in (*ASYNC_MODES, "async_rollverify_redraw"):
            r = st["async"]["modes"][key]
            b = r["busy_days"]
            chip = r["rollout_devices"] / 86400.0
            acc = "-" if r["acceptance"] is None or r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.3f}"
            sw = r["switch_step"] if r["switch_step"] >= 0 else "-"
            name = key.replace("_redraw", ", redraw end").replace("_", " ")
            lines.append(
                f"| {_label(st)} | {name} | {r['device_days']:.2f} | {r['rollout_busy_fraction']:.2f} | "
                f"{r['learner_busy_fraction']:.2f} | {b['rollout']:.2f} + {b['learner']:.2f} + {b['synchronous']:.2f} "
                f"| {r['reprefill_s'] * chip:.2f} | {r['publish_s'] * chip:.3f} | {r['rollout_wait_s'] / 3600:.1f} / "
                f"{r['rollout_idle_s'] / 3600:.1f} | {r['learner_wait_s'] / 3600:.1f} | "
                f"{r['batch_tokens'] / 1e6:,.0f}M | {acc} | {r['staleness_mean']:.2f} / {r['staleness_max']} | {sw} |")
    return "\n".join(lines)


def _finite(x):
    """NaN (an on-policy run's acceptance) as null: strict JSON."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def plot(out: dict, path: str) -> None:
    from rollverify_jax.run.metrics import pyplot

    plt = pyplot(cli=True)

    def series(mode: str, variant: str) -> list[tuple[int, float]]:
        return sorted((r["context"], r["speedup_vs_on_policy"]) for r in out["rows"]
                      if r["model"] == "Qwen3-8B" and r["mode"] == mode and r["variant"] == variant)

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = [("rollverify", "default", "o-", "RollVerify, paper-shaped acceptance (default)"),
              ("rollverify", "tiny_acceptance", "o--", "RollVerify, tiny-run acceptance"),
              ("partial", "default", "s:", "naive partial"),
              ("async_rollverify", "default", "D-", "async RollVerify, same chips (default)"),
              ("async_rollverify", "redraw", "D--", "async RollVerify, redraw end"),
              ("rollverify", "no_cuts", "x-.", "RollVerify, nothing cut (diagnostic)")]
    for sigma in sorted({r["variant"] for r in out["rows"] if r["variant"].startswith("sigma_")}):
        styles.append(("rollverify", sigma, "--", f"RollVerify, length {sigma.replace('_', ' ')}"))
    for mode, variant, style, label in styles:
        pts = series(mode, variant)
        ax.plot([c / 1024 for c, _ in pts], [s for _, s in pts], style, alpha=0.8, label=f"simulated {label}")
    ax.plot([c / 1024 for c in PAPER], [a / b for a, b in PAPER.values()], "k^-", label="paper, Table 7 (GPU days)")
    ax.plot([c / 1024 for c in GOAL], list(GOAL.values()), "rv", ls="none", label="issue 25 goal")
    ax.plot([c / 1024 for c in ASYNC_GOAL], list(ASYNC_GOAL.values()), "m^", ls="none",
            label="issue 46 goal (async)")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks([c / 1024 for c in sorted(GOAL)], ["8K", "~20K", "64K"])
    ax.set_xlabel("response cap (tokens)")
    ax.set_ylabel("speed-up vs on-policy (device-days ratio)")
    ax.set_title("Qwen3-8B, 700 steps: predicted vs reported (cut length kept)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
