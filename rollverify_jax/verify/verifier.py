"""Two-stage verification of cached trajectories against the newest policy (METHOD.md section 3).

Given the new policy's log-probs of every cached token (a by-product of the resume prefill), decide how many
response tokens each paused trajectory keeps:

1. segment stage: the first segment (run of equal `v_t`) whose mean OPS is `>= ds` cuts at its first token;
2. token stage: inside that prefix, the first token with OPS `>= dt` cuts there.

It is one jitted function of cumulative ops over padded `[N, L]` arrays: O(N·L) work, no Python loops, and the
thresholds are traced arguments so changing them never recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from rollverify_jax.verify.ops import response_mask, segment_mean_ops, segment_starts, token_ops

DEFAULT_DS = 0.01  # segment-stage threshold on mean OPS
DEFAULT_DT = 2.0  # token-stage threshold on OPS


RULES = ("two_stage", "coupled")  # VerifyConfig.rule


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """RollVerify's verification settings. ds: segment threshold on mean OPS; dt: token threshold on OPS;
    verify_finished: also re-verify finished trajectories still in the cache (members waiting for their group,
    and complete groups carried to a later batch), each re-prefilled in a slot every cycle. Off by default, as
    the paper verifies paused (unfinished) trajectories only. The acceptance window is `SwitchConfig`.
    rule: 'two_stage' (the paper's rule on the OPS thresholds ds and dt: a near on-policy prefix) or 'coupled'
    (exact: the prefix the new policy samples with each token's own Gumbel noise, docs/method.md; ds and dt
    unused). coupled_tolerance: the coupled rule also keeps a token whose perturbed score is within this many
    nats of the winner's (0: exact; a bf16 engine's prefill and decode round differently, and a near-tie flips).
    """

    ds: float = DEFAULT_DS
    dt: float = DEFAULT_DT
    verify_finished: bool = False
    rule: str = "two_stage"
    coupled_tolerance: float = 0.0  # >= 0; the tokens kept by it alone: verify/near_ties_kept

    def __post_init__(self):
        _check_thresholds(self.ds, self.dt)
        if self.rule not in RULES:
            raise ValueError(f"VerifyConfig.rule={self.rule!r}: use one of {', '.join(map(repr, RULES))}.")
        if not self.coupled_tolerance >= 0:
            raise ValueError(f"VerifyConfig.coupled_tolerance={self.coupled_tolerance!r} must be >= 0 (0: the exact "
                             "coupled rule).")


def _check_thresholds(ds, dt) -> None:
    """Reject bad thresholds early when they are host numbers; traced values are trusted."""
    if isinstance(ds, numbers.Real) and not (ds >= 0.0):  # also catches NaN
        raise ValueError(f"two_stage_verify: ds (segment threshold on mean OPS) must be >= 0, got {ds!r}.")
    if isinstance(dt, numbers.Real) and not (dt > 0.0):
        raise ValueError(f"two_stage_verify: dt (token threshold on OPS) must be > 0, got {dt!r}.")


def _check_shapes(new_logp, behavior_logp, versions, lengths) -> None:
    """Shapes are static, so mismatches are caught here with names instead of deep inside XLA."""
    shape = jnp.shape(new_logp)
    if len(shape) != 2:
        raise ValueError(f"two_stage_verify: new_logp must be [N, L], got shape {shape}.")
    for name, arr in (("behavior_logp", behavior_logp), ("versions", versions)):
        if jnp.shape(arr) != shape:
            raise ValueError(
                f"two_stage_verify: {name} has shape {jnp.shape(arr)}, expected {shape} like new_logp."
            )
    if jnp.shape(lengths) != shape[:1]:
        raise ValueError(f"two_stage_verify: lengths has shape {jnp.shape(lengths)}, expected ({shape[0]},).")
    if isinstance(lengths, np.ndarray | list | tuple):
        host = np.asarray(lengths)
        if host.size and (host.min() < 0 or host.max() > shape[1]):
            raise ValueError(
                f"two_stage_verify: lengths must lie in [0, {shape[1]}] (the padded length L), "
                f"got min {host.min()} max {host.max()}."
            )


def _verify_arrays(
    new_logp: jax.Array,  # [N, L] float32
    behavior_logp: jax.Array,  # [N, L] float32
    versions: jax.Array,  # [N, L] int32
    lengths: jax.Array,  # [N] int32
    ds: jax.Array,  # [] float32
    dt: jax.Array,  # [] float32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(keep [N], keep1 [N]: the segment stage's keep, seg_start [N, L]: first tokens of segments)."""
    max_len = new_logp.shape[1]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_len)  # [N]
    valid = response_mask(lengths, max_len)  # [N, L]
    ops = token_ops(new_logp, behavior_logp)  # [N, L]
    # A NaN log-prob in a valid token is a broken token: treat it as maximally off-policy so it gets cut.
    ops = jnp.where(valid, jnp.where(jnp.isnan(ops), jnp.inf, ops), 0.0)
    positions = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # [1, L]

    seg_mean = segment_mean_ops(ops, versions, valid)  # [N, L]
    starts = segment_starts(versions, valid)  # [N, L]
    seg_cut = starts & (seg_mean >= ds)  # [N, L]
    keep1 = jnp.min(jnp.where(seg_cut, positions, max_len), axis=1)  # [N]
    keep1 = jnp.minimum(keep1, lengths)

    tok_cut = (positions < keep1[:, None]) & (ops >= dt)  # [N, L]; t < keep1 <= n implies valid
    keep = jnp.min(jnp.where(tok_cut, positions, max_len), axis=1)  # [N]
    return jnp.minimum(keep, keep1).astype(jnp.int32), keep1.astype(jnp.int32), starts


