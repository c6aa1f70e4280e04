"""Predicts wall-clock and device-days of a run in each rollout mode, without running it.

    python -m rollverify_jax.simulate --gin_file=configs/tiny_rollverify.gin [--gin_param=...] [--steps N]
        [--calibrate_from RUN_DIR ... [--fit_from RUN_DIR ...]] [--json out.json]

A discrete-event replay of the scheduler and training loop (``rollverify_jax/sim/replay.py``) over the run's
shape (B, G, slots, steps per dispatch, response cap, switching: read from its gin config) for on-policy,
naive partial and RollVerify, with a cost model (``rollverify_jax/sim/costs.py``): measured rates fitted on
runs (``--calibrate_from``: their ``metrics.jsonl``), or the compiled programs' roofline (``SimConfig.costs =
'roofline'`` with ``RooflineCosts`` bound, configs/sim/*.gin). With ``--calibrate_from``, the response lengths
and RollVerify's acceptance per step come from those runs too, and the prediction for every run given is
printed beside its measured wall-clock, timers and event counts (rates from the ``--fit_from`` runs, by default
the on-policy ones). With ``--calibrate_from``, RollVerify's per-segment failure probability by age comes from
the RollVerify runs' logged segment statistics (``calibrate.fit_segment_fail_prob``). docs/results/simulator.md
has the equations and the calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from rollverify_jax.infra.cli import run_cli
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim.config import SimConfig
from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import CutModel, LengthModel, TrainLayout, Workload, simulate


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the simulator reads from the run's own configurables."""

    mode: str
    batch_groups: int
    group_size: int
    max_new_tokens: int
    queue_groups: int
    num_slots: int
    steps_per_dispatch: int
    switch_window: int
    switch_threshold: float
    switching: bool
    verify_finished: bool
    num_steps: int
    mesh_shape: tuple
    live_slots: bool = True  # EngineConfig.live_slots and a pool on one device (else one bucket: all slots)
    min_prefill_len: int = 32
    max_seq_len: int = 512
    page_size: int = 16
    live_pages: bool = True
    kv_pages_per_shard: int = 0  # pages a pool shard hands out (0: no limit)
    pool_shards: int = 1
    page_reservation: str = "incremental"
    train_layout: TrainLayout | None = None  # LearnerConfig's packed rows (None: each sequence its own row)

    def workload(self, mode: str, prompt_len: int) -> Workload:
        return Workload(mode=mode, batch_groups=self.batch_groups, group_size=self.group_size,
                        num_slots=self.num_slots, steps_per_dispatch=self.steps_per_dispatch,
                        max_new_tokens=self.max_new_tokens, prompt_len=prompt_len, queue_groups=self.queue_groups,
                        switch_window=self.switch_window, switch_threshold=self.switch_threshold,
                        switching=self.switching, verify_finished=self.verify_finished, live_slots=self.live_slots,
                        min_prefill_len=self.min_prefill_len, max_seq_len=self.max_seq_len,
                        page_size=self.page_size, live_pages=self.live_pages,
                        kv_pages_per_shard=self.kv_pages_per_shard, pool_shards=self.pool_shards,
                        page_reservation=self.page_reservation, train_layout=self.train_layout)


def pool_shards(mesh_shape: tuple, num_slots: int) -> int:
    """Devices the engine splits the slots over (``PoolLayout.for_mesh``): the batch axes ('data', 'fsdp', the
    first two of ``make_mesh.shape``; -1 counts as 1 here) when the slots divide over them, else 1."""
    n = math.prod(max(1, int(x)) for x in mesh_shape[:2])
    return n if num_slots % n == 0 else 1


