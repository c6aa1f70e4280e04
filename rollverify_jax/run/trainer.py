"""``Trainer``: a training run's state (the serving policy, its evaluator, the train state, rollout manager, data
position, checkpointer) and the five calls of one step (``rollout``, ``score``, ``select``, ``learn``,
``end_cycle``). Built by ``builder.build_trainer``; its host-side state is one dict (``state_dict``) that
checkpoints hold beside the train state."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Any

import jax
from etils import epath
from jax.sharding import Mesh

from rollverify_jax.data.datasets import PromptIterator
from rollverify_jax.data.prompts import PromptRenderer
from rollverify_jax.data.rewards import RewardScorer
from rollverify_jax.infra import distributed
from rollverify_jax.infra.transfer import tree_bytes
from rollverify_jax.models import Qwen3ForCausalLM, Tokenizer
from rollverify_jax.rl import step as step_lib
from rollverify_jax.rl.partial_rollout import PhaseResult, RolloutManager
from rollverify_jax.rollout.engine import Engine
from rollverify_jax.rollout.publish import WeightPublisher
from rollverify_jax.rollout.tool_use import ToolEnvironment
from rollverify_jax.run import programs, shape_plan
from rollverify_jax.run.checkpoint import Checkpointer
from rollverify_jax.run.evaluation import Evaluator
from rollverify_jax.run.spec import RunSpec


@dataclasses.dataclass
class Serving:
    """The policy as rollout samples it and the reward grades it, opened and closed together: the model and its
    engine on the mesh, the tokenizer (responses are decoded with it) and the prompt renderer, the reward scorer
    and, with tool use, the tool runner."""

    model: Qwen3ForCausalLM
    mesh: Mesh
    engine: Engine
    tokenizer: Tokenizer
    prompts: PromptRenderer
    scorer: RewardScorer
    tools: ToolEnvironment | None = None  # ToolUseConfig.enabled: multi-turn tool use

    def close(self) -> None:
        try:
            self.scorer.close()
        finally:
            if self.tools is not None:
                self.tools.close()


@dataclasses.dataclass
class Trainer:
    """Everything a training run holds; ``step`` = completed training steps = the policy version sampled with."""

    spec: RunSpec
    serving: Serving
    evaluator: Evaluator
    workdir: epath.Path
    graphdef: Any
    train_state: Any
    train_step: Any
    manager: RolloutManager
    iterator: PromptIterator
    checkpointer: Checkpointer
    ref_params: Any = None
    logprob_fn: Any = None  # learner.make_logprob_fn: the packed log-prob pass of select (step start, reference)
    inputs: dict = dataclasses.field(default_factory=dict)  # what the run reads (data, tokenizer): its hashes
    # The asynchronous mode: the learner's own mesh and the publisher of its weights to the engine's devices.
    train_mesh: Mesh | None = None
    publisher: WeightPublisher | None = None
    wall_offset: float = 0.0
    step: int = 0
    learner: Any = None  # rl.learner.Learner: its programs, for compile_ahead

    def compile_ahead(self) -> dict:
        """Compiles the run's shape plan (``run/shape_plan.py``) before its first step -> {'programs', 'seconds',
        'wall_s'}."""
        engine = self.serving.engine
        plan = shape_plan.plan_run(self.spec, engine.plan, train_state=self.train_state,
                                   logprob_users=programs.logprob_pass_users(self.spec))
        style = self.spec.metrics.progress
        bar = style == "bar" or (style == "auto" and sys.stdout.isatty() and sys.stderr.isatty())
        return shape_plan.compile_ahead(plan, engine, self.learner, self.train_state,
                                        self.spec.rollout.batch_groups * self.spec.rollout.group_size, progress=bar)

    # The five calls of a step ---------------------------------------------------------------------------

    def rollout(self) -> PhaseResult:
        """One rollout phase, with paused trajectories verified inside their resume prefill."""
        return self.manager.run_phase()

    def score(self, groups) -> step_lib.Scored:
        serving = self.serving
        return step_lib.score(groups, serving.tokenizer.decode, serving.scorer, self.spec.train.advantage,
                              multi_turn=serving.tools is not None)

    def select(self, scored: step_lib.Scored) -> tuple[dict, dict]:
        spec = self.spec
        return step_lib.select(
            scored, spec.learner, spec.filter, current_version=self.step,
            rows=spec.rollout.batch_groups * spec.rollout.group_size, width=spec.engine.max_seq_len,
            mesh=self.learner_mesh, skip_uniform_groups=spec.train.skip_uniform_groups,
            policy_logp=step_lib.on_host(self.logprob_fn, self.train_state.params),
            ref_logp=step_lib.on_host(self.logprob_fn, self.ref_params) if self.ref_params is not None else None)

    @property
    def learner_mesh(self) -> Mesh:
        return self.train_mesh if self.train_mesh is not None else self.serving.mesh

    def learn(self, batch: dict) -> dict:
        """One jitted, sharded update; the engine samples with the new params as the next policy version.

        Asynchronous mode: the update is dispatched on the train mesh and not waited for; the new params are
        staged into the engine's layout while the rollout decodes ``AsyncConfig.overlap_dispatches`` more
        dispatches with the weights it holds; then (the update done) they are swapped in at that decode-step
        boundary and the running trajectories are paused, to be verified under them at the next phase."""
        if self.publisher is None:
            self.train_state, metrics = self.train_step(self.train_state, batch)
            self.step += 1
            self.serving.engine.update_params(self.train_state.params, version=self.step)
            # What the engine takes from the learner: every weight, or a LoRA run's adapters alone.
            return {**{k: float(v) for k, v in distributed.fetch(metrics).items()},
                    "publish/bytes": float(tree_bytes(self.train_state.params))}
        t0 = time.perf_counter()
        self.train_state, metrics = self.train_step(self.train_state, batch)
        self.step += 1
        update = _ReadyClock(metrics, t0)
        self.publisher.stage(self.train_state.params, self.step)
        manager = self.manager
        overlap = manager.overlap(0 if manager.on_policy else self.spec.async_rollout.overlap_dispatches)
        t1 = time.perf_counter()
        fetched = {k: float(v) for k, v in distributed.fetch(metrics).items()}
        waited = time.perf_counter() - t1
        published = self.publisher.swap()
        manager.at_swap()
        return {**fetched, **overlap, **published, "time/update": update.seconds(),
                "time/rollout_wait_for_update": waited}

    def evaluate(self) -> dict:
        """Held-out evaluation with the engine's current weights; a rollout still decoding (the asynchronous
        mode's 'keep_stale_kv') is paused first, since evaluation uses the engine's slots."""
        if not self.manager.scheduler.idle:
            self.manager.quiesce()
        return self.evaluator.run(self.workdir)

    def check_agreement(self, batch: dict) -> None:
        """Several hosts: the batch (scheduling, cuts, rewards), the data position and the rollout state (cache,
        switching) are decided on each host and must agree before they become one global batch."""
        distributed.check_same_on_every_process(self.step, batch=lambda: batch, data=self.iterator.get_state,
                                                rollout=self.manager.state_dict)

    def end_cycle(self, phase_metrics: dict) -> dict:
        return self.manager.end_cycle(self.step, phase_metrics)

    # State ------------------------------------------------------------------------------------------------

    def settings(self) -> dict:
        """The settings saved in every checkpoint and compared on resume (``run_settings``)."""
        return run_settings(self.spec, self.inputs, self.serving.engine.compute_dtype)

    def state_dict(self, wall: float) -> dict:
        """The host-side state a checkpoint holds beside the train state (params, optimizer, PRNG)."""
        return {"step": self.step, "data": self.iterator.get_state(), "rollout": self.manager.state_dict(),
                "wall_time": wall, "settings": self.settings(), "published_version": self.serving.engine.version}

    def load_state_dict(self, extra: dict) -> None:
        self.iterator.set_state(extra["data"])
        self.manager.load_state_dict(extra["rollout"])
        self.wall_offset = float(extra["wall_time"])
        self.step = int(extra["step"])
        published = int(extra.get("published_version", self.step))
        if published != self.step:  # a publish had failed: the resumed rollout starts on the learner's weights
            print(f"the checkpoint's rollout was on policy version {published} (a publish had failed); it resumes "
                  f"on version {self.step}", flush=True)

    def close(self) -> None:
        """The last save committed first (a run's end waits for it), then the grader and tool pools stopped, each
        with a bounded wait (``RewardScorer.close``, ``ToolEnvironment.close``)."""
        try:
            self.checkpointer.close()
        finally:
            self.serving.close()


class _ReadyClock:
    """When an update's outputs became ready, seen from a thread that waits on them: the train mesh's busy time,
    measured without making the host wait."""

    def __init__(self, outputs: Any, started: float):
        self.started, self.ready = started, None
        self._thread = threading.Thread(target=self._wait, args=(outputs,), daemon=True)
        self._thread.start()

    def _wait(self, outputs: Any) -> None:
        jax.block_until_ready(outputs)
        self.ready = time.perf_counter()

    def seconds(self) -> float:
        self._thread.join()
        return self.ready - self.started


def run_settings(spec: RunSpec, inputs: dict, rollout_dtype: str) -> dict:
    """The settings a checkpoint holds and a resume compares: the spec's (``RunSpec.settings``), what the run
    reads (``builder.input_identity``) and the rollout's resolved activation dtype (it changes what is sampled)."""
    return {**spec.settings(), **inputs, "inputs.rollout_dtype": rollout_dtype}