def _keep_lengths(new_logp, behavior_logp, versions, lengths, ds, dt) -> jax.Array:  # [N] int32
    return _verify_arrays(new_logp, behavior_logp, versions, lengths, ds, dt)[0]


# Wrapped here rather than decorated, so mutation testing (which skips decorated functions) reaches the body.
_two_stage_verify = jax.jit(_keep_lengths)
_two_stage_verify_detail = jax.jit(_verify_arrays)


def _device_inputs(new_logp, behavior_logp, versions, lengths, ds, dt) -> tuple:
    _check_thresholds(ds, dt)
    _check_shapes(new_logp, behavior_logp, versions, lengths)
    def scalar(x):  # a Python number as a host scalar: jnp.asarray of one compiles a conversion program
        return np.float32(x) if isinstance(x, int | float) else jnp.asarray(x, jnp.float32)
    return (jnp.asarray(new_logp, jnp.float32), jnp.asarray(behavior_logp, jnp.float32),
            jnp.asarray(versions, jnp.int32), jnp.asarray(lengths, jnp.int32), scalar(ds), scalar(dt))


def two_stage_verify(
    new_logp: jax.Array,  # [N, L] log pi(y_t) under the newest policy
    behavior_logp: jax.Array,  # [N, L] log mu(y_t) recorded at sampling time
    versions: jax.Array,  # [N, L] policy version v_t that sampled y_t
    lengths: jax.Array,  # [N] number of cached response tokens n_i
    ds: float | jax.Array = DEFAULT_DS,
    dt: float | jax.Array = DEFAULT_DT,
) -> jax.Array:  # [N] int32
    """Keep lengths `keep: int32[N]`, `0 <= keep_i <= lengths_i`, per METHOD.md section 3.

    Positions `t >= lengths_i` are padding and ignored whatever they hold. `lengths` given as a host array
    must lie in `[0, L]`; device arrays are clipped into that range (a check would force a host sync).
    A NaN log-prob inside a response counts as infinite OPS. Works under an outer `jit` and on sharded inputs.
    """
    return _two_stage_verify(*_device_inputs(new_logp, behavior_logp, versions, lengths, ds, dt))


def two_stage_verify_with_stats(new_logp, behavior_logp, versions, lengths, ds: float, dt: float,
                                current_version: int) -> tuple[np.ndarray, CutStats]:
    """`two_stage_verify` on host inputs, plus where it cut (`CutStats`) for a verifier at ``current_version``."""
    keep, keep1, starts = jax.device_get(
        _two_stage_verify_detail(*_device_inputs(new_logp, behavior_logp, versions, lengths, ds, dt)))
    return keep, CutStats.of(keep, keep1, starts, np.asarray(versions), np.asarray(lengths), current_version)


def coupled_keep(match, lengths) -> np.ndarray:
    """The coupled rule's keep lengths, int64[N]: the first token ``t < lengths_i`` the new policy would not have
    sampled with its own noise (``match[i, t]`` False) cuts there, else the whole response is kept. ``match``:
    bool[N, L] (the resume prefill's ``sampled_argmax`` check), ``lengths``: [N]."""
    match, lengths = np.asarray(match, bool), np.asarray(lengths, np.int64)
    if match.ndim != 2 or lengths.shape != match.shape[:1]:
        raise ValueError(f"coupled_keep: match must be [N, L] and lengths [N], got {match.shape} and {lengths.shape}.")
    pos = np.arange(match.shape[1])[None, :]
    miss = ~match & (pos < lengths[:, None])
    return np.where(miss.any(axis=1), miss.argmax(axis=1), lengths).astype(np.int64)


