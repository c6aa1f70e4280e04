"""Builds the embedded default policy: a tiny Qwen3-architecture model taught the synthetic task by SFT.

The RL configs start from this checkpoint, so it has to be *partly* right: held-out accuracy when sampling
at temperature 1 should sit around 25%, with greedy accuracy (~37%) and pass@4 (~48%) well above it, which
is the room RL's sharpening has to work with in a few CPU minutes. Accuracy is controlled by
stopping early: the LR schedule spans ``--schedule-steps`` and training stops after ``--steps``. Held-out
accuracy rises steeply once the model has learned the task's format (from 25% to 44% sampled accuracy
between steps 450 and 500 of the 600-step schedule), and an LR schedule that does not depend on ``--steps``
means stopping at step N gives exactly the model the ``--eval-every`` curve shows at N. Everything is
deterministic given ``--seed`` on one backend (train data uses the seed, held-out problems seed + 1000).

The recipe is the package's: ``rl/sft.py`` (packing, the SFT loss and step, the learner's optimizer) on the
``tiny`` Qwen3 preset (``models/qwen3``); evaluation samples with the rollout's engine and scheduler.

Output (``--out``, HF layout): ``config.json`` + ``model.safetensors``, the char tokenizer files,
``task.json`` (the ``SyntheticTask`` kwargs the RL configs must reuse) and ``README.md`` with the numbers.

    .venv/bin/python scripts/make_tiny_policy.py --steps 450 --schedule-steps 600 --seed 0 --eval-every 50 \
        --out assets/tiny_policy
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from rollverify_jax.data.rewards import exact_reward
from rollverify_jax.data.synthetic import SyntheticTask, char_vocabulary, num_ops
from rollverify_jax.models.hf import param_count, save_pretrained
from rollverify_jax.models.qwen3 import init_model, model_config
from rollverify_jax.models.tokenizer import build_char_tokenizer
from rollverify_jax.rl import sft

EOS = "<|endoftext|>"
PAD = "<pad>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>", PAD)

# The tiny default task: median 3 steps, a lognormal tail clipped at 20 steps (p99 response ~4x median).
TASK_KWARGS: dict = dict(
    max_steps=20, length_median=3.0, length_sigma=0.75, max_value=99, max_operand=9, max_multiplier=3,
    holdout_fraction=0.1,
)
# Overrides of the `tiny` preset: small enough to train in a few minutes on two CPU cores.
MODEL_OVERRIDES: dict = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=512,
)
STEP_BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 9), (10, 14), (15, 10_000))


def evaluate(sampler: sft.Sampler, params, problems: list[dict], seed: int, num_samples: int) -> dict:
    """Greedy and temperature-1 (avg@num_samples) exact-answer accuracy, overall and by chain length."""
    sampler.set_params(params)
    prompts, answers = [p["prompt"] for p in problems], [p["answer"] for p in problems]

    def score(trajs) -> np.ndarray:
        texts = sampler.tokenizer.decode_batch([t.tokens for t in trajs], skip_special_tokens=True)
        return np.array([exact_reward(t, a) for t, a in zip(texts, answers, strict=True)])

    greedy = score(sampler.generate(prompts, seed, greedy=True))
    sampled, lengths = [], []
    for i in range(num_samples):
        trajs = sampler.generate(prompts, seed + (i + 1) * len(prompts), greedy=False)
        sampled.append(score(trajs))
        lengths.extend(t.num_tokens for t in trajs)
    sampled = np.stack(sampled, axis=1)  # [N, num_samples]
    return {
        "greedy_accuracy": float(greedy.mean()), "sampled_accuracy": float(sampled.mean()),
        "pass_at_k": float(sampled.max(axis=1).mean()),
        "by_num_steps": sft.bucket_accuracy(np.array([num_ops(p) for p in prompts]), STEP_BUCKETS, greedy, sampled),
        "sampled_response_tokens": sft.length_stats(lengths),
    }


def write_readme(out: Path, report: dict) -> None:
    """A human-readable summary next to the weights; tests parse the `Held-out sampled accuracy` line."""
    ev = report["eval"]
    rows = "\n".join(
        f"| {k} | {v['n']} | {v['greedy']:.3f} | {v['sampled']:.3f} |" for k, v in ev["by_num_steps"].items()
    )
    ref, smp = report["reference_response_tokens"], ev["sampled_response_tokens"]
    curve = "\n".join(f"| {c['step']} | {c['greedy']:.3f} | {c['sampled']:.3f} |" for c in report["curve"])
    text = f"""# tiny_policy: the embedded default policy

