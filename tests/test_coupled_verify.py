"""The coupled verification rule (issue 49): counter-based sampling keys, the resume prefill's argmax check, and
exactness: a trajectory sampled under weights A, verified under B and completed is B's sample from scratch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollverify_jax.models import load_pretrained
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.sampling import (
    _filter,
    gumbel_noise,
    logp_and_samples,
    noise_blocks,
    request_keys,
    sample_tokens,
    sampled_argmax,
    samples,
)
from rollverify_jax.studies import coupling
from rollverify_jax.verify import VerifyConfig, coupled_keep, coupled_verify_with_stats
from tests.shared import POLICY

# logits_chunk: the check runs chunked over positions, as the log-probs do
CFG = EngineConfig(num_slots=4, page_size=8, max_seq_len=64, steps_per_dispatch=3, logits_chunk=8)
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95, top_k=24)  # the check applies the same processing


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, CFG, SAMPLING, eos_ids=(3,))


@pytest.fixture(scope="module")
def engine_two_level(model):
    return Engine(model, CFG, dataclasses.replace(SAMPLING, noise="two_level"), eos_ids=(3,))


@pytest.fixture(scope="module")
def params_b(model):
    """Weights B: A's moved enough that some cached tokens are cut and some kept."""
    rng = np.random.default_rng(7)
    return jax.tree.map(lambda x: x + 0.03 * rng.standard_normal(x.shape).astype(x.dtype), nnx.state(model))


def _requests(n, seed=0, max_new=24):
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=rng.integers(2, 10)).astype(np.int32),
                       seed=700 + 3 * i, max_new_tokens=max_new) for i in range(n)]


def _finish(sched):
    sched.run()
    return {t.uid: t for t in sched.take_finished()}


def _copy(t):
    return dataclasses.replace(t, tokens=list(t.tokens), logps=list(t.logps), versions=list(t.versions))


CONFIGS = [SamplingConfig(1.0), SAMPLING, SamplingConfig(1.3, top_k=5)]
CONFIGS = CONFIGS + [dataclasses.replace(c, noise="two_level") for c in CONFIGS]


