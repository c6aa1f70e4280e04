"""The simulator's calibration over seeds: every run's rates predicting every run's wall-clock, and the event
counts, as markdown tables (docs/results/simulator.md, "Calibration on the tiny runs").

    python -m rollverify_jax.studies.sim_seeds --runs runs/compare_studies/{onpolicy,partial,rollverify}_s{0,1,2} \
        [--skip 1 5] [--pool held_out|all] [--json out.json] [--md out.md]

Each prediction is what the CLI computes (``rollverify_jax.simulate``: ``build_inputs`` then
``calibration_rows``) for one fit run F and one predicted run T:

- ``--pool all``: lengths, prompt length and (when F verifies nothing) the log-prob and verifier rates come
  from every run given, as ``python -m rollverify_jax.simulate --gin_file=RUN0/config.gin --calibrate_from
  RUNS... --fit_from F --gin_param=SimConfig.skip_steps=SKIP`` prints for T (the spec: RUN0's spec.json);
- ``--pool held_out`` (default): the same from every run but T (F always in), so T's own timers and lengths
  take no part in its prediction (F = T: in sample, every run).

A RollVerify run is replayed with its own acceptance trace (an input of the model, as the lengths are). The
runs must share one shape (the CLI's check). A run's mode is its ``RolloutConfig.mode``, its seed the ``_s<N>``
suffix of its directory (else its ``TrainConfig.seed``), both read from its ``spec.json``. Tables: the measured
seconds of each run and its training seconds per token (the same work per token in every mode: the machine's
load), same-mode predictions with, beside them, another seed's measured seconds as the prediction (the
seed-to-seed noise floor), cross-mode predictions grouped by fit mode, predicted mode and same / other seed, every
prediction as a matrix, and the event counts (the rates play no part; lengths and acceptance as above: under
``held_out`` from every run but T).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from pathlib import Path

from rollverify_jax import simulate as sim
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim import predict as sim_predict
from rollverify_jax.sim.shape import check_same_shape, sim_config, sim_costs

MODE_ORDER = ("on_policy", "partial", "rollverify")
TOL = 0.15


def run_seed(run: cal.RunData) -> str:
    m = re.search(r"_s(\d+)$", run.path.name)
    if m:
        return m.group(1)
    return str(run.spec.get("train", {}).get("seed", "?"))


def train_rate(run: cal.RunData, skip: int, prompt_tokens: int) -> float:
    """Seconds of training per trained token (``prompt_tokens`` per step + the responses) over the steps after
    ``skip``: the same work per token in every mode, so its spread over runs is mostly the machine's load."""
    used = run.used(skip)
    return sum(r["time/train"] for r in used) / max(1, sum(r["train/loss_tokens"] + prompt_tokens for r in used))


def predict(runs: list[cal.RunData], pool: str, skips: list[int]) -> dict:
    """rows[skip][F][T]: the calibration row of run T under run F's rates (paths as str), and costs[skip][F]."""
    spec = runs[0].spec
    base, shape = sim_config(spec), sim.shape_of(spec)
    for run in runs:
        check_same_shape(shape, run.spec, str(run.path))
    rows, costs = {}, {}
    for k in skips:
        cfg = dataclasses.replace(base, skip_steps=k)
        rows[k], costs[k] = {}, {}
        cache = {}
        for f in runs:
            rows[k][str(f.path)] = {}
            for t in runs:
                given = [r for r in runs if r is not t or r is f] if pool == "held_out" else runs
                key = (str(f.path), tuple(str(r.path) for r in given))
                if key not in cache:
                    cache[key] = sim_predict.build_inputs(cfg, shape, given, [f], sim_costs(spec))
                inputs = cache[key]
                if t is f:
                    costs[k][str(f.path)] = dataclasses.asdict(inputs.costs)
                row, = sim_predict.calibration_rows(shape, inputs, [t], k, cfg.fit_split, cfg.decode_width_ref)
                rows[k][str(f.path)][str(t.path)] = row
    counts = {}  # per T: the replay from the pool alone (any fit run: the rates play no part in the counts)
    cfg = dataclasses.replace(base, skip_steps=skips[0])
    for t in runs:
        given = [r for r in runs if r is not t] if pool == "held_out" else runs
        inputs = sim_predict.build_inputs(cfg, shape, given, given[:1], sim_costs(spec))
        counts[str(t.path)], = sim_predict.calibration_rows(shape, inputs, [t], skips[0], cfg.fit_split,
                                                            cfg.decode_width_ref)
    n = shape.batch_groups * shape.group_size
    return {"rows": rows, "costs": costs, "counts": counts, "prompt_tokens": cal.prompt_len(runs, n, skips[0]) * n}


