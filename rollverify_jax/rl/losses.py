"""Policy losses of the GRPO family, selected by name (METHOD.md sections 6-7).

Every loss has one signature::

    fn(new_logp: [B, L], behavior_logp: [B, L], advantages: [B], mask: [B, L], cfg: LossConfig,
       ref_logp: [B, L] | None = None, entropy: [B, L] | None = None) -> (loss: scalar, metrics: dict)

`new_logp` are the current policy's log-probs of the sampled response tokens (differentiated), `behavior_logp`
the log-probs recorded when each token was sampled (the behaviour policy `mu`, possibly several versions old),
`mask` marks response tokens (float or bool). The importance ratio is taken against the behaviour policy,
`r_t = exp(clip(new - behavior, -20, 20))`, so stale tokens are clipped like any off-policy token.

Every loss returns the same metrics: `loss`, `policy/pg_loss`, `policy/ratio_mean`, `ops/token_mean`
(masked token mean of `|r_t - 1|`, the train-time OPS, by `verify.ops.ops_of_log_ratio` as the verifier's),
`policy/clip_fraction`; plus `policy/entropy` when `entropy` is given, `policy/kl` when `kl_coef > 0`,
`policy/dual_clip_fraction` for `grpo` with a dual clip, `vespo/phi_mean` for `vespo`. Metrics are
stop-gradient'ed scalars.

`LossConfig` is frozen and hashable, so it can be a static argument of `jax.jit`.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rollverify_jax.verify.ops import LOG_RATIO_CLIP, log_ratio, ops_of_log_ratio

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Metrics = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Metrics]]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters shared by all losses; each loss reads the fields it needs.

    eps_low, eps_high: PPO clip range `(1 - eps_low, 1 + eps_high)` with clip-higher (DAPO).
    dual_clip_c: dual-clip constant c > 1 for `grpo` (None: off). For A < 0 the per-token loss is
        `min(max(-r A, -clip(r) A), -c A)` as in verl's `compute_policy_loss`: once r > c the token's loss is
        the constant -c A and its gradient is 0; tokens with A >= 0 are unaffected.
    aggregation: how a per-token loss matrix becomes a scalar (see `aggregate`), one of `AGGREGATIONS`.
    max_response_length: constant divisor of 'seq-mean-token-sum-norm' (Dr. GRPO); None uses the padded L.
    kl_coef: weight of the KL to the reference policy, aggregated like the policy loss; 0 turns it off and
        `ref_logp` may be None. The estimator is k3, `exp(ref - new) - (ref - new) - 1` per token, bounded as
        verl's 'low_var_kl' bounds it (`_k3_kl`: log-ratio clipped to [-20, 20], value to `K3_CLIP` = 10); it is
        the only one (no k1 / k2 here), so it is the default.
    tis_cap: token-level truncated importance sampling for the token-ratio losses `grpo` and `sapo` (None:
        off). The per-token policy-gradient loss is multiplied by `w_t = sg[min(r_t, C) / r_t]`, so a token's
        gradient weight `r_t * A * grad log pi` becomes `min(r_t, C) * A * grad log pi`: importance weights
        above C are truncated. (A literal `sg[min(r_t, C)]` multiplier would apply the ratio twice, since the
        surrogate already carries `r_t`.)
    gspo_eps_low, gspo_eps_high: GSPO's sequence-ratio clip range `(1 - 3e-4, 1 + 4e-4)`.
    sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for A > 0 and A <= 0.
    vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg: VESPO kernel `(k, lam)` for A >= 0 and A < 0.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = None
    aggregation: str = "token-mean"
    max_response_length: int | None = None
    kl_coef: float = 0.0
    tis_cap: float | None = None
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lam_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lam_neg: float = 2.0

    def __post_init__(self) -> None:
        """Fail at construction (where a gin binding lands) rather than as NaNs mid-training."""
        _check_clip_range("eps_low", "eps_high", self.eps_low, self.eps_high)
        _check_clip_range("gspo_eps_low", "gspo_eps_high", self.gspo_eps_low, self.gspo_eps_high)
        c = self.dual_clip_c
        _require(c is None or c > 1.0, f"dual_clip_c must be > 1 (e.g. 3.0) or None, got {c}")
        _require(
            self.aggregation in AGGREGATIONS,
            f"aggregation '{self.aggregation}' is unknown; known: {list(AGGREGATIONS)}",
        )
        n = self.max_response_length
        _require(n is None or n > 0, f"max_response_length must be > 0 or None, got {n}")
        _require(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        cap = self.tis_cap
        _require(cap is None or cap > 0, f"tis_cap must be > 0 (e.g. 2.0) or None, got {cap}")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "vespo_lam_pos", "vespo_lam_neg"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")


def _require(ok: bool, message: str) -> None:
    """Raise a ValueError naming the LossConfig field, as a gin binding error should."""
    if not ok:
        raise ValueError(f"LossConfig.{message}.")


def _check_clip_range(low_name: str, high_name: str, low: float, high: float) -> None:
    """A clip range needs `0 <= eps_low < 1` (a positive lower ratio bound) and `eps_high >= 0`."""
    _require(0.0 <= low < 1.0, f"{low_name} must be in [0, 1), got {low}")
    _require(high >= 0.0, f"{high_name} must be >= 0, got {high}")


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of `x` over `mask`; an empty mask gives 0 instead of NaN."""
    mask = jnp.asarray(mask, jnp.float32)
    return (x * mask).sum(axis=axis) / jnp.maximum(mask.sum(axis=axis), 1.0)


