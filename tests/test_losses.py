"""Tests for rollverify_jax.rl.losses against independent numpy references written token by token."""

import dataclasses
import math

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


def np_k3(d):
    """verl's 'low_var_kl' of the log-ratio d = ref - new: k3 of d clipped to [-20, 20], its value clipped at 10."""
    d = np.clip(d, -20.0, 20.0)
    return np.minimum(np.exp(d) - d - 1.0, 10.0)


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
        kl = np_k3(REF.astype(np.float64) - NEW)
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


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_k3_is_bounded_like_verls_low_var_kl(name):
    """A token the policy finds e^20 times less likely than the reference (log-ratio ref - new = 20) adds
    kl_coef * K3_CLIP = 10 to the token-mean, not exp(20) - 21 ~ 4.9e8, and gets no gradient; so does one past
    the lower clip (d = -25: k3 = 19 unbounded); a token inside the bound keeps the exact k3 and its gradient."""
    assert L.K3_CLIP == 10.0
    new = np.array([[-21.0, -1.0, -0.1]], np.float32)
    ref = np.array([[-1.0, -0.7, -25.1]], np.float32)  # d = ref - new = 20, 0.3, -25
    mask = np.ones_like(new)
    cfg = L.LossConfig(kl_coef=1.0)
    fn = L.get_loss_fn(name)
    # Zero advantages and mu = pi: the policy term is 0, the loss is the KL term alone.
    (loss, metrics), grad = jax.value_and_grad(
        lambda x: fn(x, new, np.zeros(1, np.float32), mask, cfg, ref_logp=ref), has_aux=True)(jnp.asarray(new))
    inside = math.exp(0.3) - 0.3 - 1.0
    np.testing.assert_allclose(float(loss), (10.0 + inside + 10.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["policy/kl"]), (10.0 + inside + 10.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[0], [0.0, (1.0 - math.exp(0.3)) / 3, 0.0], atol=1e-6)


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


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", -0.1),
        ("eps_low", 1.0),
        ("eps_high", -0.01),
        ("gspo_eps_low", -0.1),
        ("gspo_eps_low", 1.0),
        ("gspo_eps_high", -1e-4),
        ("dual_clip_c", 1.0),
        ("dual_clip_c", 0.5),
        ("max_response_length", 0),
        ("max_response_length", -3),
        ("kl_coef", -1e-3),
        ("tis_cap", 0.0),
        ("tis_cap", -1.0),
        ("sapo_tau_pos", 0.0),
        ("sapo_tau_neg", -1.0),
        ("vespo_lam_pos", 0.0),
        ("vespo_lam_neg", -0.5),
        ("vespo_k_pos", -1e-3),
        ("vespo_k_neg", -2.0),
    ],
)
def test_config_error_names_the_field_and_value(field, value):
    # Just outside each bound: the error names exactly the offending field and echoes its value.
    with pytest.raises(ValueError) as info:
        L.LossConfig(**{field: value})
    message = str(info.value).splitlines()[0]  # gin appends the configurable on a second line
    assert message.startswith(f"LossConfig.{field} must be ") and message.endswith(f"got {value}."), message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", 0.0),
        ("eps_low", 0.99),
        ("eps_high", 0.0),
        ("gspo_eps_low", 0.0),
        ("gspo_eps_low", 0.99),
        ("gspo_eps_high", 0.0),
        ("dual_clip_c", 1.01),
        ("dual_clip_c", 1.5),
        ("max_response_length", 1),
        ("kl_coef", 0.0),
        ("kl_coef", 0.5),
        ("tis_cap", 0.01),
        ("tis_cap", 0.5),
        ("sapo_tau_pos", 0.01),
        ("sapo_tau_neg", 0.5),
        ("vespo_lam_pos", 0.01),
        ("vespo_lam_neg", 0.5),
        ("vespo_k_pos", 0.0),
        ("vespo_k_pos", 0.5),
        ("vespo_k_neg", 0.0),
        ("vespo_k_neg", 0.5),
    ],
)
def test_config_accepts_values_just_inside_the_bounds(field, value):
    cfg = L.LossConfig(**{field: value})
    assert getattr(cfg, field) == value


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
def test_config_accepts_every_aggregation(aggregation):
    assert L.LossConfig(aggregation=aggregation).aggregation == aggregation


