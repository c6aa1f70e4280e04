"""Kept tokens against policy shift on real trajectories of the tiny task: coupled vs two-stage (issue 49).

``N`` trajectories of the tiny task (its prompts, ``group_size`` samples each, up to ``max_new_tokens`` tokens) are
sampled under weights A (``assets/tiny_policy``) by the engine (``Scheduler``: its sampler, key (seed, t) per
token). For each policy shift, weights B are A moved by one of:

- 'noise': Gaussian noise of standard deviation ``sigma`` on every weight (the toy of ``studies/coupling.py``);
- 'grpo': one optimizer update (``rl.learner.make_optimizer``: AdamW, clip 1, no weight decay, as the tiny default)
  of the GRPO surrogate on these trajectories (group-normalised exact-match rewards, token-mean; at ratio 1 its
  gradient is the clipped objective's) at learning rate ``lr`` (a first AdamW update without weight decay is
  linear in the rate: computed once, scaled). A first Adam step moves every weight by about
  ``lr`` (``m / sqrt(v) = sign(g)``), more than a later step of the same rate, whose moments average.

and, at every cached token, from A's and B's full logits on the same sequences (one forward pass each):

- TV per token: the exact total variation between A's and B's sampling distributions (top-k / top-p applied);
- the coupled rule: whether B samples the cached token with its own noise (``sampling.samples``, the check the
  resume prefill computes, with the sampler's noise layout ``--noise``), over every token (the per-token
  agreement, against the bound ``(1 - TV) / (1 + TV)`` of the flat Gumbel-max coupling and the optimal coupling's
  ``1 - TV``), and the kept fraction (the prefix up to the first disagreement, ``verify.coupled_keep``);
- the two-stage rule's kept fraction at its defaults (``verify.two_stage_verify``, ds = 0.01, dt = 2) on the
  engine's ``log mu`` and B's ``log pi``; each trajectory was sampled by one version, so it is one segment;
- ``verify/tv_estimate``'s estimator (mean of ``(1 - pi/mu)_+``) beside the exact TV.

Kept fractions are over whole trajectories (``sum keep / sum n``) and over their first ``--prefix`` tokens (a
paused trajectory's cached prefix is shorter than a finished one).

    python -m rollverify_jax.studies.coupling_shift [--prompts 32] [--group_size 8] [--out docs/results/...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollverify_jax.data.datasets import get_dataset
from rollverify_jax.data.prompts import PromptRenderer
from rollverify_jax.data.rewards import exact_reward
from rollverify_jax.models import load_pretrained
from rollverify_jax.models.tokenizer import load_tokenizer
from rollverify_jax.rl.learner import OptimizerConfig, make_optimizer
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.sampling import NOISES, _filter, samples
from rollverify_jax.studies.coupling import POLICY, moved
from rollverify_jax.verify import coupled_keep, tv_terms, two_stage_verify
from rollverify_jax.verify.verifier import DEFAULT_DS, DEFAULT_DT

SIGMAS = (1e-5, 1e-4, 3e-4, 5e-4, 7e-4, 1e-3, 2e-3, 3e-3, 1e-2, 3e-2)
LRS = (5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 5e-5, 7e-5, 2e-4, 7e-4, 2e-3)


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Trajectories sampled under A, padded: ``seqs`` int32[N, S] (prompt + response, 0 after), ``starts`` [N]
    (prompt lengths), ``tokens`` int32[N, L], ``logps`` float32[N, L] (the engine's log mu), ``lengths`` [N],
    ``seeds`` [N] (each token t sampled with the key (seed, t)), ``groups`` [N], ``rewards`` float32[N]."""

    seqs: np.ndarray
    starts: np.ndarray
    tokens: np.ndarray
    logps: np.ndarray
    lengths: np.ndarray
    seeds: np.ndarray
    groups: np.ndarray
    rewards: np.ndarray

    @property
    def valid(self) -> np.ndarray:  # bool[N, L]
        return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


