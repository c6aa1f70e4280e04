"""The decode roofline arithmetic (rollverify_jax/scale/roofline.py) against brute force."""

import math
import random

import pytest

from rollverify_jax import schedule_rules
from rollverify_jax.scale import roofline


def test_lognormal_lengths_are_deterministic_quantiles_in_range():
    a = roofline.lognormal_lengths(2500, 1.0, 20480, 512)
    assert a == roofline.lognormal_lengths(2500, 1.0, 20480, 512)
    assert len(a) == 512 and min(a) >= 1 and max(a) == 20480  # the top quantiles hit the cap
    s = sorted(a)
    assert abs(s[255] - 2500) / 2500 < 0.02  # the median
    assert sorted(roofline.lognormal_lengths(100, 0.0, 50, 8)) == [50] * 8  # sigma 0 at the cap
    with pytest.raises(ValueError):
        roofline.lognormal_lengths(0, 1.0, 10)


@pytest.mark.parametrize("block", [1, 3, 16])
def test_block_tokens_sum_is_the_sum_of_rounded_lengths(block):
    for lo, hi in [(1, 1), (1, 40), (5, 37), (17, 16), (100, 163)]:
        want = sum(-(-x // block) * block for x in range(lo, hi + 1))
        assert roofline.block_tokens_sum(lo, hi, block) == want


def test_running_context_is_the_mean_over_slot_steps():
    lengths, p = [3, 1, 7], 5
    attended = [p + t + 1 for n in lengths for t in range(n)]
    assert roofline.running_context(lengths, p) == pytest.approx(sum(attended) / len(attended))


def _brute_phase(lengths, slots, p, page, max_len, k, block):
    """Step by step: admission at dispatch starts, live width from the pages held for the dispatch."""
    queue, running, stale = list(lengths), {}, [0] * slots
    buckets = schedule_rules.live_page_buckets(-(-max_len // page))
    total = {"one": 0, "stale": 0}
    live = steps = run = 0
    while queue or running:
        for s in range(slots):
            if s not in running and queue:
                running[s] = [p, queue.pop(0)]
        most = max(min(max_len, c + k + 1) for c, _ in running.values())
        width = schedule_rules.smallest_holding(buckets, -(-most // page)) * page
        for _ in range(k):
            for s in range(slots):
                if s in running and running[s][1] > 0:
                    seen = running[s][0] + 1
                    live += seen
                    run += 1
                    for rule in total:
                        total[rule] += -(-seen // block) * block
                    running[s][0] += 1
                    running[s][1] -= 1
                    if running[s][1] == 0:
                        stale[s] = running[s][0]
                else:
                    total["one"] += block
                    total["stale"] += -(-min(stale[s] + 1, width) // block) * block
            steps += 1
        running = {s: v for s, v in running.items() if v[1] > 0}
    return steps, run, live, total


@pytest.mark.parametrize("slots,k,block", [(3, 2, 4), (4, 3, 1), (8, 1, 16)])
def test_on_policy_phase_equals_a_step_by_step_replay(slots, k, block):
    lengths = [random.Random(slots + k).randint(1, 90) for _ in range(11)]
    got = roofline.on_policy_phase(lengths, slots, 7, 8, 112, k, block)
    steps, run, live, total = _brute_phase(lengths, slots, 7, 8, 112, k, block)
    assert (got.steps, got.running_slot_steps, got.live_tokens) == (steps, run, live)
    assert {r: got.kernel_tokens(r) for r in roofline.INACTIVE_RULES} == total
    assert got.read_ratio("stale") >= got.read_ratio("one") >= 1.0


def test_on_policy_tail_reads_stale_kv_under_the_old_rule_only():
    """The issue's figure: at the real 8B config's shapes an on-policy phase read ~3x the live KV before."""
    lengths = roofline.lognormal_lengths(2500, 1.0, 20480, 512)
    phase = roofline.on_policy_phase(lengths, 256, 200, 64, 22528, 16, 256)
    assert 2.8 < phase.read_ratio("stale") < 3.8
    assert phase.read_ratio("one") < 1.2
    assert phase.running_slot_steps == sum(lengths)


def _step(**kw):
    base = dict(weights=4.0, weights_min=1.0, kv_bytes_per_token=2.0, shards=2, devices=4, forward_flops_per_token=10.0,
                attn_flops_per_token_ctx=1.0, program_flops=0.0, collective_bytes=0.0, collectives=0.0,
                hbm_bandwidth=1.0, peak_flops=math.inf, ici_bandwidth=0.0, collective_latency_s=0.0)
    return roofline.DecodeStep(**{**base, **kw})


def test_decode_step_prices_bytes_flops_and_collectives():
    s = _step()
    assert s.roofline_s(1, 8, 100) == pytest.approx(1.0 + 100 / 2 * 2.0)  # weights once + live KV of the shard
    assert s.estimate_s(1, 120) == pytest.approx(4.0 + 120 / 2 * 2.0)
    s = _step(kernel_hbm_share=0.5, collective_bytes=10.0, ici_bandwidth=5.0, collectives=3, collective_latency_s=0.1)
    assert s.estimate_s(2, 120) == pytest.approx(2 * 4.0 + 120 / 2 * 2.0 / 0.5 + 2 * (2.0 + 0.3))
    s = _step(peak_flops=1.0, program_flops=1000.0)  # compute-bound: FLOPs bind
    assert s.estimate_s(1, 0) == pytest.approx(1000.0)
    assert s.roofline_s(1, 8, 0) == pytest.approx(8 * 10.0 / 4)
