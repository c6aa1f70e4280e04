"""Measured rates from a run's ``metrics.jsonl``: cost coefficients, the response-length distribution and the
acceptance trace the simulator replays (pure Python + numpy; reads files only).

What a step's record holds (``rl/partial_rollout.py``, ``train.py``): ``time/rollout`` (prefill + decode +
host, without verification), ``time/verify``, ``time/train``, ``time/step``, ``rollout/tokens`` (decoded),
``rollout/slot_utilization`` (decoded tokens / (slots x decode steps)), ``rollout/prefill_tokens``,
``train/loss_tokens``, ``response/length_mean`` / ``length_max`` of the batch, ``verify/acceptance`` and
``verify/num_verified``, ``mode/on_policy``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np

from rollverify_jax.sim.costs import CostModel

_MODE = re.compile(r"^\s*RolloutConfig\.mode\s*=\s*['\"](\w+)['\"]", re.M)


@dataclasses.dataclass
class RunData:
    path: Path
    mode: str  # the run's configured rollout mode
    steps: list[dict]  # training steps' records (with time/step), in order

    def used(self, skip: int) -> list[dict]:
        return [r for r in self.steps if r["step"] > skip]


def read_run(path) -> RunData:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} has no metrics.jsonl: --calibrate_from takes a run's directory.")
    steps = []
    for line in metrics.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "time/step" in rec:
                steps.append(rec)
    if not steps:
        raise ValueError(f"{metrics} holds no training step (no time/step record).")
    mode = None
    for name in ("config.gin", "operative_config.gin"):
        if (path / name).is_file():
            m = _MODE.search((path / name).read_text())
            if m:
                mode = m.group(1)
                break
    if mode is None:
        raise ValueError(f"{path}: no RolloutConfig.mode in its config.gin; is it a training run's directory?")
    return RunData(path, mode, steps)


def dispatches(rec: dict, num_slots: int, steps_per_dispatch: int) -> float:
    """Decode dispatches of a step, from decoded tokens and slot utilization."""
    util = rec.get("rollout/slot_utilization") or 0.0
    if util <= 0:
        return 0.0
    return rec["rollout/tokens"] / (util * num_slots) / steps_per_dispatch


def prompt_len(runs: list[RunData], num_sequences: int, skip: int) -> int:
    """Mean prompt length: an on-policy step prefills exactly its B x G new prompts."""
    vals = [r["rollout/prefill_tokens"] / num_sequences for run in runs for r in run.used(skip)
            if r.get("mode/on_policy")]
    if not vals:
        raise ValueError("no on-policy step to measure the prompt length on.")
    return int(round(statistics.fmean(vals)))


def fit_costs(runs: list[RunData], num_slots: int, steps_per_dispatch: int, batch_sequences: int,
              prompt: int, skip: int = 1, steps=None, on_policy_only: bool = True) -> tuple[CostModel, dict]:
    """Least-squares rates from the steps of ``runs`` after ``skip`` (they compile) and in ``steps`` (None: all),
    on-policy steps only unless ``on_policy_only`` is False:

        time/rollout = decode_dispatch_s * dispatches + prefill_token_s * prefill_tokens
        time/train   = train_step_s + train_token_s * (loss_tokens + B G prompt)
        overhead     = mean(time/step - time/rollout - time/verify - time/train)
        verify_token_s = sum time/verify / sum verify/tokens_total (over steps that verified, any mode)
    """
    on = [r for run in runs for r in run.used(skip) if (r.get("mode/on_policy") or not on_policy_only)
          and (steps is None or r["step"] in steps)]
    if len(on) < 2:
        raise ValueError("calibration needs at least 2 steps to fit on (after the skipped ones) in the fit runs.")
    x = np.asarray([[dispatches(r, num_slots, steps_per_dispatch), r["rollout/prefill_tokens"]] for r in on])
    y = np.asarray([r["time/rollout"] for r in on])
    a_disp, p_tok = _nonneg_lstsq(x, y)
    toks = np.asarray([r["train/loss_tokens"] + batch_sequences * prompt for r in on])
    ttrain = np.asarray([r["time/train"] for r in on])
    if np.ptp(toks) > 0:
        t1, t0 = np.polyfit(toks, ttrain, 1)
    else:
        t1, t0 = 0.0, float(ttrain.mean())
    if t0 < 0 or t1 < 0:  # a negative coefficient: per-token only
        t0, t1 = 0.0, float(ttrain.sum() / toks.sum())
    overhead = statistics.fmean(r["time/step"] - r["time/rollout"] - r["time/verify"] - r["time/train"] for r in on)
    ver = [r for run in runs for r in run.used(skip)
           if r.get("verify/num_verified") and (steps is None or r["step"] in steps)]
    vtok = sum(r["verify/tokens_total"] for r in ver)
    verify_token_s = sum(r["time/verify"] for r in ver) / vtok if vtok else 0.0
    costs = CostModel(decode_step_s=float(a_disp) / steps_per_dispatch, prefill_token_s=float(p_tok),
                      train_step_s=float(t0), train_token_s=float(t1), step_overhead_s=max(0.0, float(overhead)),
                      verify_token_s=float(verify_token_s))
    fit = {"on_policy_steps": len(on), "decode_dispatch_s": float(a_disp),
           "rollout_rmse_s": float(np.sqrt(np.mean((x @ np.asarray([a_disp, p_tok]) - y) ** 2))),
           "verify_steps": len(ver)}
    return costs, fit


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two non-negative coefficients: the unconstrained fit, else the better one-variable fit."""
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    fits = []
    for j in range(2):
        c = float(np.sum(x[:, j] * y) / max(np.sum(x[:, j] ** 2), 1e-30))
        coef = (c, 0.0) if j == 0 else (0.0, c)
        fits.append((float(np.sum((x @ np.asarray(coef) - y) ** 2)), coef))
    return min(fits)[1]


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


