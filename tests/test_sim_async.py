"""The simulator's async mode (rollverify_jax/sim/async_replay.py) and the cut-length bracket, on small cases."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rollverify_jax.sim import CostModel, CutModel, LengthModel, RooflineCosts, Workload, simulate
from rollverify_jax.sim import calibrate as cal
from rollverify_jax.sim.async_replay import AsyncCosts, AsyncSetup, rollout_workload, simulate_async

# 2 devices: on-policy time-shares both; async gives one to rollout (half the slots, the same decode step per
# chip) and one to training (twice the train step's time)
FULL = CostModel(decode_step_s=0.01, prefill_token_s=1e-4, train_token_s=2e-4, step_overhead_s=0.5)
HALF_TRAIN = dataclasses.replace(FULL, train_token_s=4e-4, prefill_token_s=2e-4)


def full_workload(mode="on_policy", **kw):
    base = dict(mode=mode, batch_groups=4, group_size=4, num_slots=32, steps_per_dispatch=4, max_new_tokens=400,
                prompt_len=20, pool_shards=2, live_slots=False, switching=False)
    return Workload(**{**base, **kw})


def lengths(cut_length="keep"):
    return LengthModel(400, median=40, sigma=1.0, seed=3, group_share=0.5, cut_length=cut_length)


def run_async(at_swap="verify", k=4, staleness=1, publish_s=0.05, p=0.1, steps=30, costs=None):
    w = rollout_workload(full_workload("rollverify"), 2, 1, at_swap)
    costs = costs or AsyncCosts(rollout=HALF_TRAIN, train=HALF_TRAIN, sync=FULL, publish_s=publish_s)
    return simulate_async(w, costs, lengths(), AsyncSetup(2, 1, k, staleness, at_swap), CutModel(fail_prob=(p,)),
                          steps, full_workload())


def test_rollout_workload_keeps_the_slots_per_shard():
    w = rollout_workload(full_workload(), 2, 1)
    assert (w.num_slots, w.pool_shards, w.live_slots) == (16, 1, True)
    with pytest.raises(ValueError, match="multiple"):
        rollout_workload(full_workload(num_slots=32, pool_shards=2), 4, 1)


def test_overlap_beats_on_policy_on_the_same_devices():
    # The same work on the same 2 devices: on-policy idles through each batch's tail and trains with nothing
    # decoding; async overlaps the two, so its wall clock is below on-policy's and below its own busy times' sum.
    on = simulate(full_workload(), FULL, lengths(), num_steps=30)
    s = run_async().summary()
    assert s["steps"] == 30 and s["swaps"] >= 25
    assert s["wall_s"] < on.wall_s
    assert s["wall_s"] < s["rollout_busy_s"] + s["learner_busy_s"]  # they overlapped
    assert s["device_days"] == pytest.approx(s["wall_s"] * 2 / 86400)


def test_publish_and_reprefill_are_counted():
    runs = {at: run_async(at_swap=at, publish_s=0.25).summary() for at in ("verify", "reprefill", "keep_stale_kv")}
    for s in runs.values():
        assert s["publish_s"] == pytest.approx(0.25 * s["swaps"]) and s["swaps"] > 0
    assert runs["verify"]["reprefill_s"] > 0 and runs["reprefill"]["reprefill_s"] > 0
    assert runs["keep_stale_kv"]["reprefill_s"] == 0 and runs["keep_stale_kv"]["verified"] == 0
    assert runs["verify"]["verified"] > 0 and runs["verify"]["num_cut"] > 0  # cut at the swaps' verification
    assert runs["reprefill"]["verified"] == 0 and runs["reprefill"]["removed_tokens"] == 0
    # a swap's publish stalls the rollout: a dearer publish makes the run longer
    assert run_async(publish_s=2.0).wall_s > run_async(publish_s=0.0).wall_s


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_admission_stops_at_the_staleness_cap(staleness):
    s = run_async(staleness=staleness, k=50).summary()
    assert s["admitted_max"] <= (staleness + 1) * 4
    assert s["steps"] == 30


def test_a_larger_staleness_bound_trains_staler_tokens():
    tight, loose = (run_async(staleness=s, k=50).summary() for s in (0, 3))
    assert tight["staleness_mean"] < loose["staleness_mean"]


def test_the_swap_waits_for_k_dispatches_or_the_update():
    # K = 1: the rollout reaches K long before the update ends and waits for it (the deterministic schedule); a
    # huge K: the rollout never waits, the swaps come later.
    short, long = (run_async(k=k).summary() for k in (1, 10_000))
    assert short["rollout_wait_s"] > 0 and long["rollout_wait_s"] == 0
    assert long["swaps"] < short["swaps"]


def test_a_switch_returns_to_synchronous_on_policy():
    # every segment fails: acceptance 0 at each swap, the window (8) fills and the run goes on-policy on both
    # devices for the steps left
    w = rollout_workload(full_workload("rollverify", switching=True), 2, 1)
    costs = AsyncCosts(rollout=HALF_TRAIN, train=HALF_TRAIN, sync=FULL)
    res = simulate_async(w, costs, lengths(), AsyncSetup(2, 1, 4, 1, "verify"), CutModel(fail_prob=(1.0,)), 30,
                         full_workload())
    assert 0 < res.switch_step < 30 and res.sync_steps and all(r.on_policy for r in res.sync_steps)
    assert res.summary()["steps"] == 30


def test_keep_is_the_unfavourable_end_of_the_cut_length_bracket():
    # Cut trajectories keep their drawn length ('keep') or draw L | L > keep ('redraw'): the cut ones are the long
    # ones, so 'redraw' trains fewer response tokens and takes less time; without cuts the two are the same.
    w = full_workload("rollverify", num_slots=16, pool_shards=1)
    res = {c: simulate(w, FULL, lengths(c), CutModel(fail_prob=(0.3,)), 30) for c in ("keep", "redraw")}
    tokens = {c: sum(s.batch_tokens for s in r.steps) for c, r in res.items()}
    assert tokens["keep"] > tokens["redraw"] and res["keep"].wall_s > res["redraw"].wall_s
    same = {c: simulate(w, FULL, lengths(c), CutModel(fail_prob=(0.0,)), 30).wall_s for c in ("keep", "redraw")}
    assert same["keep"] == same["redraw"]
    lm = LengthModel(100, median=40, sigma=1.0, cut_length="keep")
    assert lm.regenerated(0.0, 10, 57) == 57 and lm.regenerated(0.0, 60, 57) == 61  # at least one more token


def test_roofline_split_keeps_the_decode_step_per_chip_and_spreads_flops():
    roof = RooflineCosts(num_devices=16, decode_num_slots=256, decode_kv_shards=4, decode_block_tokens=256,
                         decode_weights_bytes=4e9, decode_kv_bytes_per_token=36864, decode_program_flops=2e11,
                         hbm_bandwidth=2.765e12, peak_flops=459e12, prefill_flops_per_token=1.4e10,
                         train_flops_per_token=1.5e10, param_bytes=16e9, publish_bandwidth=100e9)
    r8, t8 = roof.on_devices(8), roof.on_devices(8, decode=False)
    assert (r8.decode_num_slots, r8.decode_kv_shards) == (128, 2) and t8.decode_num_slots == 0
    full, half = roof.cost_model(), r8.cost_model()
    first, runs = np.full(128, 1000), np.full(128, 16)
    # 128 slots on 8 chips cost what 256 on 16 do: the same program per chip
    assert half.decode(1, 16, 128, 0, 128, 0, (first, runs)) == pytest.approx(
        full.decode(1, 16, 256, 0, 256, 0, (np.full(256, 1000), np.full(256, 16))))
    assert t8.cost_model().train_position_s == pytest.approx(2 * full.train_position_s)
    assert half.prefill_token_s == pytest.approx(2 * full.prefill_token_s)
    assert roof.publish_s() == pytest.approx(0.16)
    with pytest.raises(ValueError, match="slot shard"):
        roof.on_devices(6)


def test_group_share_fit_on_logged_rollout_samples(tmp_path):
    lm = LengthModel(10_000, median=40.0, sigma=0.6, group_share=0.7, seed=5)
    samples = tmp_path / "samples"
    samples.mkdir()
    rows = [{"step": 1 + g // 50, "group": g, "num_tokens": n} for g in range(400) for n in lm.draw(8)]
    for step in sorted({r["step"] for r in rows}):
        (samples / f"rollout_step_{step}.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows if r["step"] == step) + "\n")
    fit = cal.fit_group_share(cal.rollout_sample_lengths(tmp_path))
    assert fit["groups"] == 400 and fit["trajectories"] == 3200
    assert fit["group_share"] == pytest.approx(0.7, abs=0.07) and fit["sigma"] == pytest.approx(0.6, abs=0.05)
    with pytest.raises(FileNotFoundError, match="rollout_samples_every"):
        cal.rollout_sample_lengths(tmp_path / "none")