def task_prompts(num_prompts: int, seed: int = 1) -> tuple[list[dict], list[np.ndarray], list[int]]:
    """(records, prompt ids, EOS ids) of the tiny task, as the tiny default's training set renders them."""
    tokenizer = load_tokenizer(str(POLICY))
    task = json.loads((POLICY / "task.json").read_text())
    records = list(get_dataset("synthetic", n=num_prompts, seed=seed, split="train", **task))
    renderer = PromptRenderer(tokenizer)
    return records, [renderer.encode(r) for r in records], list(tokenizer.eos_ids)


def sample_rollouts(model, num_prompts: int, group_size: int, max_new_tokens: int, cfg: SamplingConfig,
                    seed: int = 0) -> Rollouts:
    """``num_prompts x group_size`` trajectories of the tiny task sampled under ``model`` by the engine."""
    records, prompts, eos = task_prompts(num_prompts, seed + 1)
    longest = max(len(p) for p in prompts) + max_new_tokens
    slots = min(64, num_prompts * group_size)
    engine = Engine(model, EngineConfig(num_slots=slots, page_size=16, max_seq_len=-(-longest // 16) * 16,
                                        steps_per_dispatch=8, bucket_ratio=4), cfg, eos_ids=tuple(eos))
    trajs = [Trajectory(uid=g * group_size + j, group_id=g, prompt=p, seed=(seed * 1_000_003 + g * group_size + j)
                        % (2**31 - 1), max_new_tokens=max_new_tokens)
             for g, p in enumerate(prompts) for j in range(group_size)]
    sched = Scheduler(engine)
    sched.submit(trajs)
    sched.run()
    done = sorted(sched.take_finished(), key=lambda t: t.uid)
    assert len(done) == len(trajs), "every trajectory finishes (EOS or max_new_tokens)"
    tokenizer = load_tokenizer(str(POLICY))
    n, width = len(done), max(t.num_tokens for t in done)
    tokens, logps = np.zeros((n, width), np.int32), np.zeros((n, width), np.float32)
    seqs = np.zeros((n, max(len(t.prompt) for t in done) + width), np.int32)
    for i, t in enumerate(done):
        tokens[i, : t.num_tokens], logps[i, : t.num_tokens] = t.tokens, t.logps
        seqs[i, : len(t.prompt) + t.num_tokens] = np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)])
    rewards = [exact_reward(tokenizer.decode(t.tokens), records[t.group_id]["answer"]) for t in done]
    return Rollouts(seqs=seqs, starts=np.asarray([len(t.prompt) for t in done]), tokens=tokens, logps=logps,
                    lengths=np.asarray([t.num_tokens for t in done]), seeds=np.asarray([t.sample_seed for t in done]),
                    groups=np.asarray([t.group_id for t in done]), rewards=np.asarray(rewards, np.float32))


def _response_logits(graphdef, state, seqs, starts, width: int):
    """float32[N, width, V]: the logits that predicted response token t (at position start + t - 1)."""
    logits = nnx.merge(graphdef, state)(seqs).astype(jnp.float32)  # [N, S, V]
    idx = starts[:, None] - 1 + jnp.arange(width)[None, :]  # [N, width]
    return jnp.take_along_axis(logits, jnp.minimum(idx, seqs.shape[1] - 1)[:, :, None], axis=1)


_response_logits_jit = jax.jit(_response_logits, static_argnums=(0, 4))


def response_logits(model, ro: Rollouts) -> np.ndarray:
    """float32[N, L, V]: ``model``'s logits at every response position of ``ro`` (teacher-forced, one pass)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_response_logits_jit(graphdef, state, jnp.asarray(ro.seqs), jnp.asarray(ro.starts),
                                           ro.tokens.shape[1]))


def _surrogate(state, graphdef, seqs, starts, tokens, weights):
    """The GRPO surrogate's loss at ratio 1: -sum(weights * log pi(tokens)) (weights: advantage / token count)."""
    logits = _response_logits(graphdef, state, seqs, starts, tokens.shape[1])
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]
    return -jnp.sum(weights * logp)


_surrogate_grad = jax.jit(jax.grad(_surrogate), static_argnums=1)


