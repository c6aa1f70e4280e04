"""The simulator (rollverify_jax/sim, python -m rollverify_jax.simulate) against hand-computed cases."""

from __future__ import annotations

import json
import math

import gin
import numpy as np
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
    # Insert samples each admitted sequence's first token. Round 1: u0 (1 token), u1 ends at insert (its slot is
    # held through the round). Dispatch 1 (one only: a slot is free and u2 waits): u0 = 2. Round 2: u2 = 1;
    # dispatch 2: u0 = 3, u2 ends. Round 3: u3 = 1; dispatch 3: u0 and u3 end. 3 s; 5 decoded + 4 inserted.
    res = simulate(workload("on_policy"), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=1)
    (s,) = res.steps
    assert s.step_s == 3.0 and s.dispatches == 3 and s.decode_steps == 3 and s.batch_tokens == 9
    assert (s.tokens_generated, s.inserted_tokens, s.slot_steps) == (5, 4, 6)
    assert s.slot_utilization(2) == 5 / 6


def test_partial_two_slots_by_hand():
    # B = 1 group of 2, 2 slots, lengths cycle (4, 1, 2, 2): g0 = (u0: 4, u1: 1), g1 = (u2: 2, u3: 2), g2 = ...
    # Step 1 is the on-policy case's schedule (the queue is topped up with g1, then g2): 3 dispatches; at its
    # end g0 and g1 are complete, g0 is the batch and g2 (queued, never started) is paused.
    # Step 2: g1 is complete already: no rollout. Step 3: g2 (4, 1) with g3 (2, 2) as step 1: 3 s.
    res = simulate(workload("partial", batch_groups=1), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=3)
    assert [s.step_s for s in res.steps] == [3.0, 0.0, 3.0]
    assert [s.batch_tokens for s in res.steps] == [5, 4, 5]
    assert [s.tokens_generated for s in res.steps] == [5, 0, 5]
    assert [s.prefill_calls for s in res.steps] == [3, 0, 3]  # one per admission round (one length bucket)


def test_decode_closed_form_matches_the_per_dispatch_sum():
    c = CostModel(decode_step_s=0.5, decode_slot_s=0.25, decode_ctx_token_s=0.125)
    n, k, m, a0 = 5, 4, 3, 17
    by_hand = sum(k * (0.5 + 0.25 * m + 0.125 * (a0 + m * k * i)) for i in range(n))
    assert c.decode(n, k, m, a0) == by_hand


def test_all_costs_by_hand():
    # One slot, B = 1 group of 1, prompt 3, k = 2, length 3: the admission prefills 3 tokens in one call
    # (2 + 1 * 3 = 5 s) and insert samples token 1; one dispatch makes the other 2, attending 3 + 1 tokens:
    # 2 * (1 + 4) = 10; train on 6 tokens: 10 + 2 * 6 + 1 * 36 = 58; overhead 7. Step = 5 + 10 + 58 + 7 = 80.
    c = CostModel(decode_step_s=1.0, decode_ctx_token_s=1.0, prefill_call_s=2.0, prefill_token_s=1.0,
                  train_step_s=10.0, train_token_s=2.0, train_attn_s=1.0, step_overhead_s=7.0)
    w = Workload("on_policy", 1, 1, 1, 2, 10, prompt_len=3)
    (s,) = simulate(w, c, LengthModel(10, lengths=[3]), num_steps=1).steps
    assert (s.prefill_s, s.decode_s, s.train_s, s.overhead_s, s.step_s) == (5.0, 10.0, 58.0, 7.0, 80.0)
    assert (s.dispatches, s.decode_steps, s.tokens_generated, s.inserted_tokens) == (1, 2, 2, 1)


