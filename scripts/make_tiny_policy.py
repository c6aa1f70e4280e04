"""Builds the embedded default policy: a tiny Qwen3-architecture model taught the synthetic task by SFT.

The RL configs start from this checkpoint, so it has to be *partly* right: held-out accuracy when sampling
at temperature 1 should sit around 25%, with greedy accuracy (~37%) and pass@4 (~48%) well above it, which
is the room RL's sharpening has to work with in a few CPU minutes. Accuracy is controlled by
stopping early: the LR schedule spans ``--schedule-steps`` and training stops after ``--steps``. Held-out
accuracy rises steeply once the model has learned the task's format (from 25% to 44% sampled accuracy
between steps 450 and 500 of the 600-step schedule), and an LR schedule that does not depend on ``--steps``
means stopping at step N gives exactly the model the ``--eval-every`` curve shows at N. Everything is
deterministic given ``--seed`` on one backend (train data uses the seed, held-out problems seed + 1000).

Output (``--out``, HF layout): ``config.json`` + ``model.safetensors``, the char tokenizer files,
``task.json`` (the ``SyntheticTask`` kwargs the RL configs must reuse) and ``README.md`` with the numbers.

    .venv/bin/python scripts/make_tiny_policy.py --steps 450 --schedule-steps 600 --seed 0 --eval-every 50 \
        --out assets/tiny_policy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from rollverify_jax.data.rewards import exact_reward
from rollverify_jax.data.synthetic import ANSWER_PREFIX, SyntheticTask, char_vocabulary
from rollverify_jax.models.hf import param_count, save_pretrained
from rollverify_jax.models.qwen3 import (
    Qwen3ForCausalLM,
    dot_product_attention,
    init_model,
    model_config,
)
from rollverify_jax.models.tokenizer import Tokenizer, build_char_tokenizer
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory

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


# ----------------------------------------------------------------------------------------------------
# Data


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def max_lengths(task: SyntheticTask) -> tuple[int, int]:
    """Upper bounds (prompt chars, solution chars + EOS) over every problem the task can draw, so fixed
    shapes never truncate the long tail."""
    dv = len(str(task.max_value))
    do = len(str(max(task.max_operand, task.max_multiplier)))
    prompt = len("Start ") + dv + len(". ") + task.max_steps * (1 + do + 1) - 1 + len(".") + len(" Compute.")
    solution = task.max_steps * (4 + 2 * dv + do) + 1 + len(ANSWER_PREFIX) + dv + 1
    return prompt, solution


def num_ops(prompt: str) -> int:
    """Chain length of a prompt `Start 7. +3 *2. Compute.`."""
    return len(prompt.split(". ")[1].split())


@dataclasses.dataclass
class Packer:
    """Streams train examples packed into fixed [rows, length] batches (one shape: one compile).

    Each example is ``prompt + solution + EOS``; only solution and EOS tokens carry loss. Segment ids keep
    packed examples from attending to each other and positions restart at 0 for each.
    """

    task: SyntheticTask
    tokenizer: Tokenizer
    rows: int
    length: int
    next_index: int = 0
    _carry: tuple | None = None

    def _example(self) -> tuple[list[int], list[int], list[float]]:
        ex = self.task.sample(self.next_index)
        self.next_index += 1
        prompt = self.tokenizer.encode(ex["prompt"])
        seq = prompt + self.tokenizer.encode(ex["solution"]) + [self.tokenizer.token_id(EOS)]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(seq) - len(prompt))
        return seq[:-1], seq[1:], weights

    def batch(self) -> dict[str, np.ndarray]:
        shape = (self.rows, self.length)
        out = {
            "inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
            "weights": np.zeros(shape, np.float32), "segments": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
        }
        for r in range(self.rows):
            col, seg = 0, 1
            while True:
                ex = self._carry or self._example()
                self._carry = None
                n = len(ex[0])
                if n > self.length:
                    raise ValueError(f"example of {n} tokens exceeds the packed row length {self.length}")
                if col + n > self.length:
                    self._carry = ex
                    break
                sl = slice(col, col + n)
                out["inputs"][r, sl], out["targets"][r, sl], out["weights"][r, sl] = ex
                out["segments"][r, sl] = seg
                out["positions"][r, sl] = np.arange(n)
                col, seg = col + n, seg + 1
        return out


@dataclasses.dataclass
class SegmentAttention:
    """Causal attention restricted to the query's own packed segment (segment 0 is padding)."""

    segments: jax.Array

    def __call__(self, layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        t = q.shape[1]
        same = (self.segments[:, :, None] == self.segments[:, None, :]) & (self.segments[:, None, :] > 0)
        return dot_product_attention(q, k, v, same & jnp.tril(jnp.ones((t, t), bool))[None])


# ----------------------------------------------------------------------------------------------------
# Training


def make_optimizer(steps: int, lr: float, warmup_frac: float, weight_decay: float) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to 10% over ``steps`` (the schedule horizon, which may
    run past where training stops)."""
    warmup = max(1, int(steps * warmup_frac))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay)
    )


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """A jitted (params, opt_state, batch) -> (params, opt_state, loss) step on the split model state."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"], batch["positions"], SegmentAttention(batch["segments"]))
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# ----------------------------------------------------------------------------------------------------
# Sampling: the package's engine and scheduler (continuous batching over a paged KV cache)


