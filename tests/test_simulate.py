"""The simulator (rollverify_jax/sim, python -m rollverify_jax.simulate) against hand-computed cases."""

from __future__ import annotations

import json
import math

import gin
import pytest

from rollverify_jax import simulate as sim_cli
from rollverify_jax.sim import AcceptanceModel, CostModel, LengthModel, Workload, simulate
from rollverify_jax.sim import calibrate as cal

UNIT = CostModel(decode_step_s=1.0)  # one second per decode step, everything else free


@pytest.fixture(autouse=True)
def _fresh_gin():
    """The CLI parses (and locks) the global gin config: leave it cleared and unlocked for the next test."""
    yield
    gin.clear_config()


def workload(mode, **kw):
    base = dict(mode=mode, batch_groups=2, group_size=2, num_slots=2, steps_per_dispatch=1, max_new_tokens=10,
                prompt_len=0)
    return Workload(**{**base, **kw})


def test_on_policy_two_slots_four_sequences_by_hand():
    # Groups g0 = (u0: 4, u1: 1), g1 = (u2: 2, u3: 2); 2 slots, 1 token per dispatch, 1 s per decode step.
    # t=0: u0, u1 start. t=1: u1 ends, u2 takes its slot. t=3: u2 ends (u0 has 1 left), u3 starts.
    # t=4: u0 ends; u3 has 1 left and runs alone. t=5: u3 ends. Wall = 5 s, 9 tokens in 2 x 5 slot-steps.
    res = simulate(workload("on_policy"), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=1)
    (s,) = res.steps
    assert s.step_s == 5.0 and s.decode_steps == 5 and s.tokens_generated == 9 and s.batch_tokens == 9
    assert s.slot_utilization(2) == 9 / 10


def test_partial_two_slots_by_hand():
    # B = 1 group of 2, 2 slots, lengths cycle (4, 1, 2, 2): g0 = (4, 1), g1 = (2, 2), g2 = (4, 1), ...
    # Step 1: u0, u1 start; t=1 u1 ends, g1 queued, u2 starts; t=3 u2 ends, g2 queued, u3 starts;
    #   t=4 u0 ends -> g0 complete, batch = g0. u3 (1 of 2 tokens) is paused, g2 (never started) too. 4 s.
    # Step 2: u3 resumes (1 token left) with u4 (4): t=1 u3 ends -> g1 complete. 1 s.
    res = simulate(workload("partial", batch_groups=1), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=2)
    assert [s.step_s for s in res.steps] == [4.0, 1.0]
    assert [s.batch_tokens for s in res.steps] == [5, 4]
    assert [s.tokens_generated for s in res.steps] == [8, 2]
    assert res.wall_s == 5.0


def test_decode_closed_form_matches_the_per_dispatch_sum():
    c = CostModel(decode_step_s=0.5, decode_slot_s=0.25, decode_ctx_token_s=0.125)
    n, k, m, a0 = 5, 4, 3, 17
    by_hand = sum(k * (0.5 + 0.25 * m + 0.125 * (a0 + m * k * i)) for i in range(n))
    assert c.decode(n, k, m, a0) == by_hand


def test_all_costs_by_hand():
    # One slot, B = 1 group of 1, prompt 3, k = 2, length 3: admission prefills 3 tokens (2 + 1 * 3 = 5 s);
    # dispatch 1 attends 3 tokens: 2 * (1 + 1 * 3) = 8; dispatch 2 attends 5: 2 * (1 + 5) = 12;
    # train on 6 tokens: 10 + 2 * 6 + 1 * 36 = 58; overhead 7. Step = 5 + 8 + 12 + 58 + 7 = 90.
    c = CostModel(decode_step_s=1.0, decode_ctx_token_s=1.0, prefill_call_s=2.0, prefill_token_s=1.0,
                  train_step_s=10.0, train_token_s=2.0, train_attn_s=1.0, step_overhead_s=7.0)
    w = Workload("on_policy", 1, 1, 1, 2, 10, prompt_len=3)
    (s,) = simulate(w, c, LengthModel(10, lengths=[3]), num_steps=1).steps
    assert (s.prefill_s, s.decode_s, s.train_s, s.overhead_s, s.step_s) == (5.0, 20.0, 58.0, 7.0, 90.0)
    assert s.dispatches == 2 and s.decode_steps == 4 and s.tokens_generated == 3


