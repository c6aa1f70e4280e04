"""Measured rates from a run's ``metrics.jsonl``: cost coefficients, the response-length distribution and the
cut rates the simulator replays (pure Python + numpy; reads files only: the metrics and the run's ``spec.json``).

What a step's record holds (``rl/partial_rollout.py``, ``train.py``): ``time/rollout`` (prefill + decode +
host, without verification), ``time/verify``, ``time/train``, ``time/step``, the scheduler's timers
``rollout/prefill_time`` (prefill + activate calls; it includes ``time/verify``, which runs inside them) and
``rollout/decode_time`` (generate calls), ``rollout/dispatches``, ``rollout/tokens`` (decoded),
``rollout/slot_utilization`` (decoded tokens / (slots x decode steps)), ``rollout/prefill_tokens`` (tokens the
prefill calls compute) and ``rollout/shared_prompt_tokens`` (a group's prompt tokens copied, not computed),
``train/loss_tokens``, ``response/length_mean`` / ``length_max`` of the batch, ``verify/acceptance``,
``verify/num_verified`` / ``num_cut`` / ``num_restarted`` (paused trajectories), ``verify/segments_checked/<c>``
and ``verify/segments_failed/<c>`` (segments of age c the segment stage examined and those that failed),
``mode/on_policy``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from rollverify_jax.infra import spec_json
from rollverify_jax.sim.costs import CostModel
from rollverify_jax.sim.shape import value as spec_value


@dataclasses.dataclass
class RunData:
    path: Path
    mode: str  # the run's configured rollout mode
    steps: list[dict]  # training steps' records (with time/step), in order
    spec: dict = dataclasses.field(default_factory=dict)  # the run's spec.json, as plain data

    def used(self, skip: int) -> list[dict]:
        return [r for r in self.steps if r["step"] > skip]


def read_run(path) -> RunData:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} has no metrics.jsonl: --calibrate_from takes a run's directory.")
    steps = []
    lines = metrics.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rec, error = None, e.msg
        else:
            error = None if isinstance(rec, dict) else "not a JSON object"
        if error is not None:
            if i == last:  # a run killed mid-write, or one still writing, leaves its last line torn
                print(f"warning: {metrics}: line {i + 1}, the last, is cut off ({error}); reading the lines before it",
                      file=sys.stderr, flush=True)
                continue
            raise ValueError(f"{metrics}: line {i + 1} is not a metrics record ({error}); only the last line of a "
                             "run's metrics.jsonl can be cut off by a crash, so this file is damaged.")
        if "time/step" in rec:
            steps.append(rec)
    if not steps:
        raise ValueError(f"{metrics} holds no training step (no time/step record).")
    spec = spec_json.read(path, "The simulator reads a run's mode and shape from it: calibrate on runs that wrote one.")
    return RunData(path, spec_value(spec, "rollout.mode"), steps, spec)


def dispatches(rec: dict, num_slots: int, steps_per_dispatch: int) -> float:
    """Decode dispatches of a step: logged (``rollout/dispatches``), else from decoded tokens and slot
    utilization (runs before the scheduler's counters were logged)."""
    if "rollout/dispatches" in rec:
        return float(rec["rollout/dispatches"])
    util = rec.get("rollout/slot_utilization") or 0.0
    if util <= 0:
        return 0.0
    return rec["rollout/tokens"] / (util * num_slots) / steps_per_dispatch


def has_timers(run: RunData) -> bool:
    """Whether the run logs the scheduler's prefill / decode timers (commit 61a59a8 on)."""
    return all("rollout/decode_time" in r for r in run.steps)


def pending_last_token(run: RunData) -> bool:
    """Whether the run's engine prefilled every sequence but its last token (its slot's pending token, which
    decode writes): the engine since its shape ladders, whose spec.json has ``engine.bucket_ratio``. Its
    ``rollout/prefill_tokens`` count one token fewer per sequence than an earlier run's."""
    return "bucket_ratio" in run.spec.get("engine", {})


def prompt_len(runs: list[RunData], num_sequences: int, skip: int) -> int:
    """Mean prompt length: an on-policy step prefills exactly its B x G new prompts (computed, or copied from a
    group member's: ``rollout/shared_prompt_tokens``), each but its last token where the engine leaves that
    pending (``pending_last_token``)."""
    vals = [(r["rollout/prefill_tokens"] + r.get("rollout/shared_prompt_tokens", 0)) / num_sequences
            + pending_last_token(run) for run in runs for r in run.used(skip) if r.get("mode/on_policy")]
    if not vals:
        raise ValueError("no on-policy step to measure the prompt length on; add a run with on-policy steps to "
                         "--calibrate_from (e.g. one of configs/tiny_onpolicy.gin, or a RollVerify run that switched).")
    return int(round(statistics.fmean(vals)))


@dataclasses.dataclass(frozen=True)
class KindRatios:
    """Counts the engine does not log, per unit of one it does, from the replay of one kind of step (an
    on-policy phase, or a partial phase of a mode): they turn a logged step into the cost model's regressors."""

    slot_steps_per_token: float = 1.0  # live-bucket slot-steps per decoded token (1 / bucket utilization)
    width_per_slot_step: float = 0.0  # mean live page-table width (tokens) a slot-step reads
    calls_per_dispatch: float = 0.0  # prefill and activate calls (``StepRecord.prefill_calls``) per dispatch
    padded_per_token: float = 1.0  # prefill tokens computed (packed rows x width) per logged prefill token
    logp_per_verified_token: float = 1.0  # positions of the log-prob calls per verified cached token


def kind_ratios(steps) -> KindRatios:
    """``KindRatios`` over replayed ``StepRecord``s (sums, so long steps weigh more)."""
    tok = sum(s.tokens_generated for s in steps)
    disp = sum(s.dispatches for s in steps)
    pf = sum(s.prefill_tokens for s in steps)
    slot = sum(s.slot_steps for s in steps)
    vt = sum(s.verified_tokens for s in steps)
    return KindRatios(slot / tok if tok else 1.0, sum(s.width_slot_steps for s in steps) / slot if slot else 0.0,
                      sum(s.prefill_calls for s in steps) / disp if disp else 0.0,
                      sum(s.prefill_padded_tokens for s in steps) / pf if pf else 1.0,
                      sum(s.logp_tokens for s in steps) / vt if vt else 1.0)


def step_kind(run_mode: str, rec: dict) -> str:
    """'on_policy' for an on-policy phase (any mode: the same scheduler work), else the run's mode."""
    return "on_policy" if rec.get("mode/on_policy") else run_mode


def fit_costs(runs: list[RunData], ratios: dict[str, KindRatios], steps_per_dispatch: int, batch_sequences: int,
              prompt: int, skip: int = 1, steps=None, width_ref: float = 0.0) -> tuple[CostModel, dict]:
    """Rates from each timer of the steps of ``runs`` after ``skip`` (they compile) and in ``steps`` (None: all);
    the runs must log the scheduler's timers. Least squares, coefficients >= 0, per step ``s``:

        decode_time            = decode_dispatch_s * dispatches
                                 + decode_slot_s * slot-steps (bucket x k) * (1 + live width / width_ref)
        prefill_time - verify  = prefill_call_s * calls + prefill_token_s * padded tokens
                                 + prefill_logp_token_s * log-prob call tokens
        time/train             = train_step_s + train_token_s * (loss_tokens + B G prompt)
        time/verify            = verify_token_s * verified tokens
        overhead               = mean(time/step - decode_time - prefill_time - time/train)

    slot-steps, calls, padded tokens and log-prob call tokens are not logged: they are the step's decoded
    tokens, dispatches, prefill tokens and verified tokens times the replay's ``ratios`` for its kind of step
    (``step_kind``; the replay packs each call as ``Engine.pack`` does: ``Workload.prefill_shape``). Without
    on-policy steps every dispatch runs the full slot bucket, which cannot tell a per-dispatch cost from a per-slot one;
    decode is then priced per slot-step only (what the on-policy fits find on the tiny runs). A slot-step's
    cost grows with the live page-table width ``W`` as ``1 + W / width_ref`` (0: width ignored): the timers
    cannot separate it from the slot's own cost, so its scale is given (``SimConfig.decode_width_ref``).
    Prefill's attention term (``prefill_attn_s``, quadratic in the row length) is left at 0: on the tiny runs'
    rows of at most a few hundred tokens it cannot be told from the per-token rate, which absorbs it.
    """
    used = [(run.mode, r) for run in runs for r in run.used(skip) if steps is None or r["step"] in steps]
    if len(used) < 2:
        raise ValueError("calibration needs at least 2 steps to fit on (after the skipped ones) in the fit runs.")
    for run in runs:
        if not has_timers(run):
            raise ValueError(f"{run.path} does not log rollout/decode_time (runs from commit 61a59a8 on do): "
                             "rerun it, or leave it out of the fit runs.")
    kr = [ratios.get(step_kind(m, r), KindRatios()) for m, r in used]
    recs = [r for _, r in used]
    k = steps_per_dispatch
    x = np.asarray([[r["rollout/dispatches"], r["rollout/tokens"] * q.slot_steps_per_token
                     * (1.0 + (q.width_per_slot_step / width_ref if width_ref else 0.0))]
                    for r, q in zip(recs, kr, strict=True)], float)
    y = np.asarray([r["rollout/decode_time"] for r in recs], float)
    if any(step_kind(m, r) == "on_policy" for m, r in used):
        d_disp, d_slot = nonneg_lstsq(x, y)
    else:  # every dispatch ran the full bucket: per dispatch and per slot are one number; price it per slot
        d_disp, d_slot = 0.0, nonneg_lstsq(x[:, 1:], y)[0]
    xp = np.asarray([[r["rollout/dispatches"] * q.calls_per_dispatch, r["rollout/prefill_tokens"] * q.padded_per_token,
                      (r.get("verify/tokens_total", 0) if r.get("verify/num_verified") else 0)
                      * q.logp_per_verified_token]
                     for r, q in zip(recs, kr, strict=True)], float)
    yp = np.asarray([r["rollout/prefill_time"] - r["time/verify"] for r in recs], float)
    p_call, p_tok, p_logp = nonneg_lstsq(xp, yp)
    toks = np.asarray([r["train/loss_tokens"] + batch_sequences * prompt for r in recs], float)
    t0, t1 = nonneg_lstsq(np.stack([np.ones_like(toks), toks], 1), np.asarray([r["time/train"] for r in recs]))
    overhead = statistics.fmean(r["time/step"] - r["rollout/decode_time"] - r["rollout/prefill_time"] - r["time/train"]
                                for r in recs)
    vtok = sum(r["verify/tokens_total"] for r in recs if r.get("verify/num_verified"))
    verify_token_s = sum(r["time/verify"] for r in recs if r.get("verify/num_verified")) / vtok if vtok else 0.0
    costs = CostModel(decode_step_s=d_disp / k, decode_slot_s=d_slot,
                      decode_width_token_s=d_slot / width_ref if width_ref else 0.0, prefill_call_s=p_call,
                      prefill_token_s=p_tok, prefill_logp_token_s=p_logp, train_step_s=t0, train_token_s=t1,
                      step_overhead_s=max(0.0, overhead), verify_token_s=verify_token_s)
    fit = {"steps": len(recs), "decode_dispatch_s": d_disp, "decode_slot_step_s": d_slot,
           "prefill_call_s": p_call, "prefill_token_s": p_tok, "prefill_logp_token_s": p_logp,
           "train_step_s": t0, "train_token_s": t1, "overhead_s": overhead, "verify_token_s": verify_token_s,
           "ratios": {kind: dataclasses.asdict(q) for kind, q in ratios.items()}}
    return costs, fit


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: the best fit over the column subsets whose unconstrained
    solution is non-negative (at most 3 columns here: exact, no solver)."""
    n = x.shape[1]
    best = (float(np.sum(y ** 2)), [0.0] * n)
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub = x[:, cols]
        if not np.any(sub):
            continue
        coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if np.all(coef >= 0):
            full = [0.0] * n
            for j, c in zip(cols, coef, strict=True):
                full[j] = float(c)
            err = float(np.sum((x @ np.asarray(full) - y) ** 2))
            if err < best[0] - 1e-12 * max(1.0, best[0]):
                best = (err, full)
    return best[1]


# -- response lengths ------------------------------------------------------------------------------------

def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ lognormal(mu, sigma)."""
    if sigma == 0:
        return min(math.exp(mu), cap)
    lc = math.log(cap)
    return (math.exp(mu + sigma * sigma / 2) * _phi((lc - mu - sigma * sigma) / sigma)
            + cap * (1.0 - _phi((lc - mu) / sigma)))


def fit_group_lognormal(mean: float, mean_max: float, batch_mean_sd: float, groups: int, group_size: int,
                        cap: float, seed: int = 0) -> tuple[float, float, float]:
    """(median, sigma, group_share) of ``LengthModel``'s grouped lognormal whose capped mean is ``mean`` and
    whose batches of ``groups`` x ``group_size`` come closest (relative squared error, Monte Carlo on fixed
    draws) to the mean batch maximum ``mean_max`` and the batch mean's standard deviation ``batch_mean_sd``:
    the spread between groups is what moves the batch mean, the spread within them what moves its maximum."""
    rng = np.random.default_rng(seed)
    zg = rng.standard_normal((400, groups, 1))
    zi = rng.standard_normal((400, groups, group_size))
    best = None
    for sigma in np.arange(0.05, 1.501, 0.025):
        lo, hi = -5.0, math.log(cap) + 5.0
        for _ in range(60):  # capped mean rises with mu: bisection (the shares leave the total sigma alone)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
        for share in np.arange(0.0, 1.001, 0.05):
            x = np.clip(np.rint(np.exp(lo + sigma * (math.sqrt(share) * zg + math.sqrt(1 - share) * zi))), 1, cap)
            x = x.reshape(len(x), -1)
            err = ((x.max(1).mean() / mean_max - 1) ** 2
                   + (x.mean(1).std(ddof=1) / max(batch_mean_sd, 1e-9) - 1) ** 2)
            if best is None or err < best[0]:
                best = (err, math.exp(lo), float(sigma), float(share))
    return best[1], best[2], best[3]


def length_stats(runs: list[RunData], skip: int) -> tuple[float, float, float]:
    """Mean response length, mean batch maximum and the batch mean's step-to-step standard deviation over the
    on-policy steps (unbiased batches: a partial batch is the short end of what was in flight). The deviation
    comes from consecutive differences (sd(diff) / sqrt 2, per run), so a slow drift of the policy's lengths
    does not count as spread between groups."""
    on = [r for run in runs for r in run.used(skip) if r.get("mode/on_policy")]
    if not on:
        raise ValueError("no on-policy step to fit the response-length distribution on; add a run with on-policy "
                         "steps to --calibrate_from (e.g. one of configs/tiny_onpolicy.gin).")
    diffs = []
    for run in runs:
        steps = [r for r in run.used(skip) if r.get("mode/on_policy")]
        diffs += [b["response/length_mean"] - a["response/length_mean"]
                  for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1]
    sd = math.sqrt(statistics.fmean(d * d for d in diffs) / 2) if diffs else 0.0
    return (statistics.fmean(r["response/length_mean"] for r in on),
            statistics.fmean(r["response/length_max"] for r in on), sd)


def rollout_sample_lengths(workdir) -> list[list[int]]:
    """Each logged group's response lengths (``num_tokens``) from a run's ``samples/rollout_step_<N>.jsonl``
    (``MetricsConfig.rollout_samples_every``; log every trajectory with ``rollout_samples_logged = B x G``), one
    list per (step, group) with at least two members."""
    groups: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    files = sorted(Path(workdir).glob("samples/rollout_step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{workdir}/samples holds no rollout_step_*.jsonl: run with "
                                "MetricsConfig.rollout_samples_every=1 and rollout_samples_logged=B*G.")
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "num_tokens" in row:
                    groups[(int(row.get("step", 0)), int(row["group"]))].append(int(row["num_tokens"]))
    return [v for v in groups.values() if len(v) >= 2]


def fit_group_share(groups: list[list[int]]) -> dict:
    """The share of the log-length variance between groups (``LengthModel.group_share``) from per-group response
    lengths: the one-way random-effects (ANOVA) estimate on log lengths, sigma_b^2 = (MSB - MSW) / n0 over
    sigma_b^2 + MSW (n0 the mean group size, corrected for unequal sizes), floored at 0. Also the total log
    sigma and median it implies (a tiny run's, not the real task's)."""
    logs = [np.log(np.asarray(g, float)) for g in groups]
    if len(logs) < 2:
        raise ValueError(f"fit_group_share needs at least two groups of two or more; got {len(logs)}.")
    sizes = np.asarray([len(x) for x in logs], float)
    n, k = sizes.sum(), len(logs)
    grand = np.concatenate(logs).mean()
    msb = float(sum(len(x) * (x.mean() - grand) ** 2 for x in logs) / (k - 1))
    msw = float(sum(((x - x.mean()) ** 2).sum() for x in logs) / (n - k))
    n0 = (n - (sizes ** 2).sum() / n) / (k - 1)
    between = max(0.0, (msb - msw) / n0)
    share = float(between / (between + msw)) if between + msw > 0 else 0.0
    return {"group_share": share, "sigma": math.sqrt(between + msw), "median": float(math.exp(grand)),
            "groups": k, "trajectories": int(n), "max": int(max(max(g) for g in groups))}


# -- where verification cuts ------------------------------------------------------------------------------

_CHECKED = re.compile(r"^verify/segments_checked/(\d+)$")


def segment_counts(records) -> tuple[dict[int, int], dict[int, int]]:
    """(checked, failed) segments by age summed over ``records`` (``verify/segments_checked/<c>``,
    ``verify/segments_failed/<c>``: what the segment stage examined, each trajectory's segments up to its first
    failing one, and how many of those failed)."""
    checked: dict[int, int] = collections.Counter()
    failed: dict[int, int] = collections.Counter()
    for r in records:
        for key, value in r.items():
            m = _CHECKED.match(key)
            if m:
                age = int(m.group(1))
                checked[age] += int(value)
                failed[age] += int(r.get(f"verify/segments_failed/{age}", 0))
    return checked, failed


def fail_prob_from_counts(checked: dict[int, int], failed: dict[int, int], min_checked: int = 30) -> tuple[float, ...]:
    """``p(c) = failed / checked`` for ages 1 .. A (``CutModel.fail_prob``: the last value repeats beyond it), A the
    oldest age examined at least ``min_checked`` times (else the oldest examined): p(A) pools every age >= A, so
    a few old segments neither set the rate of all older ages alone nor are lost. An age below A never examined
    takes the nearest younger age's rate (better measured: most segments are young), age 1 the nearest older."""
    seen = sorted(a for a, n in checked.items() if n > 0 and a >= 1)
    if not seen:
        raise ValueError("no segment was examined: the runs verified nothing (or log no verify/segments_checked).")
    last_age = max((a for a in seen if checked[a] >= min_checked), default=seen[-1])
    tail_checked = sum(checked[a] for a in seen if a >= last_age)
    tail_failed = sum(failed.get(a, 0) for a in seen if a >= last_age)
    out, last = [], failed.get(seen[0], 0) / checked[seen[0]]
    for age in range(1, last_age):
        if checked.get(age, 0) > 0:
            last = failed.get(age, 0) / checked[age]
        out.append(last)
    return (*out, tail_failed / tail_checked)


def fit_segment_fail_prob(runs: list[RunData], skip: int = 0, min_checked: int = 30) -> tuple[tuple[float, ...], dict]:
    """The per-segment failure probability by age, pooled over the runs' steps after ``skip``
    (``fail_prob_from_counts``), and how it was measured. Runs from before the segment statistics were logged
    (no ``verify/segments_checked/<c>``) give ``num_cut / num_verified`` at every age: each verified trajectory
    counted as one segment, an upper bound on the per-segment rate when trajectories hold several."""
    recs = [r for run in runs for r in run.used(skip) if r.get("verify/num_verified")]
    checked, failed = segment_counts(recs)
    if checked:
        fit = {"source": "segments", "checked": dict(sorted(checked.items())), "failed": dict(sorted(failed.items()))}
        return fail_prob_from_counts(checked, failed, min_checked), fit
    verified = sum(r["verify/num_verified"] for r in recs)
    if not verified:
        raise ValueError("the RollVerify runs verified nothing after the skipped steps: no cut rate to fit.")
    cut = sum(r.get("verify/num_cut", 0) for r in recs)
    return (cut / verified,), {"source": "num_cut / num_verified (no segment statistics logged)",
                               "verified": verified, "cut": cut}


def fail_prob_trace(run: RunData) -> list[tuple[float, ...]]:
    """Per step (1-based, from step 1), the run's own ``p(c)`` where it verified something (ages that step did
    not examine: the run's pooled rate), else the previous step's (no cuts before the first verification):
    what a replay of that run takes, as it takes its lengths."""
    pooled, _ = fit_segment_fail_prob([run], min_checked=1)
    out, last = [], (0.0,)
    for r in run.steps:
        if r.get("verify/num_verified"):
            checked, failed = segment_counts([r])
            if checked:
                last = tuple(failed.get(a, 0) / checked[a] if checked.get(a) else pooled[min(a, len(pooled)) - 1]
                             for a in range(1, max(max(checked), len(pooled)) + 1))
            else:
                last = (r.get("verify/num_cut", 0) / r["verify/num_verified"],)
        out.append(last)
    return out


def switch_step(run: RunData) -> int:
    for r in run.steps:
        if "mode/switch_step" in r:
            return int(r["mode/switch_step"])
    return -1


# -- where the coupled rule cuts ----------------------------------------------------------------------------

def coupled_counts(records) -> dict:
    """Sums over ``records`` of what the coupled rule's per-token mismatch is estimated from: cached tokens
    verified (``verify/tokens_total``), removed, trajectories cut, and, where logged, the matched cached tokens
    (``verify/token_agreement`` times ``tokens_total``: the fraction of every verified cached token the new
    policy would have sampled with its noise, before and after the first miss) over the tokens it was measured
    on."""
    out = {"steps": 0, "tokens": 0, "removed": 0, "cut": 0, "agree_tokens": 0.0, "agree_of": 0}
    for r in records:
        n = int(r.get("verify/tokens_total", 0))
        out["steps"] += 1
        out["tokens"] += n
        out["removed"] += int(r.get("verify/tokens_removed", 0))
        out["cut"] += int(r.get("verify/num_cut", 0))
        agree = r.get("verify/token_agreement")
        if agree is not None and n and not math.isnan(float(agree)):
            out["agree_tokens"] += float(agree) * n
            out["agree_of"] += n
    return out


def fit_coupled_mismatch(runs: list[RunData], skip: int = 0,
                         token_ages: tuple[float, float] = (1.0, 1.0)) -> tuple[tuple[float], dict]:
    """The coupled rule's per-token mismatch at age 1, ``(q1,)`` (``SimConfig.coupled_mismatch_per_token``; older
    ages follow ``replay.coupled_survival``, ``(1 - q1) ** c``), from the runs' verifying steps after ``skip``.

    First pooled over the ages the run's cached tokens had:

    - with ``verify/token_agreement`` logged (the matched fraction of every verified cached token),
      ``q_pool = 1 - sum(agreement x tokens_total) / sum(tokens_total)`` over the steps that log it: direct, every
      cached token counted;
    - else the censored-geometric estimate ``q_pool = cuts / (kept + cuts)``: the check examines each
      trajectory's tokens up to and including its first miss, so the examined tokens are the kept ones
      (``tokens_total - tokens_removed``) plus one per cut, and the misses are the cuts: the maximum-likelihood
      per-token rate of a cut at one per-token rate. It sees only the tokens up to each first miss.

    Then to age 1: ``q1 = 1 - (1 - q_pool) ** (1 / a)``, ``a`` the mean age of the tokens the estimate counts
    (``token_ages`` = (examined tokens', every verified token's); the runs do not log them, so
    ``predict.build_inputs`` takes them from a replay of the runs' shape: ``replay_token_ages``; (1, 1): q1 is
    the pooled rate)."""
    recs = [r for run in runs for r in run.used(skip) if r.get("verify/num_verified")]
    if not recs:
        raise ValueError("the coupled runs verified nothing after the skipped steps: no per-token mismatch to fit.")
    c = coupled_counts(recs)
    if c["agree_of"]:
        q_pool, age = 1.0 - c["agree_tokens"] / c["agree_of"], token_ages[1]
        source = "verify/token_agreement (matched fraction of every verified cached token)"
    else:
        examined = c["tokens"] - c["removed"] + c["cut"]
        if examined <= 0:
            raise ValueError("the coupled runs examined no cached token: no per-token mismatch to fit.")
        q_pool, age = c["cut"] / examined, token_ages[0]
        source = "cuts / (kept + cuts): censored geometric, no verify/token_agreement logged"
    if age < 1.0:
        raise ValueError(f"fit_coupled_mismatch: a mean token age of {age} (ages start at 1).")
    q1 = 1.0 - (1.0 - min(max(q_pool, 0.0), 1.0 - 1e-12)) ** (1.0 / age)
    return (q1,), {"source": source, "q_pooled": q_pool, "mean_token_age": age, **c}


def replay_token_ages(steps) -> tuple[float, float]:
    """(examined, every verified) cached tokens' mean age over replayed ``StepRecord``s (1 where none)."""
    ex = sum(s.examined_tokens for s in steps)
    vt = sum(s.verified_tokens for s in steps)
    return (sum(s.examined_token_age for s in steps) / ex if ex else 1.0,
            sum(s.verified_token_age for s in steps) / vt if vt else 1.0)


def verify_rule(run: RunData) -> str:
    """The verifier's rule a run used (``VerifyConfig.rule``; 'two_stage' for runs from before it existed)."""
    return run.spec.get("verify", {}).get("rule", "two_stage")
