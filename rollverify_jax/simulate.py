"""Predicts wall-clock and device-days of a run in each rollout mode, without running it.

    python -m rollverify_jax.simulate --gin_file=configs/tiny_rollverify.gin [--gin_param=...] [--steps N]
        [--calibrate_from RUN_DIR ... [--fit_from RUN_DIR ...]] [--json out.json]
    python -m rollverify_jax.simulate --calibrate_from RUN_DIR ... [--steps N] [--json out.json]

A discrete-event replay of the scheduler and training loop (``rollverify_jax/sim/replay.py``) over the run's
shape (B, G, slots, steps per dispatch, response cap, switching: read from its spec) for on-policy,
naive partial and RollVerify, with a cost model (``rollverify_jax/sim/costs.py``): measured rates fitted on
runs (``--calibrate_from``: their ``metrics.jsonl``), or the compiled programs' roofline (``SimConfig.costs =
'roofline'`` with ``RooflineCosts`` bound, configs/sim/*.gin). With ``--calibrate_from``, the response lengths
and RollVerify's acceptance per step come from those runs too, and the prediction for every run given is
printed beside its measured wall-clock, timers and event counts (rates from the ``--fit_from`` runs, by default
the on-policy ones). With ``--calibrate_from``, RollVerify's per-segment failure probability by age comes from
the RollVerify runs' logged segment statistics (``calibrate.fit_segment_fail_prob``). docs/results/simulator.md
has the equations and the calibration.

The spec is the gin config's (``--gin_file``: the one path that imports gin and the configurables' modules,
JAX among them), else the ``spec.json`` of the first ``--calibrate_from`` run, read as plain data: that path
imports no JAX, unless the spec sets ``EngineConfig.kv_memory_bytes`` (the KV pool's size then needs the
model's geometry, from ``rollverify_jax.models``). The simulator itself is ``rollverify_jax/sim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rollverify_jax.infra.cli import run_cli
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim import predict
from rollverify_jax.sim.shape import RunShape, check_same_shape, needs_model, run_shape, sim_config, sim_costs


def spec_from_gin(gin_files: list[str], gin_params: list[str]) -> dict[str, Any]:
    """The plain spec of a gin configuration (``RunSpec.to_json``): imports gin and every configurable's module,
    JAX among them, so it is imported here only when a gin file is given."""
    from rollverify_jax.run.spec import RunSpec, parse_gin

    parse_gin(gin_files, gin_params)
    return json.loads(RunSpec.from_gin().to_json())


def model_pool_pages(spec: Mapping[str, Any]) -> Callable[[int], int]:
    """``rollout.engine.pool_pages`` of the spec's ``model_config`` and ``EngineConfig`` (imports JAX: only a
    spec with a KV budget needs it)."""
    from rollverify_jax.infra import spec_json
    from rollverify_jax.models import model_config
    from rollverify_jax.rollout.engine import EngineConfig, pool_pages

    model = model_config(**spec_json.from_plain(spec.get("model", {})))
    engine = spec_json.dataclass_from_plain(EngineConfig, spec["engine"], "engine")
    return lambda shards: pool_pages(model, engine, shards)


def shape_of(spec: Mapping[str, Any]) -> RunShape:
    """The simulated run's shape from its plain spec (``sim.shape.run_shape``)."""
    return run_shape(spec, model_pool_pages(spec) if needs_model(spec) else None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gin_file", action="append", default=[],
                    help="gin config file (repeatable; default: the spec.json of the first --calibrate_from run)")
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
    if not args.gin_file and not args.calibrate_from:
        raise ValueError("--gin_file or --calibrate_from is required: the run's config (e.g. "
                         "configs/tiny_rollverify.gin), or runs whose spec.json is simulated.")
    if args.gin_param and not args.gin_file:
        raise ValueError("--gin_param needs --gin_file: a run's spec.json is simulated as it is; to change it, pass "
                         "its config (--gin_file=RUN_DIR/config.gin) and the bindings.")
    for f in args.gin_file:
        if not Path(f).is_file():
            raise FileNotFoundError(f"gin file {f} does not exist.")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps={args.steps} must be >= 1.")
    runs = [cal.read_run(p) for p in args.calibrate_from]  # bad run directories fail before any import
    fit_runs = [cal.read_run(p) for p in args.fit_from]
    if fit_runs and not runs:
        raise ValueError("--fit_from needs --calibrate_from (the runs to compare and to take lengths from).")
    spec = spec_from_gin(args.gin_file, args.gin_param) if args.gin_file else runs[0].spec
    config = args.gin_file or [str(runs[0].path / "spec.json")]
    cfg, shape = sim_config(spec), shape_of(spec)
    for run in runs + fit_runs:
        check_same_shape(shape, run.spec, str(run.path))
    inputs = predict.build_inputs(cfg, shape, runs, fit_runs, sim_costs(spec))
    steps = args.steps or cfg.num_steps or shape.num_steps
    rows = [{**predict.run_mode(m, shape, inputs, steps).summary(inputs.num_devices)} for m in cfg.modes]
    print(f"{', '.join(config)}: B={shape.batch_groups} G={shape.group_size} slots={shape.num_slots} "
          f"k={shape.steps_per_dispatch} max_new_tokens={shape.max_new_tokens} prompt={inputs.prompt_len} "
          f"devices={inputs.num_devices} lengths={inputs.length_kwargs}")
    print(predict.format_table(rows))
    report = {"config": config, "gin_params": args.gin_param, "shape": dataclasses.asdict(shape),
              "costs": dataclasses.asdict(inputs.costs), "lengths": inputs.length_kwargs,
              "prompt_len": inputs.prompt_len, "notes": inputs.notes, "modes": rows}
    if runs:
        calib = predict.calibration_rows(shape, inputs, runs, cfg.skip_steps, cfg.fit_split, cfg.decode_width_ref)
        how = ("each run's rates fitted on its own odd steps, compared on its even steps"
               if cfg.fit_split == "odd_even"
               else "rates fitted on every step after the skipped ones of: " + ", ".join(inputs.notes["fit_runs"]))
        print(f"\nCalibration ({how})")
        print(predict.format_calibration(calib))
        print("\nEvent counts, predicted / measured")
        print(predict.format_counts(calib))
        report["calibration"] = calib
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


if __name__ == "__main__":
    main()
