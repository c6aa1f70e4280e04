"""Token sampling with per-request randomness and the behaviour log-prob recorded alongside."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rollverify_jax.models.qwen3 import at_tokens

# How the noise of one token is drawn; both sample softmax(filter(logits / T)) exactly, and both make the token a
# function of (seed, index) and the logits, as the coupled verification rule needs. 'flat': V Gumbel values and
# their argmax (jax.random.categorical's draw): two policies draw the same token with probability at least
# (1 - TV) / (1 + TV). 'two_level': nb + B values (``noise_blocks``; ~2 sqrt(V)): a block by its mass, then a
# member; the coupled check's cost stays small beside the model's at any width, and two policies agree less often
# where many tokens compete (docs/method.md, "Coupled verification").
NOISES = ("flat", "two_level")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature T > 0 (ignored when greedy); 0 < top_p <= 1; top_k >= 0 (0: off); noise: how a token's Gumbel
    noise is laid out (both exact; see ``NOISES``)."""

    temperature: float = 1.0  # T > 0 (ignored when greedy); the learner scores log-probs at the same T
    top_p: float = 1.0  # nucleus sampling, 0 < top_p <= 1 (1: off)
    top_k: int = 0  # >= 0 (0: off)
    greedy: bool = False  # argmax decoding
    noise: str = "flat"  # 'flat' (a Gumbel per vocabulary entry) or 'two_level' (a block, then a member): NOISES

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be > 0 (or set greedy=True).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 disables it).")
        if self.noise not in NOISES:
            raise ValueError(f"SamplingConfig.noise={self.noise!r}; choose one of {list(NOISES)}.")

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


