"""Tests for rollverify_jax.rl.losses against independent numpy references written token by token."""

import dataclasses
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollverify_jax.rl import losses as L

B, T = 4, 6
LENGTHS = [6, 4, 3, 2]
ADV = np.array([1.2, -0.8, 0.5, -1.5], np.float32)


def _batch():
    """Behaviour/new log-probs whose ratios hit every branch: unclipped, clipped high/low, dual-clipped."""
    rng = np.random.default_rng(0)
    behavior = rng.uniform(-3.0, -0.1, size=(B, T))
    diff = rng.uniform(-0.15, 0.15, size=(B, T))
    diff[0, 1] = 0.5  # A > 0, r = 1.65 > 1.28: clipped
    diff[1, 2] = 1.5  # A < 0, r = 4.48 > c = 3: dual-clipped
    diff[1, 0] = 0.7  # A < 0, r = 2.01: unclipped (only the dual clip could act)
    diff[3, 0] = -0.5  # A < 0, r = 0.61 < 0.8: clipped
    diff[2, :] = rng.uniform(-1e-4, 1e-4, size=T)  # near on-policy: inside GSPO's tiny clip range
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1.0
    entropy = rng.uniform(0.0, 2.0, size=(B, T)).astype(np.float32)
    ref = (behavior + rng.uniform(-0.3, 0.3, size=(B, T))).astype(np.float32)
    return (behavior + diff).astype(np.float32), behavior.astype(np.float32), mask, entropy, ref


NEW, BEH, MASK, ENT, REF = _batch()


# ---------------------------------------------------------------------------------------------------------
# Independent numpy references (float64, python loops)
# ---------------------------------------------------------------------------------------------------------


def _lr(b, t):
    return min(max(float(NEW[b, t]) - float(BEH[b, t]), -20.0), 20.0)


def _tokens(b):
    return [t for t in range(T) if MASK[b, t] > 0]


def np_aggregate(mat, mode, max_len=None):
    if mode == "token-mean":
        num = sum(mat[b, t] for b in range(B) for t in _tokens(b))
        return num / sum(len(_tokens(b)) for b in range(B))
    per_seq = []
    for b in range(B):
        toks = _tokens(b)
        if not toks:
            continue
        s = sum(mat[b, t] for t in toks)
        per_seq.append(s / len(toks) if mode == "seq-mean-token-mean" else s / (max_len or T))
    return sum(per_seq) / len(per_seq)


def np_ppo(r, a, low, high):
    unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
    return max(unclipped, clipped), clipped > unclipped


def np_grpo(cfg):
    mat, clip = np.zeros((B, T)), np.zeros((B, T), bool)
    for b in range(B):
        for t in _tokens(b):
            r = math.exp(_lr(b, t))
            loss, clip[b, t] = np_ppo(r, float(ADV[b]), cfg.eps_low, cfg.eps_high)
            if cfg.dual_clip_c is not None and ADV[b] < 0 and loss > -ADV[b] * cfg.dual_clip_c:
                loss, clip[b, t] = -float(ADV[b]) * cfg.dual_clip_c, True
            if cfg.tis_cap is not None:
                loss *= min(r, cfg.tis_cap) / r
            mat[b, t] = loss
    return mat, clip


def np_seq_ratio(b):
    toks = _tokens(b)
    return math.exp(sum(_lr(b, t) for t in toks) / len(toks))


def np_gspo(cfg):
    mat, clip = np.zeros((B, T)), np.zeros((B, T), bool)
    for b in range(B):
        loss, clipped = np_ppo(np_seq_ratio(b), float(ADV[b]), cfg.gspo_eps_low, cfg.gspo_eps_high)
        for t in _tokens(b):
            mat[b, t], clip[b, t] = loss, clipped
    return mat, clip


def np_sapo(cfg):
    mat = np.zeros((B, T))
    for b in range(B):
        tau = cfg.sapo_tau_pos if ADV[b] > 0 else cfg.sapo_tau_neg
        for t in _tokens(b):
            r = math.exp(_lr(b, t))
            gate = 1.0 / (1.0 + math.exp(-tau * (r - 1.0))) * 4.0 / tau
            w = 1.0 if cfg.tis_cap is None else min(r, cfg.tis_cap) / r
            mat[b, t] = -gate * float(ADV[b]) * w
    return mat, np.zeros((B, T), bool)


