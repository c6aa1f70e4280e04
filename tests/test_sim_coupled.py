"""The simulator's coupled cut model (``CutModel(rule='coupled')``, ``SimConfig.rule``; issue 49): the kept prefix
of a cached trajectory is ``min(n, Geometric)`` at a per-token mismatch ``q(age)``, the two-stage rule is left as it
was, and ``calibrate.fit_coupled_mismatch`` recovers ``q`` from what a run logs. No JAX, no training: each test
replays a few hundred trajectories (well under a second) except the CLI one, which parses the tiny config (~2 s)."""

from __future__ import annotations

import dataclasses
import json
import math

import gin
import numpy as np
import pytest

from rollverify_jax import simulate as sim_cli
from rollverify_jax.sim import CostModel, CutModel, LengthModel, Workload, simulate
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim.config import SimConfig
from rollverify_jax.sim.replay import RULES, coupled_keep_mean, coupled_survival

UNIT = CostModel(decode_step_s=1.0)


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


def _mean_keeps(cut: CutModel, segments, step: int, draws: int) -> tuple[float, float]:
    keeps = np.asarray([cut.verify(segments, step)[0] for _ in range(draws)], float)
    return float(keeps.mean()), float(keeps.std(ddof=1) / math.sqrt(draws))


@pytest.mark.parametrize("n,q", [(400, 1e-3), (400, 1e-2), (50, 0.05), (2000, 3e-4)])
def test_mean_keep_matches_the_closed_form(n, q):
    # One segment of age 1: E[min(n, G)] = (1 - q)(1 - (1 - q)^n) / q, within 4 standard errors at a fixed seed.
    mean, se = _mean_keeps(CutModel(rule="coupled", mismatch=(q,), seed=7), [[1, n]], 2, 4000)
    assert abs(mean - coupled_keep_mean(n, q)) < 4 * se + 1e-9, (mean, coupled_keep_mean(n, q), se)


def test_older_tokens_match_less_and_segments_chain():
    # Age 3 at q1 = 0.01: survival (0.99)^3 a token. Two segments (age 2 then age 1, 100 tokens each): the
    # survival of the first j tokens is a^(2 min(j, 100)) a^(max(0, j - 100)); its sum is E[keep].
    q = 0.01
    assert coupled_survival((q,), 3) == pytest.approx(0.99 ** 3)
    assert coupled_survival((0.01, 0.05), 2) == pytest.approx(0.95)
    assert coupled_survival((0.01, 0.05), 4) == pytest.approx(0.95 ** 2)  # beyond the last age: linear log-survival
    mean, se = _mean_keeps(CutModel(rule="coupled", mismatch=(q,), seed=1), [[4, 300]], 7, 4000)
    assert abs(mean - coupled_keep_mean(300, 1 - 0.99 ** 3)) < 4 * se
    a = 0.99
    expect = sum(a ** (2 * min(j, 100) + max(0, j - 100)) for j in range(1, 201))
    mean, se = _mean_keeps(CutModel(rule="coupled", mismatch=(q,), seed=2), [[1, 100], [2, 100]], 3, 4000)
    assert abs(mean - expect) < 4 * se
    keep, checked, fail_age = CutModel(rule="coupled", mismatch=(0.5,), seed=0).verify([[1, 100], [2, 100]], 3)
    assert keep < 100 and checked == [2] and fail_age == 2  # the miss falls in the first (age-2) segment


def test_q_zero_keeps_everything_and_a_shift_cuts():
    w = Workload("rollverify", 2, 4, 8, 4, 300, prompt_len=10, switching=False)
    lengths = dict(median=60.0, sigma=1.0, seed=3)
    res = simulate(w, UNIT, LengthModel(300, **lengths), CutModel(rule="coupled", mismatch=(0.0,)), 12)
    assert sum(s.verified_tokens for s in res.steps) > 500
    assert all(s.kept_tokens == s.verified_tokens and s.num_cut == 0 for s in res.steps)
    cut = simulate(w, UNIT, LengthModel(300, **lengths), CutModel(rule="coupled", mismatch=(0.02,)), 12)
    assert sum(s.num_cut for s in cut.steps) > 0
    again = simulate(w, UNIT, LengthModel(300, **lengths), CutModel(rule="coupled", mismatch=(0.02,)), 12)
    assert [dataclasses.asdict(s) for s in cut.steps] == [dataclasses.asdict(s) for s in again.steps]  # seeded