def expected_max(mu: float, sigma: float, n: int, cap: float) -> float:
    """Approximate expected maximum of ``n`` draws (Blom's plotting position), capped."""
    z = statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return min(cap, math.exp(mu + sigma * z))


def fit_lognormal(mean: float, mean_max: float, n: int, cap: float) -> tuple[float, float]:
    """(median, sigma) of the capped lognormal whose capped mean is ``mean`` and whose expected maximum of ``n``
    draws is closest to ``mean_max``."""
    best = None
    for sigma in np.linspace(0.05, 2.5, 246):
        lo, hi = -5.0, math.log(cap) + 5.0
        for _ in range(80):  # capped mean rises with mu: bisection
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
        err = abs(expected_max(lo, sigma, n, cap) - mean_max)
        if best is None or err < best[0]:
            best = (err, math.exp(lo), float(sigma))
    return best[1], best[2]


def length_stats(runs: list[RunData], skip: int) -> tuple[float, float]:
    """Mean response length and mean batch maximum over the on-policy steps (unbiased batches: a partial
    batch is the short end of what was in flight)."""
    on = [r for run in runs for r in run.used(skip) if r.get("mode/on_policy")]
    if not on:
        raise ValueError("no on-policy step to fit the response-length distribution on.")
    return (statistics.fmean(r["response/length_mean"] for r in on),
            statistics.fmean(r["response/length_max"] for r in on))


def acceptance_trace(run: RunData) -> list[float]:
    """Per step (1-based, from step 1): the run's acceptance where it verified something, else the previous
    value (1.0 before the first verification)."""
    out, last = [], 1.0
    for r in run.steps:
        if r.get("verify/num_verified"):
            last = float(r["verify/acceptance"])
        out.append(last)
    return out


def switch_step(run: RunData) -> int:
    for r in run.steps:
        if "mode/switch_step" in r:
            return int(r["mode/switch_step"])
    return -1
