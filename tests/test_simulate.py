"""The simulator (rollverify_jax/sim, python -m rollverify_jax.simulate) against hand-computed cases."""

from __future__ import annotations

import dataclasses
import json
import math

import gin
import numpy as np
import pytest

from rollverify_jax import simulate as sim_cli
from rollverify_jax.sim import CostModel, CutModel, LengthModel, RooflineCosts, TrainLayout, Workload, simulate
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
    # Admission samples nothing: every token is decoded, the first included. Round 1: u0, u1; dispatch 1: u0 = 1,
    # u1 ends. Round 2: u2; 2 dispatches: u0 = 3, u2 ends. Round 3: u3; dispatch 4: u0 ends, u3 = 1. Dispatch 5:
    # u3 ends (a free slot idles). 5 s; 9 decoded over 10 slot-steps.
    res = simulate(workload("on_policy"), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=1)
    (s,) = res.steps
    assert s.step_s == 5.0 and s.dispatches == 5 and s.decode_steps == 5 and s.batch_tokens == 9
    assert (s.tokens_generated, s.prefill_sequences, s.slot_steps) == (9, 4, 10)
    assert s.slot_utilization(2) == 9 / 10


def test_partial_two_slots_by_hand():
    # B = 1 group of 2, 2 slots, lengths cycle (4, 1, 2, 2): g0 = (u0: 4, u1: 1), g1 = (u2: 2, u3: 2), g2 = (u4: 4,
    # u5: 1), g3 = (u6: 2, u7: 2). Step 1 is the on-policy case's first 4 dispatches (the queue topped up with g1,
    # then g2): g0 completes with u3 at 1 token; u3, then g2 (queued) are paused. Step 2 resumes u3 and u4:
    # 1 dispatch ends u3 (g1 complete), u4 = 1. Step 3 resumes u4 and u5: 1 dispatch ends u5, u4 = 2; then u6
    # (g3 topped up): 2 dispatches end u4 (g2 complete) and u6.
    res = simulate(workload("partial", batch_groups=1), UNIT, LengthModel(10, lengths=[4, 1, 2, 2]), num_steps=3)
    assert [s.step_s for s in res.steps] == [4.0, 1.0, 3.0]
    assert [s.batch_tokens for s in res.steps] == [5, 4, 5]
    assert [s.tokens_generated for s in res.steps] == [8, 2, 6]
    # two engine calls per admission round (one width bucket): the prefill and the activation
    assert [s.prefill_calls for s in res.steps] == [6, 2, 4]


def test_decode_closed_form_matches_the_per_dispatch_sum():
    c = CostModel(decode_step_s=0.5, decode_slot_s=0.25, decode_ctx_token_s=0.125)
    n, k, m, a0 = 5, 4, 3, 17
    by_hand = sum(k * (0.5 + 0.25 * m + 0.125 * (a0 + m * k * i)) for i in range(n))
    assert c.decode(n, k, m, a0) == by_hand


def test_all_costs_by_hand():
    # One slot, B = 1 group of 1, prompt 3, k = 2, length 3: the admission prefills the prompt but its last token
    # (2 tokens) and activates the slot: two calls, 2 * 2 + 1 * 2 = 6 s. Two dispatches sample the 3 tokens (the
    # second stops after 1), attending 3 + 0 and 3 + 2 tokens at their starts: 2 * (2 * 1 + 3 + 5) = 20; train on 6
    # tokens: 10 + 2 * 6 + 1 * 36 = 58; overhead 7. Step = 6 + 20 + 58 + 7 = 91.
    c = CostModel(decode_step_s=1.0, decode_ctx_token_s=1.0, prefill_call_s=2.0, prefill_token_s=1.0,
                  train_step_s=10.0, train_token_s=2.0, train_attn_s=1.0, step_overhead_s=7.0)
    w = Workload("on_policy", 1, 1, 1, 2, 10, prompt_len=3)
    (s,) = simulate(w, c, LengthModel(10, lengths=[3]), num_steps=1).steps
    assert (s.prefill_s, s.decode_s, s.train_s, s.overhead_s, s.step_s) == (6.0, 20.0, 58.0, 7.0, 91.0)
    assert (s.dispatches, s.decode_steps, s.tokens_generated, s.prefill_sequences) == (2, 4, 3, 1)
    assert (s.prefill_calls, s.prefill_tokens) == (2, 2)


def test_rollverify_restart_redraws_by_hand():
    # Partial RollVerify, 2 slots, B = 1, k = 1, prompt 1, every segment of age 1 fails; lengths cycle (5, 1, 3,
    # 3): g0 = (u0: 5, u1: 1), g1 = (u2: 3, u3: 3), g2 = (u4: 5, u5: 1).
    # Step 1: u0, u1; 1 dispatch: u0 = 1, u1 ends; u2; 3 dispatches: u0 = 4, u2 ends; u3; 1 dispatch: u0 ends
    # (g0 complete), u3 = 1. 5 s; u3 (1 token, one segment of step 1) and g2 (queued) are paused.
    # Step 2: u3's segment (age 1) fails: keep = 0, a restart from the prompt (its log-prob prefill: prompt +
    # 1 token but the last, 1 row of 1 x 10 s), which draws a fresh length: the first value of the redraw cycle,
    # 5. u3 and u4 then decode 5 each: 5 dispatches, g1 complete with u2 (3) + u3 (5). 5 + 10 = 15 s; acceptance
    # 0 / 1.
    c = CostModel(decode_step_s=1.0, prefill_logp_token_s=10.0)
    w = workload("rollverify", batch_groups=1, switching=False, prompt_len=1)
    res = simulate(w, c, LengthModel(10, lengths=[5, 1, 3, 3]), CutModel(fail_prob=(1.0,)), num_steps=2)
    s1, s2 = res.steps
    assert s1.step_s == 5.0 and s1.verified == 0 and s1.batch_tokens == 6
    assert (s2.verified, s2.verified_tokens, s2.kept_tokens, s2.removed_tokens) == (1, 1, 0, 1)
    assert (s2.num_cut, s2.num_restarted, dict(s2.segments_checked), dict(s2.segments_failed)) == (1, 1, {1: 1}, {1: 1})
    assert s2.decode_s == 5.0 and s2.verify_s == 10.0 and s2.step_s == 15.0 and s2.acceptance == 0.0
    assert s2.batch_tokens == 8


def test_segment_of_age_one_always_failing_cuts_exactly_there():
    # B = 1, 2 slots, k = 1, lengths cycle (9, 1, 30, 1). Step 1 ends with u2 paused at 8 tokens (one segment,
    # step 1); step 2 (nothing fails) verifies it whole and u2 decodes 11 more (a second segment, step 2). At
    # step 3 its segments have ages 2 and 1; p(1) = 1, p(2) = 0: the cut falls at the age-1 segment's first token,
    # keep = 8, and u2 regenerates to a fresh length (next redraw value 9, at least keep + 1): one dispatch
    # finishes it. A response passes whole unless a segment fails: at p = 0 nothing is cut.
    w = workload("rollverify", batch_groups=1, max_new_tokens=40, switching=False)
    res = simulate(w, UNIT, LengthModel(40, lengths=[9, 1, 30, 1]), CutModel(trace=[(0.0,), (0.0,), (1.0, 0.0)]), 3)
    s2, s3 = res.steps[1:]
    assert (s2.verified, s2.verified_tokens, s2.kept_tokens, dict(s2.segments_checked)) == (1, 8, 8, {1: 1})
    assert (s3.verified, s3.verified_tokens, s3.kept_tokens, s3.removed_tokens) == (1, 19, 8, 11)
    assert dict(s3.segments_checked) == {2: 1, 1: 1} and dict(s3.segments_failed) == {1: 1}
    assert s3.verify_metrics()["verify/keep_fraction/1"] == 8 / 19 and s3.num_restarted == 0
    assert s3.batch_tokens == 9 + 1
    never = simulate(w, UNIT, LengthModel(40, lengths=[9, 1, 30, 1]), CutModel(fail_prob=(0.0,)), 3)
    assert all(s.kept_tokens == s.verified_tokens and s.num_cut == 0 for s in never.steps)
    assert sum(s.verified for s in never.steps) > 0


