"""The GRPO learner: optimizer, sharded train state and the jitted train step (METHOD.md section 6).

`Learner.create` assembles what the learner runs on its mesh (optimizer, graph, train-state shardings, the
train step and the log-prob pass) for a concrete or an abstract model: the run and the deviceless compile use
the same programs. One call of the train step consumes one rollout batch (fixed, packed shapes) and makes
`ppo_epochs * num_minibatches` optimizer updates. Each update accumulates gradients over the micro-batches of
packed rows its minibatch fills, weighting each micro-batch by its share of the loss normaliser so that the
accumulated gradient equals the full-minibatch gradient for every aggregation of `losses.AGGREGATIONS` (see
`_normaliser`).

Batch layout (every entry has the batch dimension B first, sharded over ('data', 'fsdp')):

    tokens          int32[B, T]    prompt + response, right padded
    loss_mask       float32[B, T]  1 on response tokens counted in the loss (0 on prompt, padding and on
                                   every token of a trajectory a filter dropped)
    behavior_logp   float32[B, T]  log mu(tokens[t]), aligned to tokens (entry 0 unused)
    advantages      float32[B]
    ref_logp        float32[B, T]  optional, needed when LossConfig.kl_coef > 0 (see `make_logprob_fn`)
    attention_mask  bool[B, T]     True on real tokens (what packing reads each length from)
    packed_*, tail_*, unpack_index, micro_index
                                   the packed layout of `tokens` (`packing.pack_for_learner`): the model runs
                                   on micro-batches of packed rows, as many as each minibatch fills, and the
                                   log-probs are gathered back to [B, T]. An unpacked batch
                                   (`LearnerConfig.pack_sequences = False`) is the same layout with one
                                   sequence per row: there is one train path.

The policy's log-prob of token t is read from the logits at position t - 1, so `loss_mask[:, 0]` is ignored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollverify_jax.infra import distributed
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import lora
from rollverify_jax.models.flash_attention import DEFAULT_FLASH, FlashConfig
from rollverify_jax.models.qwen3 import REMAT_POLICIES, CausalAttention, chunked_scores, score_tokens
from rollverify_jax.rl import losses, packing
from rollverify_jax.schedule_rules import batch_devices

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
TrainStep = Callable[["TrainState", Batch], tuple["TrainState", Metrics]]
LogProbStep = Callable[[nnx.State, Batch], jax.Array]  # (params, batch) -> log-probs float32[B, T]

SCHEDULES = ("constant", "cosine")
REQUIRED_KEYS = ("tokens", "loss_mask", "behavior_logp", "advantages")
RATIO_AGAINST = ("behavior", "step_start")  # LearnerConfig.ratio_against
# Loss metrics that are masked means over live sequences rather than over tokens (see `_combine`).
_SEQ_METRICS = frozenset({"vespo/phi_mean"})
# Loss metrics reduced with the configured aggregation (their normaliser depends on it).
_AGG_METRICS = frozenset({"loss", "policy/pg_loss"})
# The batch entries the train step reads (the rest, e.g. attention_mask, never reach its program).
_TRAIN_KEYS = frozenset({*REQUIRED_KEYS, "ref_logp", *packing.ALL_KEYS})


# ---------------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + constant/cosine learning-rate schedule.

    Steps count optimizer updates (`num_minibatches * ppo_epochs` per rollout batch), not rollout batches.
    schedule: 'constant' (linear warmup, then `learning_rate`) or 'cosine' (linear warmup, then cosine decay to
        `learning_rate * end_lr_ratio` at `total_steps`; optax counts the warmup inside total_steps). The warmup's
        update k (from 0) uses `learning_rate * (k + 1) / (warmup_steps + 1)`: the first update already learns
        (a ramp from 0 spends it at lr 0).
    weight_decay: decoupled decay, applied to matrices only (ndim >= 2), not to norm scales or biases.
    max_grad_norm: clip the global gradient norm to this (None: no clipping).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        """Fail where the gin binding lands rather than with a NaN learning rate later."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule '{self.schedule}' is unknown; known: {list(SCHEDULES)}.")
        if self.learning_rate < 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError(
                "OptimizerConfig.learning_rate, warmup_steps and weight_decay must be >= 0; got "
                f"{self.learning_rate}, {self.warmup_steps}, {self.weight_decay}."
            )
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"OptimizerConfig.schedule='cosine' needs total_steps > warmup_steps={self.warmup_steps} "
                f"(optimizer updates in the whole run), got total_steps={self.total_steps}."
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}.")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer-update count."""
    lr = cfg.learning_rate
    start = lr / (cfg.warmup_steps + 1)  # a linear ramp from here reaches lr * (k + 1) / (W + 1) at update k
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=start, peak_value=lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.total_steps,
            end_value=lr * cfg.end_lr_ratio,
        )
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(start, lr, cfg.warmup_steps), optax.constant_schedule(lr)], [cfg.warmup_steps]
    )


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: decaying RMSNorm scales towards 0 would fight the pretrained model."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """`chain(clip_by_global_norm, adamw)`; hyper-parameters live in the optimizer state (inject_hyperparams)
    so the train step can report the learning rate it used and checkpoints carry the schedule position."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",), hyperparam_dtype=jnp.float32)(
        learning_rate=make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=_decay_mask,
    )
    clip = optax.identity() if cfg.max_grad_norm is None else optax.clip_by_global_norm(cfg.max_grad_norm)
    return optax.chain(clip, adamw)