def read_run_shape(spec) -> RunShape:
    """The run's settings from its ``RunSpec`` (no model is built)."""
    r, e, s, v, lc = spec.rollout, spec.engine, spec.switch, spec.verify, spec.learner
    mesh = tuple(spec.mesh.get("shape", (1, -1, 1)))
    shards = pool_shards(mesh, e.num_slots)
    pages = shard_pages(spec, shards)
    # train.select packs into the engine's max_seq_len; pack_for_learner rounds rows up to the batch devices
    layout = TrainLayout(width=e.max_seq_len, num_minibatches=lc.num_minibatches, micro_batch_size=lc.micro_batch_size,
                         tail_row_width=lc.tail_row_width, pack_sequences=lc.pack_sequences, ppo_epochs=lc.ppo_epochs,
                         row_multiple=math.prod(max(1, int(x)) for x in mesh[:2]))
    return RunShape(mode=r.mode, batch_groups=r.batch_groups, group_size=r.group_size,
                    max_new_tokens=r.max_new_tokens, queue_groups=r.queue_groups, num_slots=e.num_slots,
                    steps_per_dispatch=e.steps_per_dispatch, switch_window=s.window, switch_threshold=s.threshold,
                    switching=s.enabled, verify_finished=v.verify_finished, num_steps=spec.train.num_steps,
                    mesh_shape=mesh, live_slots=e.live_slots and pool_shards(mesh, e.num_slots) == 1,
                    min_prefill_len=e.min_prefill_len, max_seq_len=e.max_seq_len, page_size=e.page_size,
                    live_pages=e.live_pages, kv_pages_per_shard=pages, pool_shards=shards,
                    page_reservation=e.page_reservation, train_layout=layout)


def shard_pages(spec, shards: int) -> int:
    """Pages one shard of the engine's KV pool hands out (``engine.pool_pages``, less the shard's scratch page):
    ``EngineConfig.kv_memory_bytes`` over the pages of the gin-configured model (``model_config``), or enough
    for every slot at ``max_seq_len`` when no budget is set."""
    from rollverify_jax.models import model_config
    from rollverify_jax.rollout.engine import pool_pages

    return pool_pages(model_config(**spec.model), spec.engine, shards) // shards - 1


@dataclasses.dataclass
class Inputs:
    """Everything one simulation of a mode needs, after calibration."""

    costs: CostModel
    prompt_len: int
    length_kwargs: dict
    cut_kwargs: dict
    num_devices: int
    notes: dict


SHAPE_BINDINGS = {"RolloutConfig.batch_groups": "batch_groups", "RolloutConfig.group_size": "group_size",
                  "RolloutConfig.max_new_tokens": "max_new_tokens", "EngineConfig.num_slots": "num_slots",
                  "EngineConfig.steps_per_dispatch": "steps_per_dispatch"}


def check_run_shapes(shape: RunShape, runs: list[cal.RunData]) -> None:
    """A calibration run replayed with another run's shape would compare unlike work: refuse it."""
    for run in runs:
        bound = cal.run_bindings(run)
        for key, field in SHAPE_BINDINGS.items():
            if key in bound and bound[key] != str(getattr(shape, field)):
                raise ValueError(f"{run.path} ran with {key} = {bound[key]}, the simulated config has "
                                 f"{getattr(shape, field)}: pass the run's config (--gin_file={run.path}/config.gin) "
                                 "or leave the run out.")