def np_phi(b, cfg):
    log_w = min(max(sum(_lr(b, t) for t in _tokens(b)), -20.0), 20.0)
    k, lam = (cfg.vespo_k_pos, cfg.vespo_lam_pos) if ADV[b] >= 0 else (cfg.vespo_k_neg, cfg.vespo_lam_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def np_vespo(cfg):
    mat = np.zeros((B, T))
    for b in range(B):
        phi = np_phi(b, cfg)
        for t in _tokens(b):
            mat[b, t] = -phi * float(ADV[b]) * float(NEW[b, t])
    return mat, np.zeros((B, T), bool)


NP_REFS = {"grpo": np_grpo, "gspo": np_gspo, "gspo_token": np_gspo, "sapo": np_sapo, "vespo": np_vespo}


def np_token_mean(x):
    return np_aggregate(np.asarray(x, np.float64), "token-mean")


def np_metrics(name, cfg):
    mat, clip = NP_REFS[name](cfg)
    pg = np_aggregate(mat, cfg.aggregation, cfg.max_response_length)
    ratio = np.exp(np.clip(NEW.astype(np.float64) - BEH, -20, 20))
    out = {
        "policy/pg_loss": pg,
        "policy/ratio_mean": np_token_mean(ratio),
        "ops/token_mean": np_token_mean(np.abs(ratio - 1)),
        "policy/clip_fraction": np_token_mean(clip),
        "policy/entropy": np_token_mean(ENT),
        "loss": pg,
    }
    if cfg.kl_coef > 0:
        d = REF.astype(np.float64) - NEW
        kl = np.exp(d) - d - 1
        out["policy/kl"] = np_token_mean(kl)
        out["loss"] = pg + cfg.kl_coef * np_aggregate(kl, cfg.aggregation, cfg.max_response_length)
    return out


def _run(name, cfg, **kw):
    kw.setdefault("entropy", ENT)
    return L.get_loss_fn(name)(NEW, BEH, ADV, MASK, cfg, **kw)


def _check_metrics(got, want):
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------------------------------------------
# Values against the references
# ---------------------------------------------------------------------------------------------------------


def test_batch_covers_every_branch():
    _, grpo_clip = np_grpo(L.LossConfig())
    _, gspo_clip = np_gspo(L.LossConfig())
    assert grpo_clip[0, 1] and grpo_clip[3, 0] and not grpo_clip[1, 0]
    assert 0 < np_token_mean(gspo_clip) < 1  # both clipped and unclipped sequences
    assert math.exp(_lr(1, 2)) > 3.0 and ADV[1] < 0  # dual clip territory


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_loss_matches_numpy_for_every_aggregation(name, aggregation):
    cfg = L.LossConfig(aggregation=aggregation)
    loss, metrics = _run(name, cfg)
    want = np_metrics(name, cfg)
    _check_metrics(metrics, want)
    np.testing.assert_allclose(float(loss), want["loss"], rtol=2e-5, atol=1e-6)
    assert "policy/kl" not in metrics


def test_seq_mean_token_sum_norm_uses_the_constant():
    cfg = L.LossConfig(aggregation="seq-mean-token-sum-norm", max_response_length=16)
    _, metrics = _run("grpo", cfg)
    mat, _ = np_grpo(cfg)
    want = sum(mat[b, t] for b in range(B) for t in _tokens(b)) / 16 / B
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-5)


def test_grpo_hand_values_on_policy():
    # r = 1 everywhere: the loss is -mean(A) over tokens, nothing clipped, OPS 0.
    cfg = L.LossConfig()
    loss, metrics = L.grpo_loss(BEH, BEH, ADV, MASK, cfg)
    want = -sum(ADV[b] * LENGTHS[b] for b in range(B)) / sum(LENGTHS)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert float(metrics["ops/token_mean"]) == 0.0 and float(metrics["policy/clip_fraction"]) == 0.0
    np.testing.assert_allclose(float(metrics["policy/ratio_mean"]), 1.0)