def test_cut_model_segments_ages_and_ramp():
    cut = CutModel(fail_prob=(1.0, 0.0))  # age 1 always fails, age 2 and older never
    assert cut.verify([[1, 3], [2, 4]], 3) == (3, [2, 1], 1)  # ages 2, 1: cut at the second segment's start
    assert cut.verify([[1, 3], [2, 4]], 4) == (7, [3, 2], None)  # ages 3, 2 (the last value repeats): whole
    assert cut.verify([[3, 5]], 4) == (0, [1], 1)  # a restart
    assert CutModel().verify([[1, 3], [2, 4]], 3) == (7, [2, 1], None)
    ramp = CutModel(fail_prob=(0.1,), ramp_start=100, ramp_doubling=10.0)
    assert ramp.prob(1, 100) == 0.1 and ramp.scale(110) == 2.0
    assert ramp.prob(1, 120) == pytest.approx(1 - 0.9 ** 4)  # the log-survival doubles every 10 steps
    with pytest.raises(ValueError, match="ages start at 1"):
        cut.verify([[3, 2]], 3)


def test_redraw_is_a_fresh_length_conditioned_on_the_kept_prefix():
    # A restart (keep = 0) draws from the member distribution; a cut at keep draws L | L > keep: every redraw
    # exceeds keep, and its distribution is the lognormal's tail (median of L | L > 2,500 for median 2,500 is
    # the 75th percentile of the lognormal: 2,500 * e^(0.674 sigma)).
    lm = LengthModel(100_000, median=2500.0, sigma=1.0, seed=5)
    fresh = [lm.redraw(math.log(2500.0), 0) for _ in range(4000)]
    assert np.median(fresh) == pytest.approx(2500, rel=0.06)
    tail = [lm.redraw(math.log(2500.0), 2500) for _ in range(4000)]
    assert min(tail) > 2500 and np.median(tail) == pytest.approx(2500 * math.exp(0.6745), rel=0.06)
    assert LengthModel(10, lengths=[3, 7]).redraw(0.0, 5) == 6  # explicit: next value, at least keep + 1


def test_verified_finished_member_that_survives_is_not_decoded():
    # Step 1 ends with g1 = (3, 3) complete and u1 (length 1) finished, waiting for u0 (paused at 7 of 9
    # tokens); with verify_finished and nothing failing both survive: u1 goes back to its group without decoding,
    # u0 decodes its last 2 tokens. The acceptance counts the paused trajectory only (u0), as the rollout phase
    # does.
    w = workload("rollverify", batch_groups=1, num_slots=2, switching=False, verify_finished=True)
    res = simulate(w, UNIT, LengthModel(10, lengths=[9, 1, 3, 3]), CutModel(), num_steps=2)
    s2 = res.steps[1]
    assert (s2.verified, s2.finished_verified, s2.verified_tokens) == (1, 1, 7) and s2.kept_tokens == 7
    assert s2.batch_tokens == 10  # g0 = (9, 1)
    default = simulate(dataclass_replace(w, verify_finished=False), UNIT, LengthModel(10, lengths=[9, 1, 3, 3]),
                       CutModel(), num_steps=2).steps[1]
    assert (default.verified, default.finished_verified) == (1, 0)  # paused trajectories only, by default
    assert Workload("rollverify", 1, 1, 1, 1, 1, 0).verify_finished is False


def test_switching_after_a_full_window_below_threshold():
    # Per step every segment fails (p = 1: acceptance 0) or none does (p = 0: acceptance 1): the trace gives
    # acceptance 1, 1, 1, 0, 1, 0, 0, 0 where a step verifies something; window 2, threshold 0.5. A restarted
    # member redraws 1000, so long members stay cached. Step 1 has nothing cached; step 4's restarts make
    # enough groups complete at its end that step 5 trains carried groups without admitting anything (it
    # verifies nothing and stays out of the window). Windows: step 3 (1 + 1) / 2, step 4 (1 + 0) / 2 = 0.5 (not
    # below), step 6 (0 + 0) / 2 = 0: switch at step 6 (had step 5 entered as 1.0, the mean would be 0.5: no
    # switch); steps 7-8 run on-policy (cache dropped, nothing verified).
    w = Workload("rollverify", batch_groups=2, group_size=4, num_slots=8, steps_per_dispatch=1,
                 max_new_tokens=1000, prompt_len=0, switch_window=2, switch_threshold=0.5)
    trace = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    cut = [(1.0 - a,) for a in trace]

    def lengths():
        return LengthModel(1000, lengths=[1000, 10, 10, 10], redraw_lengths=[1000])

    res = simulate(w, UNIT, lengths(), CutModel(trace=cut), 8)
    assert [s.verified > 0 for s in res.steps] == [False, True, True, True, False, True, False, False]
    assert [s.acceptance for s in res.steps[1:4]] == trace[1:4] and res.steps[5].acceptance == 0.0
    assert res.switch_step == 6 and res.steps[5].switched
    assert [s.on_policy for s in res.steps] == [False] * 6 + [True] * 2
    no_switch = simulate(dataclass_replace(w, switching=False), UNIT, lengths(), CutModel(trace=cut), 8)
    assert no_switch.switch_step == -1 and not any(s.on_policy for s in no_switch.steps)


def test_decode_runs_over_the_live_slot_bucket():
    # 32 slots (buckets 8, 16, 32), k = 1, one group of 20: 19 sequences of 2 tokens and one of 6. Dispatches 1-2
    # run 20 sequences in the 32-slot bucket and end 19; the last one's 4 remaining dispatches run in the 8-slot
    # bucket: 2 * 32 + 4 * 8 = 96 slot-steps (192 without live slots).
    assert Workload("on_policy", 1, 1, 64, 1, 10, 0).slot_buckets == [8, 16, 32, 64]
    assert Workload("on_policy", 1, 1, 12, 1, 10, 0).slot_buckets == [12]
    c = CostModel(decode_slot_s=1.0)
    for live, slot_steps in ((True, 96), (False, 192)):
        w = Workload("on_policy", 1, 20, 32, 1, 10, prompt_len=0, live_slots=live)
        (s,) = simulate(w, c, LengthModel(10, lengths=[2] * 19 + [6]), num_steps=1).steps
        assert (s.dispatches, s.slot_steps, s.decode_s, s.tokens_generated) == (6, slot_steps, slot_steps, 44)