# ---------------------------------------------------------------------------------------------------------
# Train state
# ---------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything the update changes: a pytree, so it is jitted, donated and checkpointed as one.

    params: `nnx.State` of what trains: the model's `nnx.Param`s, or a LoRA model's adapters (`nnx.LoRAParam`s);
        Variables keep their `logical_axes` metadata.
    opt_state: optax state; its moment trees mirror `params` and share their shardings.
    step: int32[] number of optimizer updates so far.
    rng: uint32 key data of the run's PRNG (`jax.random.key_data`); the learner does not consume it.
    """

    params: nnx.State
    opt_state: Any
    step: jax.Array
    rng: jax.Array

    def replace(self, **kw) -> TrainState:
        return dataclasses.replace(self, **kw)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """`(graphdef, params)`: the static structure and the trainable state of `model` (every `nnx.Param`, or the
    LoRA adapters of an adapted model: `lora.split_trainable`)."""
    graphdef, params, _ = lora.split_trainable(model)
    return graphdef, params


def trainable_state(model: nnx.Module) -> nnx.State:
    """What the optimizer updates: every `nnx.Param`, or an adapted model's `nnx.LoRAParam`s."""
    return nnx.state(model, lora.trainable_filter(model))


def frozen_state(model: nnx.Module) -> nnx.State:
    """The weights an adapted model trains around (its base); empty for full fine-tuning."""
    return lora.split_trainable(model)[2]


def merge(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None) -> nnx.Module:
    """The model of `graphdef` from its trainable `params` and its `frozen` weights (None: there are none)."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def _init_opt_state(optimizer: optax.GradientTransformation, params: nnx.State) -> Any:
    """Optimizer state with float32 moments whatever the params' dtype: bfloat16 moments lose the small updates
    of the second moment, and the update loop carries one type (gradients accumulate in float32)."""
    def f32(x):
        return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return optimizer.init(jax.tree.map(f32, params))


def _state_sharding(tree: Any, mesh: Mesh, rules: dict[str, tuple[str, ...]]) -> Any:
    """NamedSharding per leaf: Variables by their logical axes, every other leaf (counts, scalars) replicated."""
    def one(x):
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("logical_axes")
            spec = PartitionSpec() if axes is None else mesh_lib.logical_to_spec(axes, x.shape, mesh, rules)
            return NamedSharding(mesh, spec)
        return mesh_lib.replicated(mesh)
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def train_state_shardings(model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """Shardings of the train state (a `TrainState` of `NamedSharding`s), derived without allocating it.

    The optimizer moments are `nnx.State`s holding the same Variables (with `logical_axes`) as the params,
    so they get the params' shardings; optimizer counters and hyper-parameters are replicated.
    """
    params = trainable_state(model)
    abstract_opt = jax.eval_shape(lambda p: _init_opt_state(optimizer, p), params)
    rep = mesh_lib.replicated(mesh)
    rules = model.cfg.rules()
    return TrainState(params=_state_sharding(params, mesh, rules), opt_state=_state_sharding(abstract_opt, mesh, rules),
                      step=rep, rng=rep)


def abstract_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """`jax.ShapeDtypeStruct`s with shardings: the restore target for a checkpoint of the train state."""
    shardings = train_state_shardings(model, optimizer, mesh)
    # The params go in as arguments, so an abstract model (`nnx.eval_shape`, ShapeDtypeStruct leaves) works too.
    abstract = jax.eval_shape(lambda p: _raw_state(p, optimizer, 0), trainable_state(model))
    return _map_with_shardings(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def abstract_params(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """The params of `model` (concrete or abstract) as `jax.ShapeDtypeStruct`s in the train state's shardings: the
    restore target of a checkpoint's params alone (evaluation, export), with no optimizer state."""
    return _abstract_on(trainable_state(model), mesh, model.cfg.rules())


def _abstract_on(params: nnx.State, mesh: Mesh, rules: dict[str, tuple[str, ...]]) -> nnx.State:
    shardings = _state_sharding(params, mesh, rules)
    return _map_with_shardings(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)


def place_frozen(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """`model`'s frozen weights on `mesh` by their logical axes, not copied where they are already placed so (the
    engine on the same mesh holds the same arrays); ShapeDtypeStructs with shardings for an abstract model."""
    frozen, rules = frozen_state(model), model.cfg.rules()
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(frozen)):
        return _abstract_on(frozen, mesh, rules)
    return _map_with_shardings(jax.device_put, frozen, _state_sharding(frozen, mesh, rules))


