"""Builds the tiny tool-using policy: the embedded default's model, taught the tool task by SFT.

The task is ``synthetic_tools`` (``rollverify_jax/data/synthetic_tools.py``): arithmetic chains whose big steps
(``*m``, ``//m`` on values up to 99999) are calculator calls, ``<calculator>10*523</calculator>``, answered by the
environment with ``<tool_response>5230</tool_response>``. The four tags are one token each (non-special added
tokens of the char tokenizer, so decoding keeps them), the alphabet is printable ASCII (anything a calculator
reply or error can print), and SFT's loss skips the reply tokens: the policy reads them, it does not write them.

Like ``make_tiny_policy.py`` (whose model settings and flags this reuses; the SFT is ``rl/sft.py``'s), the
policy is deliberately undertrained, stopped early in a longer LR schedule, so held-out sampled accuracy (T=1,
with tool use) sits in the 20-40% range RL can improve. Evaluation runs the calls: each response stops at
``</calculator>``, the call is evaluated, the reply is appended as environment tokens and decoding continues.

Output (``--out``, HF layout): ``config.json`` + ``model.safetensors``, the tokenizer files, ``task.json`` (the
``SyntheticToolTask`` kwargs), ``tool_use.json`` (the ``ToolUseConfig`` the configs bind) and ``README.md``.

    .venv/bin/python scripts/make_tiny_tool_policy.py --steps 450 --schedule-steps 600 --seed 0 \
        --out assets/tiny_tool_policy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import make_tiny_policy as base  # the sibling recipe (this file's directory is on sys.path when it runs)
import numpy as np
from flax import nnx
from tqdm import tqdm

from rollverify_jax.data.rewards import exact_reward
from rollverify_jax.data.synthetic import num_ops
from rollverify_jax.data.synthetic_tools import (
    CALL_END,
    REPLY_PREFIX,
    REPLY_SUFFIX,
    TOOL_NAME,
    TOOL_TAGS,
    SyntheticToolTask,
    char_vocabulary,
    num_tool_steps,
)
from rollverify_jax.models.hf import param_count, save_pretrained
from rollverify_jax.models.qwen3 import init_model, model_config
from rollverify_jax.models.tokenizer import build_char_tokenizer
from rollverify_jax.rl import sft
from rollverify_jax.rollout.tool_use import ToolEnvironment, ToolUseConfig

EOS, PAD = base.EOS, base.PAD

# Median 3 steps, a lognormal tail clipped at 16 steps (p99 response ~4x median), 1-8 calculator calls each.
TASK_KWARGS: dict = dict(
    max_steps=16, length_median=3.0, length_sigma=0.75, max_value=99_999, max_start=99, max_operand=9,
    min_factor=11, max_factor=999, tool_fraction=0.4, max_tool_steps=8, holdout_fraction=0.1,
)
# What configs/tiny_tool_base.gin binds as ToolUseConfig (the rollout's side of the same protocol).
TOOL_USE = ToolUseConfig(
    enabled=True, tools=(TOOL_NAME,), call_end_token=CALL_END, reply_prefix=REPLY_PREFIX, reply_suffix=REPLY_SUFFIX,
    max_calls=8, max_reply_tokens=32, timeout_s=10.0,
)
CALL_BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 5), (6, 10_000))


def evaluate(sampler: sft.Sampler, params, problems: list[dict], seed: int, num_samples: int) -> dict:
    """Greedy and temperature-1 (avg@num_samples) exact-answer accuracy with tool use, overall and by number of
    steps and of tool steps; calls per response and how many of them the calculator refused."""
    sampler.set_params(params)
    prompts, answers = [p["prompt"] for p in problems], [p["answer"] for p in problems]

    def score(trajs) -> np.ndarray:
        texts = sampler.tokenizer.decode_batch([t.tokens for t in trajs], skip_special_tokens=True)
        return np.array([exact_reward(t, a) for t, a in zip(texts, answers, strict=True)])

    greedy = score(sampler.generate(prompts, seed, greedy=True))
    sampled, lengths, calls = [], [], []
    sampler.tools.reset_stats()
    for i in range(num_samples):
        trajs = sampler.generate(prompts, seed + (i + 1) * len(prompts), greedy=False)
        sampled.append(score(trajs))
        lengths.extend(t.num_tokens for t in trajs)
        calls.extend(t.tool_calls for t in trajs)
    stats = sampler.tools.stats
    sampled = np.stack(sampled, axis=1)  # [N, num_samples]
    needed = np.array([num_tool_steps(p) for p in prompts])
    calls_arr = np.asarray(calls).reshape(num_samples, -1).T  # [N, num_samples]
    return {
        "greedy_accuracy": float(greedy.mean()), "sampled_accuracy": float(sampled.mean()),
        "pass_at_k": float(sampled.max(axis=1).mean()),
        "by_num_steps": sft.bucket_accuracy(np.array([num_ops(p) for p in prompts]), base.STEP_BUCKETS, greedy,
                                            sampled),
        "by_tool_steps": sft.bucket_accuracy(needed, CALL_BUCKETS, greedy, sampled),
        "sampled_response_tokens": sft.length_stats(lengths),
        "sampled_tool_calls": {"mean": float(np.mean(calls)), "max": int(np.max(calls)),
                               "needed_mean": float(needed.mean()),
                               "as_needed": float((calls_arr == needed[:, None]).mean()),
                               "refused_fraction": stats.errors / max(1, stats.calls)},
    }


def write_readme(out: Path, report: dict) -> None:
    """A human-readable summary next to the weights; tests parse the `Held-out sampled accuracy` line."""
    ev = report["eval"]

    def table(rows: dict) -> str:
        return "\n".join(f"| {k} | {v['n']} | {v['greedy']:.3f} | {v['sampled']:.3f} |" for k, v in rows.items())

    ref, smp, calls = report["reference_response_tokens"], ev["sampled_response_tokens"], ev["sampled_tool_calls"]
    curve = "\n".join(f"| {c['step']} | {c['greedy']:.3f} | {c['sampled']:.3f} |" for c in report["curve"])
    if curve:
        curve = f"""Held-out accuracy during SFT (same schedule; the last row is the saved policy), on the first
{report['curve_problems']} held-out problems, sampled avg@{report['curve_samples']}:

| SFT step | greedy | sampled (T=1) |
|---|---|---|
{curve}
"""
    text = f"""# tiny_tool_policy: the tiny tool-using policy

Written by `scripts/make_tiny_tool_policy.py {report['command']}`; rerun that command (on CPU) to
reproduce it. The embedded default's architecture ({report['params']:,} parameters), a character-level tokenizer
over printable ASCII (EOS `{EOS}`, pad `{PAD}`) whose tool tags `{'`, `'.join(TOOL_TAGS)}` are one token each
(non-special: decoding keeps them), supervised fine-tuned on `prompt + solution + {EOS}` from the
`synthetic_tools` task's train split. The loss covers the tokens the policy writes (its steps, its calls, the
answer, EOS), not the prompt and not the `{REPLY_PREFIX}...{REPLY_SUFFIX}` replies, which the environment
writes. It is deliberately undertrained, so RL has room to improve it. `task.json` holds the
`SyntheticToolTask` kwargs, `tool_use.json` the `ToolUseConfig` it was evaluated with.

Held-out evaluation runs the calls through the rollout's own path (`Scheduler` with a `ToolEnvironment`, the
engine's stop id `{CALL_END}`): a response stops at the call, the calculator evaluates it, its reply
(`format_tool_output(result, tag='')`, at most {TOOL_USE.max_reply_tokens} tokens, between `{REPLY_PREFIX}` and
`{REPLY_SUFFIX}`) is appended, decoding goes on; at most {TOOL_USE.max_calls} calls per response.

