"""One prediction of the simulator: its inputs after calibration (``build_inputs``: measured rates, lengths and
cut rates fitted on runs' ``metrics.jsonl``), the replay of each mode (``run_mode``), the prediction against the
runs it was calibrated on (``calibration_rows``), and the tables ``python -m rollverify_jax.simulate`` prints."""

from __future__ import annotations

import dataclasses
import math

from rollverify_jax.sim import async_replay as sim_async
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim.config import SimConfig
from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import CutModel, LengthModel, check_mismatch, simulate
from rollverify_jax.sim.shape import RunShape


@dataclasses.dataclass
class Inputs:
    """Everything one simulation of a mode needs, after calibration."""

    costs: CostModel
    prompt_len: int
    length_kwargs: dict
    cut_kwargs: dict
    num_devices: int
    notes: dict


def build_inputs(cfg: SimConfig, shape: RunShape, runs: list[cal.RunData],
                 fit_runs: list[cal.RunData] | None = None, costs: CostModel | RooflineCosts | None = None) -> Inputs:
    """``costs``: the spec's ``CostModel`` (or, with ``SimConfig.costs = 'roofline'``, its ``RooflineCosts``)."""
    devices = cfg.num_devices or math.prod(max(1, int(x)) for x in shape.mesh_shape)
    costs = costs if costs is not None else (RooflineCosts() if cfg.costs == "roofline" else CostModel())
    costs = costs.cost_model() if isinstance(costs, RooflineCosts) else costs
    prompt = cfg.prompt_len
    lengths = ({"lengths": list(cfg.lengths)} if cfg.lengths else
               {"median": cfg.length_median, "sigma": cfg.length_sigma, "group_share": cfg.length_group_share,
                "seed": cfg.seed})
    lengths["cut_length"] = cfg.cut_length
    cut = {"fail_prob": tuple(cfg.segment_fail_prob) if isinstance(cfg.segment_fail_prob, list | tuple)
           else (cfg.segment_fail_prob,), "ramp_start": cfg.fail_ramp_start,
           "ramp_doubling": cfg.fail_ramp_doubling, "seed": cfg.seed, "rule": cfg.rule,
           "mismatch": check_mismatch(cfg.coupled_mismatch_per_token, "SimConfig.coupled_mismatch_per_token")}
    inputs = Inputs(costs, prompt, lengths, cut, devices, {})
    if not runs:
        return inputs
    n = shape.batch_groups * shape.group_size
    fit_runs = fit_runs or [r for r in runs if r.mode == "on_policy"] or runs
    inputs.prompt_len = cal.prompt_len(runs, n, cfg.skip_steps)
    mean, mean_max, mean_sd = cal.length_stats(runs, cfg.skip_steps)
    median, sigma, share = cal.fit_group_lognormal(mean, mean_max, mean_sd, shape.batch_groups, shape.group_size,
                                                   shape.max_new_tokens, cfg.seed)
    inputs.length_kwargs = {"median": median, "sigma": sigma, "group_share": share, "seed": cfg.seed,
                            "cut_length": cfg.cut_length}
    verify_runs = [r for r in runs if r.mode == "rollverify"]
    coupled_runs = [r for r in verify_runs if cal.verify_rule(r) == "coupled"]
    cut_fit = coupled_fit = None
    if verify_runs:
        fail_prob, cut_fit = cal.fit_segment_fail_prob(verify_runs)
        inputs.cut_kwargs = {**cut, "fail_prob": fail_prob}
    if coupled_runs:  # the coupled rule's per-token mismatch (used where SimConfig.rule or a run is 'coupled')
        mismatch, coupled_fit = _fit_mismatch(shape, inputs, coupled_runs, cfg)
        inputs.cut_kwargs = {**inputs.cut_kwargs, "mismatch": mismatch}
    steps = max(r.steps[-1]["step"] for r in runs)
    ratios = replay_ratios(shape, inputs, {r.mode for r in runs}, steps)
    costs, fit = cal.fit_costs(fit_runs, ratios, shape.steps_per_dispatch, n, inputs.prompt_len, cfg.skip_steps,
                               width_ref=cfg.decode_width_ref)
    if not any(r.mode == "rollverify" for r in fit_runs) and verify_runs:
        costs = _verification_rates(costs, verify_runs, ratios, cfg.skip_steps)
    inputs.costs = costs
    inputs.notes = {"fit_runs": [str(r.path) for r in fit_runs], "fit": fit, "length_mean": mean,
                    "length_max_mean": mean_max, "length_mean_sd": mean_sd, "length_median": median,
                    "length_sigma": sigma, "length_group_share": share,
                    "prompt_len": inputs.prompt_len,
                    "segment_fail_prob": inputs.cut_kwargs["fail_prob"], "segment_fail_prob_fit": cut_fit,
                    "segment_fail_prob_from": [str(r.path) for r in verify_runs],
                    "coupled_mismatch_per_token": inputs.cut_kwargs["mismatch"], "coupled_mismatch_fit": coupled_fit,
                    "coupled_mismatch_from": [str(r.path) for r in coupled_runs]}
    return inputs