def grpo_direction(model, ro: Rollouts):
    """The first AdamW update at learning rate 1 (as the tiny default: clip 1, no weight decay) of the GRPO
    surrogate on ``ro`` (group-normalised rewards, token-mean; at ratio 1 its gradient is the clipped loss's).
    With no weight decay a first update is linear in the rate: the update at rate ``lr`` is ``lr`` times this."""
    adv = np.zeros_like(ro.rewards)
    for g in np.unique(ro.groups):
        r = ro.rewards[ro.groups == g]
        adv[ro.groups == g] = (r - r.mean()) / (r.std() + 1e-6)
    weights = adv[:, None] * ro.valid / ro.valid.sum()
    graphdef, state = nnx.split(model)
    grads = _surrogate_grad(state, graphdef, jnp.asarray(ro.seqs), jnp.asarray(ro.starts), jnp.asarray(ro.tokens),
                            jnp.asarray(weights, jnp.float32))
    opt = make_optimizer(OptimizerConfig(learning_rate=1.0, weight_decay=0.0, max_grad_norm=1.0))
    return jax.jit(lambda g, s: opt.update(g, opt.init(s), s)[0])(grads, state)


def stepped(model, direction, lr: float):
    """``model`` after the update ``lr * direction`` (``grpo_direction``)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x, d: x + lr * d, state, direction))


def grpo_step(model, ro: Rollouts, lr: float):
    """``model`` after one AdamW update of the GRPO surrogate on ``ro`` at learning rate ``lr``."""
    return stepped(model, grpo_direction(model, ro), lr)


@jax.jit
def _sampling_tv(za, zb, temperature):
    """The sampling distributions' TV per position (no top-k / top-p: see ``shift_row``)."""
    return 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(za / temperature, -1) - jax.nn.softmax(zb / temperature, -1)), -1)


_samples = jax.jit(samples, static_argnums=4)


def shift_row(ro: Rollouts, logits_a: np.ndarray, logits_b: np.ndarray, cfg: SamplingConfig,
              prefix: int = 64) -> dict[str, float]:
    """The rules against the shift A -> B on ``ro``: TV per token (exact, and ``verify/tv_estimate``'s estimate),
    the coupled rule's per-token agreement and its bounds, and both rules' kept fractions (whole trajectories, and
    their first ``prefix`` tokens)."""
    valid = ro.valid
    za, zb = jnp.asarray(logits_a), jnp.asarray(logits_b)
    if cfg.top_k or cfg.top_p < 1:
        pa = jax.nn.softmax(_filter(za / cfg.temperature, cfg), -1)
        pb = jax.nn.softmax(_filter(zb / cfg.temperature, cfg), -1)
        tv = np.asarray(0.5 * jnp.sum(jnp.abs(pa - pb), -1), np.float64)
    else:
        tv = np.asarray(_sampling_tv(za, zb, cfg.temperature), np.float64)
    tv = tv[valid]  # [K]
    t_index = np.broadcast_to(np.arange(ro.tokens.shape[1], dtype=np.int32), ro.tokens.shape)
    seeds = np.broadcast_to(ro.seeds.astype(np.uint32)[:, None], ro.tokens.shape)
    match = np.asarray(_samples(zb, jnp.asarray(ro.tokens), jnp.asarray(seeds), jnp.asarray(t_index), cfg))
    log_pi = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(zb / cfg.logp_temperature, -1),
                                            jnp.asarray(ro.tokens)[..., None], -1)[..., 0])
    row = {"tv": float(tv.mean()), "tv_estimate": float(tv_terms(log_pi[valid], ro.logps[valid]).mean()),
           "agreement": float(match[valid].mean()), "bound": float(np.mean((1 - tv) / (1 + tv))),
           "one_minus_tv": float(1 - tv.mean()), "tokens": int(valid.sum())}
    for name, lengths in (("", ro.lengths), (f"_first{prefix}", np.minimum(ro.lengths, prefix))):
        keep_c = coupled_keep(match, lengths)
        keep_t = np.asarray(two_stage_verify(log_pi, ro.logps, np.zeros(ro.tokens.shape, np.int32),
                                             lengths.astype(np.int32), DEFAULT_DS, DEFAULT_DT))
        row[f"coupled_kept{name}"] = float(keep_c.sum() / lengths.sum())
        row[f"two_stage_kept{name}"] = float(keep_t.sum() / lengths.sum())
    return row


