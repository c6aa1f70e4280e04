"""Builds the tiny tool-using policy: the embedded default's model, taught the tool task by SFT.

The task is ``synthetic_tools`` (``rollverify_jax/data/synthetic_tools.py``): arithmetic chains whose big steps
(``*m``, ``//m`` on values up to 99999) are calculator calls, ``<calculator>10*523</calculator>``, answered by the
environment with ``<tool_response>5230</tool_response>``. The four tags are one token each (non-special added
tokens of the char tokenizer, so decoding keeps them), the alphabet is printable ASCII (anything a calculator
reply or error can print), and SFT's loss skips the reply tokens: the policy reads them, it does not write them.

Like ``make_tiny_policy.py`` (whose model, optimizer and packing this reuses), the policy is deliberately
undertrained, stopped early in a longer LR schedule, so held-out sampled accuracy (T=1, with tool use) sits in
the 20-40% range RL can improve. Evaluation runs the calls: each response stops at ``</calculator>``, the call is
evaluated, the reply is appended as environment tokens and decoding continues.

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
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_policy as base  # noqa: E402  (the sibling script: model, optimizer, packing)

from rollverify_jax.data.rewards import exact_reward  # noqa: E402
from rollverify_jax.data.synthetic import ANSWER_PREFIX  # noqa: E402
from rollverify_jax.data.synthetic_tools import (  # noqa: E402
    CALL_END,
    REPLY_PREFIX,
    REPLY_SUFFIX,
    TOOL_NAME,
    TOOL_OPS,
    TOOL_TAGS,
    Segment,
    SyntheticToolTask,
    char_vocabulary,
    num_tool_steps,
)
from rollverify_jax.models.hf import param_count, save_pretrained  # noqa: E402
from rollverify_jax.models.qwen3 import Qwen3ForCausalLM, init_model, model_config  # noqa: E402
from rollverify_jax.models.tokenizer import Tokenizer, build_char_tokenizer  # noqa: E402
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory  # noqa: E402
from rollverify_jax.rollout.tool_use import ToolEnvironment, ToolUseConfig  # noqa: E402

EOS, PAD, SPECIAL_TOKENS = base.EOS, base.PAD, base.SPECIAL_TOKENS

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


# ----------------------------------------------------------------------------------------------------
# Data


def build_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The char tokenizer of the tool policy: printable ASCII, the base specials, the tool tags as one id each."""
    return build_char_tokenizer(char_vocabulary(), SPECIAL_TOKENS, path, eos_tokens=[EOS], pad_token=PAD,
                                added_tokens=TOOL_TAGS)


def max_lengths(task: SyntheticToolTask) -> tuple[int, int]:
    """Upper bounds in tokens (each tag one token) of (prompt, solution + EOS) over every problem the task draws,
    so fixed shapes never truncate the long tail."""
    dv, ds, do, df = len(str(task.max_value)), len(str(task.max_start)), len(str(task.max_operand)), len(
        str(task.max_factor))
    op = max(len(max(TOOL_OPS, key=len)) + df, 1 + do)
    prompt = len("Start ") + ds + len(". ") + task.max_steps * (op + 1) - 1 + len(".") + len(" Compute.")
    tool_step = 1 + 1 + (dv + len(max(TOOL_OPS, key=len)) + df) + 1 + 1 + dv + 1  # " <c>expr</c><r>value</r>"
    inline_step = 1 + dv + 1 + do + 1 + dv + 1  # " a-b=c."
    tools = min(task.max_tool_steps, task.max_steps)
    solution = tools * tool_step + (task.max_steps - tools) * inline_step + 1 + len(ANSWER_PREFIX) + dv + 1
    return prompt, solution


def sft_example(tokenizer: Tokenizer, prompt: str, segments: Sequence[Segment]) -> tuple[list[int], list[int],
                                                                                          list[float]]:
    """(inputs, targets, weights) of ``prompt + solution + EOS``: weight 1 where the target is a token the policy
    writes (solution text, its calls, EOS), 0 on the prompt and on the environment's replies (read, not written)."""
    seq = tokenizer.encode(prompt)
    written = [False] * len(seq)
    for text, env in segments:
        ids = tokenizer.encode(text)
        seq += ids
        written += [not env] * len(ids)
    seq.append(tokenizer.token_id(EOS))
    written.append(True)
    return seq[:-1], seq[1:], [float(w) for w in written[1:]]