def test_decode_reads_the_live_page_table_width():
    # Table of 64 tokens in pages of 4: 16 pages, buckets 4, 8, 16 pages (16, 32, 64 tokens). One sequence of 20
    # tokens, prompt 3, k = 2: a dispatch reserves prompt + tokens + k + 1 = tokens + 6 (at most 23) positions, so
    # the dispatches at tokens 0, 2, ..., 10 fit 4 pages (width 16) and those at 12-18 need 5-6 (width 32):
    # 6 dispatches at 16 and 4 at 32, 2 * (6 * 16 + 4 * 32) = 448 width-slot-steps; the whole table: 1280.
    c = CostModel(decode_width_token_s=1.0)
    for live, cost in ((True, 448), (False, 1280)):
        w = Workload("on_policy", 1, 1, 1, 2, 20, prompt_len=3, max_seq_len=64, page_size=4, live_pages=live)
        assert w.page_buckets == ([4, 8, 16] if live else [16])
        (s,) = simulate(w, c, LengthModel(20, lengths=[20]), num_steps=1).steps
        assert (s.dispatches, s.width_slot_steps, s.decode_s) == (10, cost, cost)


def test_prefill_calls_per_width_bucket_and_packing():
    # Engine buckets (Engine.pack): a sequence's last token is its slot's pending token, so a call prefills the
    # others; its width is the smallest of the ladder min_prefill_len = 4, 8, ..., max_seq_len = 64 (bucket_ratio
    # 2) holding its longest sequence's, its sequences are packed end to end into rows of that width (first-fit
    # decreasing), and the rows rounded up to the row ladder 1, 2, 4, ... up to the slots.
    # Partial, 2 slots, B = 1, k = 1, prompt 3, lengths (9, 1, 3, 3): step 1 ends with u0 paused at 7 tokens (as in
    # the verified-finished case). Step 2's first round admits u0 (3 + 7 = 10 tokens, 9 prefilled: width 16) and
    # u4 (3, 2 prefilled: width 4): 2 prefills of 1 row, each followed by an activation (neither verifies): 4
    # calls, 16 + 4 = 20 tokens computed for 11 real ones, and causal attention over 16^2 + 4^2 = 272 (rows x
    # width^2, the halving is in the rate); then u0 needs 2 more tokens: 2 dispatches, and g0 is complete.
    w = workload("partial", batch_groups=1, prompt_len=3, min_prefill_len=4, max_seq_len=64)
    assert w.prefill_widths == [4, 8, 16, 32, 64] and w.prefill_rows(4) == [1, 2]
    assert w.prefill_bucket(5) == 4 and w.prefill_bucket(6) == 8  # 4 and 5 tokens prefilled
    assert w.prefill_shape([3, 3]) == (1, 4) and w.prefill_shape([5, 5]) == (2, 4)  # 2 + 2 share a row; 4 + 4 not
    assert w.prefill_shape([40]) == (1, 64) and w.prefill_shape([10, 4, 3, 2]) == (1, 16)  # 9 + 3 + 2 + 1
    wide = dataclass_replace(w, num_slots=16)
    assert wide.prefill_shape([5] * 9) == (16, 4)  # 9 rows: the row bucket 16
    assert dataclass_replace(w, bucket_ratio=3).prefill_widths == [4, 12, 36, 64]
    # a token budget of 128 holds 2 rows of 64: three long resumes are two calls (first-fit rows, in order)
    budget = dataclass_replace(w, num_slots=4, prefill_token_budget=128)
    assert budget.prefill_rows(64) == [1, 2] and budget.prefill_rows(16) == [1, 2, 4]
    assert budget.split_for_prefill([40, 50, 45]) == [[1, 2], [0]] and budget.split_for_prefill([9, 9]) == [[0, 1]]
    with pytest.raises(ValueError, match="split_for_prefill"):
        budget.prefill_shape([40, 50, 45])
    with pytest.raises(ValueError, match="prefill_token_budget"):
        dataclass_replace(w, prefill_token_budget=32)
    c = CostModel(prefill_call_s=1.0, prefill_token_s=0.5, prefill_attn_s=0.01, decode_step_s=1.0)
    s2 = simulate(w, c, LengthModel(10, lengths=[9, 1, 3, 3]), num_steps=2).steps[1]
    assert (s2.prefill_calls, s2.prefill_padded_tokens, s2.prefill_tokens, s2.logp_tokens) == (4, 20, 11, 0)
    assert s2.prefill_s == pytest.approx(4 * 1.0 + 20 * 0.5 + 272 * 0.01) and s2.prefill_attn_s == pytest.approx(2.72)
    assert (s2.decode_s, s2.batch_tokens, s2.prefill_sequences) == (2.0, 10, 2)


def test_a_prefill_token_budget_splits_a_round_into_calls():
    # On-policy, 4 slots, one group of 4, prompt 40, lengths 1, min_prefill_len 16, max_seq_len 64: the four
    # prompts (39 tokens prefilled each, width 64) are one call with the group's prompt computed once. Under a
    # budget of 128 tokens (2 rows of 64) the round is two calls (members 0-1, then 2-3), each computing the
    # prompt once and activating its members: 4 calls, 2 x 39 computed and 2 x 39 copied, 2 x 64 padded.
    base = Workload("on_policy", 1, 4, 4, 1, 10, prompt_len=40, min_prefill_len=16, max_seq_len=64)
    c = CostModel(prefill_call_s=1.0)
    (one,) = simulate(base, c, LengthModel(10, lengths=[1]), num_steps=1).steps
    assert (one.prefill_calls, one.prefill_tokens, one.shared_prompt_tokens, one.prefill_padded_tokens) == (
        2, 39, 3 * 39, 64)
    (two,) = simulate(dataclass_replace(base, prefill_token_budget=128), c, LengthModel(10, lengths=[1]), 1).steps
    assert (two.prefill_calls, two.prefill_tokens, two.shared_prompt_tokens, two.prefill_padded_tokens) == (
        4, 2 * 39, 2 * 39, 2 * 64)
    assert two.prefill_s == 4.0 and two.dispatches == one.dispatches == 1


def test_a_verified_resume_is_a_log_prob_prefill_and_an_activation():
    # The partial case above under RollVerify (nothing fails): step 2's u0 has 7 cached tokens to verify, so its
    # bucket (16) is a log-prob prefill call and then an activation, the log-prob projection over its 1 x 16
    # positions; u4 (new, bucket 4) is a prefill and an activation: 4 calls. With min_prefill_len 16 both are
    # in one bucket, one 16-wide row (9 + 2), and the whole call verifies: 2 calls, 16 log-prob positions.
    # Naive partial puts the same two in one call: 2 calls. Step 1's first round admitted g0's two new members in
    # one call: its prompt computed once (2 tokens: the last is pending), the other's 2 copied.
    w = workload("rollverify", batch_groups=1, prompt_len=3, min_prefill_len=4, max_seq_len=64, switching=False)
    c = CostModel(prefill_call_s=1.0, prefill_token_s=0.5, prefill_logp_token_s=0.25, verify_token_s=2.0)
    s1, s2 = simulate(w, c, LengthModel(10, lengths=[9, 1, 3, 3]), CutModel(), num_steps=2).steps
    assert (s2.verified, s2.verified_tokens, s2.prefill_calls, s2.prefill_padded_tokens) == (1, 7, 4, 20)
    assert (s2.logp_tokens, s2.prefill_tokens, s2.shared_prompt_tokens) == (16, 11, 0)
    assert s2.verify_s == pytest.approx(16 * 0.25 + 7 * 2.0) and s2.prefill_s == pytest.approx(4 * 1.0 + 20 * 0.5)
    assert (s1.prefill_tokens, s1.shared_prompt_tokens) == (2 + 2 + 2, 2)  # round 1: u0 (u1 shares); u2; u3
    one = dataclass_replace(w, min_prefill_len=16)
    s2 = simulate(one, c, LengthModel(10, lengths=[9, 1, 3, 3]), CutModel(), num_steps=2).steps[1]
    assert (s2.prefill_calls, s2.prefill_padded_tokens, s2.logp_tokens, s2.prefill_tokens) == (2, 16, 16, 11)
    naive = simulate(dataclass_replace(one, mode="partial"), c, LengthModel(10, lengths=[9, 1, 3, 3]),
                     num_steps=2).steps[1]
    assert (naive.prefill_calls, naive.prefill_padded_tokens, naive.logp_tokens, naive.verify_s) == (2, 16, 0, 0.0)


