"""Proves a run fits a TPU slice before anyone rents one: compiles its programs deviceless.

    python -m rollverify_jax.aot --gin_file=configs/qwen3_8b_dapo.gin [--topology=v5p:4x4x2] [--json out.json]
    python -m rollverify_jax.aot --gin_file=... --plan            # the shape plan: every program a run compiles
    python -m rollverify_jax.aot --gin_file=... --plan_compile    # each plan program's deviceless compile time

With libtpu installed (``pip install -e '.[tpu]'``), JAX compiles for a named TPU topology without the
hardware. This compiles the very programs training builds (``run.programs``: the learner's and the engine
plan's), for the config's mesh on that topology and at the config's real shapes:

- ``train_step``: one GRPO update call at the batch's worst case (every row at the full context, one packed
  row per sequence), with the config's micro-batching, remat, chunked log-probs and splash attention;
- ``prefill``: the resume prefill that returns verification log-probs, for the longest resumed sequence
  (``AotConfig.prefill_rows`` rows of ``max_seq_len`` tokens);
- ``decode``: one ``generate`` dispatch over every slot with the Pallas paged-attention kernel per device.

It reports per device what XLA allocates (arguments, outputs, aliased, temporaries) and its cost analysis,
the run's resident bytes (train state and KV pool) and the peak (resident plus the largest program's
transient bytes), against the chip's HBM: FITS or DOES NOT FIT. The step times are roofline estimates from
analytic FLOPs and the chip's peak, not measurements.

The persistent compilation cache (``compilation_cache.dir``, rollverify_jax/infra/compile_cache.py) holds deviceless
compiles too: a program compiled before is loaded, so its ``compile_s`` is then a load time (the report names
the cache; ``ROLLVERIFY_COMPILATION_CACHE=0`` measures the compiles).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile is deviceless: never start a local TPU client
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is claimed, so concurrent compiles are fine

import argparse  # noqa: E402
import json  # noqa: E402

from rollverify_jax.infra import compile_cache, storage  # noqa: E402
from rollverify_jax.infra.cli import run_cli  # noqa: E402
from rollverify_jax.run.programs import compile_plan, compile_run, plan_for  # noqa: E402
from rollverify_jax.run.spec import RunSpec, parse_gin  # noqa: E402
from rollverify_jax.scale.fit import format_report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding")
    ap.add_argument("--topology", default=None, help="TPU topology (default: AotConfig.topology)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--plan", action="store_true", help="list the run's shape plan (every program it compiles) "
                    "and stop: nothing is compiled")
    ap.add_argument("--plan_compile", action="store_true", help="compile every program of the shape plan "
                    "deviceless and report each one's compile time, instead of the fit report")
    ap.add_argument("--threads", type=int, default=4, help="programs compiled at once by --plan_compile")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    args = ap.parse_args(argv)

    def body():
        if args.json:  # before the compile, which takes minutes: a bad path used to fail only after it
            storage.check_writable(args.json, "--json")
        parse_gin(args.gin_file, args.gin_param)
        spec = RunSpec.from_gin()
        if args.plan:
            print(plan_for(spec, args.topology)[0].table())
            return
        cache = compile_cache.compilation_cache(**spec.compile_cache)
        if args.plan_compile:
            report = {**compile_plan(spec, args.topology, args.threads), "compilation_cache": cache}
            for r in report["programs"]:
                print(f"  {r['program']}: {r['compile_s']} s")
            print(f"{report['summary']}\n{report['compiled']} compiled in {report['total_s']} s of compile time, "
                  f"{report['wall_s']} s wall on {report['threads']} threads ({report['topology']})")
            if args.json:
                storage.write_text_atomically(args.json, json.dumps(report, indent=2) + "\n")
            return
        report = {**compile_run(spec, args.topology), "compilation_cache": cache}
        print(format_report(report))
        if args.json:
            storage.write_text_atomically(args.json, json.dumps(report, indent=2) + "\n")
        if not report["fits"]:
            raise SystemExit(1)

    run_cli(body, args.traceback)


if __name__ == "__main__":
    main()