def sweep(ro: Rollouts, policy, cfg: SamplingConfig, sigmas=SIGMAS, lrs=LRS, prefix: int = 64,
          noise_seed: int = 1, train: Rollouts | None = None) -> list[dict]:
    """``shift_row`` for A itself (shift 0), A + Gaussian noise of each sigma and A after one GRPO step of each
    learning rate on ``train`` (other trajectories, as a paused trajectory is not in the batch that trains the
    version verifying it; default ``ro`` itself)."""
    logits_a = response_logits(policy, ro)
    rows = [{"family": "none", "shift": 0.0, **shift_row(ro, logits_a, logits_a, cfg, prefix)}]
    for sigma in sigmas:
        b = moved(policy, sigma, noise_seed)
        rows.append({"family": "noise", "shift": sigma, **shift_row(ro, logits_a, response_logits(b, ro), cfg, prefix)})
    direction = grpo_direction(policy, ro if train is None else train)
    for lr in lrs:
        b = stepped(policy, direction, lr)
        rows.append({"family": "grpo", "shift": lr, **shift_row(ro, logits_a, response_logits(b, ro), cfg, prefix)})
    return rows


def crossing(rows: list[dict], key: str = "", family: str | None = None) -> float | None:
    """The TV per token at which the two-stage rule starts keeping fewer tokens than the coupled rule (the first
    sign change of ``two_stage_kept - coupled_kept`` along TV, interpolated in log TV), over the shifts of
    ``family`` (None: all); None without a sign change."""
    pts = sorted((r["tv"], r[f"two_stage_kept{key}"] - r[f"coupled_kept{key}"]) for r in rows
                 if r["tv"] > 0 and family in (None, r.get("family")))
    for (t0, d0), (t1, d1) in zip(pts, pts[1:], strict=False):
        if d0 > 0 >= d1:
            w = d0 / (d0 - d1)
            return float(np.exp(np.log(t0) + w * (np.log(t1) - np.log(t0))))
    return None


def table(rows: list[dict], prefix: int) -> str:
    head = ("| shift | TV per token | TV estimate | coupled agreement | bound (1-TV)/(1+TV) | 1 - TV | coupled kept | "
            f"two-stage kept | coupled kept, first {prefix} | two-stage kept, first {prefix} |")
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for r in rows:
        name = {"none": "none (B = A)", "noise": f"noise sigma {r['shift']:g}", "grpo": f"GRPO step lr {r['shift']:g}"}
        lines.append(f"| {name[r['family']]} | {r['tv']:.4f} | {r['tv_estimate']:.4f} | {r['agreement']:.4f} | "
                     f"{r['bound']:.4f} | {r['one_minus_tv']:.4f} | {r['coupled_kept']:.3f} | "
                     f"{r['two_stage_kept']:.3f} | "
                     f"{r[f'coupled_kept_first{prefix}']:.3f} | {r[f'two_stage_kept_first{prefix}']:.3f} |")
    return "\n".join(lines)