def test_the_flat_sampler_is_jax_random_categorical_of_the_processed_logits():
    """The default noise draws what jax.random.categorical draws with the key (seed, index), bit for bit:
    argmax(filter(logits / T) + Gumbel(key))."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((64, 40)) * 3, jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32))
    index = jnp.arange(64, dtype=jnp.int32)
    for cfg in CONFIGS[:3]:
        ref = jax.vmap(jax.random.categorical)(request_keys(seeds, index), _filter(logits / cfg.temperature, cfg))
        np.testing.assert_array_equal(sample_tokens(logits, seeds, index, cfg)[0], ref)


def _reference_draw(scaled: np.ndarray, noise: np.ndarray, kind: str) -> np.ndarray:
    """The draw written out in numpy: flat, argmax(scaled + noise); two-level, a block by Gumbel-max over its
    members' log-mass, then a member (token v is member v // nb of block v % nb)."""
    if kind == "flat":
        return np.argmax(scaled + noise, axis=1)
    block, n_blocks = noise_blocks(scaled.shape[-1])
    grid = np.full((len(scaled), block * n_blocks), -np.inf, np.float64)
    grid[:, :scaled.shape[-1]] = scaled
    grid = grid.reshape(len(scaled), block, n_blocks)
    with np.errstate(divide="ignore"):
        mass = np.log(np.exp(grid - grid.max(axis=(1, 2), keepdims=True)).sum(axis=1))
    chosen = np.argmax(mass + noise[:, :n_blocks], axis=1)
    member = np.argmax(grid[np.arange(len(scaled)), :, chosen] + noise[:, n_blocks:], axis=1)
    return member * n_blocks + chosen


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("vocab", [40, 50])  # 40 = 8 x 5 blocks; 50 has no factor of 8: padded to 8 x 7
def test_the_sampler_is_a_function_of_the_processed_logits_and_the_tokens_own_noise(cfg, vocab):
    """``sampled_argmax`` (what decode samples and the coupled check recomputes) is a function of the processed
    logits filter(logits / T) and the noise of (seed, index) only, here against a numpy reference for each noise;
    ``samples`` and ``logp_and_samples`` (the resume prefill's check) agree with it for the token
    sampled and for others, and the latter's log-prob is ``sample_tokens``' own."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((64, vocab)) * 3, jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32))
    index = jnp.arange(64, dtype=jnp.int32)
    noise = np.asarray(gumbel_noise(seeds, index, vocab, cfg.noise))
    assert noise.shape == (64, vocab if cfg.noise == "flat" else sum(noise_blocks(vocab)))
    ref = _reference_draw(np.asarray(_filter(logits / cfg.temperature, cfg), np.float64), noise, cfg.noise)
    tokens, logp = sample_tokens(logits, seeds, index, cfg)
    np.testing.assert_array_equal(tokens, ref)
    np.testing.assert_array_equal(sampled_argmax(logits.reshape(8, 8, vocab), seeds.reshape(8, 8),
                                                 index.reshape(8, 8), cfg).reshape(-1), ref)
    for other in (tokens, (tokens + 1) % vocab, jnp.zeros_like(tokens)):
        np.testing.assert_array_equal(samples(logits, other, seeds, index, cfg), ref == other)
        check_logp, match = logp_and_samples(logits, other, seeds, index, cfg)
        np.testing.assert_array_equal(match, ref == other)
        np.testing.assert_allclose(check_logp, sample_tokens(logits, seeds, index, cfg)[1] if other is tokens
                                   else jax.nn.log_softmax(logits / cfg.temperature)[jnp.arange(64), other],
                                   rtol=0, atol=2e-6)


@pytest.mark.parametrize(("cfg", "vocab"), list(zip(CONFIGS[3:], [40, 50, 50], strict=True)), ids=str)
def test_the_two_level_sampler_draws_each_token_with_its_probability(cfg, vocab):
    """Exact in law: over 200,000 keys the draws of one row of logits are within the sampling floor of
    softmax(filter(logits / T)) (TV < 0.012, where the expected TV of exact sampling at this size is ~0.006), and
    a token filtered out is never drawn."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal(vocab) * 2, jnp.float32)
    n = 200_000
    seeds = jnp.arange(n, dtype=jnp.uint32)
    tokens = jax.jit(sampled_argmax, static_argnums=3)(jnp.broadcast_to(logits, (n, vocab)), seeds,
                                                       jnp.full((n,), 5, jnp.int32), cfg)
    freq = np.bincount(np.asarray(tokens), minlength=vocab) / n
    exact = np.asarray(jax.nn.softmax(_filter(logits / cfg.temperature, cfg)), np.float64)
    assert np.all(freq[exact == 0] == 0)
    assert 0.5 * np.abs(freq - exact).sum() < 0.012


def test_the_noise_blocks_split_real_vocabularies_without_padding():
    """B = the power of two at or above sqrt(V), halved until it divides V; padded only without a factor of 8."""
    assert noise_blocks(151_936) == (128, 1187)  # Qwen3: 1,315 draws instead of 151,936
    assert noise_blocks(128_256) == (256, 501)  # Llama 3
    assert noise_blocks(32_768) == (256, 128)
    assert noise_blocks(50_257) == (256, 197)  # odd: padded to 50,432
    assert noise_blocks(2) == (2, 1) and noise_blocks(1) == (1, 1)


def test_the_check_breaks_ties_as_argmax_does():
    """Greedy (no noise) on tied logits: argmax takes the first of the tied tokens; so does the check."""
    logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], jnp.float32)
    greedy = SamplingConfig(greedy=True)
    zeros = jnp.zeros((2,), jnp.uint32)
    for token in range(4):
        tokens = jnp.full((2,), token, jnp.int32)
        np.testing.assert_array_equal(samples(logits, tokens, zeros, zeros, greedy), [token == 1, token == 0])