def test_grpo_dual_clip():
    cfg = L.LossConfig(dual_clip_c=3.0)
    loss, metrics = _run("grpo", cfg)
    _check_metrics(metrics, np_metrics("grpo", cfg))
    no_dual, _ = _run("grpo", L.LossConfig())
    # The dual clip only lowers the loss of the A < 0 token with r > 3: from -A r to -A c.
    r = math.exp(_lr(1, 2))
    np.testing.assert_allclose(float(no_dual - loss), -ADV[1] * (r - 3.0) / sum(LENGTHS), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["policy/dual_clip_fraction"]), 1 / sum(LENGTHS), rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "sapo"])
def test_tis_truncates_large_ratios(name):
    cfg = L.LossConfig(tis_cap=1.5)
    _, metrics = _run(name, cfg)
    _check_metrics(metrics, np_metrics(name, cfg))
    # A cap above every ratio is a no-op.
    big, _ = _run(name, L.LossConfig(tis_cap=1e6))
    plain, _ = _run(name, L.LossConfig())
    np.testing.assert_allclose(float(big), float(plain), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_kl_term(name):
    cfg = L.LossConfig(kl_coef=0.1, aggregation="seq-mean-token-mean")
    loss, metrics = _run(name, cfg, ref_logp=REF)
    want = np_metrics(name, cfg)
    _check_metrics(metrics, want)
    assert float(metrics["policy/kl"]) > 0


def test_kl_needs_ref():
    with pytest.raises(ValueError, match="needs ref_logp"):
        _run("grpo", L.LossConfig(kl_coef=0.1))


def test_vespo_phi_is_one_on_policy_and_vanishes_far_off():
    cfg = L.LossConfig()
    loss, metrics = L.vespo_loss(BEH, BEH, ADV, MASK, cfg)
    want = np_aggregate(-ADV[:, None].astype(np.float64) * BEH * MASK, "token-mean")
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["vespo/phi_mean"]), 1.0, rtol=1e-6)
    far = BEH + 5.0 * MASK  # log W = 5 * length, clipped at 20
    loss, metrics = L.vespo_loss(far, BEH, ADV, MASK, cfg)
    assert np.isfinite(float(loss)) and float(metrics["vespo/phi_mean"]) < 1e-6