def test_two_stage_is_unchanged_by_the_coupled_settings():
    # The two-stage rule ignores the coupled q: the same records, draw for draw, as before the rule existed
    # (CutModel's defaults), and the hand-computed case of test_simulate still holds.
    w = Workload("rollverify", 2, 4, 8, 4, 300, prompt_len=10, switching=False)
    lengths = dict(median=60.0, sigma=1.0, seed=3)
    base = simulate(w, UNIT, LengthModel(300, **lengths), CutModel(fail_prob=(0.2, 0.4), seed=5), 12)
    two = simulate(w, UNIT, LengthModel(300, **lengths),
                   CutModel(fail_prob=(0.2, 0.4), seed=5, rule="two_stage", mismatch=(0.3,)), 12)
    assert sum(s.num_cut for s in base.steps) > 0
    assert [dataclasses.asdict(s) for s in base.steps] == [dataclasses.asdict(s) for s in two.steps]
    cut = CutModel(fail_prob=(1.0, 0.0), rule="two_stage", mismatch=(0.9,))
    assert cut.verify([[1, 3], [2, 4]], 3) == (3, [2, 1], 1)
    assert SimConfig().rule == "two_stage" and RULES == ("two_stage", "coupled")


def test_rules_match_the_verifiers():
    from rollverify_jax.verify import verifier

    assert RULES == verifier.RULES


@pytest.mark.parametrize("kw,message", [
    ({"rule": "spec_rl"}, "SimConfig.rule='spec_rl'"),
    ({"coupled_mismatch_per_token": (1.0,)}, "in [0, 1)"),
    ({"coupled_mismatch_per_token": (-1e-3,)}, "in [0, 1)"),
    ({"coupled_mismatch_per_token": ()}, "in [0, 1)"),
])
def test_bad_rule_or_mismatch_is_a_clear_error(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        SimConfig(**kw)
    with pytest.raises(ValueError, match="rule|mismatch"):
        CutModel(**({"rule": kw["rule"]} if "rule" in kw else {"mismatch": kw["coupled_mismatch_per_token"]}))


def test_gin_selects_the_coupled_rule(tmp_path, capsys):
    # The tiny config with SimConfig.rule = 'coupled' at a large q cuts (acceptance below 1), at q = 0 not; a
    # bad rule is one message and exit 2.
    out = {}
    for q in ("0.0", "0.05"):
        path = tmp_path / f"{q}.json"
        sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--steps=4", f"--json={path}",
                      "--gin_param=SimConfig.modes=('rollverify',)", "--gin_param=SimConfig.rule='coupled'",
                      f"--gin_param=SimConfig.coupled_mismatch_per_token=({q},)",
                      "--gin_param=SimConfig.length_median=30.0"])
        out[q] = json.loads(path.read_text())["modes"][0]
    assert out["0.0"]["acceptance"] == 1.0 and out["0.0"]["num_cut"] == 0
    assert out["0.05"]["acceptance"] < 0.9 and out["0.05"]["num_cut"] > 0
    with pytest.raises(SystemExit) as e:
        sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--steps=2", "--gin_param=SimConfig.rule='exact'"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "SimConfig.rule='exact'" in err and "Traceback" not in err


def _run(tmp_path, recs, rule="coupled"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "spec.json").write_text(json.dumps({"format": 1, "rollout": {"mode": "rollverify"},
                                                    "verify": {"rule": rule}}))
    return cal.read_run(tmp_path)


def test_fit_recovers_the_replays_own_mismatch(tmp_path):
    # A replay at q1 = 2e-3 (older tokens: (1 - q1)^age) writes its verification counts as a run's metrics (no
    # verify/token_agreement): the censored-geometric estimate, brought to age 1 with the replay's token ages,
    # recovers q1 within 10%; the pooled rate alone (ages taken as 1) overstates it.
    w = Workload("rollverify", 4, 8, 64, 8, 3000, prompt_len=20, switching=False)
    res = simulate(w, UNIT, LengthModel(3000, median=300.0, sigma=1.0, seed=4),
                   CutModel(rule="coupled", mismatch=(2e-3,), seed=1), 30)
    recs = [{"step": s.step, "time/step": s.step_s, **s.verify_metrics()} for s in res.steps]
    run = _run(tmp_path / "replay", recs)
    ages = cal.replay_token_ages(res.steps)
    (q1,), fit = cal.fit_coupled_mismatch([run], token_ages=ages)
    assert fit["cut"] > 300 and "censored geometric" in fit["source"] and min(ages) > 1.1
    assert q1 == pytest.approx(2e-3, rel=0.1)
    assert cal.fit_coupled_mismatch([run])[0][0] > 2.4e-3


def test_fit_reads_token_agreement_where_logged(tmp_path):
    # Logged agreement is weighted by the step's cached tokens: 1 - (0.99 * 1000 + 0.98 * 3000) / 4000; steps
    # that verified nothing are left out; without agreement the cuts and kept tokens give cuts / (kept + cuts).
    recs = [{"step": 1, "time/step": 1.0, "verify/num_verified": 0},
            {"step": 2, "time/step": 1.0, "verify/num_verified": 10, "verify/tokens_total": 1000,
             "verify/tokens_removed": 500, "verify/num_cut": 5, "verify/token_agreement": 0.99},
            {"step": 3, "time/step": 1.0, "verify/num_verified": 30, "verify/tokens_total": 3000,
             "verify/tokens_removed": 800, "verify/num_cut": 9, "verify/token_agreement": 0.98}]
    (q,), fit = cal.fit_coupled_mismatch([_run(tmp_path / "a", recs)])
    assert q == pytest.approx(1 - (0.99 * 1000 + 0.98 * 3000) / 4000) and "token_agreement" in fit["source"]
    plain = [{k: v for k, v in r.items() if k != "verify/token_agreement"} for r in recs]
    (q,), fit = cal.fit_coupled_mismatch([_run(tmp_path / "b", plain)])
    assert q == pytest.approx(14 / (4000 - 1300 + 14)) and fit["cut"] == 14
    assert cal.verify_rule(_run(tmp_path / "c", recs, "two_stage")) == "two_stage"
    with pytest.raises(ValueError, match="verified nothing"):
        cal.fit_coupled_mismatch([_run(tmp_path / "d", recs[:1])])