def test_rollverify_cuts_and_regenerates_by_hand():
    # Partial RollVerify, 2 slots, B = 1, k = 1, acceptance 0.4, finished members not verified; lengths cycle
    # (5, 1, 3, 3): g0 = (u0: 5, u1: 1), g1 = (u2: 3, u3: 3), g2 = (u4: 5, u5: 1).
    # Step 1: u0 = 1, u1 ends at insert; 1 dispatch (free slot): u0 = 2; u2 = 1; 2 dispatches: u0 = 4, u2 ends;
    # u3 = 1; 1 dispatch: u0 ends (g0 complete), u3 = 2. 4 s; u3 (2 tokens) and g2 (queued) are paused.
    # Step 2: u3 is verified: keeps floor(0.4 * 2 + 0.5) = 1 (its log-probs: 2 tokens x 10 s), insert makes it 2;
    # u4 (no tokens: nothing to verify) = 1. 1 dispatch: u3 ends, g1 complete. 1 + 20 = 21 s.
    c = CostModel(decode_step_s=1.0, prefill_logp_token_s=10.0)
    w = workload("rollverify", batch_groups=1, verify_finished=False, switching=False)
    res = simulate(w, c, LengthModel(10, lengths=[5, 1, 3, 3]), AcceptanceModel(start=0.4), num_steps=2)
    s1, s2 = res.steps
    assert s1.step_s == 4.0 and s1.verified == 0 and s1.batch_tokens == 6
    assert (s2.verified, s2.verified_tokens, s2.kept_tokens, s2.regen_tokens) == (1, 2, 1, 1)
    assert s2.decode_s == 1.0 and s2.verify_s == 20.0 and s2.step_s == 21.0 and s2.acceptance == 0.5
    assert s2.batch_tokens == 6


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


def test_decode_runs_over_the_live_slot_bucket():
    # 32 slots (buckets 8, 16, 32), k = 1, one group of 20: 19 sequences of 2 tokens and one of 6. After insert
    # each holds 1 token; dispatch 1 runs 20 sequences in the 32-slot bucket and ends 19; the last one's 4
    # remaining dispatches run in the 8-slot bucket: 1 * 32 + 4 * 8 = 64 slot-steps (160 without live slots).
    assert Workload("on_policy", 1, 1, 64, 1, 10, 0).slot_buckets == [8, 16, 32, 64]
    assert Workload("on_policy", 1, 1, 12, 1, 10, 0).slot_buckets == [12]
    c = CostModel(decode_slot_s=1.0)
    for live, slot_steps in ((True, 64), (False, 160)):
        w = Workload("on_policy", 1, 20, 32, 1, 10, prompt_len=0, live_slots=live)
        (s,) = simulate(w, c, LengthModel(10, lengths=[2] * 19 + [6]), num_steps=1).steps
        assert (s.dispatches, s.slot_steps, s.decode_s, s.tokens_generated) == (5, slot_steps, slot_steps, 24)


def test_decode_reads_the_live_page_table_width():
    # Table of 64 tokens in pages of 4: 16 pages, buckets 4, 8, 16 pages (16, 32, 64 tokens). One sequence of 20
    # tokens, prompt 3, k = 2: after insert it holds 1; a dispatch reserves prompt + tokens + k + 1 = tokens + 6
    # (at most 23) positions, so tokens 1, 3, 5, 7, 9 fit 4 pages (width 16) and tokens 11-19 need 5-6 (width
    # 32): 5 dispatches at 16 and 5 at 32, 2 * (5 * 16 + 5 * 32) = 480 width-slot-steps; the whole table: 1280.
    c = CostModel(decode_width_token_s=1.0)
    for live, cost in ((True, 480), (False, 1280)):
        w = Workload("on_policy", 1, 1, 1, 2, 20, prompt_len=3, max_seq_len=64, page_size=4, live_pages=live)
        assert w.page_buckets == ([4, 8, 16] if live else [16])
        (s,) = simulate(w, c, LengthModel(20, lengths=[20]), num_steps=1).steps
        assert (s.dispatches, s.width_slot_steps, s.decode_s) == (10, cost, cost)