def test_config_is_gin_configurable_and_hashable(spec_of):
    spec = spec_of("LossConfig.eps_high = 0.3", "LossConfig.aggregation = 'seq-mean-token-mean'")
    cfg = spec.loss
    assert cfg.eps_high == 0.3 and cfg.aggregation == "seq-mean-token-mean" and cfg.eps_low == 0.2
    assert spec.learner.loss == cfg  # the learner's loss is the spec's
    with pytest.raises(ValueError, match="dual_clip_c"):
        spec_of("LossConfig.dual_clip_c = 0.5")
    assert L.LossConfig().eps_high == 0.28
    assert hash(L.LossConfig()) == hash(L.LossConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.LossConfig().eps_low = 0.1


# Configs are built inside the test, not at import: mutation testing swaps LossConfig's code per test run.
@pytest.mark.parametrize(
    ("name", "options", "pattern"),
    [
        ("gspo", {"dual_clip_c": 3.0}, "'gspo' has no dual clip"),
        ("sapo", {"dual_clip_c": 3.0}, "'sapo' has no dual clip"),
        ("vespo", {"tis_cap": 2.0}, "'vespo' has no token-level TIS"),
        ("gspo_token", {"tis_cap": 2.0}, "'gspo_token' has no token-level TIS"),
    ],
)
def test_unsupported_options_are_refused(name, options, pattern):
    with pytest.raises(ValueError, match=pattern):
        _run(name, L.LossConfig(**options))


def test_shape_errors():
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        L.grpo_loss(NEW, BEH, ADV[:, None], MASK, L.LossConfig())
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        L.grpo_loss(NEW, BEH[:, :3], ADV, MASK, L.LossConfig())


def test_unknown_loss_lists_known():
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'.*grpo.*gspo.*gspo_token.*sapo.*vespo"):
        L.get_loss_fn("ppo")


# ---------------------------------------------------------------------------------------------------------
# A second, hand-made batch run through a general float64 reference (values, metrics and gradients)
# ---------------------------------------------------------------------------------------------------------

# Per-row log ratios (new - behavior) on the masked tokens, chosen so that each branch is taken somewhere:
#   row 0, A > 0: r = 1.65 clipped high, r = 0.67 below 1 - eps_low (unclipped for A > 0); GSPO clipped high.
#   row 1, A < 0: r = 4.48 beyond the dual clip c = 3 and the TIS cap, r = 2.46 unclipped (only the dual clip
#       could act), r = 0.61 clipped low; GSPO unclipped (s > 1 with A < 0).
#   row 2: fully masked (its log-probs are garbage and must not matter).
#   row 3, A = 0: no gradient, but VESPO's phi_mean still sees which kernel A = 0 selects.
#   row 4, A < 0: a single token (means over exactly one token), GSPO unclipped (s > 1 with A < 0).
#   row 5, A < 0: GSPO clipped low (s < 1 - 3e-4).
#   row 6, A > 0: near on-policy, inside GSPO's tiny clip range, so its sequence gradient flows.
EDGE_LR = [
    [0.5, -0.4, 0.1, -0.05, 0.2],
    [1.5, 0.9, -0.5, 0.0],
    [],
    [0.3, -0.2, 0.05],
    [0.3],
    [-0.2, 0.1],
    [1e-4, -5e-5, 2e-4],
]
EDGE_ADV = np.array([1.0, -2.0, 0.7, 0.0, -0.5, -0.3, 0.9], np.float32)
EB, ET = len(EDGE_LR), 5


def _edge_batch():
    rng = np.random.default_rng(1)
    beh = rng.uniform(-2.5, -0.2, size=(EB, ET)).astype(np.float32)
    mask = np.zeros((EB, ET), np.float32)
    new = beh + rng.uniform(-3.0, 3.0, size=(EB, ET)).astype(np.float32)  # padding: anything
    for b, row in enumerate(EDGE_LR):
        mask[b, : len(row)] = 1.0
        new[b, : len(row)] = beh[b, : len(row)] + np.asarray(row, np.float32)
    ref = (new + rng.uniform(-0.4, 0.4, size=(EB, ET))).astype(np.float32)
    ent = rng.uniform(0.0, 3.0, size=(EB, ET)).astype(np.float32)
    return new.astype(np.float32), beh, mask, ref, ent


E_NEW, E_BEH, E_MASK, E_REF, E_ENT = _edge_batch()


def ref_aggregate(mat, mask, mode, max_len=None):
    rows = [[t for t in range(mask.shape[1]) if mask[b, t] > 0] for b in range(mask.shape[0])]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(mat[b, t] for b, r in enumerate(rows) for t in r) / max(n, 1)
    per_seq = []
    for b, toks in enumerate(rows):
        if toks:
            s = sum(mat[b, t] for t in toks)
            per_seq.append(s / len(toks) if mode == "seq-mean-token-mean" else s / (max_len or mask.shape[1]))
    return sum(per_seq) / max(len(per_seq), 1)


def ref_masked_mean(x, mask):
    n = float(np.sum(mask > 0))
    return float(np.sum(np.where(mask > 0, x, 0.0))) / max(n, 1.0)


def ref_policy(name, new, beh, adv, mask, cfg, new_sg=None):
    """Per-token loss, clip and dual-clip indicators and VESPO's phi `[B]`; `new_sg` holds the stop-gradient'ed
    copy of `new` (equal to it for values; fixed while `new` is perturbed for finite differences)."""
    new_sg = new if new_sg is None else new_sg
    b_n, t_n = new.shape
    lr = np.clip(new.astype(np.float64) - beh, -20.0, 20.0)
    lr_sg = np.clip(new_sg.astype(np.float64) - beh, -20.0, 20.0)
    mat, clip, dual = np.zeros((b_n, t_n)), np.zeros((b_n, t_n), bool), np.zeros((b_n, t_n), bool)
    phi = np.zeros(b_n)
    for b in range(b_n):
        a = float(adv[b])
        toks = [t for t in range(t_n) if mask[b, t] > 0]
        seq_lr = sum(lr[b, t] for t in toks) / max(len(toks), 1)
        seq_lr_sg = sum(lr_sg[b, t] for t in toks) / max(len(toks), 1)
        if name == "vespo":
            log_w = min(max(sum(lr_sg[b, t] for t in toks), -20.0), 20.0)
            k, lam = (cfg.vespo_k_pos, cfg.vespo_lam_pos) if a >= 0 else (cfg.vespo_k_neg, cfg.vespo_lam_neg)
            phi[b] = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in toks:
            r, r_sg = math.exp(lr[b, t]), math.exp(lr_sg[b, t])
            tis = 1.0 if cfg.tis_cap is None else min(r_sg, cfg.tis_cap) / r_sg
            if name == "grpo":
                loss, clip[b, t] = np_ppo(r, a, cfg.eps_low, cfg.eps_high)
                if cfg.dual_clip_c is not None and a < 0 and loss > -a * cfg.dual_clip_c:
                    loss, clip[b, t], dual[b, t] = -a * cfg.dual_clip_c, True, True
                mat[b, t] = loss * tis
            elif name == "gspo":
                mat[b, t], clip[b, t] = np_ppo(math.exp(seq_lr), a, cfg.gspo_eps_low, cfg.gspo_eps_high)
            elif name == "gspo_token":
                s = math.exp(seq_lr_sg + float(new[b, t]) - float(new_sg[b, t]))
                mat[b, t], clip[b, t] = np_ppo(s, a, cfg.gspo_eps_low, cfg.gspo_eps_high)
            elif name == "sapo":
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                mat[b, t] = -4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0))) * a * tis
            else:
                mat[b, t] = -phi[b] * a * float(new[b, t])
    return mat, clip, dual, phi