def build_inputs(cfg: SimConfig, shape: RunShape, runs: list[cal.RunData],
                 fit_runs: list[cal.RunData] | None = None, costs: CostModel | RooflineCosts | None = None) -> Inputs:
    """``costs``: the spec's ``CostModel`` (or, with ``SimConfig.costs = 'roofline'``, its ``RooflineCosts``)."""
    devices = cfg.num_devices or math.prod(max(1, int(x)) for x in shape.mesh_shape)
    costs = costs if costs is not None else (RooflineCosts() if cfg.costs == "roofline" else CostModel())
    costs = costs.cost_model() if isinstance(costs, RooflineCosts) else costs
    prompt = cfg.prompt_len
    lengths = ({"lengths": list(cfg.lengths)} if cfg.lengths else
               {"median": cfg.length_median, "sigma": cfg.length_sigma, "seed": cfg.seed})
    cut = {"fail_prob": tuple(cfg.segment_fail_prob) if isinstance(cfg.segment_fail_prob, list | tuple)
           else (cfg.segment_fail_prob,), "ramp_start": cfg.fail_ramp_start,
           "ramp_doubling": cfg.fail_ramp_doubling, "seed": cfg.seed}
    inputs = Inputs(costs, prompt, lengths, cut, devices, {})
    if not runs:
        return inputs
    n = shape.batch_groups * shape.group_size
    fit_runs = fit_runs or [r for r in runs if r.mode == "on_policy"] or runs
    inputs.prompt_len = cal.prompt_len(runs, n, cfg.skip_steps)
    mean, mean_max, mean_sd = cal.length_stats(runs, cfg.skip_steps)
    median, sigma, share = cal.fit_group_lognormal(mean, mean_max, mean_sd, shape.batch_groups, shape.group_size,
                                                   shape.max_new_tokens, cfg.seed)
    inputs.length_kwargs = {"median": median, "sigma": sigma, "group_share": share, "seed": cfg.seed}
    verify_runs = [r for r in runs if r.mode == "rollverify"]
    cut_fit = None
    if verify_runs:
        fail_prob, cut_fit = cal.fit_segment_fail_prob(verify_runs)
        inputs.cut_kwargs = {**cut, "fail_prob": fail_prob}
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
                    "segment_fail_prob_from": [str(r.path) for r in verify_runs]}
    return inputs


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
    RollVerify run is replayed with its own per-step segment failure rates (``calibrate.fail_prob_trace``)."""
    out = []
    for run in runs:
        n = run.steps[-1]["step"]
        compared = {r["step"] for r in run.used(skip)}
        run_inputs = inputs
        if run.mode == "rollverify":
            run_inputs = dataclasses.replace(inputs, cut_kwargs={**inputs.cut_kwargs,
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. SimConfig.length_sigma=1.2")
    ap.add_argument("--steps", type=int, default=None, help="steps to predict (default: SimConfig.num_steps, "
                    "else TrainConfig.num_steps)")
    ap.add_argument("--calibrate_from", nargs="+", default=[], metavar="RUN_DIR",
                    help="runs whose metrics.jsonl give the rates, lengths and acceptance (and are compared)")
    ap.add_argument("--fit_from", nargs="+", default=[], metavar="RUN_DIR",
                    help="runs whose rates are fitted (default: the on-policy runs of --calibrate_from)")
    ap.add_argument("--json", default=None, help="write the predictions (and calibration) here")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    args = ap.parse_args(argv)
    run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    if not args.gin_file:
        raise ValueError("--gin_file is required: the run's config (e.g. configs/tiny_rollverify.gin).")
    for f in args.gin_file:
        if not Path(f).is_file():
            raise FileNotFoundError(f"gin file {f} does not exist.")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps={args.steps} must be >= 1.")
    runs = [cal.read_run(p) for p in args.calibrate_from]  # bad run directories fail before any import
    fit_runs = [cal.read_run(p) for p in args.fit_from]
    if fit_runs and not runs:
        raise ValueError("--fit_from needs --calibrate_from (the runs to compare and to take lengths from).")
    from rollverify_jax.run.spec import RunSpec, parse_gin

    parse_gin(args.gin_file, args.gin_param)
    spec = RunSpec.from_gin()
    cfg, shape = spec.sim, read_run_shape(spec)
    check_run_shapes(shape, runs + fit_runs)
    inputs = build_inputs(cfg, shape, runs, fit_runs, sim_costs(spec))
    steps = args.steps or cfg.num_steps or shape.num_steps
    rows = [{**run_mode(m, shape, inputs, steps).summary(inputs.num_devices)} for m in cfg.modes]
    print(f"{', '.join(args.gin_file)}: B={shape.batch_groups} G={shape.group_size} slots={shape.num_slots} "
          f"k={shape.steps_per_dispatch} max_new_tokens={shape.max_new_tokens} prompt={inputs.prompt_len} "
          f"devices={inputs.num_devices} lengths={inputs.length_kwargs}")
    print(format_table(rows))
    report = {"config": args.gin_file, "gin_params": args.gin_param, "shape": dataclasses.asdict(shape),
              "costs": dataclasses.asdict(inputs.costs), "lengths": inputs.length_kwargs,
              "prompt_len": inputs.prompt_len, "notes": inputs.notes, "modes": rows}
    if runs:
        calib = calibration_rows(shape, inputs, runs, cfg.skip_steps, cfg.fit_split, cfg.decode_width_ref)
        how = ("each run's rates fitted on its own odd steps, compared on its even steps"
               if cfg.fit_split == "odd_even"
               else "rates fitted on every step after the skipped ones of: " + ", ".join(inputs.notes["fit_runs"]))
        print(f"\nCalibration ({how})")
        print(format_calibration(calib))
        print("\nEvent counts, predicted / measured")
        print(format_counts(calib))
        report["calibration"] = calib
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=_json_default) + "\n")


def sim_costs(spec) -> CostModel | RooflineCosts:
    """The cost source ``SimConfig.costs`` names, from the spec."""
    return spec.roofline if spec.sim.costs == "roofline" else spec.cost_model


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


if __name__ == "__main__":
    main()