def _fit_mismatch(shape: RunShape, inputs: Inputs, runs: list[cal.RunData], cfg: SimConfig) -> tuple[tuple, dict]:
    """``calibrate.fit_coupled_mismatch`` with the cached tokens' mean ages of a coupled replay of the runs'
    shape at the pooled rate (the runs do not log the ages; a cut changes them little)."""
    pooled, fit = cal.fit_coupled_mismatch(runs, cfg.skip_steps)
    steps = max(r.steps[-1]["step"] for r in runs)
    probe = dataclasses.replace(inputs, costs=CostModel(),
                                cut_kwargs={**inputs.cut_kwargs, "rule": "coupled", "mismatch": pooled})
    ages = cal.replay_token_ages(run_mode("rollverify", shape, probe, steps).steps)
    return cal.fit_coupled_mismatch(runs, cfg.skip_steps, ages)


def replay_ratios(shape: RunShape, inputs: Inputs, modes: set[str], steps: int) -> dict[str, cal.KindRatios]:
    """The replay's unlogged-per-logged counts for each kind of step the runs hold (costs play no part)."""
    out = {}
    for mode in sorted(modes | {"on_policy"}):
        res = run_mode(mode, shape, dataclasses.replace(inputs, costs=CostModel()), steps)
        kind = [s for s in res.steps if s.on_policy == (mode == "on_policy")]
        if kind:
            out[mode] = cal.kind_ratios(kind)
    return out


def _verification_rates(costs: CostModel, runs: list[cal.RunData], ratios: dict, skip: int) -> CostModel:
    """The log-prob and verifier rates when the fit runs verify nothing: from the RollVerify runs' verifying
    steps, what their prefill time exceeds the fitted prefill rates by, per token of their log-prob calls (the
    verified tokens times the replay's ratio), and their verification time per verified token."""
    ver = [(run.mode, r) for run in runs for r in run.used(skip) if r.get("verify/num_verified")]
    vtok = sum(r["verify/tokens_total"] for _, r in ver)
    if not vtok:
        return costs
    base = sum(r["rollout/dispatches"] * ratios[m].calls_per_dispatch * costs.prefill_call_s
               + r["rollout/prefill_tokens"] * ratios[m].padded_per_token * costs.prefill_token_s for m, r in ver)
    extra = sum(r["rollout/prefill_time"] - r["time/verify"] for _, r in ver) - base
    logp = sum(r["verify/tokens_total"] * ratios[m].logp_per_verified_token for m, r in ver)
    return dataclasses.replace(costs, prefill_logp_token_s=max(0.0, extra / logp),
                               verify_token_s=sum(r["time/verify"] for _, r in ver) / vtok)


def run_mode(mode: str, shape: RunShape, inputs: Inputs, num_steps: int):
    w = shape.workload(mode, inputs.prompt_len)
    lengths = LengthModel(shape.max_new_tokens, **inputs.length_kwargs)
    return simulate(w, inputs.costs, lengths, CutModel(**inputs.cut_kwargs), num_steps)