def ref_loss(name, new, beh, adv, mask, cfg, ref=None, new_sg=None):
    mat, _, _, _ = ref_policy(name, new, beh, adv, mask, cfg, new_sg)
    loss = ref_aggregate(mat, mask, cfg.aggregation, cfg.max_response_length)
    if cfg.kl_coef > 0:
        loss += cfg.kl_coef * ref_aggregate(np_k3(ref.astype(np.float64) - new), mask, cfg.aggregation,
                                            cfg.max_response_length)
    return loss


def ref_all_metrics(name, new, beh, adv, mask, cfg, ref=None, ent=None):
    mat, clip, dual, phi = ref_policy(name, new, beh, adv, mask, cfg)
    ratio = np.exp(np.clip(new.astype(np.float64) - beh, -20.0, 20.0))
    out = {
        "loss": ref_loss(name, new, beh, adv, mask, cfg, ref),
        "policy/pg_loss": ref_aggregate(mat, mask, cfg.aggregation, cfg.max_response_length),
        "policy/ratio_mean": ref_masked_mean(ratio, mask),
        "ops/token_mean": ref_masked_mean(np.abs(ratio - 1.0), mask),
        "policy/clip_fraction": ref_masked_mean(clip, mask),
    }
    if ent is not None:
        out["policy/entropy"] = ref_masked_mean(ent, mask)
    if cfg.kl_coef > 0:
        out["policy/kl"] = ref_masked_mean(np_k3(ref.astype(np.float64) - new), mask)
    if name == "grpo" and cfg.dual_clip_c is not None:
        out["policy/dual_clip_fraction"] = ref_masked_mean(dual, mask)
    if name == "vespo":
        live = mask.sum(axis=1) > 0
        out["vespo/phi_mean"] = float(phi[live].mean())
    return out