def test_prefill_calls_per_length_bucket_and_padding():
    # Engine buckets: rows a power of two up to the slots, length a power of two from min_prefill_len = 4 up to
    # max_seq_len = 64. Partial, 2 slots, B = 1, k = 1, prompt 3, lengths (9, 1, 3, 3): step 1 ends with u0
    # paused at 6 tokens (as in the verified-finished case). Step 2's first round admits u0 (3 + 6 = 9 tokens:
    # bucket 16) and u4 (3: bucket 4): 2 calls of 1 row, 16 + 4 = 20 tokens computed for 12 real ones; then
    # u0 needs 2 more tokens: 2 dispatches, and g0 is complete.
    w = workload("partial", batch_groups=1, prompt_len=3, min_prefill_len=4, max_seq_len=64)
    assert w.prefill_shape(2, 3) == (2, 4) and w.prefill_shape(1, 40) == (1, 64)
    assert dataclass_replace(w, num_slots=8).prefill_shape(5, 3) == (8, 4)  # rows padded to a power of two
    c = CostModel(prefill_call_s=1.0, prefill_token_s=0.5, decode_step_s=1.0)
    s2 = simulate(w, c, LengthModel(10, lengths=[9, 1, 3, 3]), num_steps=2).steps[1]
    assert (s2.prefill_calls, s2.prefill_padded_tokens, s2.prefill_tokens) == (2, 20, 12)
    assert (s2.prefill_s, s2.decode_s, s2.batch_tokens) == (2 * 1.0 + 20 * 0.5, 2.0, 10)


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


def test_group_lengths_share_the_between_group_draw():
    alike = LengthModel(1000, median=50, sigma=0.8, group_share=1.0, seed=3)
    assert all(len(set(alike.draw(8))) == 1 for _ in range(5))  # all the spread between groups
    assert len(set(LengthModel(1000, median=50, sigma=0.8, seed=3).draw(8))) > 1


def test_group_lognormal_fit_recovers_its_parameters():
    # 2,000 batches of 8 groups x 8 from median 40, sigma 0.5, half the log-variance between groups.
    lm = LengthModel(200, median=40.0, sigma=0.5, group_share=0.5, seed=11)
    batches = np.asarray([[lm.draw(8) for _ in range(8)] for _ in range(2000)], float).reshape(2000, -1)
    median, sigma, share = cal.fit_group_lognormal(batches.mean(), batches.max(1).mean(),
                                                   batches.mean(1).std(ddof=1), 8, 8, 200)
    assert median == pytest.approx(40.0, rel=0.05) and sigma == pytest.approx(0.5, abs=0.05)
    assert share == pytest.approx(0.5, abs=0.1)


def test_cost_model_rejects_negative_costs():
    with pytest.raises(ValueError, match="decode_step_s"):
        CostModel(decode_step_s=-1.0)


def _fake_run(path, mode, steps, extra: str = ""):
    path.mkdir()
    (path / "config.gin").write_text(f"RolloutConfig.mode = '{mode}'\n{extra}")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    return path


def test_fit_costs_recovers_exact_rates(tmp_path):
    # Replay ratios: on-policy steps run 1.25 bucket slot-steps per decoded token, 0.5 prefill calls per dispatch
    # and 1.5 padded per real prefill token. Timers built from exact rates: 0.2 s per dispatch, 1e-4 s per
    # slot-step, 0.01 s per call, 1e-5 s per padded token, train 1 + 1e-3 s per token, 0.5 s of the rest.
    ratios = {"on_policy": cal.KindRatios(slot_steps_per_token=1.25, calls_per_dispatch=0.5, padded_per_token=1.5)}
    recs = []
    for i, (disp, pf, tok, dec) in enumerate([(20, 8000, 10000, 9000), (30, 7000, 12000, 11000),
                                             (25, 9000, 9000, 12500)], start=2):
        decode = 0.2 * disp + 1e-4 * 1.25 * dec
        prefill = 0.01 * 0.5 * disp + 1e-5 * 1.5 * pf
        train = 1.0 + 1e-3 * tok
        recs.append({"step": i, "mode/on_policy": 1, "rollout/tokens": dec, "rollout/dispatches": disp,
                     "rollout/slot_utilization": 0.5, "rollout/prefill_tokens": pf, "rollout/decode_time": decode,
                     "rollout/prefill_time": prefill, "time/rollout": decode + prefill, "time/verify": 0.0,
                     "train/loss_tokens": tok - 256 * 30, "time/train": train,
                     "time/step": decode + prefill + train + 0.5,
                     "response/length_mean": 40.0, "response/length_max": 120})
    run = cal.read_run(_fake_run(tmp_path / "r", "on_policy", [{**recs[0], "step": 1}, *recs]))
    costs, _ = cal.fit_costs([run], ratios, 8, 256, 30, skip=1)
    assert costs.decode_step_s * 8 == pytest.approx(0.2) and costs.decode_slot_s == pytest.approx(1e-4)
    assert costs.prefill_call_s == pytest.approx(0.01) and costs.prefill_token_s == pytest.approx(1e-5)
    assert costs.train_step_s == pytest.approx(1.0) and costs.train_token_s == pytest.approx(1e-3)
    assert costs.step_overhead_s == pytest.approx(0.5)