def test_a_groups_new_members_admitted_together_share_their_prompt():
    # On-policy, B = 2 groups of 3, prompt 3, every length 2, min_prefill_len 8. With 6 slots one round admits
    # all six: each group's prompt (but its last token) is computed once, packed into one 8-wide row (2 + 2); 8
    # prompt tokens copied; one prefill and one activation. With 4 slots round 1 admits g0 and u3 (g1): 2 prompts
    # computed, 2 copied; all four end after two dispatches; round 2 admits u4 and u5 (g1 again, together): 1
    # computed, 1 copied; u3 shared nothing with them (another round). The prompt length the calibration reads
    # is the computed + copied tokens per sequence, plus the last token (pending, not prefilled).
    c = CostModel(prefill_call_s=1.0, prefill_token_s=0.5, prefill_attn_s=0.01)
    (s,) = simulate(Workload("on_policy", 2, 3, 6, 1, 10, prompt_len=3, min_prefill_len=8, max_seq_len=64), c,
                    LengthModel(10, lengths=[2]), num_steps=1).steps
    assert (s.prefill_calls, s.prefill_padded_tokens, s.prefill_tokens, s.shared_prompt_tokens) == (2, 8, 4, 8)
    assert s.prefill_s == pytest.approx(2 * 1.0 + 8 * 0.5 + 64 * 0.01)
    (s,) = simulate(Workload("on_policy", 2, 3, 4, 1, 10, prompt_len=3, min_prefill_len=8, max_seq_len=64), c,
                    LengthModel(10, lengths=[2]), num_steps=1).steps
    assert (s.prefill_calls, s.prefill_padded_tokens, s.prefill_tokens, s.shared_prompt_tokens) == (4, 16, 6, 6)
    assert (s.prefill_tokens + s.shared_prompt_tokens) / 6 + 1 == 3


def test_a_bucket_that_verifies_shares_no_prompt():
    # The engine shares a group's prompt only in a call that verifies nothing (Engine.admit): a verified resume
    # in the same bucket as two new members of one group makes the call a log-prob prefill over all three
    # (packed: 8 + 2 + 2 in one 16-wide row) and an activation: nothing copied, 12 tokens computed.
    from rollverify_jax.sim.replay import Replay, StepRecord, _Call

    w = Workload("rollverify", 1, 2, 4, 1, 10, prompt_len=3, min_prefill_len=16, max_seq_len=64)
    c = CostModel(prefill_call_s=1.0, prefill_token_s=0.5, prefill_logp_token_s=0.25, verify_token_s=2.0)
    replay = Replay(w, c, LengthModel(10, lengths=[5]), CutModel())
    rec = StepRecord(step=2, on_policy=False)
    replay._charge_prefill(rec, [_Call([9, 3, 3], [-1, 7, 7], [True, False, False], [True] * 3)], 6)
    counts = (rec.prefill_calls, rec.prefill_padded_tokens, rec.prefill_tokens, rec.shared_prompt_tokens)
    assert counts == (2, 16, 12, 0)
    assert rec.logp_tokens == 16 and rec.verify_s == pytest.approx(16 * 0.25 + 6 * 2.0)
    rec = StepRecord(step=2, on_policy=False)
    replay._charge_prefill(rec, [_Call([4, 3, 3], [-1, 7, 7], [False] * 3, [True] * 3)], 0)  # a naive resume
    counts = (rec.prefill_calls, rec.prefill_padded_tokens, rec.prefill_tokens, rec.shared_prompt_tokens)
    assert counts == (2, 16, 5, 2)  # one prefill (3 + 2, one copy) and one activation
    assert rec.logp_tokens == 0 and rec.verify_s == 0.0
    # a verified finished member that survives is prefilled but not activated: alone, its call is one prefill
    rec = StepRecord(step=2, on_policy=False)
    replay._charge_prefill(rec, [_Call([9], [-1], [True], [False])], 6)
    assert (rec.prefill_calls, rec.prefill_sequences, rec.logp_tokens) == (1, 1, 16)


def test_roofline_prefill_attention_is_causal_and_quadratic():
    # Attention FLOPs per token per context token a; a prefilled row of T tokens costs a T^2 / 2 (causal), so
    # doubling the row quadruples the term while the matmul term only doubles.
    r = RooflineCosts(num_devices=2, peak_flops=1e12, mfu=0.5, prefill_flops_per_token=1e9,
                      attn_flops_per_token_ctx=1e6).cost_model()
    assert r.prefill_attn_s == pytest.approx(1e6 / 2 / (2 * 1e12 * 0.5))
    one, two = r.prefill(1024, 0, 1, 1024 ** 2), r.prefill(2048, 0, 1, 2048 ** 2)
    attn = r.prefill_attn_s * 1024 ** 2
    assert two - 2 * one == pytest.approx(2 * attn)  # 4 attn - 2 attn


def test_train_cost_is_the_packed_positions_by_hand():
    # B = 2 groups of 4, rows in batch order g0 = (16, 10, 16, 6), g1 = (3, 5, 2, 5); 2 minibatches (strided:
    # rows 0, 2, 4, 6 and 1, 3, 5, 7), 2 rows per micro-batch, rows of 16, tail rows of 4.
    # Minibatch 0 = (16, 16, 3, 2): first fit [16] [16] [3, 2] is 2 micro-batches (64 positions); one micro-batch
    # of [16] [16] and a tail one of [3] [2] (2 x 16 + 2 x 4 = 40) computes fewer: taken. Minibatch 1 = (10, 6, 5,
    # 5): [10, 6] [5, 5], one micro-batch (32; 10 fits no tail row). Rows: 4 of 16, 2 of 4: 72 positions.
    layout = TrainLayout(width=16, num_minibatches=2, micro_batch_size=2, tail_row_width=4)
    lengths = [16, 10, 16, 6, 3, 5, 2, 5]
    assert layout.rows(lengths) == ((16, 4), (4, 2))
    c = CostModel(train_step_s=1.0, train_position_s=2.0, train_row_attn_s=0.5)
    by_hand = 1.0 + 2.0 * (4 * 16 + 2 * 4) + 0.5 * (4 * 16 ** 2 + 2 * 4 ** 2)  # 673
    assert c.train(lengths, layout.rows(lengths)) == by_hand
    # the replay charges the step so, with its batch in group order (k = 1, one slot per member)
    w = Workload("on_policy", 2, 4, 8, 1, 16, prompt_len=0, train_layout=layout)
    (s,) = simulate(w, c, LengthModel(16, lengths=lengths), num_steps=1).steps
    assert (s.train_s, s.train_positions, s.train_tokens) == (by_hand, 72, 63)
    # without tail rows minibatch 0 runs its 2 micro-batches of full rows; epochs repeat the rows
    assert dataclasses.replace(layout, tail_row_width=None).rows(lengths) == ((16, 6),)
    assert dataclasses.replace(layout, ppo_epochs=2).rows(lengths) == ((16, 8), (4, 4))
    # unpacked: every sequence a padded row of the batch's power-of-two bucket (at least 64)
    assert dataclasses.replace(layout, tail_row_width=None, pack_sequences=False).rows(lengths) == ((64, 8),)
    # the roofline prices a position at 3 passes of model FLOPs at train_mfu, attention over its row's width
    r = RooflineCosts(num_devices=2, peak_flops=1e12, mfu=0.4, train_mfu=0.5, train_flops_per_token=1e9,
                      attn_flops_per_token_ctx=1e6).cost_model()
    assert r.train_position_s == pytest.approx(3 * 1e9 / (2 * 1e12 * 0.5))
    assert r.train_row_attn_s == pytest.approx(3 * 1e6 / 2 / (2 * 1e12 * 0.5))
    assert r.train_token_s == r.train_attn_s == 0.0