def coupled_verify_with_stats(match, versions, lengths, current_version: int) -> tuple[np.ndarray, CutStats]:
    """``coupled_keep`` plus where it cut (``CutStats``, per segment age as for the two-stage rule: a cut falls in
    one segment, which counts as the failing one; ``token_cuts`` counts cuts after a segment's first token)."""
    keep = coupled_keep(match, lengths)
    versions, lengths = np.asarray(versions), np.asarray(lengths, np.int64)
    pos = np.arange(versions.shape[1])[None, :]
    valid = pos < lengths[:, None]
    starts = valid & np.concatenate([np.ones_like(versions[:, :1], bool), versions[:, 1:] != versions[:, :-1]], 1)
    # the segment-level keep: the start of the segment that holds the cut (n when nothing is cut)
    seg_keep = np.max(np.where(starts & (pos <= keep[:, None]), pos, 0), axis=1)
    keep1 = np.where(keep < lengths, seg_keep, lengths)
    return keep, CutStats.of(keep, keep1, starts, versions, lengths, current_version)


@dataclasses.dataclass
class CutStats:
    """Where verification cut, summed over a cycle, so that a cut model can be fitted from runs. Per segment age
    ``c`` (the verifying version minus the version that sampled the segment): segments the segment stage
    examined (each trajectory's segments up to and including its first failing one; later ones are censored),
    those that failed, and the sum of ``keep / n`` over trajectories whose first failing segment had age ``c``;
    ``token_cuts`` counts trajectories the token stage cut inside the segment stage's prefix."""

    checked: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    keep_fraction_sum: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    token_cuts: int = 0

    @classmethod
    def of(cls, keep, keep1, starts, versions, lengths, current_version: int) -> CutStats:
        """From one verification: keep, keep1 [N] (final and segment-stage keeps), starts [N, L] (segment
        starts), versions [N, L], lengths [N]."""
        lengths = np.asarray(lengths, np.int64)
        pos = np.arange(starts.shape[1])[None, :]
        ages = current_version - np.asarray(versions, np.int64)  # [N, L]
        examined = starts & (pos <= keep1[:, None])  # a start at keep1 < n is the failing segment's
        failing = starts & (pos == keep1[:, None]) & (keep1 < lengths)[:, None]
        rows = np.flatnonzero(failing.any(axis=1))
        fail_age = ages[rows, keep1[rows]]
        out = cls(token_cuts=int(np.sum(keep < keep1)))
        out.checked.update(ages[examined].tolist())
        out.failed.update(fail_age.tolist())
        for age, frac in zip(fail_age.tolist(), (keep[rows] / lengths[rows]).tolist(), strict=True):
            out.keep_fraction_sum[age] += frac
        return out

    def merge(self, other: CutStats) -> None:
        self.checked.update(other.checked)
        self.failed.update(other.failed)
        self.keep_fraction_sum.update(other.keep_fraction_sum)
        self.token_cuts += other.token_cuts

    def metrics(self) -> dict[str, float | int]:
        """``verify/segments_checked/<c>``, ``verify/segments_failed/<c>``, ``verify/keep_fraction/<c>`` (mean
        keep / n of the trajectories cut at a segment of age c) and ``verify/token_stage_cuts``."""
        out: dict[str, float | int] = {"verify/token_stage_cuts": self.token_cuts}
        for age in sorted(self.checked):
            out[f"verify/segments_checked/{age}"] = self.checked[age]
            out[f"verify/segments_failed/{age}"] = self.failed[age]
            if self.failed[age]:
                out[f"verify/keep_fraction/{age}"] = self.keep_fraction_sum[age] / self.failed[age]
        return out


def tv_terms(new_logp, behavior_logp) -> np.ndarray:
    """float64[...]: ``max(0, 1 - pi / mu)`` per token from ``log pi`` (new policy) and ``log mu`` (sampling
    policy). Its mean over tokens sampled from mu estimates the mean total variation between mu and pi at those
    positions without bias (``E_{x~mu}[(1 - pi(x)/mu(x))_+] = TV(mu, pi)``). A NaN log-prob counts as 1 (maximally
    off-policy, as the two-stage rule treats it)."""
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(np.asarray(new_logp, np.float64) - np.asarray(behavior_logp, np.float64))
        term = np.maximum(0.0, 1.0 - ratio)
    return np.where(np.isnan(term), 1.0, term)