def _map_with_shardings(fn: Callable[[Any, NamedSharding], Any], tree: Any, shardings: Any) -> Any:
    """`fn(array, sharding)` per array of `tree`; `shardings` holds one NamedSharding per Variable (a prefix)."""
    def one(x, s):
        return x.replace(fn(x.get_value(), s)) if isinstance(x, nnx.Variable) else fn(x, s)
    return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _raw_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(params=params, opt_state=_init_opt_state(optimizer, params), step=jnp.zeros((), jnp.int32),
                      rng=jax.random.key_data(jax.random.key(seed)))


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh,
                     seed: int = 0) -> TrainState:
    """The train state placed on `mesh`: params by their logical axes, moments alike, scalars replicated.

    Params are copied (never aliased to the model's arrays), because the train step donates the state: the
    model stays valid; refresh it after each step with `nnx.update(model, state.params)`.
    """
    shardings = train_state_shardings(model, optimizer, mesh)
    params = trainable_state(model)
    params = _map_with_shardings(jax.device_put, params, shardings.params)  # may alias the model's buffers
    fresh = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), _init_opt_state(optimizer, p)),
                    out_shardings=(shardings.params, shardings.opt_state))
    params, opt_state = fresh(params)  # jit outputs never alias its non-donated inputs
    step = jax.device_put(np.zeros((), np.int32), shardings.step)
    rng = jax.device_put(jax.random.key_data(jax.random.key(seed)), shardings.rng)
    return TrainState(params=params, opt_state=opt_state, step=step, rng=rng)


# ---------------------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------------------