def test_train_cost_without_padding_is_the_per_token_cost():
    # Where packing wastes nothing (every sequence fills a row, every micro-batch is full) the packed rows are the
    # sequences, and the position terms give the per-token formula the roofline charged before the layout:
    # passes * (F * sum L + a / 2 * sum L^2) / (chips * peak * mfu). Without a layout it is that for any lengths.
    roof = RooflineCosts(num_devices=2, peak_flops=1e12, mfu=0.4, train_mfu=0.4, train_passes=4.0,
                         train_attn_passes=4.0, train_flops_per_token=1e9, attn_flops_per_token_ctx=1e6)
    c = roof.cost_model()

    def per_token(lengths):
        flops = 2 * 1e12 * 0.4
        return sum(4.0 * (1e9 * x + 1e6 / 2 * x * x) / flops for x in lengths)

    full = [8] * 8
    layout = TrainLayout(width=8, num_minibatches=2, micro_batch_size=2, tail_row_width=4)
    assert layout.rows(full) == ((8, 8),)
    assert c.train(full, layout.rows(full)) == pytest.approx(per_token(full), rel=1e-12)
    ragged = [8, 3, 5, 1, 7, 2, 6, 4]
    assert c.train(ragged) == pytest.approx(per_token(ragged), rel=1e-12)
    assert c.train(ragged, layout.rows(ragged)) > c.train(ragged)  # padded rows, wider attention
    # the calibrated rates (per trained token) ignore the layout: the replay's train time is as before
    fitted = CostModel(train_step_s=10.0, train_token_s=2.0, train_attn_s=1.0)
    assert fitted.train(ragged, layout.rows(ragged)) == fitted.train(ragged) == 10.0 + 2.0 * 36 + 1.0 * 204
    w = Workload("on_policy", 2, 4, 8, 1, 8, prompt_len=0)
    lengths = LengthModel(8, lengths=ragged)
    (a,) = simulate(w, fitted, lengths, num_steps=1).steps
    (b,) = simulate(dataclasses.replace(w, train_layout=layout), fitted, LengthModel(8, lengths=ragged), 1).steps
    # (minibatch 0 = (8, 5, 7, 6): 4 rows of 8; minibatch 1 = (3, 1, 2, 4): [4, 3, 1] [2], 2 rows of 8, as few
    # positions as 2 tail micro-batches of 3 rows of 4 would be: the tie keeps full rows)
    assert layout.rows(ragged) == ((8, 6),)
    assert a.train_s == b.train_s and (a.train_positions, b.train_positions, b.train_tokens) == (36, 48, 36)
    with pytest.raises(ValueError, match="minibatches"):
        Workload("on_policy", 1, 3, 8, 1, 8, prompt_len=0, train_layout=layout)


@pytest.mark.parametrize("config,sim_config", [("qwen3_8b_dapo", "qwen3_8b_v5p"),
                                               ("qwen3_8b_64k_dapo", "qwen3_8b_64k_v5p"),
                                               ("qwen3_30b_a3b_dapo", "qwen3_30b_a3b_v5p"),
                                               ("qwen3_8b_dapo_lora_v5e8", "qwen3_8b_lora_v5e8")])
def test_real_scale_train_cost_equals_the_aot_estimate(config, sim_config):
    # The simulator's train step at a real config (its LearnerConfig read from the config itself) costs what
    # `fit.packed_train_estimate` estimates at AotConfig.train_mfu, batch by batch at the aot length model; for
    # LoRA without the frozen base's weight gradients (2 passes of the weights, 3 of attention).
    from rollverify_jax.run.programs import architecture
    from rollverify_jax.run.spec import RunSpec, parse_gin
    from rollverify_jax.scale import fit

    parse_gin([f"configs/{config}.gin", f"configs/sim/{sim_config}.gin"], [])
    spec = RunSpec.from_gin()
    shape, learner, a, roof = sim_cli.shape_of(json.loads(spec.to_json())), spec.learner, spec.aot, spec.roofline
    layout = shape.train_layout
    assert (layout.num_minibatches, layout.micro_batch_size, layout.tail_row_width, layout.width) == (
        learner.num_minibatches, learner.micro_batch_size, learner.tail_row_width, gin.query_parameter(
            "EngineConfig.max_seq_len"))
    lora, cfg = spec.lora, architecture(spec)
    assert roof.train_mfu == a.train_mfu and roof.train_attn_passes == 3.0
    assert roof.train_passes == (2.0 if lora.enabled else 3.0)
    # rank x (inputs + outputs) of q, k, v, o, gate, up, down in every layer
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, m = cfg.hidden_size, cfg.intermediate_size
    adapters = lora.rank * cfg.num_hidden_layers * (2 * (h + q) + 2 * (h + kv) + 3 * (h + m)) or None
    rows = shape.batch_groups * shape.group_size
    est = fit.packed_train_estimate(cfg, learner, rows, layout.width, shape.max_new_tokens,
                                    a, layout.row_multiple, batches=2, adapter_params=adapters)
    rng = np.random.default_rng(0)  # the estimate's own draws
    batches = [fit.sample_lengths(rng, rows, layout.width, shape.max_new_tokens, a) for _ in range(2)]
    costs = roof.cost_model()
    sim_s = np.mean([costs.train(x, layout.rows(x)) for x in batches])
    aot_s = est["train_model_flops_per_step"] / (roof.num_devices * roof.peak_flops * a.train_mfu)
    assert sim_s == pytest.approx(aot_s, rel=1e-5)  # the gin files round the per-token FLOPs
    useful = sum(int(x.sum()) for x in batches) / sum(w * n for x in batches for w, n in layout.rows(x))
    assert useful == pytest.approx(est["train_useful_token_fraction"], rel=1e-12)


