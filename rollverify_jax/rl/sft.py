"""Supervised fine-tuning on packed rows: the warm start of the tiny policies (``scripts/make_tiny_policy.py`` and
``make_tiny_tool_policy.py`` teach a synthetic task to a small Qwen3 that RL then starts from).

An example is one sequence ``prompt + response + EOS`` shifted by one (inputs, targets) with a loss weight per
target: 1 on the tokens the policy writes, 0 on the prompt and on what an environment writes (a tool's reply),
which the policy reads but is never taught to produce. Examples are packed into fixed ``[rows, width]`` batches
(one shape: one compile) by first-fit decreasing, the rule the train step and the engine's prefill pack by; segment
ids keep packed examples from attending to each other (``CausalAttention(segments=...)``, as in the learner's
packed rows) and positions restart at 0 for each. The optimizer is the learner's (``learner.make_optimizer``:
AdamW with global-norm clipping and a warmup + cosine schedule).

Evaluation samples through the rollout's own path (``Engine`` + ``Scheduler``), tools included.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from rollverify_jax.models.qwen3 import CausalAttention, Qwen3ForCausalLM, token_logprobs
from rollverify_jax.models.tokenizer import Tokenizer
from rollverify_jax.rl import learner
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.schedule_rules import first_fit

Example = tuple[list[int], list[int], list[float]]  # (inputs, targets, loss weights) of one shifted sequence
BATCH_KEYS = ("inputs", "targets", "weights", "segments", "positions")  # each [rows, width]


def sft_example(tokenizer: Tokenizer, prompt: str, segments: Sequence[tuple[str, bool]], eos: str) -> Example:
    """``prompt + segments + eos`` as an example: ``segments`` are (text, written by the environment) pairs; the
    loss covers the targets the policy writes (its segments and EOS), not the prompt or the environment's."""
    seq = tokenizer.encode(prompt)
    written = [False] * len(seq)
    for text, env in segments:
        ids = tokenizer.encode(text)
        seq += ids
        written += [not env] * len(ids)
    seq.append(tokenizer.token_id(eos))
    written.append(True)
    return seq[:-1], seq[1:], [float(w) for w in written[1:]]


@dataclasses.dataclass
class SFTPacker:
    """Streams examples into fixed ``[rows, width]`` batches: examples are drawn in order while first-fit
    decreasing still places them all in ``rows`` rows; the one that would need another row opens the next batch.
    Deterministic given ``next_example``."""

    next_example: Callable[[], Example]
    rows: int
    width: int
    drawn: int = 0
    _pending: list[Example] = dataclasses.field(default_factory=list)

    @property
    def used(self) -> int:
        """Examples in the batches returned so far."""
        return self.drawn - len(self._pending)

    def _draw(self) -> Example:
        example = self.next_example()
        self.drawn += 1
        if len(example[0]) > self.width:
            raise ValueError(f"example of {len(example[0])} tokens exceeds the packed row width {self.width}")
        return example

    def batch(self) -> dict[str, np.ndarray]:
        """The next batch: ``BATCH_KEYS`` arrays [rows, width]; segments 1, 2, ... per example, 0 on padding."""
        pool = self._pending or [self._draw()]
        while True:
            example = self._draw()
            if len(first_fit([len(e[0]) for e in pool + [example]], self.width)) > self.rows:
                self._pending = [example]
                break
            pool.append(example)
        out = {k: np.zeros((self.rows, self.width), np.float32 if k == "weights" else np.int32) for k in BATCH_KEYS}
        for r, members in enumerate(first_fit([len(e[0]) for e in pool], self.width)):
            col = 0
            for seg, i in enumerate(members, start=1):
                inputs, targets, weights = pool[i]
                sl = slice(col, col + len(inputs))
                out["inputs"][r, sl], out["targets"][r, sl], out["weights"][r, sl] = inputs, targets, weights
                out["segments"][r, sl] = seg
                out["positions"][r, sl] = np.arange(len(inputs))
                col += len(inputs)
        return out