def _shifted(logp: jax.Array, entropy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Entries for tokens 1..T-1 -> [B, T] aligned to tokens (entry 0, which nothing predicts, is 0)."""
    pad = jnp.zeros((logp.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)


def _logp_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """logits float32[B, T, V], tokens int32[B, T] -> (logp [B, T], entropy [B, T]), aligned to tokens.

    Entry t scores tokens[t] with the logits at t - 1 (entry 0 is 0).
    """
    return _shifted(*score_tokens(logits[:, :-1].astype(jnp.float32) / temperature, tokens[:, 1:]))


def _model_logp(model, tokens: jax.Array, positions: jax.Array | None, attention: CausalAttention, temperature: float,
                chunk: int | None, remat: str = "none", scan: bool = False) -> tuple[jax.Array, jax.Array]:
    # The attention's mesh (its kernels run per device) is the one MoE layers route on.
    hidden, _ = model.hidden_states(tokens, positions, attention, remat, mesh=attention.mesh, scan=scan)
    if chunk is None:
        return _logp_and_entropy(model.logits_from_hidden(hidden), tokens, temperature)
    return _shifted(*chunked_scores(hidden[:, :-1], model.output_weights(), tokens[:, 1:], temperature, chunk))


def _policy_logp(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, attention_mask: jax.Array | None,
                 temperature: float, chunk: int | None = None, remat: str = "none",
                 kernel: dict | None = None, scan: bool = False,
                 frozen: nnx.State | None = None) -> tuple[jax.Array, jax.Array]:
    """``kernel``: CausalAttention's impl / flash / mesh (default: the jnp reference)."""
    model = merge(graphdef, params, frozen)
    valid = None if attention_mask is None else attention_mask.astype(bool)
    return _model_logp(model, tokens, None, CausalAttention(valid=valid, **(kernel or {})), temperature, chunk,
                       remat, scan)


def _packed_rows_logp(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State, tokens: jax.Array,
                      positions: jax.Array, segments: jax.Array, temperature: float, chunk: int | None = None,
                      remat: str = "none", kernel: dict | None = None,
                      scan: bool = False) -> tuple[jax.Array, jax.Array]:
    """(logp, entropy) [r, W] of packed rows (each token scored within its own segment)."""
    model = merge(graphdef, params, frozen)
    attention = CausalAttention(segments=segments, **(kernel or {}))
    return _model_logp(model, tokens, positions, attention, temperature, chunk, remat, scan)


@functools.partial(jax.jit, static_argnums=(0, 4))
def compute_logprobs(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array,
                     temperature: float = 1.0, frozen: nnx.State | None = None) -> jax.Array:
    """log pi(tokens[t] | tokens[:t]) float32[B, T], aligned to tokens like `behavior_logp` (entry 0 is 0).

    The unpacked, unchunked pass over the whole [B, T] batch at once: a reference for tests and small batches.
    A run's reference and step-start log-probs use `make_logprob_fn` (the train step's packed, chunked forward),
    which at a real context does not hold [B, T, V] logits. `mask` [B, T] (bool or 0/1) marks real tokens:
    padding keys are masked out of attention and padded entries of the result are 0.
    """
    logp, _ = _policy_logp(graphdef, params, tokens, mask, temperature, frozen=frozen)
    return jnp.where(mask.astype(bool), logp, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Train step
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """How one rollout batch becomes optimizer updates.

    loss_name: a name in `losses.LOSSES` ('grpo', 'gspo', 'gspo_token', 'sapo', 'vespo').
    loss: the loss hyper-parameters (aggregation, clip range, KL coefficient, ...).
    num_minibatches: optimizer updates per epoch over the batch; minibatch k takes rows k, k + n, k + 2n, ...
        (a strided split keeps every device's rows local under the batch sharding).
    ppo_epochs: passes over the batch; `num_minibatches * ppo_epochs` updates per train step.
    micro_batch_size: rows per forward/backward pass (gradient accumulation; None: the whole minibatch). It
        bounds activation memory ([micro, T, V] logits) and does not change the result (exact accumulation).
        With `pack_sequences` these are packed rows (one per batch device at real scale: a multiple of the
        data x fsdp devices, else rows are computed redundantly), and each minibatch runs as many micro-batches
        as its tokens fill, in one compiled program for every batch.
    pack_sequences: several sequences per row (`packing`); False: one sequence per row of the same layout (the
        padded batch). Same result, far fewer FLOPs on long-tailed batches. Applied by `packing.pack_for_learner`
        on the host before the step.
    tail_row_width: packed rows this many tokens wide for a minibatch's last micro-batches (None: full rows
        only). A minibatch whose tokens would leave most of a last micro-batch of full rows empty puts its
        shorter sequences into narrow rows instead; needs `micro_batch_size` and `pack_sequences`. At the real
        configs' lengths a quarter of the context lifts the useful share of positions from about 0.73 to 0.88.
    logits_chunk: score log-probs and entropy this many positions at a time, rematerialising each chunk's
        logits in the backward pass (None: all positions at once). Same result; bounds the [rows, T, V]
        logits, which at a real vocabulary and length do not fit.
    remat: what each decoder layer keeps for the backward pass: 'none', 'full' (recompute the layer), 'dots'
        (keep matmul outputs without a batch dimension). Same result; less activation memory, more FLOPs.
    scan_layers: run identical consecutive decoder layers as one scan over stacked weights (see
        `Qwen3ForCausalLM.hidden_states`). Same result; at real scale it keeps XLA from holding every layer's
        gathered weights and recomputed activations at once. Costs one stacked copy of the local weight shards.
    temperature: divides the logits before the softmax. None (the default) means the rollout sampler's
        temperature, which `for_sampler` fills in, so pi and mu are the same distribution at ratio 1 by
        construction; an explicit value that differs from the sampler's is refused there. Used alone, the
        learner takes 1.0.
    ratio_against: the log-probs the loss's importance ratio divides by. 'behavior' (the method's): the recorded
        mu of each token, however many versions old, so a stale token is clipped like any off-policy one.
        'step_start': pi_old, the batch re-scored with the step's starting params before its first update (verl's
        `old_log_prob`), so the ratio only measures this step's updates and staleness goes uncorrected; one extra
        forward pass per step (`train.select`). An ablation: it asks whether the clip alone protects partial
        rollout.
    """

    loss_name: str = "grpo"
    loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)  # gin bindings apply
    num_minibatches: int = 1
    ppo_epochs: int = 1
    micro_batch_size: int | None = None
    temperature: float | None = None
    pack_sequences: bool = True
    tail_row_width: int | None = None
    logits_chunk: int | None = None
    remat: str = "none"
    scan_layers: bool = False
    ratio_against: str = "behavior"

    def __post_init__(self) -> None:
        """A bad name or count fails at construction, where the gin binding lands."""
        losses.get_loss_fn(self.loss_name)
        if self.ratio_against not in RATIO_AGAINST:
            raise ValueError(f"LearnerConfig.ratio_against={self.ratio_against!r}: use one of {list(RATIO_AGAINST)}.")
        if self.num_minibatches < 1 or self.ppo_epochs < 1:
            raise ValueError(
                f"LearnerConfig.num_minibatches and ppo_epochs must be >= 1, got {self.num_minibatches}, "
                f"{self.ppo_epochs}."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"LearnerConfig.remat={self.remat!r}: use one of {list(REMAT_POLICIES)}.")
        if self.logits_chunk is not None and self.logits_chunk < 1:
            raise ValueError(f"LearnerConfig.logits_chunk must be >= 1 or None, got {self.logits_chunk}.")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"LearnerConfig.micro_batch_size must be >= 1 or None, got {self.micro_batch_size}.")
        if self.tail_row_width is not None and (self.tail_row_width < 1 or self.micro_batch_size is None
                                                or not self.pack_sequences):
            raise ValueError(f"LearnerConfig.tail_row_width={self.tail_row_width} needs a positive width, "
                             "micro_batch_size and pack_sequences=True (tail rows are packed micro-batches).")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"LearnerConfig.temperature must be > 0 (or None: the sampler's), got {self.temperature}.")

    @property
    def logit_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    def for_sampler(self, sampler_temperature: float) -> LearnerConfig:
        """This config scoring at the sampler's temperature (the one its behaviour log-probs were taken at)."""
        if self.temperature is not None and self.temperature != sampler_temperature:
            raise ValueError(
                f"LearnerConfig.temperature={self.temperature} differs from the sampler's log-prob temperature "
                f"{sampler_temperature} (SamplingConfig.temperature, 1 when greedy): the importance ratio would not "
                "be 1 on-policy. Remove the LearnerConfig.temperature binding (it follows the sampler).")
        return dataclasses.replace(self, temperature=sampler_temperature)