def test_kernel_decode_by_hand():
    # 2 slots (one bucket of 2), B = 1 group of 2, prompt 3, k = 2, lengths (5, 2); kernel blocks of 4 tokens.
    # Dispatch 1: u0 and u1 attend 3, 4 (blocks 4 + 4 each; the first step writes the prompt's last token) and u1
    # ends: 16 tokens. Dispatches 2-3 (one jump): u0 attends 5, 6, 7 (8 + 8 + 8) and ends after step 3; the free
    # slot reads one block at each of the 4 steps and u0's slot at the last (5 x 4): 44. A step costs weights 1 s
    # + KV 1 s a token + collectives 8 bytes / 1 B/s + 0.5 s: 2 * 9.5 + 16 + 4 * 9.5 + 44 = 117.
    roof = RooflineCosts(num_devices=1, peak_flops=1e30, hbm_bandwidth=1.0, decode_num_slots=2,
                         decode_weights_bytes=1.0, decode_kv_bytes_per_token=1.0, decode_block_tokens=4,
                         decode_collectives=1, decode_collective_bytes=8.0, ici_bandwidth=1.0,
                         collective_latency_s=0.5)
    c = roof.cost_model()
    w = Workload("on_policy", 1, 2, 2, 2, 10, prompt_len=3)
    (s,) = simulate(w, c, LengthModel(10, lengths=[5, 2]), num_steps=1).steps
    assert (s.dispatches, s.decode_steps, s.decode_s) == (3, 6, 117.0)
    kernel = c.decode_kernel
    assert kernel.kernel_tokens(4, 2, [4], [4]) == (4 + 8 + 8 + 8) + 4 * 4 and kernel.kernel_tokens(2, 2, [], []) == 16
    # a smaller live bucket computes fewer slots' activations: FLOPs and collective bytes scale, weights do not
    half = dataclasses.replace(roof, decode_num_slots=4, decode_program_flops=8.0).decode_kernel().at(2)
    assert (half.program_flops, half.collective_bytes, half.weights, half.collectives) == (4.0, 4.0, 1.0, 1)
    assert c.decode_per_step_s() == {"step": 0.0, "weights": 1.0, "collectives": 8.5}
    with pytest.raises(ValueError, match="running slots"):
        c.decode(1, 2, 1, 4, 2)
    # nothing bound: no kernel, decode costs decode_host_s a step (the fitted CostModel never reads lengths)
    assert RooflineCosts(decode_host_s=0.25).cost_model().decode(1, 4, 3, 10) == 1.0
    assert not CostModel().reads_slot_lengths and c.reads_slot_lengths


# `python -m rollverify_jax.aot --gin_file=configs/<config>.gin` at commit 5e3d9d2 with 1ff5fc0's configs (the
# reports configs/sim/*.gin bind): decode.full_slots.estimate_s, a step with every slot running at the length model
# scripts/bench_host_overhead.py (docs/benchmarks.md, "Host time per decode dispatch"): main-thread CPU of one
# 256-slot dispatch at 36 layers, which configs/sim/scale_common.gin spreads over the dispatch's steps
HOST_MS_PER_DISPATCH = 4.31
AOT_FULL_SLOTS_S = {"qwen3_8b_dapo": 0.006345176867414105, "qwen3_8b_64k_dapo": 0.004796844150162749,
                    "qwen3_30b_a3b_dapo": 0.005492528742423147}


@pytest.mark.parametrize("config,sim_config", [("qwen3_8b_dapo", "qwen3_8b_v5p"),
                                               ("qwen3_8b_64k_dapo", "qwen3_8b_64k_v5p"),
                                               ("qwen3_30b_a3b_dapo", "qwen3_30b_a3b_v5p")])
def test_real_scale_decode_step_equals_the_aot_estimate(config, sim_config):
    # With every slot running, the simulator's decode step costs what the aot report estimates (full_slots:
    # the step at the KV the kernel reads, averaged over the steps of the length model's sequences): all slots
    # decode the aot length model's sequences in lockstep, and the mean step is compared. The bindings are
    # aot's assumptions and the real config's shape.
    from rollverify_jax.run.spec import RunSpec, parse_gin
    from rollverify_jax.scale import roofline
    from rollverify_jax.scale.aot_config import CHIPS

    parse_gin([f"configs/{config}.gin", f"configs/sim/{sim_config}.gin"], [])
    spec = RunSpec.from_gin()
    shape, a, roof, cfg = sim_cli.shape_of(json.loads(spec.to_json())), spec.aot, spec.roofline, spec.sim
    chip = CHIPS["TPU v5"]
    assert (roof.peak_flops, roof.hbm_bandwidth) == (chip.peak_flops, chip.hbm_bandwidth)
    assert roof.ici_bandwidth == chip.ici_bandwidth * a.collective_links / (2 * chip.ici_links)
    assert roof.collective_latency_s == a.collective_latency_s
    assert roof.decode_host_s == pytest.approx(HOST_MS_PER_DISPATCH / 1e3 / shape.steps_per_dispatch, rel=0.01)
    assert (roof.decode_num_slots, roof.decode_kv_shards) == (shape.num_slots, shape.pool_shards)
    assert roof.decode_block_tokens == shape.page_size * 4  # pages_per_compute_block's default
    assert (cfg.length_median, cfg.length_sigma, cfg.prompt_len) == (
        a.response_length_median, a.response_length_sigma, a.prompt_len)
    s, p = shape.num_slots, a.prompt_len
    rows = shape.batch_groups * shape.group_size
    lengths = roofline.lognormal_lengths(a.response_length_median, a.response_length_sigma,
                                         min(shape.max_new_tokens, shape.max_seq_len - p), rows)
    costs = roof.cost_model()
    total = sum(costs.decode(1, n, s, s * (p + 1), s, 0, (np.full(s, p + 1), np.full(s, n))) for n in lengths)
    # aot prices the chips' work only: the host's time a step comes on top
    assert total / sum(lengths) == pytest.approx(AOT_FULL_SLOTS_S[config] + roof.decode_host_s, rel=1e-6)
    # the memory side binds (the max is linear), and collectives and weights are the step's fixed part
    step = costs.decode_kernel.step
    assert step.weights / step.hbm_bandwidth > step.program_flops / step.peak_flops
    assert step.kv_bytes_per_token / step.shards / step.hbm_bandwidth > step.attn_flops_per_token_ctx / (
        step.devices * step.peak_flops)


def test_page_pool_limit_makes_a_request_wait():
    # One shard of 2 pages of 4 tokens, 2 slots, k = 1, prompt 0, two sequences of 8 (cap 8: 2 pages each).
    # u0 takes 1 page (0 + 0 + k + 1 = 2 positions); u1 needs 1 page plus a page of headroom for u0: only 1 is
    # free, so it waits at the queue head until u0 ends (u0 grows to 2 pages): 8 + 8 dispatches. Without the
    # limit both run together: 8.
    w = Workload("on_policy", 1, 2, 2, 1, 8, prompt_len=0, page_size=4, kv_pages_per_shard=2)
    assert w.pool_binds and w.reserved_pages(0) == 1 and w.reserved_pages(7) == 2
    (s,) = simulate(w, UNIT, LengthModel(8, lengths=[8, 8]), num_steps=1).steps
    assert (s.dispatches, s.tokens_generated, s.batch_tokens, s.preemptions) == (16, 16, 16, 0) and s.page_waits > 0
    (free,) = simulate(dataclass_replace(w, kv_pages_per_shard=0), UNIT, LengthModel(8, lengths=[8, 8]), 1).steps
    assert (free.dispatches, free.page_waits) == (8, 0)
    assert not dataclass_replace(w, kv_pages_per_shard=5).pool_binds  # 2 slots x 2 pages + 1 of headroom fit
    with pytest.raises(ValueError, match="raise the KV memory budget"):
        dataclass_replace(w, kv_pages_per_shard=1)