def ref_weights(mask, mode, max_len=None):
    """d(aggregate)/d(token loss) `[B, L]`: aggregation is linear in the per-token loss."""
    n_b, n_t = mask.shape
    w = np.zeros((n_b, n_t))
    for b in range(n_b):
        for t in range(n_t):
            one = np.zeros((n_b, n_t))
            one[b, t] = 1.0
            w[b, t] = ref_aggregate(one, mask, mode, max_len)
    return w


def ref_grad(name, new, beh, adv, mask, cfg, ref=None, h=1e-5):
    """Central finite differences of the float64 reference, stop-gradient'ed parts held at `new`.

    Token terms are differenced before they are summed, so huge terms elsewhere (exp(20)) cancel exactly."""
    w = ref_weights(mask, cfg.aggregation, cfg.max_response_length)

    def token_terms(x):
        mat = ref_policy(name, x, beh, adv, mask, cfg, new_sg=new.astype(np.float64))[0]
        if cfg.kl_coef > 0:
            mat = mat + cfg.kl_coef * np_k3(ref.astype(np.float64) - x)
        return w * mat

    grad = np.zeros(new.shape)
    for b, t in zip(*np.nonzero(mask > 0), strict=True):
        bump = np.zeros(new.shape)
        bump[b, t] = h
        grad[b, t] = np.sum(token_terms(new + bump) - token_terms(new - bump)) / (2 * h)
    return grad


def _edge_check(name, cfg, new=E_NEW, beh=E_BEH, adv=EDGE_ADV, mask=E_MASK, ref=E_REF, ent=E_ENT):
    """Loss, every metric (same key set) and the gradient of `name` against the reference."""
    fn = L.get_loss_fn(name)
    kw = {"ref_logp": ref if cfg.kl_coef > 0 else None, "entropy": ent}
    (loss, metrics), grad = jax.value_and_grad(lambda x: fn(x, beh, adv, mask, cfg, **kw), has_aux=True)(
        jnp.asarray(new)
    )
    want = ref_all_metrics(name, new, beh, adv, mask, cfg, kw["ref_logp"], ent)
    assert set(metrics) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5, atol=1e-6)
    want_grad = ref_grad(name, new, beh, adv, mask, cfg, kw["ref_logp"])
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-3, atol=1e-6)
    return metrics, np.asarray(grad)


EDGE_CONFIGS = {
    "plain": {},
    "dual_tis": {"dual_clip_c": 3.0, "tis_cap": 2.0},
    "dual_only": {"dual_clip_c": 2.2},
    "tis_low_cap": {"tis_cap": 0.9, "eps_low": 0.1, "eps_high": 0.4},
    "kl": {"kl_coef": 0.3},
    "sum_norm_len": {"max_response_length": 7},
    "kernels": {"sapo_tau_pos": 0.5, "sapo_tau_neg": 2.0, "vespo_k_pos": 1.0, "vespo_lam_pos": 0.5},
}