def test_sequence_ops_matches_numpy():
    got = np.asarray(L.sequence_ops(NEW, BEH, MASK))
    want = [sum(abs(math.exp(_lr(b, t)) - 1) for t in _tokens(b)) / len(_tokens(b)) for b in range(B)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    empty = np.asarray(L.sequence_ops(NEW, BEH, np.zeros_like(MASK)))
    np.testing.assert_array_equal(empty, np.zeros(B))


# ---------------------------------------------------------------------------------------------------------
# Gradients w.r.t. new_logp
# ---------------------------------------------------------------------------------------------------------


def _agg_weights(mode, max_len=None):
    """d(aggregate)/d(token loss) for each token, from the aggregation definition."""
    w = np.zeros((B, T))
    live = [b for b in range(B) if _tokens(b)]
    n_tok = sum(len(_tokens(b)) for b in range(B))
    for b in live:
        for t in _tokens(b):
            if mode == "token-mean":
                w[b, t] = 1 / n_tok
            elif mode == "seq-mean-token-mean":
                w[b, t] = 1 / (len(_tokens(b)) * len(live))
            else:
                w[b, t] = 1 / ((max_len or T) * len(live))
    return w


def _grad(name, cfg, new=NEW, **kw):
    fn = L.get_loss_fn(name)
    return np.asarray(jax.grad(lambda x: fn(x, BEH, ADV, MASK, cfg, **kw)[0])(jnp.asarray(new)))


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_grpo_gradient_hand_derived(aggregation, dual_clip_c):
    # d/dlogp of -r A is -r A where the unclipped branch is active; clipped tokens get 0.
    cfg = L.LossConfig(aggregation=aggregation, dual_clip_c=dual_clip_c, tis_cap=2.5)
    _, clip = np_grpo(cfg)
    w = _agg_weights(aggregation)
    want = np.zeros((B, T))
    for b in range(B):
        for t in _tokens(b):
            r = math.exp(_lr(b, t))
            want[b, t] = 0.0 if clip[b, t] else -ADV[b] * min(r, 2.5) * w[b, t]
    np.testing.assert_allclose(_grad("grpo", cfg), want, rtol=1e-5, atol=1e-8)


def test_sapo_gradient_hand_derived_and_equal_to_grpo_on_policy():
    cfg = L.LossConfig()
    w = _agg_weights("token-mean")
    want = np.zeros((B, T))
    for b in range(B):
        tau = 1.0 if ADV[b] > 0 else 1.05
        for t in _tokens(b):
            r = math.exp(_lr(b, t))
            p = 1 / (1 + math.exp(-tau * (r - 1)))
            want[b, t] = -ADV[b] * 4 * p * (1 - p) * r * w[b, t]
    np.testing.assert_allclose(_grad("sapo", cfg), want, rtol=1e-5, atol=1e-8)
    # At r = 1 the soft gate has unit slope: same gradient as the PPO surrogate.
    np.testing.assert_allclose(_grad("sapo", cfg, new=BEH), _grad("grpo", cfg, new=BEH), rtol=1e-6)


def test_sapo_gradient_finite_differences():
    cfg = L.LossConfig(aggregation="seq-mean-token-mean")
    grad = _grad("sapo", cfg)
    h = 1e-2
    for b, t in [(0, 0), (1, 2), (3, 1)]:
        bump = np.zeros_like(NEW)
        bump[b, t] = h
        up = float(L.sapo_loss(NEW + bump, BEH, ADV, MASK, cfg)[0])
        down = float(L.sapo_loss(NEW - bump, BEH, ADV, MASK, cfg)[0])
        np.testing.assert_allclose(grad[b, t], (up - down) / (2 * h), rtol=2e-3, atol=1e-5)


def test_gspo_gradient_hand_derived_and_gspo_token_equivalence():
    cfg = L.LossConfig(aggregation="seq-mean-token-mean")
    _, clip = np_gspo(cfg)
    n_live = B
    want = np.zeros((B, T))
    for b in range(B):
        s, n = np_seq_ratio(b), len(_tokens(b))
        for t in _tokens(b):
            want[b, t] = 0.0 if clip[b, t] else -ADV[b] * s / n / n_live  # ds/dlogp_t = s / n
    got = _grad("gspo", cfg)
    assert np.abs(got).max() > 0  # the unclipped sequence carries gradient
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(_grad("gspo_token", cfg), got, rtol=1e-5, atol=1e-8)


def test_vespo_gradient_is_phi_times_advantage():
    cfg = L.LossConfig(aggregation="seq-mean-token-sum-norm", max_response_length=8)
    w = _agg_weights("seq-mean-token-sum-norm", 8)
    want = np.array([[-np_phi(b, cfg) * ADV[b] * w[b, t] for t in range(T)] for b in range(B)])
    np.testing.assert_allclose(_grad("vespo", cfg), want, rtol=1e-5, atol=1e-8)


def test_kl_gradient_hand_derived():
    # Zero advantages leave only the KL: d/dnew [exp(ref - new) - (ref - new) - 1] = 1 - exp(ref - new).
    cfg = L.LossConfig(kl_coef=0.5)
    fn = lambda x: L.grpo_loss(x, BEH, np.zeros(B, np.float32), MASK, cfg, ref_logp=REF)[0]
    got = np.asarray(jax.grad(fn)(jnp.asarray(NEW)))
    want = 0.5 * (1 - np.exp(REF.astype(np.float64) - NEW)) * _agg_weights("token-mean")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_padding_with_neg_inf_stays_finite(name):
    new = np.where(MASK > 0, NEW, -np.inf).astype(np.float32)
    beh = np.where(MASK > 0, BEH, -np.inf).astype(np.float32)
    cfg = L.LossConfig(kl_coef=0.1)
    fn = L.get_loss_fn(name)
    loss, grad = jax.value_and_grad(lambda x: fn(x, beh, ADV, MASK, cfg, ref_logp=REF)[0])(jnp.asarray(new))
    ref_loss, _ = fn(NEW, BEH, ADV, MASK, cfg, ref_logp=REF)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert np.isfinite(np.asarray(grad)).all() and (np.asarray(grad)[MASK == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# API: masks, jit, metrics, config validation, registry
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_bool_mask_jit_and_metric_keys(name):
    cfg = L.LossConfig()
    fn = L.get_loss_fn(name)
    loss, metrics = fn(NEW, BEH, ADV, MASK, cfg, entropy=ENT)
    jitted = jax.jit(fn, static_argnames="cfg")
    jit_loss, jit_metrics = jitted(NEW, BEH, ADV, MASK.astype(bool), cfg=cfg, entropy=ENT)
    np.testing.assert_allclose(float(jit_loss), float(loss), rtol=1e-5, atol=1e-7)
    required = {"loss", "policy/entropy", "ops/token_mean", "policy/clip_fraction", "policy/ratio_mean"}
    assert required <= set(metrics) and set(metrics) == set(jit_metrics)
    assert all(jnp.shape(v) == () for v in metrics.values())
    if name in ("sapo", "vespo"):
        assert float(metrics["policy/clip_fraction"]) == 0.0
    assert "policy/entropy" not in fn(NEW, BEH, ADV, MASK, cfg)[1]


def test_all_masked_sequences_do_not_dilute_seq_means():
    mask = MASK.copy()
    mask[3] = 0.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = L.LossConfig(aggregation=mode)
        full, _ = L.grpo_loss(NEW, BEH, ADV, mask, cfg)
        first3, _ = L.grpo_loss(NEW[:3], BEH[:3], ADV[:3], mask[:3], cfg)
        np.testing.assert_allclose(float(full), float(first3), rtol=1e-6)
    loss, _ = L.grpo_loss(NEW, BEH, ADV, np.zeros_like(MASK), L.LossConfig())
    assert float(loss) == 0.0


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("eps_low", -0.1, r"eps_low must be in \[0, 1\)"),
        ("eps_low", 1.0, r"eps_low must be in \[0, 1\)"),
        ("eps_high", -0.2, "eps_high must be >= 0"),
        ("dual_clip_c", 1.0, "dual_clip_c must be > 1"),
        ("aggregation", "sum", r"aggregation 'sum' is unknown.*token-mean.*seq-mean-token-mean"),
        ("max_response_length", 0, "max_response_length must be > 0"),
        ("kl_coef", -1.0, "kl_coef must be >= 0"),
        ("tis_cap", 0.0, "tis_cap must be > 0"),
        ("gspo_eps_high", -1.0, "gspo_eps_high must be >= 0"),
        ("sapo_tau_neg", 0.0, "sapo_tau_neg must be > 0"),
        ("vespo_k_neg", -1.0, "vespo_k_neg must be >= 0"),
    ],
)
def test_config_validation(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        L.LossConfig(**{field: value})


def test_config_is_gin_configurable_and_hashable():
    # Scoped bindings leave the global gin config (other tests' bindings) untouched.
    gin.parse_config(
        [
            "test_losses/LossConfig.eps_high = 0.3",
            "test_losses/LossConfig.aggregation = 'seq-mean-token-mean'",
            "test_losses_bad/LossConfig.dual_clip_c = 0.5",
        ]
    )
    with gin.config_scope("test_losses"):
        cfg = L.LossConfig()
    assert cfg.eps_high == 0.3 and cfg.aggregation == "seq-mean-token-mean" and cfg.eps_low == 0.2
    with pytest.raises(ValueError, match="dual_clip_c"), gin.config_scope("test_losses_bad"):
        L.LossConfig()
    assert L.LossConfig().eps_high == 0.28
    assert hash(L.LossConfig()) == hash(L.LossConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.LossConfig().eps_low = 0.1


@pytest.mark.parametrize(
    ("name", "cfg", "pattern"),
    [
        ("gspo", L.LossConfig(dual_clip_c=3.0), "'gspo' has no dual clip"),
        ("sapo", L.LossConfig(dual_clip_c=3.0), "'sapo' has no dual clip"),
        ("vespo", L.LossConfig(tis_cap=2.0), "'vespo' has no token-level TIS"),
        ("gspo_token", L.LossConfig(tis_cap=2.0), "'gspo_token' has no token-level TIS"),
    ],
)
def test_unsupported_options_are_refused(name, cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        _run(name, cfg)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        L.grpo_loss(NEW, BEH, ADV[:, None], MASK, L.LossConfig())
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        L.grpo_loss(NEW, BEH[:, :3], ADV, MASK, L.LossConfig())


def test_unknown_loss_lists_known():
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'.*grpo.*gspo.*gspo_token.*sapo.*vespo"):
        L.get_loss_fn("ppo")