def test_page_pool_preempts_a_sequence_that_cannot_grow():
    # 3 pages of 4 tokens, both sequences admitted (1 page each, with a page of headroom). At 3 tokens each needs
    # a second page (3 + k + 1 = 5 positions): 4 > 3, so in admission order u0 grows and u1 is preempted to the
    # queue head. u1 cannot come back while u0 runs (2 pages + headroom): u0 decodes its other 5, then u1 is
    # re-prefilled (3 tokens: 2 computed, the last pending) and 5 dispatches end it. 3 + 5 + 5 = 13 dispatches.
    w = Workload("on_policy", 1, 2, 2, 1, 8, prompt_len=0, page_size=4, kv_pages_per_shard=3)
    (s,) = simulate(w, UNIT, LengthModel(8, lengths=[8, 8]), num_steps=1).steps
    assert (s.preemptions, s.dispatches, s.prefill_tokens, s.prefill_sequences, s.batch_tokens) == (1, 13, 2, 3, 16)
    assert s.tokens_generated == 16  # a preempted sequence keeps its tokens: none is decoded twice


def test_a_head_waiting_for_pages_is_retried_once_a_finished_member_admitted_with_it_leaves():
    # Admission samples nothing, so only a verified finished member that survives leaves its admission round at
    # once (back to its group: its slot and pages are free). 3 slots, 5 pages of 4 tokens, k = 1, prompt 0: u9
    # runs (1 token of 8: 1 page); the queue holds u0 (finished at 4 tokens, to verify again: 4 + k + 1 = 6
    # positions, 2 pages) and u1 (preempted at 3 tokens: 2 pages). u0 takes its 2 with a page of headroom for u9
    # (3 <= 4 free); u1 needs 2 + 2 of headroom > 2 left: it waits. u0 survives and leaves, so the head is retried
    # after one dispatch (as the scheduler, which frees u0's pages at once) and u1 is admitted then. Had u0 gone
    # on decoding (unfinished), the head would wait through a jump of 2 dispatches (the pages' bound), and on.
    from rollverify_jax.sim.replay import Replay, StepRecord, _Traj

    w = Workload("rollverify", 1, 2, 3, 1, 8, prompt_len=0, page_size=4, kv_pages_per_shard=5, verify_finished=True)
    for finished, jump in ((True, 1), (False, 2)):
        replay = Replay(w, UNIT, LengthModel(8, lengths=[8]), CutModel())
        replay.step = 2
        trajs = [_Traj(9, 9, 8, tokens=1), _Traj(0, 0, 8 if not finished else 4, tokens=4, finished=finished,
                                                 verify=True, segments=[[1, 4]]), _Traj(1, 1, 8, tokens=3)]
        for t in trajs:
            replay.trajs[t.uid] = t
            replay.group_members[t.gid], replay.group_done[t.gid] = [t.uid], 0
        replay.slots.take(0)
        replay.slots.place(0, 9, 1, 8, pages=1)
        replay.queue.extend([0, 1])
        rec = StepRecord(step=2, on_policy=False)
        replay._admit(rec, 2)
        assert (rec.page_waits, rec.finished_verified, replay.page_blocked) == (1, int(finished), not finished)
        assert replay._dispatch(rec, one=False) == jump and list(replay.queue) == [1]
        replay._admit(rec, 2)
        assert (list(replay.queue), replay.slots.active, rec.page_waits) == (([], 2, 1) if finished else ([1], 2, 2))


def test_page_pool_over_shards_matches_an_unlimited_pool_when_it_never_binds():
    # A budget that holds every slot at full length never changes a decision: identical records.
    base = dict(mode="rollverify", batch_groups=4, group_size=4, num_slots=16, steps_per_dispatch=4,
                max_new_tokens=200, prompt_len=10, page_size=8, min_prefill_len=16, max_seq_len=256)
    lengths = dict(median=40.0, sigma=1.0, seed=2)
    roomy = Workload(**base, kv_pages_per_shard=4 * 27 + 3, pool_shards=4)
    assert not roomy.pool_binds
    a = simulate(roomy, UNIT, LengthModel(200, **lengths), CutModel(fail_prob=(0.2,)), 6)
    b = simulate(Workload(**base), UNIT, LengthModel(200, **lengths), CutModel(fail_prob=(0.2,)), 6)
    assert [dataclasses.asdict(x) for x in a.steps] == [dataclasses.asdict(x) for x in b.steps]
    tight = simulate(Workload(**base, kv_pages_per_shard=40, pool_shards=4), UNIT, LengthModel(200, **lengths),
                     CutModel(fail_prob=(0.2,)), 6)
    assert sum(s.page_waits for s in tight.steps) > 0 and tight.wall_s > a.wall_s


def test_fit_segment_fail_prob_from_synthetic_logs(tmp_path):
    # Logged counts by age over 3 steps: p(1) = 30 / 300, p(2) = 20 / 100, age 3 never examined (takes age 2's),
    # p(4) = 5 / 10. Pooled over steps; steps that verified nothing are ignored. The per-step trace (a run's
    # replay) takes each step's own rates, the pooled one for ages that step did not examine.
    recs = [{"step": 1, "time/step": 1.0, "verify/num_verified": 0},
            {"step": 2, "time/step": 1.0, "verify/num_verified": 100, "verify/segments_checked/1": 100,
             "verify/segments_failed/1": 10, "verify/segments_checked/2": 40, "verify/segments_failed/2": 8},
            {"step": 3, "time/step": 1.0, "verify/num_verified": 200, "verify/segments_checked/1": 200,
             "verify/segments_failed/1": 20, "verify/segments_checked/2": 60, "verify/segments_failed/2": 12,
             "verify/segments_checked/4": 10, "verify/segments_failed/4": 5}]
    run = cal.read_run(_fake_run(tmp_path / "rv", "rollverify", recs))
    p, fit = cal.fit_segment_fail_prob([run], min_checked=1)
    assert p == pytest.approx((0.1, 0.2, 0.2, 0.5)) and fit["source"] == "segments"
    # by default an age examined under 30 times is pooled with the younger ones down to one examined enough
    assert cal.fit_segment_fail_prob([run])[0] == pytest.approx((0.1, 25 / 110))
    trace = cal.fail_prob_trace(run)
    assert trace[0] == (0.0,) and trace[1] == pytest.approx((0.1, 0.2, 0.2, 0.5))  # age 4 unseen at step 2: pooled
    assert trace[2] == pytest.approx((0.1, 0.2, 0.2, 0.5))
    old = cal.read_run(_fake_run(tmp_path / "old", "rollverify", [
        {"step": 2, "time/step": 1.0, "verify/num_verified": 40, "verify/num_cut": 10}]))
    assert cal.fit_segment_fail_prob([old])[0] == (0.25,)  # before the segment logs: one segment per trajectory
    with pytest.raises(ValueError, match="verified nothing"):
        cal.fit_segment_fail_prob([cal.read_run(_fake_run(tmp_path / "none", "rollverify", recs[:1]))])