def aggregate(loss_mat: jax.Array, mask: jax.Array, cfg: LossConfig) -> jax.Array:
    """Reduce a per-token loss `[B, L]` to a scalar by `cfg.aggregation`.

    - 'token-mean': sum over all masked tokens / number of masked tokens (long answers weigh more).
    - 'seq-mean-token-mean': per-sequence masked token mean, then mean over sequences (each answer weighs 1).
    - 'seq-mean-token-sum-norm' (Dr. GRPO): per-sequence masked token sum / `max_response_length` (a
      constant, default the padded L), then mean over sequences.
    The sequence means run over sequences with at least one masked token, so trajectories dropped from the
    loss (all-zero mask rows) do not dilute the others.
    """
    mask = jnp.asarray(mask, jnp.float32)
    if cfg.aggregation == "token-mean":
        return masked_mean(loss_mat, mask)
    token_sum = (loss_mat * mask).sum(axis=-1)  # [B]
    token_count = mask.sum(axis=-1)  # [B]
    if cfg.aggregation == "seq-mean-token-mean":
        per_seq = token_sum / jnp.maximum(token_count, 1.0)
    else:
        per_seq = token_sum / float(cfg.max_response_length or mask.shape[-1])
    live = (token_count > 0).astype(jnp.float32)  # [B]
    return (per_seq * live).sum() / jnp.maximum(live.sum(), 1.0)


# The k3 value is clamped here (verl's `kl_penalty(..., 'low_var_kl')` clamps it to [-10, 10]; k3 >= 0, so only the
# upper bound acts). Unbounded, one token the policy finds e^20 times less likely than the reference adds
# exp(20) - 21 ~ 4.9e8 to the loss and a gradient as large, which no learning rate survives.
K3_CLIP = 10.0