def _normaliser(mask: jax.Array, aggregation: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss normaliser, token count, live-sequence count) of a mask [N, T], each clamped to >= 1.

    `losses.aggregate` divides by `max(#tokens, 1)` ('token-mean') or by `max(#live sequences, 1)` (the
    seq-mean modes; a sequence is live when it has a masked token). Weighting micro-batch k by
    `n_k / n` with these clamped counts makes `sum_k w_k loss_k` equal the whole-minibatch loss exactly
    (empty micro-batches have loss 0), and likewise for masked-mean metrics.
    """
    tokens = jnp.maximum(mask.sum(), 1.0)
    seqs = jnp.maximum((mask.sum(axis=-1) > 0).sum().astype(jnp.float32), 1.0)
    if aggregation == "token-mean":
        return tokens, tokens, seqs
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return seqs, tokens, seqs
    raise ValueError(f"no exact micro-batch weighting for aggregation '{aggregation}'; extend learner._normaliser.")


def _split(x: jax.Array, n: int, mesh: Mesh) -> jax.Array:
    """[N, ...] -> [n, N/n, ...], part k = rows k, k+n, ...; the second axis stays on the batch mesh axes."""
    parts = jnp.moveaxis(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 1, 0)
    if parts.shape[1] % batch_devices(mesh.shape) == 0:
        spec = PartitionSpec(None, mesh_lib.BATCH_AXES, *([None] * (x.ndim - 1)))
        parts = jax.lax.with_sharding_constraint(parts, NamedSharding(mesh, spec))
    return parts


def _unsplit(parts: jax.Array) -> jax.Array:
    """The inverse of `_split`: [n, N/n, ...] with part k = rows k, k + n, ... -> [N, ...]."""
    return jnp.moveaxis(parts, 0, 1).reshape(parts.shape[0] * parts.shape[1], *parts.shape[2:])


def _check_batch(batch: Batch, cfg: LearnerConfig) -> packing.PackShape:
    """Validate shapes at trace time; returns the batch's packed layout."""
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(f"train batch lacks {missing}; it needs {list(REQUIRED_KEYS)} (+ optional ref_logp).")
    if "micro_index" not in batch:
        raise ValueError("the learner takes a packed batch (packed_*, unpack_index, micro_index): lay it out with "
                         "packing.pack_for_learner and the same LearnerConfig.")
    b, t = batch["tokens"].shape
    for k in ("loss_mask", "behavior_logp", "ref_logp", "attention_mask", "unpack_index"):
        if k in batch and batch[k].shape != (b, t):
            raise ValueError(f"batch['{k}'] has shape {batch[k].shape}, expected tokens' shape {(b, t)}.")
    for k in ("advantages", "micro_index"):
        if batch[k].shape != (b,):
            raise ValueError(f"batch['{k}'] has shape {batch[k].shape}, expected {(b,)}.")
    for keys in (packing.PACKED_KEYS, packing.TAIL_KEYS):
        shapes = {batch[k].shape for k in keys if k in batch}
        if len(shapes) > 1 or any(s[1] > t for s in shapes):
            raise ValueError(f"packed entries {keys} need one shape [P, W <= {t}], got {shapes}.")
    if b % cfg.num_minibatches:
        raise ValueError(f"batch size {b} is not divisible by LearnerConfig.num_minibatches={cfg.num_minibatches}.")
    return packing.pack_shape(batch, cfg)


def _over_packed_micro_batches(minibatch: Batch, shape: packing.PackShape, mesh: Mesh, body: Callable, carry: Any):
    """`carry = body(member bool[S], rows (tokens, positions, segments) [r, W], carry)` over the packed
    micro-batches one minibatch fills (full rows, then tail rows of their own width), as many as its
    `micro_index` says: a loop with a data-dependent trip count, so the cost follows the tokens. The train step
    and the log-prob pass (`make_logprob_fn`) both run this loop, so they compute the same rows."""
    micro_index = minibatch["micro_index"]

    def run(keys, first: int, most: int, carry):
        blocks = tuple(_split(minibatch[k], most, mesh) for k in keys)  # [most, r, W] each
        mine = (micro_index >= first) & (micro_index < first + most)
        count = jnp.max(jnp.where(mine, micro_index - first, -1)) + 1  # micro-batches this minibatch fills

        def step(j, carry):
            rows = tuple(jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False) for x in blocks)
            return body(micro_index == first + j, rows, carry)

        return jax.lax.fori_loop(0, count, step, carry)

    carry = run(packing.PACKED_KEYS, 0, shape.max_micro, carry)
    if shape.tail_width is not None:
        carry = run(packing.TAIL_KEYS, shape.max_micro, shape.max_tail_micro, carry)
    return carry


def _kernel(flash: FlashConfig, mesh: Mesh) -> dict:
    """CausalAttention's impl / flash / mesh on `mesh` (read when the step is traced: an abstract mesh has no
    devices to name a platform until then)."""
    return {"impl": flash.resolved_impl(mesh.devices.flat[0].platform), "flash": flash, "mesh": mesh}


def _weighted(metrics: Metrics, w_norm: jax.Array, w_tok: jax.Array, w_seq: jax.Array) -> Metrics:
    """Each micro-batch metric times its share of the minibatch's normaliser (see `_normaliser`)."""
    return {k: (w_norm if k in _AGG_METRICS else w_seq if k in _SEQ_METRICS else w_tok) * v
            for k, v in metrics.items()}


def _learning_rate(opt_state: Any) -> jax.Array:
    """The learning rate of the last update, read from `inject_hyperparams` state (NaN when there is none)."""
    lr = optax.tree_utils.tree_get(opt_state, "learning_rate", filtering=lambda _, v: isinstance(v, jax.Array))
    return jnp.asarray(jnp.nan if lr is None else lr, jnp.float32)