def _edge_cases():
    for cfg_name, extra in EDGE_CONFIGS.items():
        for name in sorted(L.LOSSES):
            if ("dual_clip_c" in extra and name != "grpo") or ("tis_cap" in extra and name not in ("grpo", "sapo")):
                continue  # refused options (see test_every_unsupported_option_is_refused_by_name)
            if cfg_name == "kernels" and name not in ("sapo", "vespo"):
                continue  # fields only these losses read
            for aggregation in L.AGGREGATIONS:
                if cfg_name == "sum_norm_len" and aggregation != "seq-mean-token-sum-norm":
                    continue  # the only aggregation that reads max_response_length
                yield pytest.param(name, aggregation, extra, id=f"{name}-{aggregation}-{cfg_name}")


@pytest.mark.parametrize(("name", "aggregation", "extra"), list(_edge_cases()))
def test_edge_batch_value_metrics_and_gradient(name, aggregation, extra):
    _edge_check(name, L.LossConfig(aggregation=aggregation, **extra))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_extreme_log_ratios_are_clipped_per_token(name, aggregation):
    # |new - behavior| and |ref - new| beyond 20 are clipped token by token, before GSPO's sequence mean and
    # VESPO's sequence sum: row 0's clipped log ratios (-20, 20, 0) average to 0, unclipped they would not.
    beh = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], np.float32)
    new = beh + np.array([[-30.0, 25.0, 0.0], [22.0, 0.1, 9.0]], np.float32)
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], np.float32)
    ref = new + np.array([[25.0, -26.0, 0.2], [0.3, -0.1, 0.0]], np.float32)
    adv = np.array([-1.0, 1.0], np.float32)
    cfg = L.LossConfig(aggregation=aggregation, kl_coef=0.1)
    metrics, _ = _edge_check(name, cfg, new=new, beh=beh, adv=adv, mask=mask, ref=ref, ent=None)
    want_ratio = (math.exp(-20) + 2 * math.exp(20) + 1 + math.exp(0.1)) / 5
    np.testing.assert_allclose(float(metrics["policy/ratio_mean"]), want_ratio, rtol=1e-5)
    if name == "vespo":  # log W = 0 for row 0 (phi = 1), log W = 20 for row 1 (phi = 0)
        np.testing.assert_allclose(float(metrics["vespo/phi_mean"]), 0.5, rtol=1e-6)


def test_low_precision_inputs_are_computed_in_float32():
    # bfloat16 inputs (exactly representable values) give the float32 result: -A c for the dual-clipped token
    # is computed in float32 (c = 2.2 is not a bfloat16 number).
    cfg = L.LossConfig(dual_clip_c=2.2, tis_cap=2.0, aggregation="seq-mean-token-mean")
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (E_NEW, E_BEH, EDGE_ADV, E_MASK)]
    exact = [np.asarray(x, np.float32) for x in as_bf16]
    for name in ("grpo", "sapo"):
        fn = L.get_loss_fn(name)
        kw = {"dual_clip_c": None} if name == "sapo" else {}
        c = dataclasses.replace(cfg, **kw)
        loss, metrics = fn(*as_bf16, c)
        want_loss, want_metrics = fn(*exact, c)
        assert loss.dtype == jnp.float32
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
        for key, value in want_metrics.items():
            np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-6, err_msg=key)