class Sampler:
    """Greedy and temperature-1 responses from the current params, one engine per mode (compiled once)."""

    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer, prompt_len: int, max_new: int, slots: int):
        page = 16
        config = EngineConfig(num_slots=slots, page_size=page, max_seq_len=round_up(prompt_len + max_new, page),
                              steps_per_dispatch=8)
        eos = (tokenizer.token_id(EOS),)
        self.engines = {greedy: Engine(model, config, SamplingConfig(greedy=greedy), eos_ids=eos)
                        for greedy in (True, False)}
        self.tokenizer, self.max_new, self.version = tokenizer, max_new, 0

    def set_params(self, params) -> None:
        self.version += 1
        for engine in self.engines.values():
            engine.update_params(params, version=self.version)

    def generate(self, prompts: Sequence[str], seed: int, greedy: bool) -> list[list[int]]:
        """Responses (token ids up to and including EOS) for ``prompts``; request i samples with seed + i."""
        sched = Scheduler(self.engines[greedy])
        sched.submit([Trajectory(uid=i, group_id=i, prompt=np.asarray(ids, np.int32), seed=seed + i,
                                 max_new_tokens=self.max_new)
                      for i, ids in enumerate(self.tokenizer.encode_batch(list(prompts)))])
        sched.run()
        return [t.tokens for t in sorted(sched.take_finished(), key=lambda t: t.uid)]


def evaluate(sampler: Sampler, params, problems: list[dict], seed: int, num_samples: int) -> dict:
    """Greedy and temperature-1 (avg@num_samples) exact-answer accuracy, overall and by chain length."""
    sampler.set_params(params)
    prompts = [p["prompt"] for p in problems]
    answers = [p["answer"] for p in problems]

    def score(responses: list[list[int]]) -> np.ndarray:
        texts = sampler.tokenizer.decode_batch(responses, skip_special_tokens=True)
        return np.array([exact_reward(t, a) for t, a in zip(texts, answers, strict=True)])

    greedy = score(sampler.generate(prompts, seed, greedy=True))
    sampled, lengths = [], []
    for i in range(num_samples):
        responses = sampler.generate(prompts, seed + (i + 1) * len(prompts), greedy=False)
        sampled.append(score(responses))
        lengths.extend(len(r) for r in responses)
    sampled = np.stack(sampled, axis=1)  # [N, num_samples]
    steps = np.array([num_ops(p) for p in prompts])
    by_steps = {}
    for lo, hi in STEP_BUCKETS:
        sel = (steps >= lo) & (steps <= hi)
        if sel.any():
            name = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10_000 else f"{lo}+")
            by_steps[name] = {"n": int(sel.sum()), "greedy": float(greedy[sel].mean()),
                              "sampled": float(sampled[sel].mean())}
    return {
        "greedy_accuracy": float(greedy.mean()),
        "sampled_accuracy": float(sampled.mean()),
        "pass_at_k": float(sampled.max(axis=1).mean()),
        "by_num_steps": by_steps,
        "sampled_response_tokens": length_stats(lengths),
    }


def length_stats(lengths: Sequence[int]) -> dict:
    x = np.asarray(lengths)
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": int(x.max())}


# ----------------------------------------------------------------------------------------------------
# Main


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
  final loss {report['final_loss']:.4f})
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