def _apply_update(optimizer: optax.GradientTransformation, params: nnx.State, opt_state: Any, grads: Any,
                  metrics: Metrics) -> tuple[tuple[nnx.State, Any], Metrics]:
    """One optimizer update. A NaN or Inf in the loss or the gradients skips it: params and optimizer state (and
    the schedule's count) stay as they were, and the metrics say which quantity it was."""
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    bad_loss, bad_grad = ~jnp.isfinite(metrics["loss"]), ~jnp.isfinite(metrics["grad_norm"])
    ok = ~(bad_loss | bad_grad)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), (new_params, new_opt_state),
                                     (params, opt_state))
    metrics["learning_rate"] = _learning_rate(opt_state)
    metrics["train/nonfinite_loss"], metrics["train/nonfinite_grad"] = bad_loss, bad_grad
    metrics["train/skipped_updates"] = ~ok
    return (params, opt_state), metrics


def _step_metrics(metrics: Metrics, num_updates: int) -> Metrics:
    """The step's metrics from the updates' ([ppo_epochs, num_minibatches] each): means, except the first
    update's OPS, the last learning rate, the tokens counted once and the skip counts summed."""
    out = {k: v.mean() for k, v in metrics.items()}
    out["ops/token_mean"] = metrics["ops/token_mean"][0, 0]
    out["learning_rate"] = metrics["learning_rate"][-1, -1]
    out["train/loss_tokens"] = metrics["train/loss_tokens"][0].sum()
    out["train/num_updates"] = jnp.asarray(num_updates, jnp.float32)
    for k in ("train/skipped_updates", "train/nonfinite_loss", "train/nonfinite_grad"):
        out[k] = metrics[k].sum()  # counts over the step's updates
    return {k: v.astype(jnp.float32) for k, v in out.items()}


def make_train_step(graphdef: nnx.GraphDef, learner_cfg: LearnerConfig, optimizer: optax.GradientTransformation,
                    mesh: Mesh, state_shardings: TrainState, flash: FlashConfig = DEFAULT_FLASH,
                    frozen_shardings: Any = None) -> TrainStep:
    """`train_step(state, batch, frozen) -> (state, metrics)` on a packed batch (`packing.pack_for_learner`), jitted on
    `mesh` with the state donated (one process; `Learner.train_step` places a batch over several).

    Each minibatch loops over the micro-batches of packed rows it fills; each micro-batch's loss is weighted by
    its sequences' share of the minibatch's normaliser, so the accumulated gradient is the minibatch's exactly.
    Metrics (replicated float32 scalars): `loss`, `policy/*` and `grad_norm` averaged over the updates;
    `train/skipped_updates` (updates not applied because the loss or the gradient norm was NaN or Inf; then
    `train/nonfinite_loss` / `train/nonfinite_grad` count which); `ops/token_mean` of the first minibatch of the
    first epoch (before any update of this step moved the policy); `learning_rate` of the last update;
    `train/num_updates`; `train/loss_tokens`. Calls with the same batch shapes reuse one executable. `flash`
    picks the attention implementation (splash on TPU, cuDNN on GPU, the jnp reference on CPU). `frozen`: the
    weights an adapted model trains around (an empty `nnx.State` for full fine-tuning), in `frozen_shardings`.
    """
    frozen_shardings = nnx.State({}) if frozen_shardings is None else frozen_shardings
    cfg, loss_fn, agg = learner_cfg, losses.get_loss_fn(learner_cfg.loss_name), learner_cfg.loss.aggregation

    def micro_loss(params, frozen, rows: tuple[jax.Array, ...], seqs: Batch, member: jax.Array, mask: jax.Array,
                   weight: jax.Array):
        """Loss of the minibatch's sequences `member` [S] holds, scored on one micro-batch's packed `rows`
        (tokens, positions, segments [r, W]); the other sequences keep ratio 1 and mask 0. The gradient is taken
        with respect to `params` only (`frozen`: an adapted model's base)."""
        logp, entropy = _packed_rows_logp(graphdef, params, frozen, *rows, cfg.logit_temperature, cfg.logits_chunk,
                                          cfg.remat, _kernel(flash, mesh), cfg.scan_layers)
        index, keep = seqs["unpack_index"], member[:, None]
        logp = jnp.where(keep, jnp.take(logp.reshape(-1), index, mode="clip"), seqs["behavior_logp"])
        entropy = jnp.where(keep, jnp.take(entropy.reshape(-1), index, mode="clip"), 0.0)
        loss, metrics = loss_fn(logp, seqs["behavior_logp"], seqs["advantages"], mask, cfg.loss,
                                ref_logp=seqs.get("ref_logp"), entropy=entropy)
        return weight * loss, metrics

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def minibatch_grads(params, frozen, minibatch: Batch, shape: packing.PackShape) -> tuple[Any, Metrics]:
        """Gradient and metrics of one minibatch, accumulated exactly over the micro-batches it fills."""
        mask = minibatch["loss_mask"].astype(jnp.float32).at[:, 0].set(0.0)  # [S, T]; token 0 has no prediction
        totals = _normaliser(mask, agg)
        seqs = {k: minibatch[k] for k in ("behavior_logp", "advantages", "ref_logp", "unpack_index") if k in minibatch}

        def body(member, rows, carry):
            grads, acc = carry
            mask_j = mask * member[:, None]
            w = [a / b for a, b in zip(_normaliser(mask_j, agg), totals, strict=True)]
            g, m = grad_fn(params, frozen, rows, seqs, member, mask_j, w[0])
            return jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, acc, _weighted(m, *w))

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)  # accumulate in f32 (bf16 params)
        rows0 = tuple(jax.ShapeDtypeStruct((shape.rows_per_micro, shape.width), jnp.int32) for _ in range(3))
        template = jax.eval_shape(micro_loss, params, frozen, rows0, seqs, minibatch["micro_index"] >= 0, mask, 1.0)[1]
        carry = (zeros, jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), template))
        grads, metrics = _over_packed_micro_batches(minibatch, shape, mesh, body, carry)
        metrics["train/loss_tokens"] = mask.sum()
        return grads, metrics

    def train_step(state: TrainState, batch: Batch, frozen: nnx.State) -> tuple[TrainState, Metrics]:
        shape = _check_batch(batch, cfg)
        batch = {k: v for k, v in batch.items() if k in _TRAIN_KEYS}
        minibatches = jax.tree.map(lambda x: _split(x, cfg.num_minibatches, mesh), batch)

        def update(carry, minibatch):
            grads, metrics = minibatch_grads(carry[0], frozen, minibatch, shape)
            return _apply_update(optimizer, *carry, grads, metrics)

        def epoch(carry, _):
            return jax.lax.scan(update, carry, minibatches)

        (params, opt_state), metrics = jax.lax.scan(
            epoch, (state.params, state.opt_state), None, length=cfg.ppo_epochs
        )  # metrics: [ppo_epochs, num_minibatches] each
        num_updates = cfg.ppo_epochs * cfg.num_minibatches
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + num_updates)
        return new_state, _step_metrics(metrics, num_updates)

    batch_shardings = mesh_lib.batch_sharding(mesh, 1)  # prefix for every [B, ...] entry of the batch dict
    return jax.jit(train_step, in_shardings=(state_shardings, batch_shardings, frozen_shardings),
                   out_shardings=(state_shardings, mesh_lib.replicated(mesh)), donate_argnums=(0,))