def test_clip_indicators_are_strict_at_ties():
    # r = 2 exactly (float32 exp of this log ratio), A < 0: with c = 2 the dual cap equals the PPO loss, so
    # the token is not counted as dual-clipped; r = 2.5 > c is. With eps_high = 1 the clip bound 1 + eps_high
    # equals r = 2 for the A > 0 row: the clipped branch does not win strictly, so it is not counted either.
    lr_two = np.float32(0.6931472)
    assert float(jnp.exp(jnp.float32(0.0) - jnp.float32(-lr_two))) == 2.0
    new = np.zeros((2, 2), np.float32)
    beh = np.array([[-lr_two, -math.log(2.5)], [-lr_two, -0.1]], np.float32)
    mask = np.ones((2, 2), np.float32)
    adv = np.array([-1.0, 1.0], np.float32)
    cfg = L.LossConfig(dual_clip_c=2.0, eps_high=1.0)
    loss, metrics = L.grpo_loss(new, beh, adv, mask, cfg)
    np.testing.assert_allclose(float(metrics["policy/dual_clip_fraction"]), 1 / 4)
    np.testing.assert_allclose(float(metrics["policy/clip_fraction"]), 1 / 4)
    # -A c for both A < 0 tokens, -A r for the A > 0 ones.
    np.testing.assert_allclose(float(loss), (2.0 + 2.0 - 2.0 - math.exp(0.1)) / 4, rtol=1e-6)


def test_vespo_overflowing_kernel_gives_zero_weight():
    # phi = exp(lam + k log W - lam W) overflows float32 for k = 100, log W = 5: that sequence gets weight 0
    # (no inf/NaN in the loss or the gradient), while the A < 0 sequence keeps its finite phi.
    cfg = L.LossConfig(vespo_k_pos=100.0, vespo_lam_pos=0.01)
    beh = np.full((2, 2), -1.0, np.float32)
    new = beh + np.array([[2.5, 2.5], [0.2, -0.1]], np.float32)
    mask = np.ones((2, 2), np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    fn = lambda x: L.vespo_loss(x, beh, adv, mask, cfg)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(new))
    phi_neg = math.exp(2.0 + 3.0 * 0.1 - 2.0 * math.exp(0.1))
    np.testing.assert_allclose(float(metrics["vespo/phi_mean"]), phi_neg / 2, rtol=1e-5)
    np.testing.assert_allclose(float(loss), phi_neg * float(new[1].sum()) / 4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.0], [phi_neg / 4, phi_neg / 4]], rtol=1e-5)


def test_bfloat16_masks_count_every_token():
    # bfloat16 cannot count past 256 (256 + 1 rounds to 256): masks are cast to float32 before counting, so a
    # bfloat16 mask over 257 tokens gives the float32 results for masked_mean and for every loss.
    n = 257
    rng = np.random.default_rng(2)
    beh = rng.uniform(-2.0, -0.5, size=(2, n)).astype(np.float32)
    new = (beh + rng.uniform(-0.3, 0.3, size=(2, n))).astype(np.float32)
    mask = np.ones((2, n), np.float32)
    mask[1, 200:] = 0.0
    mat = rng.uniform(-1.0, 1.0, size=(2, n)).astype(np.float32)
    half = jnp.asarray(mask, jnp.bfloat16)
    for got, want in [
        (L.masked_mean(mat, half), L.masked_mean(mat, mask)),
        (L.masked_mean(mat, half, axis=-1), L.masked_mean(mat, mask, axis=-1)),
    ]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    for aggregation in L.AGGREGATIONS:
        cfg = L.LossConfig(aggregation=aggregation)
        np.testing.assert_allclose(float(L.aggregate(mat, half, cfg)), float(L.aggregate(mat, mask, cfg)), rtol=1e-6)
    cfg = L.LossConfig(aggregation="seq-mean-token-mean")
    adv = np.array([0.5, -1.0], np.float32)
    np.testing.assert_allclose(
        float(L.grpo_loss(new, beh, adv, half, cfg)[0]), float(L.grpo_loss(new, beh, adv, mask, cfg)[0]), rtol=1e-6
    )


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_seq_means_with_a_single_live_sequence(aggregation):
    # One live sequence (the other is dropped: all-zero mask): the loss is that sequence's own term.
    mat = np.array([[0.3, -1.2, 0.6], [5.0, 5.0, 5.0]], np.float32)
    mask = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    cfg = L.LossConfig(aggregation=aggregation, max_response_length=4)
    want = (0.3 - 1.2) / (2 if aggregation == "seq-mean-token-mean" else 4)
    np.testing.assert_allclose(float(L.aggregate(mat, mask, cfg)), want, rtol=1e-6)
    assert float(L.aggregate(mat, np.zeros_like(mask), cfg)) == 0.0


