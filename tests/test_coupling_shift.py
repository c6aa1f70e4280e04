"""studies/coupling_shift.py: kept tokens of the coupled and two-stage rules against the policy shift, on
trajectories the engine samples from the tiny policy (a few short ones: about 40 s on 2 cores, compilation
included)."""

import dataclasses
import json

import numpy as np
import pytest

from rollverify_jax.models import load_pretrained
from rollverify_jax.rollout import SamplingConfig
from rollverify_jax.studies import coupling_shift
from rollverify_jax.studies.coupling import POLICY, moved

CFG = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def setup():
    policy = load_pretrained(POLICY)
    ro = coupling_shift.sample_rollouts(policy, num_prompts=2, group_size=4, max_new_tokens=48, cfg=CFG)
    return policy, ro, coupling_shift.response_logits(policy, ro)


def test_no_shift_keeps_every_token_and_kept_fractions_fall_as_the_shift_grows(setup):
    """B = A: the teacher-forced check samples every token the engine sampled (the same noise), TV 0, both rules
    keep everything. Moving A by growing noise (one direction, fixed seed): TV grows, agreement and the coupled
    rule's kept fraction fall, and the agreement stays above the Gumbel-max coupling's bound."""
    policy, ro, logits_a = setup
    assert ro.lengths.sum() > 50
    same = coupling_shift.shift_row(ro, logits_a, logits_a, CFG, prefix=16)
    assert same["tv"] == 0.0 and same["tv_estimate"] < 1e-4
    assert same["agreement"] == same["coupled_kept"] == same["coupled_kept_first16"] == 1.0
    assert same["two_stage_kept"] == 1.0
    rows = [coupling_shift.shift_row(ro, logits_a, coupling_shift.response_logits(moved(policy, s), ro), CFG, 16)
            for s in (3e-3, 3e-2, 3e-1)]
    tv = [r["tv"] for r in rows]
    assert 0 < tv[0] < tv[1] < tv[2]
    for key in ("agreement", "coupled_kept", "coupled_kept_first16", "two_stage_kept"):
        values = [same[key]] + [r[key] for r in rows]
        assert all(a >= b for a, b in zip(values, values[1:], strict=False)), (key, values)
    assert rows[-1]["coupled_kept"] < 0.5
    for r in rows:
        assert r["agreement"] >= r["bound"] - 0.02  # the bound holds in expectation; a few hundred tokens
        assert r["tv_estimate"] == pytest.approx(r["tv"], abs=0.05)


def test_a_grpo_step_raises_the_rewarded_trajectorys_probability_and_moves_nothing_without_advantage(setup):
    policy, ro, logits_a = setup
    flat = dataclasses.replace(ro, rewards=np.zeros_like(ro.rewards))
    assert coupling_shift.shift_row(ro, logits_a, coupling_shift.response_logits(
        coupling_shift.grpo_step(policy, flat, 1e-3), ro), CFG)["tv"] == 0.0
    rewards = np.zeros_like(ro.rewards)
    rewards[0] = 1.0  # group 0: one rewarded sample among four
    stepped = coupling_shift.response_logits(coupling_shift.grpo_step(
        policy, dataclasses.replace(ro, rewards=rewards), 1e-5), ro)

    def logp(logits):  # [N, L] log-probs of the sampled tokens
        z = logits - logits.max(-1, keepdims=True)
        z = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return np.take_along_axis(z, ro.tokens[..., None], -1)[..., 0] * ro.valid

    adv = np.zeros(len(rewards))
    adv[:4] = (rewards[:4] - rewards[:4].mean()) / rewards[:4].std()
    assert logp(stepped)[0].sum() > logp(logits_a)[0].sum()  # the rewarded sample is more likely
    assert (adv[:, None] * logp(stepped)).sum() > (adv[:, None] * logp(logits_a)).sum()  # the surrogate rose


def test_crossing_is_where_the_two_stage_rule_starts_keeping_fewer_tokens():
    rows = [{"tv": tv, "two_stage_kept": t, "coupled_kept": c}
            for tv, t, c in ((0.0, 1.0, 1.0), (0.001, 1.0, 0.9), (0.01, 0.5, 0.7), (0.1, 0.0, 0.3))]
    x = coupling_shift.crossing(rows)
    assert 0.001 < x < 0.01
    assert x == pytest.approx(np.exp(np.log(0.001) + (0.1 / 0.3) * np.log(10)))
    assert coupling_shift.crossing(rows[:2]) is None
    rows += [{"tv": 0.05, "two_stage_kept": 1.0, "coupled_kept": 0.5, "family": "grpo"}]
    assert coupling_shift.crossing(rows, family="grpo") is None  # one shift of that family: no sign change


def test_run_shift_reads_the_logged_per_version_shift(tmp_path):
    rows = [{"step": 1, "verify/acceptance": 1.0},
            {"step": 2, "verify/tv_estimate_age1": 0.002, "verify/token_agreement_age1": 0.99},
            {"step": 3, "verify/tv_estimate_age1": 0.004, "verify/token_agreement_age1": 0.97}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    got = coupling_shift.run_shift([tmp_path])
    assert got == pytest.approx({"cycles": 2, "tv_min": 0.002, "tv_max": 0.004, "tv_mean": 0.003,
                                 "agreement_mean": 0.98})
