"""Token sampling with per-request randomness and the behaviour log-prob recorded alongside."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature T > 0 (ignored when greedy); 0 < top_p <= 1; top_k >= 0 (0: off)."""

    temperature: float = 1.0  # T > 0 (ignored when greedy); the learner scores log-probs at the same T
    top_p: float = 1.0  # nucleus sampling, 0 < top_p <= 1 (1: off)
    top_k: int = 0  # >= 0 (0: off)
    greedy: bool = False  # argmax decoding

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be > 0 (or set greedy=True).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 disables it).")

    @property
    def logp_temperature(self) -> float:
        """The temperature the behaviour log-prob is taken at (1 for greedy)."""
        return 1.0 if self.greedy else self.temperature


def request_keys(seeds: jax.Array, token_index: jax.Array) -> jax.Array:
    """One key per row from (request seed, index of the token being sampled): a sample never depends
    on the slot or batch it ran in."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, token_index)


def _filter(scaled: jax.Array, cfg: SamplingConfig) -> jax.Array:
    neg = jnp.finfo(scaled.dtype).min
    if cfg.top_k:
        kth = jax.lax.top_k(scaled, cfg.top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, neg, scaled)
    if cfg.top_p < 1:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        cutoff = jnp.min(jnp.where(before < cfg.top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < cutoff, neg, scaled)
    return scaled


def gumbel_noise(seeds: jax.Array, token_index: jax.Array, vocab: int) -> jax.Array:
    """float32[..., V]: the Gumbel noise of the token at ``token_index`` of the request ``seeds`` (both [...]),
    from the key (seed, index) alone: a token's noise never depends on where or when it was sampled, so a later
    policy can be asked what it would have drawn with the same noise (the coupled verification rule)."""
    shape = jnp.shape(seeds)
    keys = request_keys(jnp.reshape(seeds, (-1,)), jnp.reshape(token_index, (-1,)))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    return noise.reshape(*shape, vocab)


def perturbed_scores(logits: jax.Array, seeds: jax.Array, token_index: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """float32[..., V]: what the sampler takes the argmax of, for ``logits`` [..., V] and the noise of (seed, index)
    [...]: ``filter(logits / T) + Gumbel(key(seed, index))`` (top-k / top-p applied as always), or the logits
    themselves when greedy."""
    logits = logits.astype(jnp.float32)
    if cfg.greedy:
        return logits
    return _filter(logits / cfg.temperature, cfg) + gumbel_noise(seeds, token_index, logits.shape[-1])


def sampled_argmax(logits: jax.Array, seeds: jax.Array, token_index: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """int32[...]: the token the sampler draws, ``argmax(perturbed_scores)``: ``jax.random.categorical`` of the
    processed logits written out (it is argmax(logits + gumbel) with the same draw), so decode and the coupled
    verification compute one function of the same noise."""
    return jnp.argmax(perturbed_scores(logits, seeds, token_index, cfg), axis=-1).astype(jnp.int32)


def samples(logits: jax.Array, tokens: jax.Array, seeds: jax.Array, token_index: jax.Array,
            cfg: SamplingConfig) -> jax.Array:
    """bool[...]: ``sampled_argmax(logits, seeds, token_index, cfg) == tokens``, computed as the first index
    holding the maximum (two plain reductions, where ``argmax``'s index-carrying reduction is several times slower
    on CPU); equal to it for every input without NaN (a NaN score never matches: the token is cut)."""
    scores = perturbed_scores(logits, seeds, token_index, cfg)
    top = jnp.max(scores, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(scores == top, jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape[-1]), axis=-1)
    return first == tokens


def sample_tokens(logits: jax.Array, seeds: jax.Array, token_index: jax.Array,
                  cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """logits: float32[B, V] -> (tokens int32[B], behaviour log-prob float32[B]).

    The token is ``sampled_argmax`` (its noise a function of (seed, index) only). The log-prob is the full
    softmax of logits / T at the sampled token (no top-p/top-k truncation; a known bias when they are on, see
    docs/method.md).
    """
    logits = logits.astype(jnp.float32)
    logp_all = jax.nn.log_softmax(logits / cfg.logp_temperature, axis=-1)
    tokens = sampled_argmax(logits, seeds, token_index, cfg)
    return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