- SFT steps: {report['steps']}, stopped early in a {report['schedule_steps']}-step warmup + cosine schedule
  (batch {report['batch_rows']} x {report['row_length']} packed tokens, {report['train_examples']:,} train examples,
  first batch's loss {report['first_loss']:.4f}, final loss {report['final_loss']:.4f})
- Wall-clock: {report['wall_clock_s']:.0f} s total, {report['train_s']:.0f} s of it SFT
  ({report['device']}, {os.cpu_count()} cores)
- Held-out problems: {report['eval_problems']} (test split, seed {report['eval_seed']})
- Held-out sampled accuracy (T=1, avg@{report['num_samples']}, with tool use): {ev['sampled_accuracy']:.3f}
- Held-out greedy accuracy: {ev['greedy_accuracy']:.3f}
- Held-out pass@{report['num_samples']} (T=1): {ev['pass_at_k']:.3f}
- Tool calls per sampled response: mean {calls['mean']:.2f} (the problems need {calls['needed_mean']:.2f}),
  max {calls['max']}; responses making exactly the needed number: {calls['as_needed']:.3f}; calls the calculator
  refused (an `Error:` reply): {calls['refused_fraction']:.3f}
- Reference response tokens (solution + EOS, replies included): median {ref['median']:.0f}, p90 {ref['p90']:.0f},
  p99 {ref['p99']:.0f}, max {ref['max']}
- Sampled response tokens: median {smp['median']:.0f}, p90 {smp['p90']:.0f}, p99 {smp['p99']:.0f},
  max {smp['max']}

Accuracy by number of arithmetic steps in the problem:

| steps | problems | greedy | sampled (T=1) |
|---|---|---|---|
{table(ev['by_num_steps'])}

Accuracy by number of tool steps (calculator calls the solution makes):

| tool steps | problems | greedy | sampled (T=1) |
|---|---|---|---|
{table(ev['by_tool_steps'])}

{curve}
Model config: `{json.dumps(report['model_overrides'])}` over the `tiny` preset, vocab_size {report['vocab_size']}.
Task: `{json.dumps(report['task'])}`.
"""
    (out / "README.md").write_text(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = base.sft_argument_parser(__doc__.split("\n\n")[0], Path("assets/tiny_tool_policy"))
    ap.add_argument("--curve-problems", type=int, default=128, help="held-out problems of each --eval-every point")
    ap.add_argument("--curve-samples", type=int, default=2, help="T=1 samples per problem of each curve point")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """Builds tokenizer and model, runs SFT, evaluates with tool use, writes everything to ``--out``."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    task_kwargs = {**TASK_KWARGS, **(args.task or {})}
    overrides = {**base.MODEL_OVERRIDES, **(args.model or {})}

    # Printable ASCII, the base specials, the tool tags as one (non-special: decoding keeps them) token each.
    tokenizer = build_char_tokenizer(char_vocabulary(), base.SPECIAL_TOKENS, out, eos_tokens=[EOS], pad_token=PAD,
                                     added_tokens=TOOL_TAGS)
    train_task = SyntheticToolTask(seed=args.seed, split="train", **task_kwargs)
    if train_task.max_tool_steps > TOOL_USE.max_calls:
        raise ValueError(f"task max_tool_steps {train_task.max_tool_steps} > max_calls {TOOL_USE.max_calls}: the "
                         "rollout would stop the longest demonstrations")
    prompt_max, solution_max = train_task.length_bounds()
    row_length = -(-(prompt_max + solution_max) // 32) * 32
    overrides["max_position_embeddings"] = max(overrides["max_position_embeddings"], row_length)
    cfg = model_config("tiny", vocab_size=-(-tokenizer.vocab_size // 8) * 8, **overrides)
    model = init_model(cfg, seed=args.seed)

    def next_example() -> sft.Example:
        prompt, segments, _ = train_task.demonstration(packer.drawn)
        return sft.sft_example(tokenizer, prompt, segments, EOS)  # the replies (env segments) out of the loss

    packer = sft.SFTPacker(next_example, args.batch_rows, row_length)
    eval_seed = args.seed + 1000
    problems = [SyntheticToolTask(seed=eval_seed, split="test", **task_kwargs).sample(i)
                for i in range(args.eval_problems)]
    prompt_len = max(len(ids) for ids in tokenizer.encode_batch([p["prompt"] for p in problems]))
    sampler = sft.Sampler(model, tokenizer, prompt_len, solution_max, args.eval_batch, EOS,
                          tools=ToolEnvironment.for_tokenizer(TOOL_USE, tokenizer))

    def curve_point(step: int, params) -> dict:
        """The curve's cheaper evaluation (the first --curve-problems problems, avg@--curve-samples)."""
        ev = evaluate(sampler, params, problems[: args.curve_problems], eval_seed, args.curve_samples)
        tqdm.write(f"step {step}: greedy {ev['greedy_accuracy']:.3f} sampled {ev['sampled_accuracy']:.3f} "
                   f"calls {ev['sampled_tool_calls']['mean']:.2f}")
        return {"step": step, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]}

    print(f"model: {param_count(model):,} params, {cfg}", flush=True)
    print(f"task: {task_kwargs}; packed rows {args.batch_rows} x {row_length}", flush=True)
    optimizer = sft.sft_optimizer(max(args.steps, args.schedule_steps), args.lr, args.warmup_frac, args.weight_decay)
    result = sft.run_sft(model, optimizer, packer.batch, args.steps, args.eval_every, curve_point)
    curve = [*result.curve, curve_point(args.steps, result.params)] if args.eval_every else []
    ev = evaluate(sampler, result.params, problems, eval_seed, args.num_samples)
    nnx.update(model, result.params)
    save_pretrained(model, out)
    (out / "task.json").write_text(json.dumps(task_kwargs, indent=2) + "\n")
    (out / "tool_use.json").write_text(json.dumps(dataclasses.asdict(TOOL_USE), indent=2) + "\n")

    solutions = [train_task.sample(i)["solution"] for i in range(5000)]
    reference = [len(ids) + 1 for ids in tokenizer.encode_batch(solutions)]
    curve_flags = f" --curve-problems {args.curve_problems} --curve-samples {args.curve_samples}" if curve else ""
    report = {
        "command": base.command_line(args, curve_flags), "steps": args.steps,
        "schedule_steps": max(args.steps, args.schedule_steps), "seed": args.seed, "params": param_count(model),
        "vocab_size": cfg.vocab_size, "model_overrides": overrides, "task": task_kwargs,
        "tool_use": dataclasses.asdict(TOOL_USE), "batch_rows": args.batch_rows, "row_length": row_length,
        "train_examples": packer.used, "first_loss": result.first_loss, "final_loss": result.final_loss,
        "train_s": result.train_s, "wall_clock_s": time.perf_counter() - t0, "device": jax.devices()[0].device_kind,
        "eval_problems": len(problems), "eval_seed": eval_seed, "num_samples": args.num_samples,
        "curve_problems": min(args.curve_problems, len(problems)), "curve_samples": args.curve_samples,
        "reference_response_tokens": sft.length_stats(reference), "eval": ev, "curve": curve,
    }
    write_readme(out, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