def test_fit_recovers_the_replays_own_fail_prob(tmp_path):
    # A replay at known p(c) = (0.05, 0.15, 0.3) writes its verification counts as a run's metrics.jsonl; the fit
    # recovers p(c) where enough segments were examined.
    w = Workload("rollverify", 4, 8, 64, 8, 2000, prompt_len=20, switching=False)
    res = simulate(w, UNIT, LengthModel(2000, median=300.0, sigma=1.0, seed=4), CutModel(fail_prob=(0.05, 0.15, 0.3)),
                   40)
    recs = [{"step": s.step, "time/step": s.step_s, **s.verify_metrics()} for s in res.steps]
    p, fit = cal.fit_segment_fail_prob([cal.read_run(_fake_run(tmp_path / "replay", "rollverify", recs))])
    assert fit["checked"][1] > 1000 and fit["checked"][3] > 100
    assert p[:3] == pytest.approx((0.05, 0.15, 0.3), abs=0.03)


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


def _fake_run(path, mode, steps, spec=None):
    """A run's directory: its metrics.jsonl rows and a spec.json of its mode (``spec``: a whole plain spec)."""
    path.mkdir()
    spec = spec or {"format": 1, "rollout": {}}
    (path / "spec.json").write_text(json.dumps({**spec, "rollout": {**spec["rollout"], "mode": mode}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    return path


def _on_policy_records() -> list[dict]:
    """Three on-policy steps (2-4) whose timers follow exact rates (``test_fit_costs_recovers_exact_rates``)."""
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
    return recs


def test_fit_costs_recovers_exact_rates(tmp_path):
    # Replay ratios: on-policy steps run 1.25 bucket slot-steps per decoded token, 0.5 prefill calls per dispatch
    # and 1.5 padded per real prefill token. Timers built from exact rates: 0.2 s per dispatch, 1e-4 s per
    # slot-step, 0.01 s per call, 1e-5 s per padded token, train 1 + 1e-3 s per token, 0.5 s of the rest.
    ratios = {"on_policy": cal.KindRatios(slot_steps_per_token=1.25, calls_per_dispatch=0.5, padded_per_token=1.5)}
    recs = _on_policy_records()
    run = cal.read_run(_fake_run(tmp_path / "r", "on_policy", [{**recs[0], "step": 1}, *recs]))
    costs, _ = cal.fit_costs([run], ratios, 8, 256, 30, skip=1)
    assert costs.decode_step_s * 8 == pytest.approx(0.2) and costs.decode_slot_s == pytest.approx(1e-4)
    assert costs.prefill_call_s == pytest.approx(0.01) and costs.prefill_token_s == pytest.approx(1e-5)
    assert costs.train_step_s == pytest.approx(1.0) and costs.train_token_s == pytest.approx(1e-3)
    assert costs.step_overhead_s == pytest.approx(0.5)


def test_prompt_len_counts_the_pending_last_token_of_runs_that_leave_it(tmp_path):
    # An on-policy step prefills its 6 new prompts of 30 tokens: computed + copied. An engine with the shape
    # ladders (its spec has engine.bucket_ratio) leaves each prompt's last token pending (29 prefilled): the same
    # prompt length as an earlier run that prefilled all 30.
    recs = [{"step": i, "time/step": 1.0, "mode/on_policy": 1, "rollout/prefill_tokens": 2 * per,
             "rollout/shared_prompt_tokens": 4 * per} for i, per in ((1, 29), (2, 29))]
    new = cal.read_run(_fake_run(tmp_path / "new", "on_policy", recs,
                                 {"format": 1, "rollout": {}, "engine": {"bucket_ratio": 2}}))
    old_recs = [{**r, "rollout/prefill_tokens": 2 * 30, "rollout/shared_prompt_tokens": 4 * 30} for r in recs]
    old = cal.read_run(_fake_run(tmp_path / "old", "on_policy", old_recs))
    assert cal.pending_last_token(new) and not cal.pending_last_token(old)
    assert cal.prompt_len([new], 6, 0) == cal.prompt_len([old], 6, 0) == cal.prompt_len([new, old], 6, 0) == 30


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
    ([], "--gin_file or --calibrate_from is required"),
    (["--gin_param=SimConfig.seed=1", "--calibrate_from", "/nonexistent_run"], "--gin_param needs --gin_file"),
    (["--gin_file=configs/tiny_rollverify.gin", "--steps=0"], "--steps=0"),
    (["--gin_file=configs/tiny_rollverify.gin", "--calibrate_from", "/nonexistent_run"], "metrics.jsonl"),
])
def test_cli_bad_input_is_one_message_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sim_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_refuses_a_run_of_another_shape_or_without_a_spec(tmp_path, capsys):
    run = _fake_run(tmp_path / "b8", "on_policy", [{"step": 1, "time/step": 1.0}],
                    {"format": 1, "rollout": {"batch_groups": 8}})
    with pytest.raises(SystemExit) as e:
        sim_cli.main(["--gin_file=configs/tiny_rollverify.gin", "--calibrate_from", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "rollout.batch_groups = 8" in err and "leave --gin_file out" in err
    (run / "spec.json").unlink()  # a run from before spec.json
    with pytest.raises(SystemExit) as e:
        sim_cli.main(["--calibrate_from", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "spec.json does not exist" in err and "calibrate on runs that wrote one" in err


def _tiny_run(tmp_path, config="tiny_onpolicy"):
    """A run of ``configs/<config>.gin``: its spec.json (as training writes it) and on-policy metrics."""
    from rollverify_jax.run.spec import RunSpec, parse_gin

    parse_gin([f"configs/{config}.gin"], [])
    spec = json.loads(RunSpec.from_gin().to_json())
    recs = _on_policy_records()
    return _fake_run(tmp_path / config, spec["rollout"]["mode"], [{**recs[0], "step": 1}, *recs], spec)


def test_cli_simulates_a_runs_spec_json_as_its_gin_config(tmp_path, capsys):
    """Without --gin_file the spec is the calibration run's spec.json: the same prediction as its gin config."""
    run = _tiny_run(tmp_path)
    sim_cli.main(["--calibrate_from", str(run), "--steps=3", f"--json={tmp_path / 'a.json'}"])
    sim_cli.main(["--gin_file=configs/tiny_onpolicy.gin", "--calibrate_from", str(run), "--steps=3",
                  f"--json={tmp_path / 'b.json'}"])
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert a["config"] == [str(run / "spec.json")] and b["config"] == ["configs/tiny_onpolicy.gin"]
    assert a["shape"]["num_slots"] > 0 and a["calibration"][0]["measured_s"] > 0
    assert {k: v for k, v in a.items() if k != "config"} == {k: v for k, v in b.items() if k != "config"}


def test_the_simulator_reads_a_spec_json_without_jax(tmp_path):
    """``import rollverify_jax.sim`` and ``simulate --calibrate_from=RUN`` (the spec from RUN's spec.json) load no
    JAX and no gin: the simulator reads the spec as plain data."""
    import subprocess
    import sys

    run = _tiny_run(tmp_path)
    code = ("import sys\nimport rollverify_jax.sim\nassert 'jax' not in sys.modules\n"
            "from rollverify_jax import simulate\n"
            f"simulate.main(['--calibrate_from', {str(run)!r}, '--steps=2'])\n"
            "loaded = sorted(m for m in ('jax', 'gin', 'flax', 'rollverify_jax.run.spec') if m in sys.modules)\n"
            "assert not loaded, loaded\nprint('JAX-free')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "JAX-free" in out.stdout and "| on_policy | 2 |" in out.stdout, out.stderr


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