def test_rollverify_cuts_and_regenerates_by_hand():
    # As the partial case, with acceptance 0.4 and verification of finished members off. Step 1 is the
    # partial step 1 (4 s). Step 2: u3 holds 1 token, keeps floor(0.4 + 0.5) = 0 and regenerates 2 tokens
    # (its log-probs cost 10 s); the queued g2 (no tokens) is not verified. u3 and u4 start: t=2 u3 ends ->
    # g1 complete. 2 s of decode + 10 s of verification = 12 s.
    c = CostModel(decode_step_s=1.0, prefill_logp_token_s=10.0)
    w = workload("rollverify", batch_groups=1, verify_finished=False, switching=False)
    res = simulate(w, c, LengthModel(10, lengths=[4, 1, 2, 2]), AcceptanceModel(start=0.4), num_steps=2)
    s1, s2 = res.steps
    assert s1.step_s == 4.0 and s1.verified == 0
    assert (s2.verified, s2.verified_tokens, s2.kept_tokens, s2.regen_tokens) == (1, 1, 0, 1)
    assert s2.decode_s == 2.0 and s2.verify_s == 10.0 and s2.step_s == 12.0 and s2.acceptance == 0.0


def test_verified_finished_member_that_survives_is_not_decoded():
    # Step 1 ends with u1 (length 1) finished and waiting for u0 (paused at 4 of 9 tokens); at acceptance 1
    # both survive: u1 goes back to its group without a slot, u0 decodes its last 5 tokens alone.
    w = workload("rollverify", batch_groups=1, num_slots=2, switching=False)
    res = simulate(w, UNIT, LengthModel(10, lengths=[9, 1, 3, 3]), AcceptanceModel(start=1.0), num_steps=2)
    s2 = res.steps[1]
    assert s2.verified == 2 and s2.kept_tokens == s2.verified_tokens
    assert s2.batch_tokens == 10  # g0 = (9, 1)


def test_switching_after_a_full_window_below_threshold():
    # Acceptance per step 1, 1, 1, 0, 1, 0, 0, 0 (all-or-nothing rates are exact); window 2, threshold 0.5.
    # Step 1 has nothing cached (verifies nothing, not in the window). Window means: step 3 (1 + 1) / 2,
    # step 4 (1 + 0) / 2 = 0.5, step 5 (0 + 1) / 2, step 6 (1 + 0) / 2: never below 0.5; step 7 (0 + 0) / 2 = 0:
    # switch at step 7; step 8 runs on-policy (cache dropped, nothing verified).
    w = Workload("rollverify", batch_groups=2, group_size=4, num_slots=8, steps_per_dispatch=1,
                 max_new_tokens=1000, prompt_len=0, switch_window=2, switch_threshold=0.5)
    trace = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    res = simulate(w, UNIT, LengthModel(1000, lengths=[1000, 10, 10, 10]), AcceptanceModel(trace=trace), 8)
    assert res.steps[0].verified == 0 and math.isnan(res.steps[0].acceptance)
    assert [s.acceptance for s in res.steps[1:7]] == trace[1:7]
    assert res.switch_step == 7 and res.steps[6].switched
    assert [s.on_policy for s in res.steps] == [False] * 7 + [True]
    assert res.steps[7].verified == 0
    no_switch = simulate(dataclass_replace(w, switching=False), UNIT, LengthModel(1000, lengths=[1000, 10, 10, 10]),
                         AcceptanceModel(trace=trace), 8)
    assert no_switch.switch_step == -1 and not any(s.on_policy for s in no_switch.steps)