def noise_blocks(vocab: int) -> tuple[int, int]:
    """(members per block B, blocks nb) of the sampler's two-level draw, B * nb >= ``vocab``: token v is member
    ``v // nb`` of block ``v % nb`` (strided, so a vocabulary split in contiguous shards splits each block evenly).
    B is the power of two nearest above sqrt(V), halved until it divides V (no padding: Qwen3's 151,936 gives 128
    x 1187); a vocabulary with no such factor of at least 8 is padded instead."""
    ideal = 1 << max(0, math.ceil(math.log2(math.sqrt(vocab))))
    block = ideal
    while block > 1 and vocab % block:
        block //= 2
    if block < min(8, ideal):
        block = ideal
    return block, -(-vocab // block)


def noise_size(vocab: int, noise: str) -> int:
    """How many Gumbel values one token's draw reads: V ('flat') or nb + B ('two_level')."""
    return vocab if noise == "flat" else sum(noise_blocks(vocab))


def gumbel_noise(seeds: jax.Array, token_index: jax.Array, vocab: int, noise: str = "flat") -> jax.Array:
    """float32[..., noise_size(vocab, noise)]: the Gumbel noise of the token at ``token_index`` of the request
    ``seeds`` (both [...]), from the key (seed, index) alone: a token's noise never depends on where or when it was
    sampled, so a later policy can be asked what it would have drawn with the same noise (the coupled verification
    rule). 'two_level': nb values for the blocks, then B for the members of the chosen block."""
    shape, size = jnp.shape(seeds), noise_size(vocab, noise)
    keys = request_keys(jnp.reshape(seeds, (-1,)), jnp.reshape(token_index, (-1,)))
    return jax.vmap(lambda k: jax.random.gumbel(k, (size,), jnp.float32))(keys).reshape(*shape, size)


def _first_max(scores: jax.Array) -> jax.Array:
    """int32[...]: the first index of the maximum over the last axis, as ``jnp.argmax`` for input without NaN,
    written as two plain reductions (XLA CPU's index-carrying argmax is several times slower); NaN everywhere gives
    the last index, not an out-of-range one."""
    n = scores.shape[-1]
    top = jnp.max(scores, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(scores == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(first, n - 1)


def _blocks(scaled: jax.Array) -> jax.Array:
    """[..., V] -> [..., B, nb]: entry [i, b] is token i * nb + b (padding: -inf, never drawn)."""
    block, n_blocks = noise_blocks(scaled.shape[-1])
    pad = block * n_blocks - scaled.shape[-1]
    if pad:
        scaled = jnp.pad(scaled, [(0, 0)] * (scaled.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return scaled.reshape(*scaled.shape[:-1], block, n_blocks)


def _two_level_draw(scaled: jax.Array, noise: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(token [...], block log-masses [..., nb], block scores [..., nb], the [..., B, nb] grid of ``scaled``) of
    the draw from softmax(``scaled``) [..., V] with ``noise`` [..., nb + B]. A block is drawn by Gumbel-max over
    the blocks' log-masses (block b with probability its members' total mass), then a member by Gumbel-max within
    it (with probability its share of the block): the product is the token's probability, exactly; nb + B draws
    instead of V."""
    grid = _blocks(scaled)  # [..., B, nb]
    block_lse = jax.nn.logsumexp(grid, axis=-2)
    n_blocks = grid.shape[-1]
    block_scores = block_lse + noise[..., :n_blocks]
    chosen = _first_max(block_scores)  # [...]
    members = jnp.take_along_axis(grid, chosen[..., None, None], axis=-1)[..., 0]  # [..., B]
    member = _first_max(members + noise[..., n_blocks:])
    return member * n_blocks + chosen, block_lse, block_scores, grid


def _scaled(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    return _filter(logits.astype(jnp.float32) / cfg.temperature, cfg)


def sampled_argmax(logits: jax.Array, seeds: jax.Array, token_index: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """int32[...]: the token the sampler draws from ``logits`` [..., V] (temperature, top-k and top-p applied) with
    the noise of (seed, index) [...]: a deterministic function of the processed logits and the noise, so decode and
    the coupled verification compute one function of the same noise. Greedy: the first maximum."""
    if cfg.greedy:
        return _first_max(logits.astype(jnp.float32))
    scaled = _scaled(logits, cfg)
    noise = gumbel_noise(seeds, token_index, logits.shape[-1], cfg.noise)
    if cfg.noise == "flat":
        return _first_max(scaled + noise)
    return _two_level_draw(scaled, noise)[0]


def samples(logits: jax.Array, tokens: jax.Array, seeds: jax.Array, token_index: jax.Array,
            cfg: SamplingConfig) -> jax.Array:
    """bool[...]: ``sampled_argmax(logits, seeds, token_index, cfg) == tokens``."""
    return sampled_argmax(logits, seeds, token_index, cfg) == tokens


# check_tokens' codes: the new policy samples the token with its noise / it does not, but the token's score is
# within the tolerance of the winner's (a near-tie, kept) / it does not (cut)
SAMPLED, NEAR_TIE, NOT_SAMPLED = 1, 2, 0


def _near(scores: jax.Array, index: jax.Array, tolerance: jax.Array) -> jax.Array:
    """bool[...]: ``scores[..., index]`` is above the maximum over the last axis less ``tolerance`` (never, at 0)."""
    return at_tokens(scores, index) > jnp.max(scores, axis=-1) - tolerance


def check_tokens(logits: jax.Array, tokens: jax.Array, seeds: jax.Array, token_index: jax.Array,
                 cfg: SamplingConfig, tolerance: jax.Array | float = 0.0) -> tuple[jax.Array, jax.Array]:
    """The coupled rule's check of cached ``tokens`` [...] against the current ``logits`` [..., V]: (log-prob
    float32[...] of each token under softmax(logits / T), as ``sample_tokens`` records it; int8[...] code:
    ``SAMPLED`` when ``sampled_argmax`` with the token's own noise (seed, index) draws it, ``NEAR_TIE`` when it does
    not but the token's perturbed score is within ``tolerance`` of the winner's (at both levels of the two-level
    draw), else ``NOT_SAMPLED``). One pass over the logits: the resume prefill computes them once; with the
    two-level noise and no top-k / top-p the block log-masses give the log-prob's normaliser too.
    ``tolerance`` 0 is the exact rule; above 0 it absorbs the rounding between the prefill's logits and decode's
    (bf16 near-ties) at the cost of keeping tokens the new policy would have drawn otherwise by that margin."""
    logits = logits.astype(jnp.float32)
    block_lse = None
    if cfg.greedy:
        token, near = _first_max(logits), _near(logits, tokens, tolerance)
    else:
        scaled = _scaled(logits, cfg)
        noise = gumbel_noise(seeds, token_index, logits.shape[-1], cfg.noise)
        if cfg.noise == "flat":
            scores = scaled + noise
            token, near = _first_max(scores), _near(scores, tokens, tolerance)
        else:
            token, block_lse, block_scores, grid = _two_level_draw(scaled, noise)
            n_blocks = grid.shape[-1]
            block, member = tokens % n_blocks, tokens // n_blocks
            members = jnp.take_along_axis(grid, block[..., None, None], axis=-1)[..., 0] + noise[..., n_blocks:]
            near = _near(block_scores, block, tolerance) & _near(members, member, tolerance)
    code = jnp.where(token == tokens, SAMPLED, jnp.where(near, NEAR_TIE, NOT_SAMPLED)).astype(jnp.int8)
    z = logits / cfg.logp_temperature
    if block_lse is None or cfg.top_k or cfg.top_p < 1:
        return at_tokens(z, tokens) - jax.nn.logsumexp(z, axis=-1), code
    return at_tokens(z, tokens) - jax.nn.logsumexp(block_lse, axis=-1), code


def _token_logp(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]


def sample_tokens(logits: jax.Array, seeds: jax.Array, token_index: jax.Array,
                  cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """logits: float32[B, V] -> (tokens int32[B], behaviour log-prob float32[B]).

    The token is ``sampled_argmax`` (its noise a function of (seed, index) only). The log-prob is the full
    softmax of logits / T at the sampled token (no top-p/top-k truncation; a known bias when they are on, see
    docs/method.md).
    """
    logits = logits.astype(jnp.float32)
    tokens = sampled_argmax(logits, seeds, token_index, cfg)
    return tokens, _token_logp(logits, tokens, cfg.logp_temperature)
