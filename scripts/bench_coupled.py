"""The coupled verification rule's numerics and cost (issue 49).

1. False cuts: with unchanged weights the coupled rule must keep every token. Decode ``--slots`` trajectories of
   ``--new`` tokens (EOS off) with the engine, then resume each under the same weights with the coupled rule (the
   resume prefill recomputes, per cached token, the argmax the sampler takes with that token's own Gumbel noise)
   and count the tokens whose check disagrees with what decode sampled (per token, over every cached token,
   not only up to the first) and the trajectories the rule would cut. Per model and dtype.
2. Cost: the resume prefill of those trajectories with the two-stage rule's log-probs against the coupled rule's
   log-probs + argmax check, plus each rule's host-side verifier, timed on the same engine (best of
   ``--repeats``), for the tiny model and one with a 32K vocabulary (where the check's Gumbel noise is largest
   against the model's work on this CPU).

Usage: python scripts/bench_coupled.py [--slots 16] [--new 128] [--repeats 5] [--no-doc]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rollverify_jax.models import init_model, load_pretrained, model_config
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.sampling import NOISES, NOT_SAMPLED, sampled_argmax
from rollverify_jax.studies import benchlib
from rollverify_jax.verify import coupled_verify_with_stats, two_stage_verify_with_stats

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"
NOTE = ("two-stage = log pi only; coupled = log pi + the check from the same chunks of logits; the two altern"
        "ate repeat by repeat. 'flat' draws V Gumbel values (threefry) per cached token, O(V) work per positi"
        "on against the model's O(parameters): nothing measurable at 64 tokens, 3.1x with a 32K vocabulary on"
        " the 128-wide 4-layer model, 1.35x with Qwen3's 151,936 on the 1024-wide 4-layer one (0.41 GFLOP of "
        "forward per token). Qwen3-8B's forward is about 16 GFLOP per token, 40x more for the same draws, whi"
        "ch would put the flat check near 1% of the resume prefill: an extrapolation, not a measurement (no a"
        "ccelerator was lent to this task). 'two_level' draws nb + B values (384 at 32K, 1,315 at 151,936) an"
        "d takes the log-prob's normaliser from its block log-masses: 1.13x on the 128-wide 32K model, no mea"
        "surable cost (0.99x) on the 1024-wide one. The check is computed as the first index of the maximum ("
        "two plain reductions): XLA CPU's index-carrying argmax cost 3x more.")
COUPLING_NOTE = ("Agreement of two policies' draws with the same noise (3 x 1000 keys, standard error over the 3): "
                 "the coupled rule keeps a cached token exactly when they agree, so this is its per-token "
                 "acceptance at that shift. Both layouts sample exactly (tests/test_coupled_verify.py); they differ "
                 "in how often two nearby policies draw the same token.")
TOLERANCES = (0.0, 0.01, 0.05)  # VerifyConfig.coupled_tolerance values the false-cut count is taken at
DTYPES = {  # name -> (param dtype, compute dtype, KV dtype, EngineConfig.compute_dtype)
    "float32": ("float32", "float32", "float32", None),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16", None),
    "bf16 params and KV, EngineConfig.compute_dtype = 'float32'": ("bfloat16", "bfloat16", "bfloat16", "float32"),
}


# name -> model_config overrides of the random models the cost table times
WIDTHS = {"random tiny": {}, "random 1024-wide": {"hidden_size": 1024, "intermediate_size": 3072,
                                                  "num_attention_heads": 8, "num_key_value_heads": 4,
                                                  "head_dim": 128}}


def load_model(name: str, param_dtype: str, compute_dtype: str, vocab: int | None = None):
    if name == "tiny policy":
        return load_pretrained(POLICY, dtype=param_dtype, compute_dtype=compute_dtype)
    extra = {"vocab_size": vocab} if vocab else {}
    return init_model(model_config("tiny", param_dtype=param_dtype, dtype=compute_dtype, **WIDTHS[name], **extra),
                      seed=0)


def requests(n: int, new: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, vocab, size=rng.integers(24, 33)).astype(np.int32),
                       seed=1000 + i, max_new_tokens=new + 32) for i in range(n)]


def make_engine(model, slots: int, new: int, kv: str, engine_compute: str | None, chunk: int | None,
                noise: str = "flat"):
    cfg = EngineConfig(num_slots=slots, page_size=16, max_seq_len=64 + new, steps_per_dispatch=8, kv_dtype=kv,
                       compute_dtype=engine_compute, logits_chunk=chunk)
    return Engine(model, cfg, SamplingConfig(temperature=1.0, noise=noise))


def decoded(engine, slots: int, new: int, vocab: int) -> list[Trajectory]:
    """``slots`` trajectories decoded to ``new`` tokens, paused (finished ones have none: EOS is off)."""
    sched = Scheduler(engine, coupled=True)
    sched.submit(requests(slots, new, vocab))
    sched.run(until=lambda s: bool(s.slots) and all(t.num_tokens >= new for t in s.slots.values()))
    return sched.pause_all()


def false_cuts(engine, trajs, tolerances) -> dict:
    """Resumes ``trajs`` under the same weights with the coupled check, once per tolerance; keeps everything and
    counts the tokens whose check disagrees with decode (at each tolerance) and the trajectories it would cut."""
    out = {"trajectories": len(trajs)}
    for tol in tolerances:
        seen = []

        def record(new_logp, behavior_logp, versions, lengths, match=None, seen=seen):
            seen.append((match.copy(), lengths.copy()))
            return lengths

        sched = Scheduler(engine, coupled=True, coupled_tolerance=tol)
        sched.resume([_copy(t) for t in trajs], keep=record)
        sched.step()
        sched.pause_all()
        tokens = miss = cut = 0
        for match, lengths in seen:
            valid = np.arange(match.shape[1])[None, :] < lengths[:, None]
            tokens += int(valid.sum())
            miss += int((~match & valid).sum())
            cut += int((~match & valid).any(axis=1).sum())
        out.update({"tokens": tokens, (tol, "mismatches"): miss, (tol, "cut"): cut})
    return out


def _copy(t: Trajectory) -> Trajectory:
    return Trajectory.from_dict(t.to_dict())


def time_resume(engine, trajs, repeats: int) -> dict[str, tuple[float, float]]:
    """Per rule ('two_stage', 'coupled'): (best prefill seconds, best verifier seconds) of resuming ``trajs``: the
    resume prefill (log pi, plus the check for the coupled rule) read back, then the rule's verifier on the host.
    The two alternate, repeat by repeat, so a machine shared with other work loads both alike."""
    seqs = [np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)]) for t in trajs]
    slots = list(range(len(trajs)))
    plens = [len(t.prompt) for t in trajs]
    width = max(len(s) for s in seqs)
    for s, seq in zip(slots, seqs, strict=True):
        engine.allocator.allocate(s, len(seq))
    engine.sync_page_table()
    versions = np.zeros((len(trajs), width), np.int32)
    lengths = np.asarray([t.num_tokens for t in trajs], np.int32)
    behavior = np.zeros((len(trajs), width), np.float32)
    for i, t in enumerate(trajs):
        behavior[i, : t.num_tokens] = t.logps
    best = {"two_stage": (float("inf"), float("inf")), "coupled": (float("inf"), float("inf"))}
    try:
        for _ in range(repeats + 1):  # the first compiles
            for rule in best:
                t0 = time.perf_counter()
                if rule == "coupled":
                    logp, code = jax.device_get(engine.prefill(seqs, slots, plens,
                                                               coupled_seeds=[t.seed for t in trajs]))
                else:
                    logp = jax.device_get(engine.prefill(seqs, slots, plens, with_logp=True))
                t1 = time.perf_counter()
                new_logp = np.zeros((len(trajs), width), np.float32)
                new_logp[:, : logp.shape[1]] = logp[: len(trajs), :width]
                if rule == "coupled":
                    m = np.zeros((len(trajs), width), bool)
                    m[:, : code.shape[1]] = code[: len(trajs), :width] != NOT_SAMPLED
                    coupled_verify_with_stats(m, versions, lengths, 1)
                else:
                    two_stage_verify_with_stats(new_logp, behavior, versions, lengths, 0.01, 2.0, 1)
                t2 = time.perf_counter()
                best[rule] = (min(best[rule][0], t1 - t0), min(best[rule][1], t2 - t1))
    finally:
        for s in slots:
            engine.allocator.release(s)
    return best


def agreement(vocab: int, sigmas=(0.03, 0.1, 0.3, 1.0), rows: int = 1000, draws: int = 3) -> list[str]:
    """How often two policies draw the same token with the same noise, per noise layout: ``rows`` random
    distributions over ``vocab`` tokens (logits Gaussian with a scale drawn in [2, 5], from near-greedy to flat),
    each moved by Gaussian logit noise of ``sigma``; the mean TV, its optimal coupling 1 - TV, the flat draw's bound
    (1 - TV) / (1 + TV), and the measured agreement of each layout over ``rows x draws`` keys."""
    rng = np.random.default_rng(0)
    sample = {noise: jax.jit(sampled_argmax, static_argnums=3) for noise in NOISES}
    out = []
    for sigma in sigmas:
        tv, agree = [], {noise: [] for noise in NOISES}
        for d in range(draws):
            scale = rng.uniform(2.0, 5.0, size=(rows, 1)).astype(np.float32)
            a = rng.standard_normal((rows, vocab), dtype=np.float32) * scale
            b = a + sigma * rng.standard_normal((rows, vocab), dtype=np.float32)
            tv.append(float(jnp.mean(0.5 * jnp.abs(jax.nn.softmax(a) - jax.nn.softmax(b)).sum(-1))))
            seeds = jnp.arange(d * rows, (d + 1) * rows, dtype=jnp.uint32)
            index = jnp.zeros(rows, jnp.int32)
            for noise in NOISES:
                cfg = SamplingConfig(1.0, noise=noise)
                same = sample[noise](jnp.asarray(a), seeds, index, cfg) == sample[noise](jnp.asarray(b), seeds, index,
                                                                                         cfg)
                agree[noise].append(float(jnp.mean(same)))
        t = float(np.mean(tv))
        line = (f"| {vocab} | {sigma} | {t:.4f} | {1 - t:.4f} | {(1 - t) / (1 + t):.4f} | "
                + " | ".join(f"{np.mean(agree[n]):.4f} +- {np.std(agree[n], ddof=1) / np.sqrt(draws):.4f}"
                             for n in NOISES) + " |")
        print(line, flush=True)
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cut_slots", type=int, default=64, help="trajectories of the false-cut count")
    ap.add_argument("--cut_new", type=int, default=256, help="their length")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    rows = ["| model | dtypes | noise | logits_chunk | tokens checked | false mismatches | per token | "
            "trajectories cut | " + " | ".join(f"mismatches at tolerance {t}" for t in TOLERANCES[1:]) + " |",
            "|" + " --- |" * (8 + len(TOLERANCES) - 1)]
    for name in ("random tiny", "tiny policy"):
        for dtype, (param, compute, kv, engine_compute) in DTYPES.items():
            model = load_model(name, param, compute)
            for noise, chunk in (("flat", None), ("flat", 64), ("two_level", 64)):
                engine = make_engine(model, args.cut_slots, args.cut_new, kv, engine_compute, chunk, noise)
                trajs = decoded(engine, args.cut_slots, args.cut_new, model.cfg.vocab_size)
                r = false_cuts(engine, trajs, TOLERANCES)
                miss = r[(0.0, "mismatches")]
                line = (f"| {name} | {dtype} | {noise} | {chunk or 'unset'} | {r['tokens']} | {miss} | "
                        f"{miss / r['tokens']:.2e} | {r[(0.0, 'cut')]}/{r['trajectories']} | "
                        + " | ".join(str(r[(t, "mismatches")]) for t in TOLERANCES[1:]) + " |")
                print(line, flush=True)
                rows.append(line)
    cost = ["| model | vocab | noise | resume prefill, two-stage (ms) | coupled (ms) | ratio | verifier two-stage "
            "(ms) | coupled (ms) | prefill + verifier ratio |", "|" + " --- |" * 9]
    for name, vocab in (("random tiny", None), ("random tiny", 32768), ("random 1024-wide", 151936)):
        model = load_model(name, "float32", "float32", vocab)
        for noise in NOISES:
            engine = make_engine(model, args.slots, args.new, "float32", None, 64, noise)
            trajs = decoded(engine, args.slots, args.new, model.cfg.vocab_size)
            best = time_resume(engine, trajs, args.repeats)
            (p2, v2), (pc, vc) = best["two_stage"], best["coupled"]
            line = (f"| {name} | {model.cfg.vocab_size} | {noise} | {p2 * 1e3:.1f} | {pc * 1e3:.1f} | "
                    f"{pc / p2:.3f} | {v2 * 1e3:.2f} | {vc * 1e3:.2f} | {(pc + vc) / (p2 + v2):.3f} |")
            print(line, flush=True)
            cost.append(line)
    coupling = ["| vocab | logit noise | mean TV | optimal coupling 1 - TV | flat bound (1 - TV)/(1 + TV) | "
                + " | ".join(f"{n} agreement" for n in NOISES) + " |", "|" + " --- |" * (5 + len(NOISES))]
    coupling += agreement(151936)
    body = ("\n".join(rows) + f"\n\nSame weights for decode and resume ({args.cut_slots} trajectories x "
            f"{args.cut_new} tokens "
            "after a 24-32-token random prompt, EOS off, T = 1), so every disagreement of the coupled check (the "
            "resume prefill's `sampled_argmax` with each token's own Gumbel noise against the token decode sampled) is "
            "numerical noise between the two paths; a trajectory with one is cut by the rule (a false cut). dtypes "
            "as in the OPS noise floor section. The last columns: the mismatches left with "
            "`VerifyConfig.coupled_tolerance` at that value.\n\n" + "\n".join(cost) +
            f"\n\nThe resume prefill of the same {args.slots} x {args.new}-token trajectories (`logits_chunk = 64`, "
            "float32), read back, best of "
            f"{args.repeats}, then each rule's verifier on the host: " + NOTE + "\n\n"
            + "\n".join(coupling) + "\n\n" + COUPLING_NOTE + "\n")
    if not args.no_doc:
        benchlib.write_section("Coupled verification: false cuts and cost (bench_coupled.py)", body)


if __name__ == "__main__":
    main()