def run_shift(workdirs: list[Path]) -> dict[str, float] | None:
    """The per-version shift training runs logged (``verify/tv_estimate_age1`` and, for the coupled rule,
    ``verify/token_agreement_age1`` in each workdir's ``metrics.jsonl``): the range and mean over their cycles."""
    tv, agree = [], []
    for d in workdirs:
        for line in (Path(d) / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            if "verify/tv_estimate_age1" in r:
                tv.append(r["verify/tv_estimate_age1"])
                if "verify/token_agreement_age1" in r:
                    agree.append(r["verify/token_agreement_age1"])
    if not tv:
        return None
    out = {"cycles": len(tv), "tv_min": min(tv), "tv_max": max(tv), "tv_mean": float(np.mean(tv))}
    if agree:
        out["agreement_mean"] = float(np.mean(agree))
    return out


def plot(rows: list[dict], prefix: int, path: Path, runs: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"noise": "o", "grpo": "s"}
    shifted = [r for r in rows if r["tv"] > 0]
    for ax, key, title in ((axes[0], "", "whole trajectories"), (axes[1], f"_first{prefix}", f"first {prefix} tokens")):
        for fam, m in marks.items():
            rs = sorted((r for r in shifted if r["family"] == fam), key=lambda r: r["tv"])
            tv = [r["tv"] for r in rs]
            ax.plot(tv, [r[f"coupled_kept{key}"] for r in rs], f"-{m}", color="C0",
                    label=f"coupled kept ({fam})")
            ax.plot(tv, [r[f"two_stage_kept{key}"] for r in rs], f"--{m}", color="C1",
                    label=f"two-stage kept ({fam})")
            if not key:
                ax.plot(tv, [r["agreement"] for r in rs], f":{m}", color="C2", label=f"coupled agreement ({fam})")
        if not key:
            tvs = np.geomspace(min(r["tv"] for r in shifted), max(r["tv"] for r in shifted), 50)
            ax.plot(tvs, (1 - tvs) / (1 + tvs), color="grey", lw=0.8, label="(1 - TV) / (1 + TV)")
            ax.plot(tvs, 1 - tvs, color="grey", lw=0.8, ls="--", label="1 - TV")
        if runs:
            ax.axvspan(runs["tv_min"], runs["tv_max"], color="C3", alpha=0.12,
                       label="training runs' TV per version" if not key else None)
        for fam, ls in (("noise", "-."), ("grpo", ":")):
            x = crossing(rows, key, fam)
            if x is not None:
                ax.axvline(x, color="k", lw=0.6, ls=ls)
        ax.set_xscale("log")
        ax.set_xlabel("TV per token between A and B (exact)")
        ax.set_ylabel("fraction")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=200)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", default="flat", choices=NOISES, help="SamplingConfig.noise: the sampler's noise layout")
    ap.add_argument("--sigmas", type=float, nargs="+", default=list(SIGMAS))
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.png")
    ap.add_argument("--runs", type=Path, nargs="*", default=[],
                    help="training workdirs whose logged per-version shift (verify/tv_estimate_age1) to mark")
    args = ap.parse_args(argv)
    cfg = SamplingConfig(temperature=1.0, noise=args.noise)
    policy = load_pretrained(POLICY)
    ro = sample_rollouts(policy, args.prompts, args.group_size, args.max_new_tokens, cfg, args.seed)
    train = sample_rollouts(policy, args.prompts, args.group_size, args.max_new_tokens, cfg, args.seed + 1)
    print(f"{len(ro.lengths)} trajectories of the tiny task, {int(ro.lengths.sum())} tokens (mean length "
          f"{ro.lengths.mean():.1f}, max {ro.lengths.max()}), reward {ro.rewards.mean():.3f}; the GRPO step on "
          f"{len(train.lengths)} others (reward {train.rewards.mean():.3f}); T = 1, noise {args.noise!r}", flush=True)
    rows = sweep(ro, policy, cfg, args.sigmas, args.lrs, args.prefix, train=train)
    print(table(rows, args.prefix))
    crossings = {}
    for key, what in (("", "whole trajectories"), (f"_first{args.prefix}", f"first {args.prefix} tokens")):
        for fam in ("noise", "grpo"):
            x = crossings[f"{fam}{key}"] = crossing(rows, key, fam)
            print(f"{fam}: two-stage keeps more below TV per token ~ {x:.4g} ({what})" if x is not None
                  else f"{fam}: no crossing ({what})")
    runs = run_shift(args.runs) if args.runs else None
    if runs:
        print(f"training runs: TV per version (verify/tv_estimate_age1) {runs['tv_min']:.4f}-{runs['tv_max']:.4f}, "
              f"mean {runs['tv_mean']:.4f} over {runs['cycles']} cycles; coupled per-token agreement "
              f"{runs.get('agreement_mean', float('nan')):.4f}")
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": json.loads(json.dumps(vars(args), default=str)),
             "trajectories": len(ro.lengths), "tokens": int(ro.lengths.sum()), "rows": rows,
             "crossings": crossings, "runs": runs}, indent=1))
        plot(rows, args.prefix, args.out.with_suffix(".png"), runs)


if __name__ == "__main__":
    main()