def sft_loss(graphdef: nnx.GraphDef, params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
    """Weighted mean next-token NLL (float32[]) of packed rows, each token attending within its own example."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["positions"], CausalAttention(segments=batch["segments"]))  # [R, W, V]
    nll = -token_logprobs(logits, batch["targets"])
    return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)


def sft_optimizer(schedule_steps: int, lr: float, warmup_frac: float, weight_decay: float,
                  b2: float = 0.98) -> optax.GradientTransformation:
    """The learner's optimizer: AdamW (decay on matrices), clipped at global norm 1, linear warmup over
    ``warmup_frac`` of ``schedule_steps``, then cosine to 10% of ``lr`` at ``schedule_steps`` (the horizon, which
    may run past where training stops)."""
    warmup = max(1, int(schedule_steps * warmup_frac))
    return learner.make_optimizer(learner.OptimizerConfig(
        learning_rate=lr, warmup_steps=warmup, schedule="cosine", total_steps=max(schedule_steps, warmup + 1),
        end_lr_ratio=0.1, weight_decay=weight_decay, b2=b2, max_grad_norm=1.0))


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation) -> Callable:
    """A jitted ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(functools.partial(sft_loss, graphdef))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@dataclasses.dataclass
class SFTResult:
    params: nnx.State
    first_loss: float  # of the first batch, before any update
    final_loss: float  # of the last batch
    train_s: float  # wall-clock of the updates, the curve's evaluations left out
    curve: list[dict]  # curve_point's results, in step order


def run_sft(model: Qwen3ForCausalLM, optimizer: optax.GradientTransformation, next_batch: Callable[[], dict],
            steps: int, eval_every: int = 0, curve_point: Callable[[int, nnx.State], dict] | None = None,
            ) -> SFTResult:
    """``steps`` updates of ``model``'s params with a progress bar; ``curve_point(step, params)`` every
    ``eval_every`` steps before the last (the caller evaluates the final params)."""
    graphdef, params = learner.split_params(model)
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(graphdef, optimizer)
    curve: list[dict] = []
    first = last = float("nan")
    eval_s, t_train = 0.0, time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="sft", mininterval=2.0, file=sys.stdout)
    for step in bar:
        params, opt_state, loss = step_fn(params, opt_state, next_batch())
        if step == 1:
            first = float(loss)
        if step % 25 == 0 or step == steps:
            last = float(loss)
            bar.set_postfix(loss=f"{last:.4f}")
        if curve_point is not None and eval_every and step % eval_every == 0 and step != steps:
            t_eval = time.perf_counter()
            curve.append(curve_point(step, params))
            eval_s += time.perf_counter() - t_eval
    return SFTResult(params, first, last, time.perf_counter() - t_train - eval_s, curve)


# ----------------------------------------------------------------------------------------------------
# Evaluation


class Sampler:
    """Greedy and temperature-1 responses from the current params, one engine per mode (each compiled once).
    With ``tools`` (a ``ToolEnvironment``), a turn stops at the call-end token, the scheduler runs the call and
    appends the reply as environment tokens, and decoding goes on."""

    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer, prompt_len: int, max_new: int, slots: int,
                 eos: str, tools: Any = None):
        page = 16
        config = EngineConfig(num_slots=slots, page_size=page, max_seq_len=-(-(prompt_len + max_new) // page) * page,
                              steps_per_dispatch=8)
        stop = () if tools is None else (tools.call_end_id,)
        self.engines = {greedy: Engine(model, config, SamplingConfig(greedy=greedy), eos_ids=(tokenizer.token_id(eos),),
                                       stop_ids=stop)
                        for greedy in (True, False)}
        self.tokenizer, self.max_new, self.tools, self.version = tokenizer, max_new, tools, 0

    def set_params(self, params: nnx.State) -> None:
        self.version += 1
        for engine in self.engines.values():
            engine.update_params(params, version=self.version)

    def generate(self, prompts: Sequence[str], seed: int, greedy: bool) -> list[Trajectory]:
        """Finished trajectories for ``prompts`` (request i samples with seed + i), in prompt order."""
        engine = self.engines[greedy]
        sched = Scheduler(engine) if self.tools is None else Scheduler(engine, env=self.tools)
        sched.submit([Trajectory(uid=i, group_id=i, prompt=np.asarray(ids, np.int32), seed=seed + i,
                                 max_new_tokens=self.max_new)
                      for i, ids in enumerate(self.tokenizer.encode_batch(list(prompts)))])
        sched.run()
        return sorted(sched.take_finished(), key=lambda t: t.uid)


def bucket_accuracy(key: np.ndarray, buckets: Sequence[tuple[int, int]], greedy: np.ndarray,
                    sampled: np.ndarray) -> dict:
    """Greedy [N] and sampled [N, k] accuracy per ``(lo, hi)`` bucket of ``key`` [N] (empty buckets left out)."""
    out = {}
    for lo, hi in buckets:
        sel = (key >= lo) & (key <= hi)
        if sel.any():
            name = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10_000 else f"{lo}+")
            out[name] = {"n": int(sel.sum()), "greedy": float(greedy[sel].mean()),
                         "sampled": float(sampled[sel].mean())}
    return out


def length_stats(lengths: Sequence[int]) -> dict:
    x = np.asarray(lengths)
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": int(x.max())}