Written by `scripts/make_tiny_policy.py {report['command']}`; rerun that command (on CPU) to
reproduce it. A Qwen3-architecture model ({report['params']:,} parameters) with a character-level
tokenizer (EOS `{EOS}`, pad `{PAD}`), supervised fine-tuned on `prompt + solution + {EOS}` from the
synthetic task's train split (loss on solution tokens only). It is deliberately undertrained, so RL has room
to improve it. Use `task.json` (the `SyntheticTask` kwargs) to get exactly the same task.

- SFT steps: {report['steps']}, stopped early in a {report['schedule_steps']}-step warmup + cosine schedule
  (batch {report['batch_rows']} x {report['row_length']} packed tokens, {report['train_examples']:,} train examples,
  first batch's loss {report['first_loss']:.4f}, final loss {report['final_loss']:.4f})
- Wall-clock: {report['wall_clock_s']:.0f} s total, {report['train_s']:.0f} s of it SFT
  ({report['device']}, {os.cpu_count()} cores)
- Held-out problems: {report['eval_problems']} (test split, seed {report['eval_seed']})
- Held-out sampled accuracy (T=1, avg@{report['num_samples']}): {ev['sampled_accuracy']:.3f}
- Held-out greedy accuracy: {ev['greedy_accuracy']:.3f}
- Held-out pass@{report['num_samples']} (T=1): {ev['pass_at_k']:.3f}
- Reference response tokens (solution + EOS): median {ref['median']:.0f}, p90 {ref['p90']:.0f},
  p99 {ref['p99']:.0f}, max {ref['max']}
- Sampled response tokens: median {smp['median']:.0f}, p90 {smp['p90']:.0f}, p99 {smp['p99']:.0f},
  max {smp['max']}

Accuracy by number of arithmetic steps in the problem:

| steps | problems | greedy | sampled (T=1) |
|---|---|---|---|
{rows}

Held-out accuracy during SFT (same schedule; the last row is the saved policy):

| SFT step | greedy | sampled (T=1) |
|---|---|---|
{curve}

Model config: `{json.dumps(report['model_overrides'])}` over the `tiny` preset, vocab_size {report['vocab_size']}.
Task: `{json.dumps(report['task'])}`.
"""
    (out / "README.md").write_text(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return sft_argument_parser(__doc__.split("\n\n")[0], Path("assets/tiny_policy")).parse_args(argv)


def sft_argument_parser(description: str, out: Path) -> argparse.ArgumentParser:
    """The flags of a tiny policy's SFT (this script's, and the tool policy's, which adds its own)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=450, help="SFT steps taken; fewer, lower accuracy")
    ap.add_argument("--schedule-steps", type=int, default=600, help="LR schedule horizon (>= --steps)")
    ap.add_argument("--seed", type=int, default=0, help="model init, train data and sampling seed")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--batch-rows", type=int, default=16, help="packed rows per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-problems", type=int, default=400, help="held-out (test split) problems")
    ap.add_argument("--num-samples", type=int, default=4, help="T=1 samples per held-out problem")
    ap.add_argument("--eval-batch", type=int, default=64, help="decode slots of the evaluation engine")
    ap.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only at the end)")
    ap.add_argument("--model", type=json.loads, default=None, help="JSON overrides of the model config")
    ap.add_argument("--task", type=json.loads, default=None, help="JSON overrides of the task kwargs")
    return ap


