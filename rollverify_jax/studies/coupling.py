"""How far each verification rule's output is from an exact sample of the new policy (issue 49).

A two-token completion of one prompt is sampled under weights A with the engine's sampler (``sampled_argmax``:
token t's noise from the key (seed, t)), then verified under weights B by one rule and completed under B. Its
distribution over many seeds is compared with the exact two-token distribution of B (computed from B's logits
for every first token, with the sampler's top-k / top-p processing), as a total variation distance:

- 'coupled': keep the tokens B samples with their own noise (``verify.coupled_keep``), continue with the same
  keys (exact: each output equals B's from-scratch sample of that seed);
- 'two_stage': ``verify.two_stage_verify`` on log mu (A) and log pi (B) at the sampling temperature, the removed
  suffix redrawn under B with fresh keys (``Trajectory.sample_seed``'s new draw);
- 'spec_rl': SPEC-RL's rule: accept each token with probability min(1, pi/mu) (of the sampling distributions),
  redraw the first rejected one from pi (no residual: no engine stores mu(.)) and continue from pi.

Everything is vectorised over the seeds, so a few hundred thousand samples take seconds on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollverify_jax.models import load_pretrained
from rollverify_jax.rollout.sampling import SamplingConfig, _filter, sampled_argmax
from rollverify_jax.verify import coupled_keep, two_stage_verify
from rollverify_jax.verify.verifier import DEFAULT_DS, DEFAULT_DT

RULES = ("coupled", "two_stage", "spec_rl")


@dataclasses.dataclass(frozen=True)
class TwoTokenLogits:
    """A policy's float32 logits for a two-token completion of one prompt: ``first`` [V] after the prompt,
    ``second`` [V, V] after the prompt and each possible first token."""

    first: np.ndarray
    second: np.ndarray

    @classmethod
    def of(cls, model, prompt: np.ndarray) -> TwoTokenLogits:
        graphdef, state = nnx.split(model)
        v = model.cfg.vocab_size
        seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (v, 1)), np.arange(v, dtype=np.int32)[:, None]],
                              axis=1)
        logits = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, seqs), np.float32)
        return cls(first=logits[0, -2], second=logits[:, -1])

    def sampling_probs(self, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """The sampler's distributions (top-k / top-p applied): first [V], second [V, V]."""
        def probs(x):
            return np.asarray(jax.nn.softmax(_filter(jnp.asarray(x) / cfg.temperature, cfg), axis=-1), np.float64)
        return probs(self.first[None])[0], probs(self.second)

    def logp(self, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """log softmax(logits / T) (untruncated, as the engine records log mu and scores log pi)."""
        def lp(x):
            return np.asarray(jax.nn.log_softmax(jnp.asarray(x) / cfg.logp_temperature, axis=-1), np.float32)
        return lp(self.first), lp(self.second)

    def sample(self, seeds: np.ndarray, cfg: SamplingConfig, first: np.ndarray | None = None,
               from_index: int = 0) -> np.ndarray:
        """int[N, 2]: the engine's samples for ``seeds`` (key (seed, t) for token t); tokens before ``from_index``
        are given in ``first`` (kept), the rest sampled after them."""
        n = len(seeds)
        s = jnp.asarray(seeds, jnp.uint32)
        y1 = first if from_index >= 1 else np.asarray(
            _argmax(jnp.broadcast_to(self.first, (n, self.first.shape[0])), s, 0, cfg))
        y2 = np.asarray(_argmax(jnp.asarray(self.second)[jnp.asarray(y1)], s, 1, cfg))
        return np.stack([np.asarray(y1), y2], axis=1)


_sampled_argmax = jax.jit(sampled_argmax, static_argnums=3)


def _argmax(logits, seeds, index: int, cfg: SamplingConfig):
    return _sampled_argmax(logits, seeds, jnp.full(seeds.shape, index, jnp.int32), cfg)


def exact_distribution(b: TwoTokenLogits, cfg: SamplingConfig) -> np.ndarray:
    """float64[V, V]: B's probability of every two-token completion."""
    p1, p2 = b.sampling_probs(cfg)
    return p1[:, None] * p2


def total_variation(samples: np.ndarray, exact: np.ndarray) -> float:
    """TV between the empirical distribution of ``samples`` [N, 2] and ``exact`` [V, V]."""
    v = exact.shape[0]
    counts = np.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v) / len(samples)
    return 0.5 * float(np.abs(counts - exact.reshape(-1)).sum())


