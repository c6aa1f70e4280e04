"""Parity with HF transformers on random models built locally from small configs (no hub)."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rollverify_jax.models import load_pretrained, save_pretrained
from rollverify_jax.models.hf import config_from_hf

VOCAB = 97


def _dense_cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=128)
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _moe_cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                max_position_embeddings=128)
    base.update(kw)
    return transformers.Qwen3MoeConfig(**base)


CASES = {
    "dense_untied_gqa1_theta1e4": (_dense_cfg, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "dense_tied_gqa4": (_dense_cfg, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "dense_theta5e5_bias": (_dense_cfg, dict(rope_theta=500000.0, attention_bias=True, num_key_value_heads=2)),
    "moe_top2of4_dense_layer0": (_moe_cfg, {}),
    "moe_no_norm_topk_step2": (_moe_cfg, dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2)),
}


def _hf_model(case):
    make, kw = CASES[case]
    torch.manual_seed(0)
    cfg = make(**kw)
    if "rope_theta" in kw:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
    model = (transformers.Qwen3MoeForCausalLM if "moe" in case else transformers.Qwen3ForCausalLM)(cfg)
    with torch.no_grad():  # random norm weights, so a wrong norm mapping cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(3, 11))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    got, router = _forward(model, jax.numpy.asarray(tokens, jax.numpy.int32), return_router_logits=True)
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert len(router) == sum(model.cfg.is_sparse_layer(i) for i in range(model.cfg.num_hidden_layers))


def _forward(model, tokens, **kw):
    """``model(tokens, **kw)`` compiled: eager dispatch compiles each op of a new config on its own."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, **kw))(state, tokens)


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "numpy") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("case", ["dense_untied_gqa1_theta1e4", "moe_top2of4_dense_layer0"])
def test_save_load_round_trip_identical(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "ours", max_shard_bytes=20_000)  # force several shards
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    original, ours = _tensors(tmp_path / "hf"), _tensors(tmp_path / "ours")
    assert set(original) == set(ours)
    for k in original:
        np.testing.assert_array_equal(original[k], ours[k], err_msg=k)
    cls = transformers.Qwen3MoeForCausalLM if "moe" in case else transformers.Qwen3ForCausalLM
    back = cls.from_pretrained(tmp_path / "ours")
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), hf.state_dict()[k].numpy(), err_msg=k)
    again = load_pretrained(tmp_path / "ours")
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again)),
                              strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))


def test_fused_expert_layout_loads(tmp_path):
    """transformers v5's fused expert tensors load to the same model as the per-expert layout."""
    hf = _hf_model("moe_top2of4_dense_layer0")
    hf.save_pretrained(tmp_path / "hf")
    tensors = _tensors(tmp_path / "hf")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = np.stack([
            np.concatenate([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(4)])
        fused[f"{p}.down_proj"] = np.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a, b = load_pretrained(tmp_path / "hf"), load_pretrained(tmp_path / "fused")
    tokens = jax.numpy.arange(12, dtype=jax.numpy.int32).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(_forward(a, tokens)), np.asarray(_forward(b, tokens)))


def test_config_v4_and_v5_layouts():
    v5 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}, "dtype": "bfloat16"}
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4.update(rope_theta=12345.0, torch_dtype="bfloat16")
    for raw in (v4, v5):
        cfg = config_from_hf(raw)
        assert cfg.rope_theta == 12345.0 and cfg.param_dtype == "bfloat16" and cfg.dtype == "bfloat16"
    moe_v5 = dict(v5, architectures=["Qwen3MoeForCausalLM"], num_local_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8)
    assert config_from_hf(moe_v5).num_experts == 4


def test_bfloat16_load(tmp_path):
    hf = _hf_model("dense_tied_gqa4")
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16")
    assert model.embed_tokens[...].dtype == jax.numpy.bfloat16
    ref = load_pretrained(tmp_path)
    tokens = jax.numpy.arange(8, dtype=jax.numpy.int32)[None]
    got = np.asarray(model(tokens))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.asarray(ref(tokens)), atol=0.1)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    hf = _hf_model("dense_tied_gqa4")
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, intermediate_size=40)))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight.*\(48, 32\).*\(40, 32\)"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    hf = _hf_model("dense_tied_gqa4")
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("rollverify_jax.models.hf.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