def _k3_kl(new_logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Bounded k3 estimator of KL(pi || ref) per token (verl's 'low_var_kl'): `min(exp(d) - d - 1, K3_CLIP)` with
    `d = clip(ref - new, -20, 20)`; non-negative. A token past the bound (d > ~2.6 or d < -11) contributes
    exactly `K3_CLIP` and no gradient, as in verl."""
    d = jnp.clip(ref_logp - new_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -K3_CLIP, K3_CLIP)


def _tis_weight(lr: jax.Array, cfg: LossConfig) -> jax.Array:
    """`sg[min(r, C) / r] = sg[min(1, exp(log C - log r))]` `[B, L]`; all ones when `tis_cap` is None."""
    if cfg.tis_cap is None:
        return jnp.ones_like(lr)
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(0.0, math.log(cfg.tis_cap) - lr)))


def _reject_unsupported(cfg: LossConfig, loss_name: str, dual_clip: bool, tis: bool) -> None:
    """Refuse options a loss does not define, instead of silently ignoring a gin binding."""
    if cfg.dual_clip_c is not None and not dual_clip:
        raise ValueError(
            f"loss '{loss_name}' has no dual clip; set LossConfig.dual_clip_c = None (only 'grpo' uses it)."
        )
    if cfg.tis_cap is not None and not tis:
        raise ValueError(
            f"loss '{loss_name}' has no token-level TIS; set LossConfig.tis_cap = None "
            "(only the token-ratio losses 'grpo' and 'sapo' use it)."
        )


def _prepare(
    new_logp: jax.Array, behavior_logp: jax.Array, advantages: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Check shapes and cast: returns `(new [B, L], behavior [B, L], adv [B, 1], mask float32 [B, L])`."""
    new_logp = jnp.asarray(new_logp, jnp.float32)
    behavior_logp = jnp.asarray(behavior_logp, jnp.float32)
    advantages = jnp.asarray(advantages, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    if new_logp.ndim != 2 or behavior_logp.shape != new_logp.shape or mask.shape != new_logp.shape:
        raise ValueError(
            "new_logp, behavior_logp and mask must all have shape [B, L]; got "
            f"{new_logp.shape}, {behavior_logp.shape}, {mask.shape}."
        )
    if advantages.shape != new_logp.shape[:1]:
        raise ValueError(f"advantages must have shape [B]={new_logp.shape[:1]}, got {advantages.shape}.")
    return _zero_padding(new_logp, mask), _zero_padding(behavior_logp, mask), advantages[:, None], mask


def _zero_padding(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Zero padded positions so a -inf/NaN log-prob there cannot leak NaN into values or gradients."""
    return jnp.where(mask > 0, x, 0.0)


def _finish(
    pg_mat: jax.Array,
    clip_mat: jax.Array,
    new_logp: jax.Array,
    lr: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None,
    entropy: jax.Array | None,
) -> tuple[jax.Array, Metrics]:
    """Aggregate the per-token policy loss, add the KL term and build the shared metrics."""
    pg_loss = aggregate(pg_mat, mask, cfg)
    loss = pg_loss
    metrics = {
        "policy/pg_loss": pg_loss,
        "policy/ratio_mean": masked_mean(jnp.exp(lr), mask),
        "ops/token_mean": masked_mean(ops_of_log_ratio(lr), mask),
        "policy/clip_fraction": masked_mean(clip_mat.astype(jnp.float32), mask),
    }
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logp [B, L]; pass it or set 0.")
        kl_mat = _k3_kl(new_logp, _zero_padding(jnp.asarray(ref_logp, jnp.float32), mask))
        loss = loss + cfg.kl_coef * aggregate(kl_mat, mask, cfg)
        metrics["policy/kl"] = masked_mean(kl_mat, mask)
    if entropy is not None:
        metrics["policy/entropy"] = masked_mean(_zero_padding(jnp.asarray(entropy, jnp.float32), mask), mask)
    metrics["loss"] = loss
    return loss, jax.lax.stop_gradient(metrics)


def _ppo_clip(ratio: jax.Array, adv: jax.Array, low: float, high: float) -> tuple[jax.Array, jax.Array]:
    """PPO surrogate `max(-r A, -clip(r, 1-low, 1+high) A)` and where the clipped branch wins (strictly)."""
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    return jnp.maximum(unclipped, clipped), clipped > unclipped


# ---------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------


def grpo_loss(
    new_logp: jax.Array,  # [B, L]
    behavior_logp: jax.Array,  # [B, L]
    advantages: jax.Array,  # [B]
    mask: jax.Array,  # [B, L]
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,  # [B, L]
    entropy: jax.Array | None = None,  # [B, L]
) -> tuple[jax.Array, Metrics]:
    """GRPO/DAPO token loss `-min(r A, clip(r, 1-eps_low, 1+eps_high) A)` against the behaviour policy.

    Dual clip (verl semantics, `dual_clip_c = c > 1`): for A < 0 the token loss becomes
    `min(that, -c A)`, capping how hard a token with a huge ratio can be pushed down; A >= 0 is unchanged.
    `policy/clip_fraction` counts tokens where either clip is active (gradient cut);
    `policy/dual_clip_fraction` counts the dual-clipped ones alone. TIS: see `LossConfig.tis_cap`.
    """
    _reject_unsupported(cfg, "grpo", dual_clip=True, tis=True)
    new_logp, behavior_logp, adv, mask = _prepare(new_logp, behavior_logp, advantages, mask)
    lr = log_ratio(new_logp, behavior_logp)
    pg_mat, clip_mat = _ppo_clip(jnp.exp(lr), adv, cfg.eps_low, cfg.eps_high)
    dual_mat = None
    if cfg.dual_clip_c is not None:
        capped = -adv * cfg.dual_clip_c
        dual_mat = (adv < 0) & (pg_mat > capped)
        pg_mat = jnp.where(adv < 0, jnp.minimum(pg_mat, capped), pg_mat)
        clip_mat = clip_mat | dual_mat
    pg_mat = pg_mat * _tis_weight(lr, cfg)
    loss, metrics = _finish(pg_mat, clip_mat, new_logp, lr, mask, cfg, ref_logp, entropy)
    if dual_mat is not None:
        metrics["policy/dual_clip_fraction"] = masked_mean(dual_mat.astype(jnp.float32), mask)
    return loss, metrics


def _sequence_log_ratio(lr: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO's `log s_i = mean_t log r_t` over a sequence's masked tokens `[B]`."""
    return masked_mean(lr, mask, axis=-1)


def gspo_loss(
    new_logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """GSPO: sequence ratio `s_i = exp(mean_t log r_t)`, loss `-min(s A, clip(s, 1-3e-4, 1+4e-4) A)`.

    The sequence loss is broadcast to each of its masked tokens, then aggregated by `cfg.aggregation`:
    'seq-mean-token-mean' gives GSPO's objective exactly (mean over sequences); 'token-mean' weights each
    sequence by its length. `policy/clip_fraction` is the fraction of masked tokens in clipped sequences.
    """
    _reject_unsupported(cfg, "gspo", dual_clip=False, tis=False)
    new_logp, behavior_logp, adv, mask = _prepare(new_logp, behavior_logp, advantages, mask)
    lr = log_ratio(new_logp, behavior_logp)
    seq_ratio = jnp.exp(_sequence_log_ratio(lr, mask))[:, None]  # [B, 1]
    seq_loss, seq_clip = _ppo_clip(seq_ratio, adv, cfg.gspo_eps_low, cfg.gspo_eps_high)  # [B, 1]
    pg_mat = jnp.broadcast_to(seq_loss, lr.shape)
    clip_mat = jnp.broadcast_to(seq_clip, lr.shape)
    return _finish(pg_mat, clip_mat, new_logp, lr, mask, cfg, ref_logp, entropy)


def gspo_token_loss(
    new_logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """GSPO-token: token ratio `s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`, clipped like GSPO per token.

    Its value is `s_i` at every token while its gradient flows through each token alone, so token-level
    advantages could be used; with one advantage per sequence and 'seq-mean-token-mean' its gradient equals
    GSPO's.
    """
    _reject_unsupported(cfg, "gspo_token", dual_clip=False, tis=False)
    new_logp, behavior_logp, adv, mask = _prepare(new_logp, behavior_logp, advantages, mask)
    lr = log_ratio(new_logp, behavior_logp)
    seq_lr = jax.lax.stop_gradient(_sequence_log_ratio(lr, mask))[:, None]  # [B, 1]
    token_ratio = jnp.exp(seq_lr + new_logp - jax.lax.stop_gradient(new_logp))  # [B, L]
    pg_mat, clip_mat = _ppo_clip(token_ratio, adv, cfg.gspo_eps_low, cfg.gspo_eps_high)
    return _finish(pg_mat, clip_mat, new_logp, lr, mask, cfg, ref_logp, entropy)


def sapo_loss(
    new_logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """SAPO (Gao et al. 2025): soft gate `f(r) = sigmoid(tau (r - 1)) * 4 / tau`, token loss `-f(r) A`.

    `tau = sapo_tau_pos` where A > 0, else `sapo_tau_neg` (faster decay for negative advantages). No hard
    clip: the gradient weight `4 sigmoid'(tau (r-1)) r` is exactly r at r = 1 and decays smoothly as r
    leaves 1, so `policy/clip_fraction` is 0. TIS: see `LossConfig.tis_cap`.
    """
    _reject_unsupported(cfg, "sapo", dual_clip=False, tis=True)
    new_logp, behavior_logp, adv, mask = _prepare(new_logp, behavior_logp, advantages, mask)
    lr = log_ratio(new_logp, behavior_logp)
    tau = jnp.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)  # [B, 1]
    gate = jax.nn.sigmoid(tau * (jnp.exp(lr) - 1.0)) * 4.0 / tau  # [B, L]
    pg_mat = -gate * adv * _tis_weight(lr, cfg)
    return _finish(pg_mat, jnp.zeros(lr.shape, bool), new_logp, lr, mask, cfg, ref_logp, entropy)


def vespo_loss(
    new_logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """VESPO (Shen et al. 2026): REINFORCE with a reshaped sequence-level importance weight.

    `log W = clip(sum_t log r_t, -20, 20)` over masked tokens (the true product of token ratios, no length
    normalisation); `phi(W) = exp(lam + k log W - lam W)` (`phi(1) = 1`), with `(k, lam) = (vespo_k_pos,
    vespo_lam_pos)` for A >= 0 and `(vespo_k_neg, vespo_lam_neg)` for A < 0. Token loss `-sg[phi] A log pi`,
    aggregated by `cfg.aggregation` (token-mean: mean of log pi over tokens; the seq modes: per-sequence mean
    or normalised sum). Only the gradient `phi A grad log pi` is meaningful, not the loss value. No clip.
    """
    _reject_unsupported(cfg, "vespo", dual_clip=False, tis=False)
    new_logp, behavior_logp, adv, mask = _prepare(new_logp, behavior_logp, advantages, mask)
    lr = log_ratio(new_logp, behavior_logp)
    log_w = jnp.clip((lr * mask).sum(axis=-1, keepdims=True), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)  # [B, 1]
    k = jnp.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = jnp.where(adv >= 0, cfg.vespo_lam_pos, cfg.vespo_lam_neg)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))  # [B, 1]
    pg_mat = -phi * adv * new_logp
    loss, metrics = _finish(pg_mat, jnp.zeros(lr.shape, bool), new_logp, lr, mask, cfg, ref_logp, entropy)
    live = mask.sum(axis=-1, keepdims=True) > 0
    metrics["vespo/phi_mean"] = masked_mean(phi, live)
    return loss, metrics


LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
}


def get_loss_fn(name: str) -> LossFn:
    """Look up a loss by its registry name; unknown names list the known ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}'; known: {sorted(LOSSES)}.")
    return LOSSES[name]