@dataclasses.dataclass
class ShiftStats:
    """How far the policy moved at the cached tokens, summed over a cycle's verifications, per token age ``c``
    (the verifying version minus the version that sampled the token): tokens checked, the sum of
    ``(1 - pi/mu)_+`` (``tv_terms``) and, for the coupled rule, the tokens checked with a match bit and those whose
    bit is true (the new policy samples the token with its own noise), over every checked token, not only up to
    the first cut: the rule's per-token acceptance, to set against the TV."""

    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tv_sum: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    coupled_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    agreed: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def of(cls, new_logp, behavior_logp, versions, lengths, current_version: int, match=None) -> ShiftStats:
        """From one verification's host arrays: new_logp, behavior_logp, versions [N, L], lengths [N] (positions
        ``t >= lengths_i`` are padding, environment tokens are already left out by the scheduler), match: bool[N, L]
        or None (the two-stage rule)."""
        versions, lengths = np.asarray(versions, np.int64), np.asarray(lengths, np.int64)
        valid = np.arange(versions.shape[1])[None, :] < lengths[:, None]  # [N, L]
        ages = (current_version - versions)[valid]  # [K]
        terms = tv_terms(np.asarray(new_logp)[valid], np.asarray(behavior_logp)[valid])  # [K]
        keys, inverse, counts = np.unique(ages, return_inverse=True, return_counts=True)
        ages_list = keys.tolist()
        out = cls()
        out.tokens.update(dict(zip(ages_list, counts.tolist(), strict=True)))
        tv_sum = np.bincount(inverse, weights=terms, minlength=len(keys))
        out.tv_sum.update(dict(zip(ages_list, tv_sum.tolist(), strict=True)))
        if match is not None:
            hit = np.asarray(match, bool)[valid]  # [K]
            out.coupled_tokens.update(out.tokens)
            out.agreed.update(dict(zip(ages_list, np.bincount(inverse, minlength=len(keys), weights=hit)
                                       .astype(np.int64).tolist(), strict=True)))
        return out

    def merge(self, other: ShiftStats) -> None:
        for mine, theirs in ((self.tokens, other.tokens), (self.tv_sum, other.tv_sum),
                             (self.coupled_tokens, other.coupled_tokens), (self.agreed, other.agreed)):
            mine.update(theirs)

    def metrics(self) -> dict[str, float]:
        """``verify/tv_estimate`` (the mean of ``(1 - pi/mu)_+`` over the checked tokens) and
        ``verify/tv_estimate_age<c>`` per token age; with the coupled rule ``verify/token_agreement`` (the fraction
        of checked tokens the new policy samples with their own noise) and ``verify/token_agreement_age<c>``. Empty
        when no token was checked."""
        out: dict[str, float] = {}
        for name, num, den in (("tv_estimate", self.tv_sum, self.tokens),
                               ("token_agreement", self.agreed, self.coupled_tokens)):
            total = sum(den.values())
            if not total:
                continue
            out[f"verify/{name}"] = float(sum(num.values()) / total)
            for age in sorted(den):
                if den[age]:
                    out[f"verify/{name}_age{age}"] = float(num[age] / den[age])
        return out


def verify_stats(keep, lengths) -> dict[str, float | int]:
    """Host-side summary of one verification cycle: tokens kept/total and the acceptance rate.

    `acceptance = sum(keep) / sum(lengths)`, the fraction of partially generated tokens retained, when given the
    paused trajectories of a cycle (METHOD.md section 4).
    When nothing was verified (no cached tokens) acceptance is defined as 1.0: an empty cycle rejected
    nothing, so it must not pull the switching window towards on-policy mode.
    Keys: `tokens_kept`, `tokens_total`, `tokens_removed`, `acceptance`, `num_verified` (trajectories with tokens),
    `num_cut` (keep < length), `num_restarted` (keep == 0 < length).
    """
    keep = np.asarray(keep).astype(np.int64)  # [N]
    lengths = np.asarray(lengths).astype(np.int64)  # [N]
    if keep.shape != lengths.shape or keep.ndim != 1:
        raise ValueError(f"verify_stats: keep {keep.shape} and lengths {lengths.shape} must both be [N].")
    if np.any(keep < 0) or np.any(keep > lengths):
        raise ValueError("verify_stats: every keep must lie in [0, length]; were keep and lengths swapped?")
    kept, total = int(keep.sum()), int(lengths.sum())
    return {
        "tokens_kept": kept,
        "tokens_total": total,
        "tokens_removed": total - kept,
        "acceptance": kept / total if total > 0 else 1.0,
        "num_verified": int(np.sum(lengths > 0)),
        "num_cut": int(np.sum(keep < lengths)),
        "num_restarted": int(np.sum((keep == 0) & (lengths > 0))),
    }