# ---------------------------------------------------------------------------------------------------------
# The log-prob pass (reference policy, step-start policy)
# ---------------------------------------------------------------------------------------------------------


def make_logprob_fn(graphdef: nnx.GraphDef, learner_cfg: LearnerConfig, mesh: Mesh, param_shardings: Any,
                    flash: FlashConfig = DEFAULT_FLASH, frozen_shardings: Any = None) -> LogProbStep:
    """`logprobs(params, batch, frozen) -> float32[B, T]`, log pi(tokens[t] | tokens[:t]) of `params`, jitted on `mesh`.

    The train step's forward of the policy without its backward: the same packed rows of `pack_for_learner`,
    micro-batch by micro-batch through the same loop, with the same logits chunking, layer scan and attention
    kernel. So it costs one epoch's forward (about a third of an epoch's FLOPs) and holds one micro-batch's
    activations, not the [B, T, V] logits of an unpacked full-context pass.

    It computes the reference log-probs of the KL (`ref_params`) and the step-start ones (the OPS filter, pi_old)
    on the host's batch before the step: a program of its own, not a part of the train step, because the
    step-start pass must reach the host before the filter decides the loss mask, and one program serves both
    (the reference params stay on device in the train state's shardings either way).

    `params` take `param_shardings` (the train state's). Entries are aligned to tokens like `behavior_logp`:
    0 at each sequence's token 0, on padding and on the rows the packing skipped (all-zero loss mask).
    """
    cfg = learner_cfg
    temperature = cfg.logit_temperature

    frozen_shardings = nnx.State({}) if frozen_shardings is None else frozen_shardings

    def packed(params, frozen, minibatch: Batch, shape: packing.PackShape) -> jax.Array:
        index = minibatch["unpack_index"]  # [S, T] into the micro-batch's flat [r, W] block

        def body(member, rows, acc):
            logp, _ = _packed_rows_logp(graphdef, params, frozen, *rows, temperature, cfg.logits_chunk, cfg.remat,
                                        _kernel(flash, mesh), cfg.scan_layers)
            return jnp.where(member[:, None], jnp.take(logp.reshape(-1), index, mode="clip"), acc)

        return _over_packed_micro_batches(minibatch, shape, mesh, body, jnp.zeros(index.shape, jnp.float32))

    def logprobs(params, batch: Batch, frozen: nnx.State) -> jax.Array:
        shape = _check_batch(batch, cfg)
        if "attention_mask" not in batch:
            raise ValueError("the log-prob pass needs batch['attention_mask'] (True on real tokens).")
        keep = ("tokens", "attention_mask", *packing.ALL_KEYS)
        minibatches = jax.tree.map(lambda x: _split(x, cfg.num_minibatches, mesh),
                                   {k: v for k, v in batch.items() if k in keep})
        parts = jax.lax.map(lambda mb: packed(params, frozen, mb, shape), minibatches)
        valid = batch["attention_mask"].astype(bool).at[:, 0].set(False)  # token 0 has no prediction
        return jnp.where(valid, _unsplit(parts), 0.0)

    return jax.jit(logprobs, in_shardings=(param_shardings, mesh_lib.batch_sharding(mesh, 1), frozen_shardings),
                   out_shardings=mesh_lib.batch_sharding(mesh, 2))


