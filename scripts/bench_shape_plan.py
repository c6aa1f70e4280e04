"""Programs per config and what compiling them costs: the shape plan (``run/shape_plan.py``) of each config, its
prefill padding at the config's length model, and (``--compile``) every program's deviceless compile time for the
config's TPU topology (``aot --plan_compile``). Writes JSON; docs/benchmarks.md holds the numbers.

    python scripts/bench_shape_plan.py --out runs/bench/shape_plan.json [--compile] [--threads 2] \
        configs/tiny_rollverify.gin configs/qwen3_8b_dapo.gin ...
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: never start a local TPU client
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

from rollverify_jax.run import shape_plan  # noqa: E402
from rollverify_jax.run.programs import compile_plan, plan_for  # noqa: E402
from rollverify_jax.run.spec import RunSpec, parse_gin  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compile", action="store_true", help="compile every plan program deviceless (minutes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--topology", default=None, help="for configs without AotConfig.topology (default v5p:2x2x4)")
    ap.add_argument("--length_model", default=None, help="a gin file binding SimConfig's length model for the "
                    "configs that have none of their own (e.g. configs/sim/scale_common.gin: DAPO's lengths)")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else {}
    for path in args.configs:
        parse_gin([path, *([args.length_model] if args.length_model and "tiny" not in path else [])], [])
        spec = RunSpec.from_gin()
        topology = args.topology or spec.aot.topology or "v5p:2x2x4"
        plan = plan_for(spec, topology)[0]
        lengths = shape_plan.length_model_sample(spec)
        waste = {w: p for w, p in shape_plan.prefill_waste(sorted({dict(x.dims)["width"] for x in plan.of("prefill")}),
                                                             lengths).items() if not math.isnan(p)}
        row = {"topology": topology, "programs": len(plan), "setup": sum(shape_plan.SETUP.values()),
               "families": plan.counts(), "prefill_waste": waste}
        print(f"{path}: {plan.summary()}", flush=True)
        if args.compile:
            report = compile_plan(spec, topology, args.threads)
            row.update(compiled=report["compiled"], compile_s=report["total_s"], wall_s=report["wall_s"],
                       slowest=sorted(report["programs"], key=lambda r: -r["compile_s"])[:3])
            print(f"  {report['compiled']} compiled: {report['total_s']} s of compile, {report['wall_s']} s wall",
                  flush=True)
        rows[path] = row
        out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