def run_sft(train_step: Callable, params, opt_state, next_batch: Callable[[], dict], steps: int, eval_every: int,
            curve_point: Callable[[int, object], dict]) -> tuple[object, float, float, list[dict]]:
    """``steps`` SFT updates with a progress bar; ``curve_point(step, params)`` every ``eval_every`` steps before
    the last (the caller evaluates the final params). Returns (params, last loss, train seconds without the
    curve's evaluations, curve)."""
    curve, loss, eval_s = [], float("nan"), 0.0
    t_train = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="sft", mininterval=2.0, file=sys.stdout)
    for step in bar:
        params, opt_state, loss_arr = train_step(params, opt_state, next_batch())
        if step % 25 == 0 or step == steps:
            loss = float(loss_arr)
            bar.set_postfix(loss=f"{loss:.4f}")
        if eval_every and step % eval_every == 0 and step != steps:
            t_eval = time.perf_counter()
            curve.append(curve_point(step, params))
            eval_s += time.perf_counter() - t_eval
    return params, loss, time.perf_counter() - t_train - eval_s, curve


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
    prompt_max, solution_max = max_lengths(train_task)
    row_length = round_up(prompt_max + solution_max, 32)
    overrides["max_position_embeddings"] = max(overrides["max_position_embeddings"], row_length)
    cfg = model_config("tiny", vocab_size=round_up(tokenizer.vocab_size, 8), **overrides)
    model = init_model(cfg, seed=args.seed)
    n_params = param_count(model)
    graphdef, params = nnx.split(model)

    tx = make_optimizer(max(args.steps, args.schedule_steps), args.lr, args.warmup_frac, args.weight_decay)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx)
    packer = Packer(train_task, tokenizer, args.batch_rows, row_length)

    eval_seed = args.seed + 1000
    problems = [SyntheticTask(seed=eval_seed, split="test", **task_kwargs).sample(i)
                for i in range(args.eval_problems)]
    prompt_len = max(len(ids) for ids in tokenizer.encode_batch([p["prompt"] for p in problems]))
    sampler = Sampler(model, tokenizer, prompt_len, solution_max, args.eval_batch)

    def run_eval(p) -> dict:
        return evaluate(sampler, p, problems, eval_seed, args.num_samples)

    print(f"model: {n_params:,} params, {cfg}", flush=True)
    print(f"task: {task_kwargs}; packed rows {args.batch_rows} x {row_length}", flush=True)
    def curve_point(step: int, p) -> dict:
        ev = run_eval(p)
        tqdm.write(f"step {step}: greedy {ev['greedy_accuracy']:.3f} sampled {ev['sampled_accuracy']:.3f}")
        return {"step": step, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]}

    params, loss, train_s, curve = run_sft(train_step, params, opt_state, packer.batch, args.steps,
                                           args.eval_every, curve_point)

    ev = run_eval(params)
    curve.append({"step": args.steps, "greedy": ev["greedy_accuracy"], "sampled": ev["sampled_accuracy"]})
    save_pretrained(nnx.merge(graphdef, params), out)
    (out / "task.json").write_text(json.dumps(task_kwargs, indent=2) + "\n")

    reference = [len(train_task.sample(i)["solution"]) + 1 for i in range(5000)]
    command = f"--steps {args.steps} --schedule-steps {args.schedule_steps} --seed {args.seed}"
    command += f" --eval-every {args.eval_every}" if args.eval_every else ""
    command += "".join(
        f" --{name} '{json.dumps(value)}'" for name, value in (("model", args.model), ("task", args.task)) if value
    )
    report = {
        "command": command, "steps": args.steps, "schedule_steps": max(args.steps, args.schedule_steps),
        "seed": args.seed, "params": n_params, "vocab_size": cfg.vocab_size,
        "model_overrides": overrides, "task": task_kwargs, "batch_rows": args.batch_rows,
        "row_length": row_length, "train_examples": packer.next_index, "final_loss": loss,
        "train_s": train_s, "wall_clock_s": time.perf_counter() - t0, "device": jax.devices()[0].device_kind,
        "eval_problems": len(problems), "eval_seed": eval_seed, "num_samples": args.num_samples,
        "reference_response_tokens": length_stats(reference), "eval": ev, "curve": curve,
    }
    write_readme(out, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