@pytest.mark.parametrize("name", sorted(L.LOSSES))
def test_bfloat16_log_probs_get_the_float32_gradient(name):
    # Mixed precision: bfloat16 log-probs are cast to float32 once, so their gradient is the float32 gradient
    # (summed over the policy and KL paths in float32) rounded once to bfloat16.
    cfg = L.LossConfig(kl_coef=0.7)
    fn = L.get_loss_fn(name)
    new16 = jnp.asarray(E_NEW, jnp.bfloat16)
    grad = lambda x: jax.grad(lambda y: fn(y, E_BEH, EDGE_ADV, E_MASK, cfg, ref_logp=E_REF)[0])(x)
    got = grad(new16)
    want = grad(jnp.asarray(new16, jnp.float32)).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


UNSUPPORTED = [
    (name, option)
    for name in sorted(L.LOSSES)
    for option in ("dual_clip_c", "tis_cap")
    if not (name == "grpo" or (name == "sapo" and option == "tis_cap"))
]


@pytest.mark.parametrize(("name", "option"), UNSUPPORTED)
def test_every_unsupported_option_is_refused_by_name(name, option):
    # Only grpo has a dual clip; only grpo and sapo have token-level TIS. The others refuse the option.
    words = "no dual clip" if option == "dual_clip_c" else "no token-level TIS"
    with pytest.raises(ValueError, match=f"loss '{name}' has {words}; set LossConfig.{option} = None"):
        L.get_loss_fn(name)(E_NEW, E_BEH, EDGE_ADV, E_MASK, L.LossConfig(**{option: 2.0}))


def test_supported_options_are_accepted():
    for name, cfg in [
        ("grpo", L.LossConfig(dual_clip_c=2.0, tis_cap=2.0)),
        ("sapo", L.LossConfig(tis_cap=2.0)),
    ]:
        loss, _ = L.get_loss_fn(name)(E_NEW, E_BEH, EDGE_ADV, E_MASK, cfg)
        assert np.isfinite(float(loss))


def test_vespo_sequence_log_weight_is_clipped_to_20():
    # Per-token log ratios within +-20 can still sum past +-20: log W is clipped to [-20, 20]. Kernels for which
    # that matters: (k, lam) = (0, 1e-9) for A > 0 with log W = 25 -> 20 (phi = exp(-1e-9 e^20) = 0.62, not 0)
    # and (0.1, 2) for A < 0 with log W = -30 -> -20 (phi = exp(2 - 2) = 1, not exp(-1)).
    cfg = L.LossConfig(vespo_k_pos=0.0, vespo_lam_pos=1e-9, vespo_k_neg=0.1, vespo_lam_neg=2.0)
    beh = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], np.float32)
    new = beh + np.array([[12.5, 12.5, 0.0], [-15.0, -15.0, 0.0]], np.float32)
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    metrics, grad = _edge_check("vespo", cfg, new=new, beh=beh, adv=adv, mask=mask, ent=None)
    phi = [math.exp(1e-9 - 1e-9 * math.exp(20.0)), math.exp(2.0 - 2.0 - 2.0 * math.exp(-20.0))]
    np.testing.assert_allclose(float(metrics["vespo/phi_mean"]), sum(phi) / 2, rtol=1e-5)
    np.testing.assert_allclose(grad[:, :2], [[-phi[0] / 4] * 2, [phi[1] / 4] * 2], rtol=1e-5)


def test_vespo_gives_no_gradient_to_a_sequence_whose_weight_is_undefined():
    """A NaN behaviour log-prob on a response token leaves W undefined: phi is 0 and that sequence adds no
    gradient, while a clean sequence (W = 1, phi = 1) keeps its full gradient."""
    new = np.full((2, 3), -1.0, np.float32)
    behavior = new.copy()
    behavior[0, 1] = np.nan
    adv, mask = np.ones(2, np.float32), np.ones((2, 3), np.float32)
    cfg = L.LossConfig()
    grad = np.asarray(jax.grad(lambda n: L.vespo_loss(n, behavior, adv, mask, cfg)[0])(jnp.asarray(new)))
    np.testing.assert_array_equal(grad[0], np.zeros(3))
    assert np.all(np.isfinite(grad[1])) and np.all(grad[1] < 0)