def command_line(args: argparse.Namespace, extra: str = "") -> str:
    """The flags that reproduce this run, for the README."""
    command = f"--steps {args.steps} --schedule-steps {args.schedule_steps} --seed {args.seed}"
    command += f" --eval-every {args.eval_every}" if args.eval_every else ""
    return command + extra + "".join(
        f" --{name} '{json.dumps(value)}'" for name, value in (("model", args.model), ("task", args.task)) if value)


def main(argv: Sequence[str] | None = None) -> dict:
    """Builds tokenizer and model, runs SFT, evaluates, writes everything to ``--out``; returns the report."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    task_kwargs = {**TASK_KWARGS, **(args.task or {})}
    overrides = {**MODEL_OVERRIDES, **(args.model or {})}

    tokenizer = build_char_tokenizer(char_vocabulary(), SPECIAL_TOKENS, out, eos_tokens=[EOS], pad_token=PAD)
    train_task = SyntheticTask(seed=args.seed, split="train", **task_kwargs)
    prompt_max, solution_max = train_task.length_bounds()
    row_length = -(-(prompt_max + solution_max) // 32) * 32
    overrides["max_position_embeddings"] = max(overrides["max_position_embeddings"], row_length)
    cfg = model_config("tiny", vocab_size=-(-tokenizer.vocab_size // 8) * 8, **overrides)
    model = init_model(cfg, seed=args.seed)

    def next_example() -> sft.Example:
        ex = train_task.sample(packer.drawn)
        return sft.sft_example(tokenizer, ex["prompt"], [(ex["solution"], False)], EOS)

    packer = sft.SFTPacker(next_example, args.batch_rows, row_length)
    eval_seed = args.seed + 1000
    problems = [SyntheticTask(seed=eval_seed, split="test", **task_kwargs).sample(i)
                for i in range(args.eval_problems)]
    prompt_len = max(len(ids) for ids in tokenizer.encode_batch([p["prompt"] for p in problems]))
    sampler = sft.Sampler(model, tokenizer, prompt_len, solution_max, args.eval_batch, EOS)

    def curve_point(step: int, params) -> dict:
        ev = evaluate(sampler, params, problems, eval_seed, args.num_samples)
        tqdm.write(f"step {step}: greedy {ev['greedy_accuracy']:.3f} sampled {ev['sampled_accuracy']:.3f}")
        return {"step": step, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]}

    print(f"model: {param_count(model):,} params, {cfg}", flush=True)
    print(f"task: {task_kwargs}; packed rows {args.batch_rows} x {row_length}", flush=True)
    optimizer = sft.sft_optimizer(max(args.steps, args.schedule_steps), args.lr, args.warmup_frac, args.weight_decay)
    result = sft.run_sft(model, optimizer, packer.batch, args.steps, args.eval_every, curve_point)
    ev = evaluate(sampler, result.params, problems, eval_seed, args.num_samples)
    curve = [*result.curve, {"step": args.steps, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]}]
    nnx.update(model, result.params)
    save_pretrained(model, out)
    (out / "task.json").write_text(json.dumps(task_kwargs, indent=2) + "\n")

    reference = [len(train_task.sample(i)["solution"]) + 1 for i in range(5000)]
    report = {
        "command": command_line(args), "steps": args.steps, "schedule_steps": max(args.steps, args.schedule_steps),
        "seed": args.seed, "params": param_count(model), "vocab_size": cfg.vocab_size,
        "model_overrides": overrides, "task": task_kwargs, "batch_rows": args.batch_rows, "row_length": row_length,
        "train_examples": packer.used, "first_loss": result.first_loss, "final_loss": result.final_loss,
        "train_s": result.train_s, "wall_clock_s": time.perf_counter() - t0, "device": jax.devices()[0].device_kind,
        "eval_problems": len(problems), "eval_seed": eval_seed, "num_samples": args.num_samples,
        "reference_response_tokens": sft.length_stats(reference), "eval": ev, "curve": curve,
    }
    write_readme(out, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