def test_a_trajectory_samples_the_same_alone_in_a_crowd_and_paused_at_any_point(engine):
    """Token t's noise depends on (trajectory seed, t) only: alone, among other requests (other slots, other live
    buckets, a group sharing its prompt's prefill), and paused and re-prefilled after 1, 2, 3 ... dispatches, the
    same trajectory gets the same tokens and (to the prefill's float noise) the same log-probs."""
    target = _requests(1, seed=3, max_new=24)[0]
    alone = Scheduler(engine)
    alone.submit([_copy(target)])
    ref = _finish(alone)[target.uid]
    assert ref.num_tokens > 6
    crowd = [dataclasses.replace(_copy(t), uid=t.uid + 1, seed=t.seed + 1) for t in _requests(5, seed=9)]
    mate = dataclasses.replace(_copy(target), uid=99, seed=target.seed + 5)  # same prompt and group: shared prefill
    for pause_every in (None, 1, 2, 3):
        sched = Scheduler(engine)
        sched.submit([crowd[0], crowd[1], _copy(target), mate, *crowd[2:]] if pause_every else
                     [*map(_copy, crowd), _copy(target), dataclasses.replace(mate)])
        done = {}
        while not sched.idle:
            sched.run(max_dispatches=pause_every)
            done |= {t.uid: t for t in sched.take_finished()}
            if pause_every:
                sched.resume(sched.pause_all())
        got = done[target.uid]
        assert got.tokens == ref.tokens, pause_every
        np.testing.assert_allclose(got.logps, ref.logps, atol=1e-4)
        crowd = [dataclasses.replace(_copy(t), tokens=[], logps=[], versions=[], finished=False) for t in crowd]
        mate = dataclasses.replace(mate, tokens=[], logps=[], versions=[], finished=False)


def _coupled_keep_fn(record):
    def keep_fn(new_logp, behavior_logp, versions, lengths, match=None):
        assert match is not None, "a coupled scheduler hands the keep function the prefill's match"
        keep, _ = coupled_verify_with_stats(match, versions, lengths, 1)
        record.append((keep, lengths))
        return keep
    return keep_fn


@pytest.mark.parametrize("engine_name", ["engine", "engine_two_level"])
def test_coupled_resume_under_new_weights_equals_sampling_from_scratch_under_them(model, engine_name, params_b,
                                                                                   request):
    """Sampled under A (paused after 1, 2 or 3 dispatches, some finished), verified with the coupled rule under B
    and completed: every trajectory is token for token B's sample from scratch with the same keys, and the rule
    both kept and cut tokens (so the test sees both branches); with either noise."""
    engine = request.getfixturevalue(engine_name)
    a_params = nnx.state(model)
    try:
        engine.update_params(params_b, version=1)
        fresh = _finish(_submit(engine, _requests(8, seed=5)))
        for dispatches in (1, 2, 3):
            engine.update_params(a_params, version=0)
            sched = Scheduler(engine, coupled=True)
            sched.submit(_requests(8, seed=5))
            sched.run(max_dispatches=dispatches)
            cached = sched.pause_all() + sched.take_finished()
            engine.update_params(params_b, version=1)
            record = []
            sched.resume(cached, keep=_coupled_keep_fn(record))
            done = _finish(sched)
            assert sorted(done) == sorted(fresh)
            for uid, t in done.items():
                assert t.tokens == fresh[uid].tokens, (dispatches, uid)
                assert t.draws == 0  # the key stream was kept
            kept = sum(int(k.sum()) for k, _ in record)
            total = sum(int(n.sum()) for _, n in record)
            assert 0 < kept < total, (kept, total)
    finally:
        engine.update_params(a_params, version=0)


@pytest.mark.parametrize("engine_name", ["engine", "engine_two_level"])
def test_with_unchanged_weights_the_coupled_rule_keeps_every_token(engine_name, request):
    """Float32, the same weights: the prefill's argmax check agrees with what decode sampled at every token."""
    engine = request.getfixturevalue(engine_name)
    sched = Scheduler(engine, coupled=True)
    sched.submit(_requests(8, seed=11))
    sched.run(max_dispatches=4)
    cached = sched.pause_all()
    record = []
    sched.resume(cached, keep=_coupled_keep_fn(record))
    sched.run(max_dispatches=1)
    keep, lengths = map(np.concatenate, zip(*record, strict=True))
    assert lengths.sum() > 30 and (keep == lengths).all()
    sched.pause_all()


def _submit(engine, trajs, coupled=False):
    sched = Scheduler(engine, coupled=coupled)
    sched.submit(trajs)
    return sched


