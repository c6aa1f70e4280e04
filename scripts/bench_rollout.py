"""Static batching vs continuous batching (as partial rollout uses it) on a long-tailed length workload.

Every request has a forced response length drawn from a lognormal with mean ~ max_new/8 (EOS disabled), so
both modes do identical work per sequence. Static: batches of ``num_slots`` requests, each waiting for its
longest member (a synchronous rollout). Continuous: the same request stream through the scheduler; a phase
ends once ``num_slots`` sequences have finished, the rest are paused (their tokens count as useful work)
and resumed first in the next phase, like partial rollout.

Usage: python scripts/bench_rollout.py [--sequences 256] [--slots 32] [--max-new 512] [--group-size 8] [--json out.json]

``--compare-dispatch-ahead [ROUNDS]``: instead, the continuous workload with ``EngineConfig.dispatch_ahead`` on and off,
interleaved over ROUNDS rounds (its own section).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from rollverify_jax.models import init_model, model_config
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout import engine as engine_lib
from rollverify_jax.studies import benchlib


def workload(n: int, max_new: int, seed: int, sigma: float = 1.0, group_size: int = 1) -> list[Trajectory]:
    """Lognormal response lengths with mean max_new / 8, clipped to [1, max_new]; ``group_size`` consecutive
    requests answer one prompt (a GRPO group: same prompt and group id, their own lengths)."""
    rng = np.random.default_rng(seed)
    mu = np.log(max_new / 8) - sigma**2 / 2
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, size=n)), 1, max_new).astype(int)
    prompts = [rng.integers(4, 60, size=rng.integers(8, 17)).astype(np.int32) for _ in range(-(-n // group_size))]
    return [Trajectory(uid=i, group_id=i // group_size, prompt=prompts[i // group_size], seed=i,
                       max_new_tokens=int(lengths[i])) for i in range(n)]


def run_static(engine: Engine, reqs: list[Trajectory]) -> dict:
    sched = Scheduler(engine)
    slots = engine.config.num_slots
    t0 = time.perf_counter()
    for i in range(0, len(reqs), slots):
        sched.submit(reqs[i: i + slots])
        sched.run()  # the batch waits for its longest member
    wall = time.perf_counter() - t0
    return _summary(sched, wall, sum(t.num_tokens for t in sched.finished), len(sched.finished))


def run_continuous(engine: Engine, reqs: list[Trajectory], target_finished: int) -> dict:
    sched = Scheduler(engine)
    slots = engine.config.num_slots
    stream = iter(reqs)
    paused: list[Trajectory] = []
    finished = 0
    phases = 0
    t0 = time.perf_counter()
    while finished < target_finished:
        sched.resume(paused)
        # keep the queue ahead of the free slots: partial rollout always has prompts waiting
        sched.submit([next(stream) for _ in range(2 * slots - len(paused))] if len(paused) < 2 * slots else [])
        phase_goal = min(slots, target_finished - finished)
        sched.run(until=lambda s, goal=phase_goal: len(s.finished) >= goal)
        finished += len(sched.take_finished())
        paused = sched.pause_all()
        phases += 1
    wall = time.perf_counter() - t0
    useful = sched.stats.tokens_generated
    out = _summary(sched, wall, useful, finished)
    out["phases"] = phases
    return out


def _summary(sched: Scheduler, wall: float, useful_tokens: int, sequences: int) -> dict:
    st = sched.stats
    return dict(tokens_per_s=useful_tokens / wall,
                slot_utilization=st.slot_utilization(sched.engine.config.num_slots),
                host_overhead=st.host_time / wall, prefill_fraction=st.prefill_time / wall, wall_s=wall,
                useful_tokens=useful_tokens, sequences=sequences,
                decode_steps=st.decode_steps, dispatches=st.dispatches, prefill_tokens=st.prefill_tokens,
                shared_prompt_tokens=st.shared_prompt_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--steps-per-dispatch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt in the grouped workload")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare-dispatch-ahead", type=int, default=0, metavar="ROUNDS")
    args = ap.parse_args()
    model = init_model(model_config("tiny"))
    cfg = EngineConfig(num_slots=args.slots, page_size=16, max_seq_len=args.max_new + 32,
                       steps_per_dispatch=args.steps_per_dispatch)
    if args.compare_dispatch_ahead:
        return compare_dispatch_ahead(args, model, cfg)
    engine = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=())
    reqs = workload(args.sequences * 4, args.max_new, args.seed)
    lengths = np.array([t.max_new_tokens for t in reqs[: args.sequences]])
    print(f"workload: {args.sequences} sequences, lengths mean {lengths.mean():.1f} median {np.median(lengths):.0f} "
          f"p99 {np.percentile(lengths, 99):.0f} max {lengths.max()} (max_new {args.max_new})")
    # Shapes compile on first use: run the timed workloads once untimed, so compile time stays out of the
    # measurement (the same requests take the same shapes).
    grouped = workload(args.sequences * 4, args.max_new, args.seed, group_size=args.group_size)
    t0 = time.perf_counter()
    run_static(engine, [_fresh(t) for t in reqs[: args.sequences]])
    run_continuous(engine, [_fresh(t) for t in reqs], args.sequences)
    run_continuous(engine, [_fresh(t) for t in grouped], args.sequences)
    print(f"warm-up run (compiles the shapes used): {time.perf_counter() - t0:.1f}s")
    before = engine_lib.compiled_programs()
    static = run_static(engine, [_fresh(t) for t in reqs[: args.sequences]])
    cont = run_continuous(engine, [_fresh(t) for t in reqs], args.sequences)
    cont_groups = run_continuous(engine, [_fresh(t) for t in grouped], args.sequences)
    recompiles = engine_lib.compiled_programs() - before
    ratio = cont["tokens_per_s"] / static["tokens_per_s"]
    runs = (("static", static), ("continuous", cont), (f"continuous, groups of {args.group_size}", cont_groups))
    for name, r in runs:
        print(f"{name:>10}: {r['tokens_per_s']:8.0f} tokens/s  slot utilization {r['slot_utilization']:.3f}  "
              f"host overhead {r['host_overhead']:.3f}  prefill {r['prefill_fraction']:.3f}  "
              f"wall {r['wall_s']:.1f}s  decode steps {r['decode_steps']}")
    print(f"continuous / static tokens/s: {ratio:.2f}x; recompiles during timed runs: {recompiles}")
    rows = ["| mode | tokens/s | slot utilization | host overhead | prefill share | wall (s) | decode steps | "
            "useful tokens | prefilled tokens | shared prompt tokens |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {n} | {r['tokens_per_s']:.0f} | {r['slot_utilization']:.3f} | {r['host_overhead']:.3f} | "
             f"{r['prefill_fraction']:.3f} | "
             f"{r['wall_s']:.1f} | {r['decode_steps']} | {r['useful_tokens']} | {r['prefill_tokens']} | "
             f"{r['shared_prompt_tokens']} |" for n, r in runs]
    body = "\n".join(rows) + (
        f"\n\nWorkload: {args.sequences} sequences, forced lognormal lengths (mean {lengths.mean():.1f}, median "
        f"{np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}, cap {args.max_new}), "
        f"tiny model, {args.slots} slots, {args.steps_per_dispatch} decode steps per dispatch. Continuous ran "
        f"{cont['phases']} partial-rollout phases ({args.slots} finished sequences each; paused tokens count as "
        f"useful). The grouped row runs the same lengths with every {args.group_size} consecutive requests answering "
        f"one prompt (a GRPO group): members admitted together share one prefill of it. Prefill share = prefill + "
        f"insert calls (packed rows, one call per length bucket and admission round) / wall-clock. Speed-up "
        f"{ratio:.2f}x; recompiles during the timed runs: {recompiles}.")
    benchlib.write_section("Rollout: static vs continuous batching (bench_rollout.py)", body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"static": static, "continuous": cont, "continuous_groups": cont_groups, "speedup": ratio,
                       "recompiles": recompiles}, f, indent=2)


def compare_dispatch_ahead(args, model, cfg: EngineConfig) -> None:
    """The continuous (partial-rollout) workload with decode dispatched ahead and in turn, interleaved."""
    reqs = workload(args.sequences * 4, args.max_new, args.seed)
    engines = {on: Engine(model, dataclasses.replace(cfg, dispatch_ahead=on), SamplingConfig(temperature=1.0),
                          eos_ids=()) for on in (True, False)}
    for engine in engines.values():  # compiles every shape the timed rounds use
        run_continuous(engine, [_fresh(t) for t in reqs], args.sequences)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.compare_dispatch_ahead):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            runs[on].append(run_continuous(engines[on], [_fresh(t) for t in reqs], args.sequences))
    ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[True], runs[False],
                                                                                   strict=True))
    rows = ["| dispatch | tokens/s | slot utilization | host overhead | decode steps | dispatches |",
            "| --- | --- | --- | --- | --- | --- |"]
    for on, name in ((True, "ahead"), (False, "in turn")):
        med = {k: statistics.median(x[k] for x in runs[on])
               for k in ("tokens_per_s", "slot_utilization", "host_overhead", "decode_steps", "dispatches")}
        print(f"{name:>8}: {med['tokens_per_s']:.0f} tokens/s, slot utilization {med['slot_utilization']:.3f}, "
              f"host overhead {med['host_overhead']:.3f}, decode steps {med['decode_steps']:.0f}")
        rows.append(f"| {name} | {med['tokens_per_s']:.0f} | {med['slot_utilization']:.3f} | "
                    f"{med['host_overhead']:.3f} | {med['decode_steps']:.0f} | {med['dispatches']:.0f} |")
    print(f"ahead / in turn tokens/s: {ratio:.2f}x (median of {args.compare_dispatch_ahead} paired rounds)")
    body = "\n".join(rows) + (
        f"\n\nahead / in turn: {ratio:.2f}x tokens/s (median of {args.compare_dispatch_ahead} paired, interleaved "
        f"rounds; the other columns are medians). The continuous workload of the section above: "
        f"{args.sequences} finished sequences in partial-rollout phases of {args.slots}, forced lognormal lengths "
        f"(cap {args.max_new}), tiny model, {args.slots} slots, {args.steps_per_dispatch} decode steps per "
        "dispatch. `EngineConfig.dispatch_ahead`: decode n + 1 is dispatched before n's outputs are read, so a slot "
        "that finishes in n is refilled a dispatch later (more decode steps for the same tokens, lower slot "
        "utilization); what it buys is the host's work overlapping the device's, which is small here (host "
        "overhead column).")
    benchlib.write_section("Rollout: dispatching ahead (bench_rollout.py --compare-dispatch-ahead)", body)


def _fresh(t: Trajectory) -> Trajectory:
    return Trajectory(uid=t.uid, group_id=t.group_id, prompt=t.prompt, seed=t.seed, max_new_tokens=t.max_new_tokens)


if __name__ == "__main__":
    main()