@dataclasses.dataclass
class ToolPacker(base.Packer):
    """``make_tiny_policy.Packer`` over tool demonstrations: the same packed rows, the replies out of the loss."""

    task: SyntheticToolTask

    def _example(self) -> tuple[list[int], list[int], list[float]]:
        prompt, segments, _ = self.task.demonstration(self.next_index)
        self.next_index += 1
        return sft_example(self.tokenizer, prompt, segments)


# ----------------------------------------------------------------------------------------------------
# Multi-turn sampling


class ToolSampler:
    """Greedy and temperature-1 multi-turn responses through the rollout's own path: the engine stops a turn at
    ``</calculator>`` (a stop id), the scheduler's ``ToolEnvironment`` runs the call and the reply is appended as
    environment tokens (``Trajectory.env_spans``), then decoding goes on."""

    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer, prompt_len: int, max_new: int, slots: int,
                 tool_use: ToolUseConfig):
        page = 16
        config = EngineConfig(num_slots=slots, page_size=page, max_seq_len=base.round_up(prompt_len + max_new, page),
                              steps_per_dispatch=8)
        self.tools = ToolEnvironment.for_tokenizer(tool_use, tokenizer)
        self.engines = {greedy: Engine(model, config, SamplingConfig(greedy=greedy), eos_ids=(tokenizer.token_id(EOS),),
                                       stop_ids=(self.tools.call_end_id,))
                        for greedy in (True, False)}
        self.tokenizer, self.max_new, self.version = tokenizer, max_new, 0

    def set_params(self, params) -> None:
        self.version += 1
        for engine in self.engines.values():
            engine.update_params(params, version=self.version)

    def generate(self, prompts: Sequence[str], seed: int, greedy: bool) -> list[Trajectory]:
        """Finished trajectories for ``prompts`` (request i samples with seed + i), in prompt order."""
        sched = Scheduler(self.engines[greedy], env=self.tools)
        sched.submit([Trajectory(uid=i, group_id=i, prompt=np.asarray(ids, np.int32), seed=seed + i,
                                 max_new_tokens=self.max_new)
                      for i, ids in enumerate(self.tokenizer.encode_batch(list(prompts)))])
        sched.run()
        return sorted(sched.take_finished(), key=lambda t: t.uid)


def evaluate(sampler: ToolSampler, params, problems: list[dict], seed: int, num_samples: int) -> dict:
    """Greedy and temperature-1 (avg@num_samples) exact-answer accuracy with tool use, overall and by number of
    steps and of tool steps; calls per response and how many of them the calculator refused."""
    sampler.set_params(params)
    prompts = [p["prompt"] for p in problems]
    answers = [p["answer"] for p in problems]

    def score(trajs: list[Trajectory]) -> np.ndarray:
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
        "greedy_accuracy": float(greedy.mean()),
        "sampled_accuracy": float(sampled.mean()),
        "pass_at_k": float(sampled.max(axis=1).mean()),
        "by_num_steps": _buckets(np.array([base.num_ops(p) for p in prompts]), base.STEP_BUCKETS, greedy, sampled),
        "by_tool_steps": _buckets(needed, CALL_BUCKETS, greedy, sampled),
        "sampled_response_tokens": base.length_stats(lengths),
        "sampled_tool_calls": {"mean": float(np.mean(calls)), "max": int(np.max(calls)),
                               "needed_mean": float(needed.mean()),
                               "as_needed": float((calls_arr == needed[:, None]).mean()),
                               "refused_fraction": stats.errors / max(1, stats.calls)},
    }


def _buckets(key: np.ndarray, buckets: Sequence[tuple[int, int]], greedy: np.ndarray, sampled: np.ndarray) -> dict:
    out = {}
    for lo, hi in buckets:
        sel = (key >= lo) & (key <= hi)
        if sel.any():
            name = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10_000 else f"{lo}+")
            out[name] = {"n": int(sel.sum()), "greedy": float(greedy[sel].mean()),
                         "sampled": float(sampled[sel].mean())}
    return out