def verify_rule(rule: str, a: TwoTokenLogits, b: TwoTokenLogits, seeds: np.ndarray, cfg: SamplingConfig,
                ds: float = DEFAULT_DS, dt: float = DEFAULT_DT) -> tuple[np.ndarray, np.ndarray]:
    """(outputs int[N, 2], keep int[N]): A's samples for ``seeds`` verified under B by ``rule`` and completed."""
    ys = a.sample(seeds, cfg)
    n = len(seeds)
    if rule == "coupled":
        b_first = np.asarray(_argmax(jnp.broadcast_to(b.first, (n, b.first.shape[0])), jnp.asarray(seeds, jnp.uint32),
                                     0, cfg))
        b_second = np.asarray(_argmax(jnp.asarray(b.second)[ys[:, 0]], jnp.asarray(seeds, jnp.uint32), 1, cfg))
        keep = coupled_keep(np.stack([b_first == ys[:, 0], b_second == ys[:, 1]], axis=1), np.full(n, 2))
        fresh = seeds  # the same key stream
    elif rule == "two_stage":
        la1, la2 = a.logp(cfg)
        lb1, lb2 = b.logp(cfg)
        mu = np.stack([la1[ys[:, 0]], la2[ys[:, 0], ys[:, 1]]], axis=1)
        pi = np.stack([lb1[ys[:, 0]], lb2[ys[:, 0], ys[:, 1]]], axis=1)
        keep = np.asarray(two_stage_verify(pi, mu, np.zeros((n, 2), np.int32), np.full(n, 2, np.int32), ds, dt))
        fresh = (seeds.astype(np.uint64) * 2654435761 + 12345).astype(np.uint32)  # a fresh draw's keys
    elif rule == "spec_rl":
        pa1, pa2 = a.sampling_probs(cfg)
        pb1, pb2 = b.sampling_probs(cfg)
        ratio = np.stack([pb1[ys[:, 0]] / pa1[ys[:, 0]], pb2[ys[:, 0], ys[:, 1]] / pa2[ys[:, 0], ys[:, 1]]], axis=1)
        u = np.random.default_rng(int(seeds[0]) + 7).random((n, 2))
        reject = u >= np.minimum(1.0, ratio)
        keep = np.where(reject.any(axis=1), reject.argmax(axis=1), 2)
        fresh = (seeds.astype(np.uint64) * 2654435761 + 12345).astype(np.uint32)  # pi's redraw: fresh noise
    else:
        raise ValueError(f"verify_rule: unknown rule {rule!r}; use one of {RULES}.")
    out = ys.copy()
    redraw0 = b.sample(fresh, cfg)
    out[keep == 0] = redraw0[keep == 0]
    cut1 = keep == 1
    if cut1.any():
        out[cut1, 1] = b.sample(fresh[cut1], cfg, first=ys[cut1, 0], from_index=1)[:, 1]
    return out, keep


def rule_distances(a: TwoTokenLogits, b: TwoTokenLogits, cfg: SamplingConfig, num_samples: int,
                   seed: int = 0) -> dict[str, dict[str, float]]:
    """Per rule: TV to B's exact distribution, the kept fraction, and (for reference) TV of B's own fresh samples
    (the sampling floor at this size) and TV(A, B) per first token."""
    seeds = (np.arange(num_samples, dtype=np.uint64) + seed * num_samples).astype(np.uint32)
    exact = exact_distribution(b, cfg)
    out = {"fresh_b": {"tv": total_variation(b.sample(seeds, cfg), exact)}}
    for rule in RULES:
        ys, keep = verify_rule(rule, a, b, seeds, cfg)
        out[rule] = {"tv": total_variation(ys, exact), "kept_fraction": float(keep.mean() / 2)}
    pa, pb = a.sampling_probs(cfg)[0], b.sampling_probs(cfg)[0]
    out["shift"] = {"tv_first_token": 0.5 * float(np.abs(pa - pb).sum())}
    return out



POLICY = Path(__file__).resolve().parents[2] / "assets" / "tiny_policy"
PROMPT = np.arange(4, 12, dtype=np.int32)  # a fixed in-vocabulary prompt (the tiny policy's specials are 0-3)


def moved(model, scale: float, seed: int = 1):
    """``model`` with every weight moved by Gaussian noise of standard deviation ``scale`` (a policy update's
    stand-in)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(x.dtype), state))


def sweep(scales: list[float], num_samples: int, cfg: SamplingConfig, seed: int = 1) -> list[dict]:
    """``rule_distances`` of the tiny policy (A) against A moved by each scale (B), for ``PROMPT``: each rule's kept
    fraction and distance to B's exact distribution as the shift grows."""
    policy = load_pretrained(POLICY)
    a = TwoTokenLogits.of(policy, PROMPT)
    return [{"scale": scale, **rule_distances(a, TwoTokenLogits.of(moved(policy, scale, seed), PROMPT), cfg,
                                              num_samples)} for scale in scales]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=float, nargs="+", default=[0.002, 0.005, 0.01, 0.02, 0.05])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--top_k", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = SamplingConfig(1.0, top_k=args.top_k)
    print(f"two-token completions of the tiny policy, {args.samples} seeds, T = 1, top_k = {args.top_k}")
    print("| weight noise | TV(A, B) first token | floor (B fresh) | coupled: kept, TV | two-stage: kept, TV | "
          "SPEC-RL: kept, TV |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in sweep(args.scales, args.samples, cfg):
        cells = " | ".join(f"{r[k]['kept_fraction']:.3f}, {r[k]['tv']:.4f}" for k in RULES)
        print(f"| {r['scale']} | {r['shift']['tv_first_token']:.3f} | {r['fresh_b']['tv']:.4f} | {cells} |",
              flush=True)


if __name__ == "__main__":
    main()