def stats(errors: list[float]) -> str:
    if not errors:
        return "-"
    within = sum(abs(e) <= TOL for e in errors)
    return (f"{100 * statistics.fmean(abs(e) for e in errors):.1f}% | {within} / {len(errors)} | "
            f"{100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%")


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, help="run directories (one shape, several seeds)")
    ap.add_argument("--skip", nargs="+", type=int, default=[1, 5], help="SimConfig.skip_steps values")
    ap.add_argument("--pool", choices=("held_out", "all"), default="held_out",
                    help="runs that give the lengths and verification rates: all but the predicted one, or all")
    ap.add_argument("--json", default=None, help="write every prediction here")
    ap.add_argument("--md", default=None, help="write the tables here (else stdout)")
    args = ap.parse_args(argv)
    runs = [str(Path(p)) for p in args.runs]  # as the CLI's rows name them
    data = {p: cal.read_run(p) for p in runs}
    order = sorted(runs, key=lambda p: (MODE_ORDER.index(data[p].mode) if data[p].mode in MODE_ORDER else 9,
                                             run_seed(data[p]), p))
    name = {p: Path(p).name for p in order}
    res = predict([data[p] for p in order], args.pool, args.skip)
    rows, prompt_tokens = res["rows"], res["prompt_tokens"]
    md = []

    md.append("Measured seconds of the compared steps (decode / prefill / train / step; the seeds of one config "
              "differ only in TrainConfig.seed):\n")
    md.append("| run | " + " | ".join(f"skip {k}: decode / prefill / train / step (s) | train ms per 1k tokens"
                                       for k in args.skip) + " |")
    md.append("| --- " * (1 + 2 * len(args.skip)) + "|")
    for p in order:
        cells = []
        for k in args.skip:
            r = rows[k][order[0]][p]
            cells.append(f"{r['meas_decode_s']:.0f} / {r['meas_prefill_s']:.0f} / {r['meas_train_s']:.0f} / "
                         f"{r['measured_s']:.0f} | {1e6 * train_rate(data[p], k, prompt_tokens):.0f}")
        md.append(f"| `{name[p]}` | " + " | ".join(cells) + " |")

    same = {k: [] for k in args.skip}
    md.append("\n**(a) Same mode**: one seed's rates predicting another seed's run (all ordered pairs); "
              "\"other seed measured\" is the fit run's own measured seconds taken as the prediction.\n")
    md.append("| fit on | predicted | " + " | ".join(f"skip {k}: pred. / meas. (s) | error | other seed measured"
                                                     for k in args.skip) + " |")
    md.append("| --- " * (2 + 3 * len(args.skip)) + "|")
    for f in order:
        for t in order:
            if t == f or data[t].mode != data[f].mode:
                continue
            cells = []
            for k in args.skip:
                r = rows[k][f][t]
                naive = rows[k][f][f]["measured_s"] / r["measured_s"] - 1
                same[k].append((data[f].mode, r["error"], naive))
                cells.append(f"{r['predicted_s']:.0f} / {r['measured_s']:.0f} | {pct(r['error'])} | {pct(naive)}")
            md.append(f"| `{name[f]}` | `{name[t]}` | " + " | ".join(cells) + " |")
    md.append("\n| mode | skip | pairs | mean abs. error | within 15% | range | other seed measured: mean abs. | "
              "within 15% | range |")
    md.append("| --- " * 9 + "|")
    for mode in MODE_ORDER:
        for k in args.skip:
            e = [x for m, x, _ in same[k] if m == mode]
            n = [y for m, _, y in same[k] if m == mode]
            if e:
                md.append(f"| {mode} | {k} | {len(e)} | {stats(e)} | {stats(n)} |")
    for k in args.skip:
        e = [x for _, x, _ in same[k]]
        n = [y for _, _, y in same[k]]
        md.append(f"| all | {k} | {len(e)} | {stats(e)} | {stats(n)} |")

    md.append("\n**(b) Cross mode**: fit on each run, predict the runs of the other modes (same seed / other "
              "seeds).\n")
    md.append("| fit mode | predicted mode | seeds | " + " | ".join(
        f"skip {k}: n | mean abs. error | within 15% | range" for k in args.skip) + " |")
    md.append("| --- " * (3 + 4 * len(args.skip)) + "|")
    cross = {}
    for fm in MODE_ORDER:
        for tm in MODE_ORDER:
            if fm == tm:
                continue
            for seeds in ("same", "other"):
                cells = []
                for k in args.skip:
                    e = [rows[k][f][t]["error"] for f in order for t in order
                         if data[f].mode == fm and data[t].mode == tm
                         and (run_seed(data[f]) == run_seed(data[t])) == (seeds == "same")]
                    cross[(fm, tm, seeds, k)] = e
                    cells.append(f"{len(e)} | {stats(e)}" if e else "0 | - | - | -")
                if any(cross[(fm, tm, seeds, k)] for k in args.skip):
                    md.append(f"| {fm} | {tm} | {seeds} | " + " | ".join(cells) + " |")
    cells = []
    for k in args.skip:
        e = [x for (fm, tm, _, kk), v in cross.items() if kk == k for x in v]
        cells.append(f"{len(e)} | {stats(e)}")
    md.append("| all | all | all | " + " | ".join(cells) + " |")
    for k in args.skip:
        md.append(f"\nEvery prediction, skip {k} (rows: fit run; columns: predicted run; error of the wall-clock):\n")
        md.append("| fit on | " + " | ".join(f"`{name[t]}`" for t in order) + " |")
        md.append("| --- " * (1 + len(order)) + "|")
        for f in order:
            md.append(f"| `{name[f]}` | " + " | ".join(
                ("**" if abs(rows[k][f][t]["error"]) > TOL else "") + pct(rows[k][f][t]["error"])
                + ("**" if abs(rows[k][f][t]["error"]) > TOL else "") for t in order) + " |")

    k0 = args.skip[0]
    md.append(f"\n**(c) Event counts**, predicted / measured (steps after {k0}; the rates play no part; lengths "
              f"from {'every run but the predicted one' if args.pool == 'held_out' else 'every run'}):\n")
    md.append("| run | dispatches | prefill tokens | decoded tokens | slot util. | switch step |")
    md.append("| --- " * 6 + "|")
    count_err = {}
    for p in order:
        r = res["counts"][p]
        cells = []
        for key in ("dispatches", "prefill_tokens", "tokens_generated"):
            pr, me = r[f"pred_{key}"], r[f"meas_{key}"]
            count_err.setdefault(key, []).append(pr / max(me, 1) - 1)
            cells.append(f"{pr:,.0f} / {me:,.0f} ({pct(pr / max(me, 1) - 1)})")
        count_err.setdefault("slot_utilization", []).append(r["pred_slot_utilization"]
                                                            / max(r["meas_slot_utilization"], 1e-9) - 1)
        sw = (f"{r['predicted_switch']} / {r['measured_switch']}" if data[p].mode == "rollverify" else "-")
        md.append(f"| `{name[p]}` | " + " | ".join(cells) + f" | {r['pred_slot_utilization']:.3f} / "
                  f"{r['meas_slot_utilization']:.3f} | {sw} |")
    md.append("\n| count | mean abs. error | within 15% | range |\n| --- | --- | --- | --- |")
    for key, e in count_err.items():
        md.append(f"| {key} | {stats(e)} |")

    text = "\n".join(md) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    else:
        print(text)
    if args.json:
        out = {"runs": order, "skip": args.skip, "pool": args.pool,
               "costs": {str(k): v for k, v in res["costs"].items()},
               "predictions": {str(k): {f: list(v.values()) for f, v in rows[k].items()} for k in args.skip},
               "counts": list(res["counts"].values())}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