# ----------------------------------------------------------------------------------------------------
# Main


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
  final loss {report['final_loss']:.4f})
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

    tokenizer = build_tokenizer(out)
    train_task = SyntheticToolTask(seed=args.seed, split="train", **task_kwargs)
    if train_task.max_tool_steps > TOOL_USE.max_calls:
        raise ValueError(f"task max_tool_steps {train_task.max_tool_steps} > max_calls {TOOL_USE.max_calls}: the "
                         "rollout would stop the longest demonstrations")
    prompt_max, solution_max = max_lengths(train_task)
    row_length = base.round_up(prompt_max + solution_max, 32)
    overrides["max_position_embeddings"] = max(overrides["max_position_embeddings"], row_length)
    cfg = model_config("tiny", vocab_size=base.round_up(tokenizer.vocab_size, 8), **overrides)
    model = init_model(cfg, seed=args.seed)
    n_params = param_count(model)
    graphdef, params = nnx.split(model)

    tx = base.make_optimizer(max(args.steps, args.schedule_steps), args.lr, args.warmup_frac, args.weight_decay)
    opt_state = tx.init(params)
    train_step = base.make_train_step(graphdef, tx)
    packer = ToolPacker(train_task, tokenizer, args.batch_rows, row_length)

    eval_seed = args.seed + 1000
    problems = [SyntheticToolTask(seed=eval_seed, split="test", **task_kwargs).sample(i)
                for i in range(args.eval_problems)]
    prompt_len = max(len(ids) for ids in tokenizer.encode_batch([p["prompt"] for p in problems]))
    sampler = ToolSampler(model, tokenizer, prompt_len, solution_max, args.eval_batch, TOOL_USE)

    def run_eval(p) -> dict:
        return evaluate(sampler, p, problems, eval_seed, args.num_samples)

    def curve_point(step: int, p) -> dict:
        """The curve's cheaper evaluation (the first --curve-problems problems, avg@--curve-samples)."""
        ev = evaluate(sampler, p, problems[: args.curve_problems], eval_seed, args.curve_samples)
        tqdm.write(f"step {step}: greedy {ev['greedy_accuracy']:.3f} sampled {ev['sampled_accuracy']:.3f} "
                   f"calls {ev['sampled_tool_calls']['mean']:.2f}")
        return {"step": step, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]}

    print(f"model: {n_params:,} params, {cfg}", flush=True)
    print(f"task: {task_kwargs}; packed rows {args.batch_rows} x {row_length}", flush=True)
    params, loss, train_s, curve = base.run_sft(train_step, params, opt_state, packer.batch, args.steps,
                                                args.eval_every, curve_point)
    if args.eval_every:
        curve.append(curve_point(args.steps, params))
    ev = run_eval(params)
    save_pretrained(nnx.merge(graphdef, params), out)
    (out / "task.json").write_text(json.dumps(task_kwargs, indent=2) + "\n")
    (out / "tool_use.json").write_text(json.dumps(dataclasses.asdict(TOOL_USE), indent=2) + "\n")

    solutions = [train_task.sample(i)["solution"] for i in range(5000)]
    reference = [len(ids) + 1 for ids in tokenizer.encode_batch(solutions)]
    command = f"--steps {args.steps} --schedule-steps {args.schedule_steps} --seed {args.seed}"
    command += f" --eval-every {args.eval_every}" if args.eval_every else ""
    command += f" --curve-problems {args.curve_problems} --curve-samples {args.curve_samples}" if curve else ""
    command += "".join(
        f" --{name} '{json.dumps(value)}'" for name, value in (("model", args.model), ("task", args.task)) if value
    )
    report = {
        "command": command, "steps": args.steps, "schedule_steps": max(args.steps, args.schedule_steps),
        "seed": args.seed, "params": n_params, "vocab_size": cfg.vocab_size,
        "model_overrides": overrides, "task": task_kwargs, "tool_use": dataclasses.asdict(TOOL_USE),
        "batch_rows": args.batch_rows,
        "row_length": row_length, "train_examples": packer.next_index, "final_loss": loss,
        "train_s": train_s, "wall_clock_s": time.perf_counter() - t0, "device": jax.devices()[0].device_kind,
        "eval_problems": len(problems), "eval_seed": eval_seed, "num_samples": args.num_samples,
        "curve_problems": min(args.curve_problems, len(problems)), "curve_samples": args.curve_samples,
        "reference_response_tokens": base.length_stats(reference), "eval": ev, "curve": curve,
    }
    write_readme(out, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