# ---------------------------------------------------------------------------------------------------------
# The learner: its programs on its mesh
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Learner:
    """What the learner runs, assembled once on its own mesh (`create`): the optimizer, the policy's graph, the
    train state's shardings and abstract value, and the two jitted programs, the train step and the log-prob
    pass. The run trains with these and the deviceless compile lowers these, so what is sized is what runs.

    `mesh` is the learner's alone: an engine may sample on another one (`rollout.engine.EnginePlan`).

    An adapted model (LoRA) trains its adapters: the train state holds them and their optimizer state only, and
    `frozen` holds the base weights once, an argument of both programs that is never donated or updated.
    """

    cfg: LearnerConfig
    optimizer: optax.GradientTransformation
    graphdef: nnx.GraphDef
    mesh: Mesh
    shardings: TrainState  # NamedSharding per leaf
    abstract_state: TrainState  # ShapeDtypeStructs with shardings: the checkpoint restore target
    step_program: TrainStep  # jitted: (state, batch, frozen) -> (state, metrics), the state donated
    logprob_program: LogProbStep  # jitted: (params, batch, frozen) -> float32[B, T]
    frozen: nnx.State  # an adapted model's base on the mesh (ShapeDtypeStructs for an abstract model); else empty

    @classmethod
    def create(cls, model: nnx.Module, learner_cfg: LearnerConfig, optimizer_cfg: OptimizerConfig, mesh: Mesh,
               flash: FlashConfig = DEFAULT_FLASH) -> Learner:
        """The learner of `model` (concrete, or abstract from `nnx.eval_shape`: nothing is allocated here)."""
        optimizer = make_optimizer(optimizer_cfg)
        graphdef, _ = split_params(model)
        shardings = train_state_shardings(model, optimizer, mesh)
        frozen = place_frozen(model, mesh)
        frozen_shardings = jax.tree.map(lambda x: x.sharding, frozen)
        return cls(cfg=learner_cfg, optimizer=optimizer, graphdef=graphdef, mesh=mesh, shardings=shardings,
                   abstract_state=abstract_train_state(model, optimizer, mesh),
                   step_program=make_train_step(graphdef, learner_cfg, optimizer, mesh, shardings, flash,
                                                frozen_shardings),
                   logprob_program=make_logprob_fn(graphdef, learner_cfg, mesh, shardings.params, flash,
                                                   frozen_shardings),
                   frozen=frozen)

    def init_state(self, model: nnx.Module, seed: int = 0) -> TrainState:
        """The initial train state of a concrete `model` on the learner's mesh (`init_train_state`)."""
        return init_train_state(model, self.optimizer, self.mesh, seed=seed)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """One call of the train step (`make_train_step`) on a packed host batch."""
        return self.step_program(state, self._place(batch), self.frozen)

    def logprob_fn(self, params: nnx.State, batch: Batch) -> jax.Array:
        """The log-prob pass (`make_logprob_fn`) of `params` on a packed host batch."""
        return self.logprob_program(params, self._place(batch), self.frozen)

    def _place(self, batch: Batch) -> Batch:
        # Several processes: jit takes no numpy array for a sharding that spans other hosts' devices. Every host
        # built the same batch, so each places the rows its own devices hold.
        return batch if jax.process_count() == 1 else distributed.to_global(batch, self.mesh)

    def abstract_batch(self, rows: int, width: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The batch of `rows` sequences of `width` tokens at its largest packed layout
        (`packing.largest_shape`): one program serves every batch of that size, since each minibatch loops over
        only the micro-batches its tokens fill. What the deviceless compile lowers the programs for."""
        cfg = self.cfg

        def b(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.batch_sharding(self.mesh, len(shape)))
        batch = {"tokens": b((rows, width), jnp.int32), "loss_mask": b((rows, width), jnp.float32),
                 "behavior_logp": b((rows, width), jnp.float32), "advantages": b((rows,), jnp.float32),
                 "attention_mask": b((rows, width), bool)}
        if cfg.loss.kl_coef > 0:  # the reference log-probs, from the log-prob pass
            batch["ref_logp"] = b((rows, width), jnp.float32)
        shape = packing.largest_shape(rows, width, cfg.num_minibatches, cfg.micro_batch_size, cfg.tail_row_width,
                                      batch_devices(self.mesh.shape))
        return {**batch, **{k: b(s, jnp.int32) for k, s in shape.shapes(rows).items()}}

    def lower_train_step(self, rows: int, width: int) -> jax.stages.Lowered:
        """The train step lowered for the abstract state and `abstract_batch(rows, width)`."""
        return self.step_program.lower(self.abstract_state, self.abstract_batch(rows, width), self._abstract_frozen())

    def lower_logprobs(self, rows: int, width: int) -> jax.stages.Lowered:
        """The log-prob pass lowered for params of the train state's shapes and `abstract_batch(rows, width)`."""
        return self.logprob_program.lower(self.abstract_state.params, self.abstract_batch(rows, width),
                                          self._abstract_frozen())

    def _abstract_frozen(self) -> nnx.State:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.frozen)