def test_fit_without_on_policy_steps_prices_decode_per_slot_step(tmp_path):
    # Partial steps: every dispatch runs the full bucket (1.1 slot-steps per decoded token here); 0.1 s per
    # dispatch + 1e-4 s per slot-step cannot be told apart from a per-slot rate, which takes it all.
    ratios = {"partial": cal.KindRatios(slot_steps_per_token=1.1)}
    recs = [{"step": i, "mode/on_policy": 0, "rollout/dispatches": d, "rollout/tokens": 512 * d / 1.1,
             "rollout/decode_time": 1e-4 * 512 * d, "rollout/prefill_time": 0.0, "rollout/prefill_tokens": 0,
             "time/verify": 0.0, "time/train": 1.0, "train/loss_tokens": 100, "time/step": 1.0 + 1e-4 * 512 * d}
            for i, d in ((1, 10), (2, 10), (3, 14))]
    costs, _ = cal.fit_costs([cal.read_run(_fake_run(tmp_path / "p", "partial", recs))], ratios, 8, 256, 30, 1)
    assert costs.decode_step_s == 0.0 and costs.decode_slot_s == pytest.approx(1e-4)


def test_nonneg_lstsq_drops_a_column_that_would_be_negative():
    # y = 2 x0 exactly; x1 anti-correlated noise would get a negative weight unconstrained.
    x = np.asarray([[1.0, 0.0], [2.0, 1.0], [3.0, 0.0]])
    assert cal.nonneg_lstsq(x, np.asarray([2.0, 3.9, 6.0])) == pytest.approx([1.98571, 0.0], abs=1e-4)


def test_fit_refuses_runs_without_the_scheduler_timers(tmp_path):
    recs = [{"step": i, "mode/on_policy": 1, "time/step": 1.0} for i in (1, 2, 3)]
    run = cal.read_run(_fake_run(tmp_path / "old", "on_policy", recs))
    with pytest.raises(ValueError, match="rollout/decode_time"):
        cal.fit_costs([run], {}, 8, 256, 30, skip=0)


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


def test_cli_refuses_a_run_of_another_shape(tmp_path, capsys):
    run = _fake_run(tmp_path / "b8", "on_policy", [{"step": 1, "time/step": 1.0}], "RolloutConfig.batch_groups = 8\n")
    with pytest.raises(SystemExit) as e:
        sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--calibrate_from", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "RolloutConfig.batch_groups = 8" in err and "config.gin" in err


def test_cli_predicts_every_mode(tmp_path, capsys):
    out = tmp_path / "sim.json"
    sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--steps=3", f"--json={out}",
                  "--gin_param=CostModel.decode_step_s=0.01", "--gin_param=SimConfig.length_median=30.0"])
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["modes"]] == ["on_policy", "partial", "rollverify"]
    assert all(r["steps"] == 3 and r["wall_s"] > 0 for r in report["modes"])
    assert "| on_policy | 3 |" in capsys.readouterr().out


def test_width_jump_matches_the_dispatch_by_dispatch_scan():
    # The replay jumps to where the live page-table width changes in closed form; it must equal the first d >= 1
    # at which live_width(tokens + d * k) differs (tiny table of 16 pages of 4, and a cap below the table).
    for cap, seq in ((20, 64), (61, 64), (100, 64)):
        w = Workload("on_policy", 1, 1, 1, 3, cap, prompt_len=3, max_seq_len=seq, page_size=4)
        for tokens in range(cap):
            scan = next((d for d in range(1, 200) if w.live_width(tokens + 3 * d) != w.live_width(tokens)), None)
            assert w.widens_after(tokens) == scan, (cap, tokens)
