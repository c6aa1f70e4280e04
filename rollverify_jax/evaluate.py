"""avg@k, pass@k and maj@k of a policy on its eval sets: ``python -m rollverify_jax.evaluate --checkpoint=...``.

``--checkpoint`` is a training workdir (its latest step), a ``<workdir>/checkpoints/<step>`` directory, or an
HF-layout policy directory. A workdir's run is read with its ``spec.json`` (``--gin_param`` binds on top of it);
``--gin_file`` reads the spec from gin instead, as an HF-layout directory does. Only the params of an orbax
checkpoint are read (no optimizer state, no paused cache), and nothing is created, moved or removed in the run's
directory. How evaluation samples is ``EvalConfig`` (rollverify_jax/run/evaluation.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from rollverify_jax.infra import cli, storage
from rollverify_jax.run.builder import build_policy, resolve_checkpoint
from rollverify_jax.run.run_dir import run_spec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gin_file", action="append", default=[],
                    help="read the spec from gin (default: the workdir's spec.json)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding on top of the spec")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--k", type=int, default=None,
                    help="samples per problem (default: EvalConfig.samples_per_problem, else TrainConfig.eval_samples)")
    ap.add_argument("--num_problems", type=int, default=None)
    ap.add_argument("--samples_out", default=None,
                    help="write EvalConfig.num_samples_logged generations to this JSONL file")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of a configuration error")
    cli.add_process_flags(ap)
    args = ap.parse_args(argv)
    if args.k is not None:  # EvalConfig checks it (0 used to be ignored in silence)
        args.gin_param.append(f"EvalConfig.samples_per_problem = {args.k}")
    cli.run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    # Checked before the evaluation, which can take hours: a bad --samples_out used to fail only after it.
    if args.num_problems is not None and args.num_problems < 1:
        raise ValueError(f"--num_problems={args.num_problems} must be >= 1.")
    if args.samples_out:
        storage.check_writable(args.samples_out, "--samples_out")
    # Its values (--k among them) are checked before the policy loads; a mistyped path fails here too.
    spec = run_spec(args.checkpoint, args.gin_file, args.gin_param)
    cli.start_process(spec, args)
    checkpoint = storage.as_path(args.checkpoint)
    if not (checkpoint / "config.json").exists():
        resolve_checkpoint(checkpoint)  # a mistyped path fails here, before the policy is loaded
    if args.num_problems is not None:
        spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, eval_size=args.num_problems))
    serving, evaluator = build_policy(spec, checkpoint=checkpoint)
    try:
        result = evaluator.run(samples_path=args.samples_out)
    finally:
        serving.close()
    for eval_set in evaluator.sets:
        print(f"{args.checkpoint}: {_set_line(result, eval_set.name, len(eval_set.records))}")
    if args.samples_out:
        print(f"samples: {args.samples_out}")


def _set_line(result: dict, name: str, problems: int) -> str:
    """One eval set's line: its problems and samples, avg@n, pass@k and maj@k, the mean response length."""
    key = f"eval/{name}/" if name else "eval/"
    n = next(k for k in result if k.startswith(f"{key}avg@")).split("@")[1]
    scores = "  ".join(f"{k[len(key):]} = {v:.4f}" for k, v in result.items()
                       if k.startswith(key) and k[len(key):].split("@")[0] in ("avg", "pass", "maj"))
    return (f"{name + ': ' if name else ''}{problems} problems x {n} samples: {scores}  "
            f"mean length {result[f'{key}response_length']:.1f}")


if __name__ == "__main__":
    main()