def run_async(mode: str, shape: RunShape, inputs: Inputs, num_steps: int, roofline: RooflineCosts,
              rollout_devices: int, overlap_dispatches: int | None = None,
              max_staleness: int = 1) -> sim_async.AsyncResult:
    """The async ``mode`` (``async_replay.ASYNC_MODES``) of ``shape`` with ``rollout_devices`` of the roofline's
    chips decoding and the rest training (``sim/async_replay.py``); ``overlap_dispatches`` None:
    ``auto_overlap``'s K."""
    if roofline.num_devices != inputs.num_devices:
        raise ValueError(f"RooflineCosts.num_devices={roofline.num_devices} but the run has {inputs.num_devices}.")
    full = shape.workload("rollverify", inputs.prompt_len)
    w = sim_async.rollout_workload(full, inputs.num_devices, rollout_devices, sim_async.ASYNC_MODES[mode])
    costs = sim_async.split_costs(roofline, rollout_devices)
    lengths = LengthModel(shape.max_new_tokens, **inputs.length_kwargs)
    k = overlap_dispatches or sim_async.auto_overlap(w, costs, lengths)
    setup = sim_async.AsyncSetup(inputs.num_devices, rollout_devices, k, max_staleness, sim_async.ASYNC_MODES[mode])
    return sim_async.simulate_async(w, costs, lengths, setup, CutModel(**inputs.cut_kwargs), num_steps, full, mode)


def split_candidates(shape: RunShape, num_devices: int) -> list[int]:
    """Rollout device counts an async split may take: whole slot shards, at least one left to train."""
    per = num_devices // shape.pool_shards
    return list(range(per, num_devices, per))


def best_split(mode: str, shape: RunShape, inputs: Inputs, roofline: RooflineCosts, num_steps: int,
               max_staleness: int = 1) -> tuple[int, dict[int, float]]:
    """The rollout device count of ``split_candidates`` with the least wall clock over ``num_steps`` updates of
    ``mode``, and every candidate's wall clock."""
    walls = {r: run_async(mode, shape, inputs, num_steps, roofline, r, max_staleness=max_staleness).wall_s
             for r in split_candidates(shape, inputs.num_devices)}
    return min(walls, key=walls.get), walls


def format_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["mode"] == "on_policy"), None)
    out = ["| mode | steps | wall (h) | s / step | rollout share | slot util. | acceptance | switch step | "
           "device-days | speed-up vs on-policy |", "| --- " * 10 + "|"]
    for r in rows:
        speed = f"{base['wall_s'] / r['wall_s']:.2f}x" if base and r["wall_s"] > 0 else "-"
        acc = "-" if math.isnan(r["acceptance"]) else f"{r['acceptance']:.3f}"
        out.append(f"| {r['mode']} | {r['steps']} | {r['wall_s'] / 3600:.3f} | {r['step_s_mean']:.2f} | "
                   f"{r['rollout_fraction']:.2f} | {r['slot_utilization']:.2f} | {acc} | "
                   f"{r['switch_step'] if r['switch_step'] >= 0 else '-'} | {r['device_days']:.4g} | {speed} |")
    return "\n".join(out)


COUNTS = (("dispatches", "rollout/dispatches"), ("prefill_tokens", "rollout/prefill_tokens"),
          ("tokens_generated", "rollout/tokens"), ("shared_prompt_tokens", "rollout/shared_prompt_tokens"))


