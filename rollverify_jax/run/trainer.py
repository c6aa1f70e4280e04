"""``Trainer``: a training run's state (policy, train state, rollout manager, data position, checkpointer) and
the five calls of one step (``rollout``, ``score``, ``select``, ``learn``, ``end_cycle``). Built by
``builder.build_trainer``; its host-side state is one dict (``state_dict``) that checkpoints hold beside the train
state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from etils import epath

from rollverify_jax.data.datasets import PromptIterator
from rollverify_jax.infra import distributed
from rollverify_jax.rl import step as step_lib
from rollverify_jax.rl.partial_rollout import PhaseResult, RolloutManager
from rollverify_jax.run.checkpoint import Checkpointer
from rollverify_jax.run.spec import RunSpec


@dataclasses.dataclass
class Policy:
    """A policy ready to sample: its spec, tokenizer, model, mesh, engine, reward scorer and eval records."""

    spec: RunSpec
    tokenizer: Any
    model: Any
    mesh: Any
    engine: Any
    scorer: Any
    eval_records: list  # the primary eval set (TrainConfig.eval_dataset)
    eval_sets: dict = dataclasses.field(default_factory=dict)  # name -> records of TrainConfig.eval_sets
    tools: Any = None  # a rollout.tool_use.ToolEnvironment when ToolUseConfig.enabled (multi-turn tool use)

    def encode(self, record: dict) -> np.ndarray:
        """A record's prompt ids: its ``prompt``, or with ``TrainConfig.chat_template`` its own ``messages`` when it
        has them, in the chat template with ``system_prompt`` (unless the record brings a system message) and
        ``enable_thinking``; ``builder.prompt_lengths`` counts the same rendering."""
        train = self.spec.train
        return np.asarray(self.tokenizer.encode_prompt(record["prompt"], chat=train.chat_template,
                                                       system=train.system_prompt,
                                                       enable_thinking=train.enable_thinking,
                                                       messages=record.get("messages")), np.int32)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.scorer.close()
        if self.tools is not None:
            self.tools.close()


@dataclasses.dataclass
class Trainer:
    """Everything a training run holds; ``step`` = completed training steps = the policy version sampled with."""

    policy: Policy
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
    wall_offset: float = 0.0
    step: int = 0

    @property
    def spec(self) -> RunSpec:
        return self.policy.spec

    # The five calls of a step ---------------------------------------------------------------------------

    def rollout(self) -> PhaseResult:
        """One rollout phase, with paused trajectories verified inside their resume prefill."""
        return self.manager.run_phase()

    def score(self, groups) -> step_lib.Scored:
        return step_lib.score(groups, self.policy.decode, self.policy.scorer, self.spec.train.advantage,
                              multi_turn=self.policy.tools is not None)

    def select(self, scored: step_lib.Scored) -> tuple[dict, dict]:
        spec = self.spec
        return step_lib.select(
            scored, spec.learner, spec.filter, current_version=self.policy.engine.version,
            rows=spec.rollout.batch_groups * spec.rollout.group_size, width=spec.engine.max_seq_len,
            mesh=self.policy.mesh, skip_uniform_groups=spec.train.skip_uniform_groups,
            policy_logp=self._logp(lambda: self.train_state.params),
            ref_logp=self._logp(lambda: self.ref_params) if self.ref_params is not None else None)

    def learn(self, batch: dict) -> dict:
        """One jitted, sharded update; the engine samples with the new params as the next policy version."""
        self.train_state, metrics = self.train_step(self.train_state, batch)
        self.step += 1
        self.policy.engine.update_params(self.train_state.params, version=self.step)
        return {k: float(v) for k, v in distributed.fetch(metrics).items()}

    def check_agreement(self, batch: dict) -> None:
        """Several hosts: the batch (scheduling, cuts, rewards), the data position and the rollout state (cache,
        switching) are decided on each host and must agree before they become one global batch."""
        distributed.check_same_on_every_process(self.step, batch=lambda: batch, data=self.iterator.get_state,
                                                rollout=self.manager.state_dict)

    def end_cycle(self, phase_metrics: dict) -> dict:
        return self.manager.end_cycle(self.step, phase_metrics)

    def _logp(self, params):
        """The learner's packed forward (`learner.make_logprob_fn`) of ``params()`` on a packed batch, on the
        host."""
        def logp(batch: dict) -> np.ndarray:
            return distributed.fetch(self.logprob_fn(params(), batch))
        return logp

    # State ------------------------------------------------------------------------------------------------

    def settings(self) -> dict:
        """The settings that define what the run trains (saved in every checkpoint, compared on resume): the
        spec's, plus what it reads and the rollout's resolved activation dtype (it changes what is sampled)."""
        return {**self.spec.settings(), **self.inputs, "inputs.rollout_dtype": self.policy.engine.compute_dtype}

    def state_dict(self, wall: float) -> dict:
        """The host-side state a checkpoint holds beside the train state (params, optimizer, PRNG)."""
        return {"step": self.step, "data": self.iterator.get_state(), "rollout": self.manager.state_dict(),
                "wall_time": wall, "settings": self.settings()}

    def load_state_dict(self, extra: dict) -> None:
        self.iterator.set_state(extra["data"])
        self.manager.load_state_dict(extra["rollout"])
        self.wall_offset = float(extra["wall_time"])
        self.step = int(extra["step"])

    def close(self) -> None:
        self.policy.close()
        self.checkpointer.close()