def test_coupled_keep_cuts_at_the_first_token_the_new_policy_would_not_sample():
    match = np.array([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]], bool)
    np.testing.assert_array_equal(coupled_keep(match, np.array([4, 4, 3, 1])), [2, 4, 0, 1])
    versions = np.array([[0, 0, 1, 1], [0, 1, 1, 1], [2, 2, 2, 2], [0, 0, 0, 0]])
    keep, stats = coupled_verify_with_stats(match, versions, np.array([4, 4, 3, 1]), current_version=2)
    np.testing.assert_array_equal(keep, [2, 4, 0, 1])
    # row 0 is cut at the first token of its version-1 segment (age 1), row 2 at its first (age 0)
    assert dict(stats.failed) == {1: 1, 0: 1} and stats.token_cuts == 0
    with pytest.raises(ValueError, match="rule"):
        VerifyConfig(rule="exact")


@pytest.mark.parametrize("noise", ["flat", "two_level"])
def test_coupled_rule_is_exact_in_distribution_and_the_others_are_not(noise):
    """A two-token completion of the tiny policy: sampled under A, verified under B (A moved), completed. Over
    100,000 seeds the coupled rule's outputs are B's fresh samples seed for seed, and their distribution is within
    TV 0.01 of B's exact one (the sampling floor at this size is ~0.006); SPEC-RL's rule (accept min(1, pi/mu),
    redraw from pi) is not. The two-stage rule's distance is reported (docs/results/coupled_verify.md)."""
    policy = load_pretrained(POLICY)
    a = coupling.TwoTokenLogits.of(policy, coupling.PROMPT)
    b = coupling.TwoTokenLogits.of(coupling.moved(policy, 0.02), coupling.PROMPT)
    cfg = SamplingConfig(1.0, noise=noise)
    seeds = np.arange(100_000, dtype=np.uint32)
    coupled, keep = coupling.verify_rule("coupled", a, b, seeds, cfg)
    np.testing.assert_array_equal(coupled, b.sample(seeds, cfg))
    assert 0.2 < keep.mean() / 2 < 0.95  # it kept tokens (and cut some)
    exact = coupling.exact_distribution(b, cfg)
    if noise == "two_level":  # the other rules' distances do not hinge on the layout: measured with the flat one
        assert coupling.total_variation(coupled, exact) < 0.01
        return
    tv = {rule: coupling.total_variation(coupling.verify_rule(rule, a, b, seeds, cfg)[0], exact)
          for rule in coupling.RULES}
    print("TV to B's exact distribution at 100k samples:", tv)
    assert tv["coupled"] < 0.01
    assert tv["spec_rl"] > 0.05


def test_the_shape_plan_compiles_the_coupled_resume_prefill_ahead(engine):
    """A coupled run plans its resume prefill (one program per prefill bucket, beside the admission's) instead of
    the two-stage verifier; compiled ahead, a resume at that bucket compiles nothing."""
    import gin

    from rollverify_jax.run import shape_plan
    from rollverify_jax.run.spec import RunSpec, parse_gin

    def plan_of(config):
        parse_gin([config], [])
        try:
            return shape_plan.plan_run(RunSpec.from_gin(), engine.plan)
        finally:
            gin.clear_config()
    coupled, two_stage = plan_of("configs/studies/coupled_tiny.gin"), plan_of("configs/tiny_rollverify.gin")
    assert len(coupled.of("coupled_prefill")) == len(coupled.of("prefill")) > 0 and not coupled.of("verify")
    assert two_stage.of("verify") and not two_stage.of("coupled_prefill")
    trajs = _requests(3, seed=21)
    sched = _submit(engine, [_copy(t) for t in trajs], coupled=True)
    sched.run(max_dispatches=2)
    cached = sched.pause_all()
    seqs = [np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)]) for t in cached]
    shape = engine.pack(seqs, list(range(len(seqs))), [len(t.prompt) for t in cached]).tokens.shape
    (program,) = [p for p in coupled.of("coupled_prefill") if tuple(v for _, v in p.dims) == shape]
    jax.clear_caches()  # an earlier test may have compiled it at first use
    shape_plan.compile_ahead(shape_plan.ShapePlan((program,)), engine, progress=False)
    with shape_plan.CompileLog() as log:
        sched.resume(cached, keep=_coupled_keep_fn([]))
        sched.step()
    assert "_prefill_fn" not in log.names and ("coupled_prefill", shape) in engine.dispatched
    sched.pause_all()