def calibration_rows(shape: RunShape, inputs: Inputs, runs: list[cal.RunData], skip: int,
                     split: str = "by_mode", width_ref: float = 0.0) -> list[dict]:
    """Predicted vs measured wall-clock, timers and event counts of every run over its steps after ``skip``
    (``split='odd_even'``: each run's rates fitted on its own odd steps, compared on its even steps). A
    RollVerify run is replayed with its own per-step segment failure rates (``calibrate.fail_prob_trace``), a
    coupled one (``VerifyConfig.rule``) with the coupled cut model at the fitted per-token mismatch."""
    out = []
    for run in runs:
        n = run.steps[-1]["step"]
        compared = {r["step"] for r in run.used(skip)}
        run_inputs = inputs
        if run.mode == "rollverify" and cal.verify_rule(run) == "coupled":
            run_inputs = dataclasses.replace(inputs, cut_kwargs={**inputs.cut_kwargs, "rule": "coupled"})
        elif run.mode == "rollverify":
            run_inputs = dataclasses.replace(inputs, cut_kwargs={**inputs.cut_kwargs, "rule": "two_stage",
                                                                 "trace": cal.fail_prob_trace(run)})
        if split == "odd_even":
            odd = {s for s in compared if s % 2 == 1}
            compared -= odd
            ratios = inputs.notes["fit"]["ratios"]
            costs, _ = cal.fit_costs([run], {k: cal.KindRatios(**v) for k, v in ratios.items()},
                                     shape.steps_per_dispatch, shape.batch_groups * shape.group_size,
                                     inputs.prompt_len, skip, odd, width_ref)
            run_inputs = dataclasses.replace(run_inputs, costs=costs)
        res = run_mode(run.mode, shape, run_inputs, n)
        pred = [s for s in res.steps if s.step in compared]
        meas = [r for r in run.steps if r["step"] in compared]
        row = {"run": str(run.path), "mode": run.mode, "steps": f"{skip + 1}-{n}" if split == "by_mode"
               else f"even of {skip + 1}-{n}", "predicted_s": sum(s.step_s for s in pred),
               "measured_s": sum(r["time/step"] for r in meas), "predicted_switch": res.switch_step,
               "measured_switch": cal.switch_step(run)}
        row["error"] = row["predicted_s"] / row["measured_s"] - 1.0
        if cal.has_timers(run):
            row.update(timer_rows(pred, meas))
        for key, metric in COUNTS:
            row[f"pred_{key}"] = sum(getattr(s, key) for s in pred)
            row[f"meas_{key}"] = sum(r.get(metric, 0) for r in meas)
        row["pred_slot_utilization"] = (sum(s.useful_token_steps for s in pred)
                                        / max(1, shape.num_slots * sum(s.decode_steps for s in pred)))
        row["meas_slot_utilization"] = (sum(r["rollout/tokens"] for r in meas)
                                        / max(1e-9, sum(r["rollout/tokens"] / r["rollout/slot_utilization"]
                                                        for r in meas if r["rollout/slot_utilization"] > 0)))
        out.append(row)
    return out


def timer_rows(pred, meas: list[dict]) -> dict:
    """Predicted and measured seconds of each timer (prefill includes verification, as the engine times it)."""
    return {"pred_decode_s": sum(s.decode_s for s in pred),
            "meas_decode_s": sum(r["rollout/decode_time"] for r in meas),
            "pred_prefill_s": sum(s.prefill_s + s.verify_s for s in pred),
            "meas_prefill_s": sum(r["rollout/prefill_time"] for r in meas),
            "pred_train_s": sum(s.train_s for s in pred), "meas_train_s": sum(r["time/train"] for r in meas)}


def format_calibration(rows: list[dict]) -> str:
    out = ["| run | mode | steps | predicted (s) | measured (s) | error | decode (s) pred. / meas. | "
           "prefill (s) pred. / meas. | train (s) pred. / meas. | switch step (pred. / meas.) |",
           "| --- " * 10 + "|"]
    for r in rows:
        sw = f"{r['predicted_switch']} / {r['measured_switch']}" if r["mode"] == "rollverify" else "-"
        timers = [f"{r[f'pred_{t}_s']:.1f} / {r[f'meas_{t}_s']:.1f}" if f"pred_{t}_s" in r else "-"
                  for t in ("decode", "prefill", "train")]
        out.append(f"| `{r['run']}` | {r['mode']} | {r['steps']} | {r['predicted_s']:.1f} | {r['measured_s']:.1f} | "
                   f"{100 * r['error']:+.1f}% | {' | '.join(timers)} | {sw} |")
    return "\n".join(out)


def _count_cell(pred: float, meas: float) -> str:
    return f"{pred:,.0f} / {meas:,.0f} ({100 * (pred / max(meas, 1) - 1):+.1f}%)"


def format_counts(rows: list[dict]) -> str:
    """Event counts predicted / measured: independent of the machine's load, they test the replay itself."""
    out = ["| run | dispatches | prefill tokens | decoded tokens | shared prompt tokens | slot util. |",
           "| --- " * 6 + "|"]
    for r in rows:
        cells = [_count_cell(r[f"pred_{k}"], r[f"meas_{k}"]) for k, _ in COUNTS]
        out.append(f"| `{r['run']}` | {' | '.join(cells)} | {r['pred_slot_utilization']:.3f} / "
                   f"{r['meas_slot_utilization']:.3f} |")
    return "\n".join(out)