def test_fraction_cuts_round_half_up():
    a = AcceptanceModel(start=0.5)
    assert [a.keep(n, 1) for n in (1, 2, 3, 10)] == [1, 1, 2, 5]


def dataclass_replace(w, **kw):
    import dataclasses

    return dataclasses.replace(w, **kw)


def test_partial_beats_on_policy_on_a_long_tail():
    lengths = dict(median=50, sigma=1.0, seed=1)
    walls = {}
    for mode in ("on_policy", "partial"):
        w = Workload(mode, 8, 8, 32, 8, 1000, prompt_len=10)
        walls[mode] = simulate(w, UNIT, LengthModel(1000, **lengths), num_steps=10).wall_s
    assert walls["partial"] < walls["on_policy"]


def test_lognormal_fit_recovers_its_parameters():
    mu, sigma, n, cap = math.log(40.0), 0.5, 256, 200
    mean = cal.capped_lognormal_mean(mu, sigma, cap)
    median, s = cal.fit_lognormal(mean, cal.expected_max(mu, sigma, n, cap), n, cap)
    assert median == pytest.approx(40.0, rel=1e-3) and s == pytest.approx(0.5, abs=0.011)


def test_cost_model_rejects_negative_costs():
    with pytest.raises(ValueError, match="decode_step_s"):
        CostModel(decode_step_s=-1.0)


def _fake_run(path, mode, steps):
    path.mkdir()
    (path / "config.gin").write_text(f"RolloutConfig.mode = '{mode}'\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    return path


def test_fit_costs_recovers_exact_rates(tmp_path):
    # time/rollout = 0.2 s per dispatch + 1e-4 s per prefill token; time/train = 1 + 1e-3 s per token.
    recs = []
    for i, (disp, pf, tok) in enumerate([(20, 8000, 10000), (30, 7000, 12000), (25, 9000, 9000)], start=2):
        util = 0.5
        recs.append({"step": i, "mode/on_policy": 1, "rollout/tokens": disp * 8 * 64 * util,
                     "rollout/slot_utilization": util, "rollout/prefill_tokens": pf,
                     "time/rollout": 0.2 * disp + 1e-4 * pf, "time/verify": 0.0,
                     "train/loss_tokens": tok - 256 * 30, "time/train": 1.0 + 1e-3 * tok,
                     "time/step": 0.2 * disp + 1e-4 * pf + 1.0 + 1e-3 * tok + 0.5,
                     "response/length_mean": 40.0, "response/length_max": 120})
    run = cal.read_run(_fake_run(tmp_path / "r", "on_policy", [{"step": 1, **recs[0]}, *recs]))
    costs, _ = cal.fit_costs([run], 64, 8, 256, 30, skip=1)
    assert costs.decode_step_s * 8 == pytest.approx(0.2)
    assert costs.prefill_token_s == pytest.approx(1e-4)
    assert costs.train_step_s == pytest.approx(1.0) and costs.train_token_s == pytest.approx(1e-3)
    assert costs.step_overhead_s == pytest.approx(0.5)


@pytest.mark.parametrize("argv, message", [
    (["--gin_file=configs/does_not_exist.gin"], "does not exist"),
    ([], "--gin_file is required"),
    (["--gin_file=configs/tiny_rollverify.gin", "--steps=0"], "--steps=0"),
    (["--gin_file=configs/tiny_rollverify.gin", "--calibrate_from", "/nonexistent_run"], "metrics.jsonl"),
])
def test_cli_bad_input_is_one_message_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sim_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_predicts_every_mode(tmp_path, capsys):
    out = tmp_path / "sim.json"
    sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--steps=3", f"--json={out}",
                  "--gin_param=CostModel.decode_step_s=0.01", "--gin_param=SimConfig.length_median=30.0"])
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["modes"]] == ["on_policy", "partial", "rollverify"]
    assert all(r["steps"] == 3 and r["wall_s"] > 0 for r in report["modes"])
    assert "| on_policy | 3 |" in capsys.readouterr().out