def test_crossing_interpolates_the_sweep_in_log_q():
    from rollverify_jax.studies.coupled_cost import crossing

    pts = [(1e-5, 0.99), (1e-4, 0.9), (1e-3, 0.5), (1e-2, 0.1)]
    assert crossing(pts, 0.9) == pytest.approx(1e-4)
    assert crossing(pts, 0.7) == pytest.approx(10 ** -3.5)  # halfway between 0.9 and 0.5 in log q
    assert crossing(pts, 0.995) is None and crossing(pts, 0.05) is None


@pytest.mark.parametrize("run,q", [("coupled_tiny_s0", 3.534e-3), ("coupled_tool_s0", 1.825e-3)])
def test_the_published_fit_reproduces_from_its_checked_in_runs(run, q):
    # docs/results/coupled_cost_model.md fits q on the metrics of two coupled runs kept beside it (every cached
    # token of age 1 in the tiny shapes, so no age correction); the fit from those files is the documented one.
    from pathlib import Path

    from rollverify_jax.studies.coupled_cost import fit_from_runs

    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    fitted, fit = fit_from_runs([str(root / "coupled_cost_model" / run)])
    assert fitted == pytest.approx(q, rel=1e-3) and fit["mean_token_age"] == 1.0
    assert f"{q:.3e}".replace("e-03", "e-3") in (root / "coupled_cost_model.md").read_text()


def test_calibrating_on_a_coupled_run_fits_its_mismatch(tmp_path):
    # --calibrate_from a coupled run (VerifyConfig.rule in its spec.json: the checked-in tiny run's first 6 steps)
    # fits q on it and replays it under the coupled rule; the on-policy partner is the same records relabelled
    # (the rates need on-policy steps).
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "docs" / "results" / "coupled_cost_model" / "coupled_tiny_s0"
    spec = json.loads((src / "spec.json").read_text())
    recs = [r for r in map(json.loads, (src / "metrics.jsonl").read_text().splitlines()[:40])
            if "time/step" in r and r["step"] <= 6]
    assert spec["verify"]["rule"] == "coupled" and len(recs) == 6
    runs = {}
    for mode, rows in (("on_policy", [{**r, "mode/on_policy": 1, "verify/num_verified": 0} for r in recs]),
                       ("rollverify", recs)):
        runs[mode] = tmp_path / mode
        runs[mode].mkdir()
        (runs[mode] / "spec.json").write_text(json.dumps({**spec, "rollout": {**spec["rollout"], "mode": mode}}))
        (runs[mode] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sim.json"
    sim_cli.main(["--calibrate_from", str(runs["on_policy"]), str(runs["rollverify"]), "--steps=2", f"--json={out}"])
    report = json.loads(out.read_text())
    (q,), _ = cal.fit_coupled_mismatch([cal.read_run(runs["rollverify"])], skip=1)
    assert 1e-3 < q < 1e-2 and report["notes"]["coupled_mismatch_per_token"] == [pytest.approx(q)]
    assert report["notes"]["coupled_mismatch_from"] == [str(runs["rollverify"])]
    row = next(r for r in report["calibration"] if r["run"] == str(runs["rollverify"]))
    assert row["mode"] == "rollverify" and row["predicted_s"] > 0


def test_the_async_replay_cuts_under_the_coupled_rule():
    # The async replay verifies at each swap with the same cut model (ages in versions): q = 0 keeps every cached
    # token, a shift cuts some.
    from rollverify_jax.sim.async_replay import AsyncCosts, AsyncSetup, rollout_workload, simulate_async

    full = Workload("rollverify", 4, 4, 32, 4, 400, prompt_len=20, pool_shards=2, live_slots=False, switching=False)
    w = rollout_workload(full, 2, 1, "verify")
    costs = AsyncCosts(rollout=UNIT, train=UNIT, sync=UNIT, publish_s=0.05)
    res = {q: simulate_async(w, costs, LengthModel(400, median=40, sigma=1.0, seed=3),
                             AsyncSetup(2, 1, 4, 1, "verify"), CutModel(rule="coupled", mismatch=(q,)), 20, full)
           for q in (0.0, 0.05)}
    assert res[0.0].summary()["acceptance"] == 1.0
    assert res[0.05].summary()["acceptance"] < 0.9
