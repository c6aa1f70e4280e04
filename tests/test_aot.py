"""The deviceless TPU compile (`python -m rollverify_jax.aot`) on a small topology: all three programs compile
with the TPU kernels (splash attention in the train step and prefill, Pallas paged attention per device in
decode), and the report's numbers hang together."""

import json

import gin
import jax
import pytest

from rollverify_jax import aot
from rollverify_jax.scale import fit

pytest.importorskip("libtpu", reason="the deviceless TPU compile needs libtpu (pip install -e '.[test]')")

# The tiny RollVerify run, two layers (scanned in the train step), head_dim 128 so the Pallas paged-attention
# kernel (128-lane tiles) is the decode attention, on a 4-chip v5p slice with the pool and slots over 4 devices.
PARAMS = [
    "TrainConfig.policy_path = None", "model_config.preset = 'tiny'", "model_config.num_hidden_layers = 2",
    "model_config.num_attention_heads = 2", "model_config.num_key_value_heads = 1", "model_config.head_dim = 128",
    "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 256", "EngineConfig.logits_chunk = 64",
    "LearnerConfig.logits_chunk = 64", "LearnerConfig.remat = 'full'", "LearnerConfig.scan_layers = True",
    "make_mesh.shape = (1, -1, 1)",
    "AotConfig.topology = 'v5p:2x2x1'",
]


@pytest.fixture(scope="module", autouse=True)
def optimized_backend():
    """The TPU programs compile as ``python -m rollverify_jax.aot`` compiles them, with every optimization (the
    suite turns LLVM's passes off for its CPU programs, conftest.py)."""
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "report.json"
    aot.main(["--gin_file=configs/tiny_rollverify.gin", *(f"--gin_param={p}" for p in PARAMS),
              f"--json={out}"])
    return json.loads(out.read_text())


def test_three_programs_compile_for_the_topology(report):
    assert report["topology"] == "v5p:2x2x1" and report["num_devices"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert set(report["programs"]) == {"train_step", "prefill", "decode"}
    for name, p in report["programs"].items():
        assert p["argument_bytes"] > 0 and p["flops"] > 0, name


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """The same run with the tensor serving layout, kl_coef > 0 and tool use: one more compile checks what each
    adds."""
    out = tmp_path_factory.mktemp("aot") / "variant.json"
    aot.main(["--gin_file=configs/tiny_rollverify.gin", *(f"--gin_param={p}" for p in PARAMS),
              "--gin_param=EngineConfig.serving_layout = 'tensor'", "--gin_param=LossConfig.kl_coef = 0.1",
              "--gin_param=ToolUseConfig.enabled = True", "--gin_param=ToolUseConfig.max_reply_tokens = 48",
              f"--json={out}"])
    return json.loads(out.read_text())


def test_report_adds_up(report):
    res = report["resident"]
    assert report["resident_bytes_per_device"] == (res["train_state"] + res["kv_pool"] + res["serving_params"]
                                                   + res["ref_params"])
    assert res["serving_params"] == 0  # the train layout: the engine's weights are the train state's arrays
    assert res["ref_params"] == 0 and report["logprobs_for"] == []  # kl_coef = 0, no filter reading pi
    assert res["params"] < res["train_state"]  # + float32 moments
    assert report["peak_bytes_per_device"] >= report["resident_bytes_per_device"]
    assert report["fits"] is (report["peak_bytes_per_device"] <= report["budget_bytes_per_device"])
    assert report["budget_bytes_per_device"] == int(0.9 * report["hbm_bytes_per_device"])


def test_unknown_topology_is_a_clear_error(capsys):
    gin.clear_config()
    with pytest.raises(SystemExit) as e:
        aot.main(["--gin_file=configs/tiny_rollverify.gin", "--topology=v9x:1x1"])
    gin.clear_config()
    assert e.value.code == 2
    assert "cannot describe TPU topology 'v9x:1x1'" in capsys.readouterr().err


def test_report_has_the_train_step_packing_at_the_length_model(report):
    train = report["train"]
    assert report["train_useful_token_fraction"] == train["train_useful_token_fraction"]
    assert 0 < train["train_useful_token_fraction"] <= 1
    assert train["train_speedup_vs_unpacked"] >= 1  # packed rows never compute more than one row per sequence
    assert report["estimate"]["train_step_s"] > 0 and report["estimate"]["train_mfu"] == 0.45


def test_packed_train_estimate_counts_the_positions_the_step_computes():
    """Against hand arithmetic: unpacked, every sequence is a full row; packed at a length model of short
    sequences, a minibatch of 8 fills one micro-batch of 2 rows."""
    from rollverify_jax.models.qwen3 import model_config
    from rollverify_jax.rl.learner import LearnerConfig
    from rollverify_jax.scale.aot_config import AotConfig

    cfg = model_config("tiny")
    short = AotConfig(response_length_median=20.0, response_length_sigma=0.0, prompt_len=10)  # every sequence 30
    padded = fit.packed_train_estimate(cfg, LearnerConfig(pack_sequences=False), 16, 128, 100, short, 1)
    assert padded["train_useful_token_fraction"] == pytest.approx(30 / 128)
    assert padded["train_speedup_vs_unpacked"] == pytest.approx(1.0)
    packed = fit.packed_train_estimate(cfg, LearnerConfig(num_minibatches=2, micro_batch_size=2), 16, 128, 100,
                                       short, 1)
    # 8 sequences of 30 per minibatch: 4 per row of 128, two rows, one micro-batch of 2 rows.
    assert packed["train_micro_batches_per_update"] == 1
    assert packed["train_useful_token_fraction"] == pytest.approx(240 / 256)
    assert packed["train_speedup_vs_unpacked"] == pytest.approx(4.0)  # 16 rows of 128 -> 4 rows of 128


def test_report_has_the_decode_roofline(report):
    """The decode section: the kernel on both of a v5p chip's TensorCores (one KV head, 2 slots per chip: split by
    slot), collectives read from the compiled step, and the roofline fraction in (0, 1]."""
    d = report["decode"]
    assert report["decode_roofline_fraction"] == d["decode_roofline_fraction"]
    assert 0 < d["decode_roofline_fraction"] <= 1
    assert d["two_cores_per_chip"] and d["kernel_on_both_cores"]
    assert [k["grid"][0] for k in d["attention_kernels"]] == [2]
    assert d["collectives_per_step"]["count"] > 0  # FSDP weights: activations all-reduced over 'fsdp'
    assert d["weights_bytes_per_chip"] >= d["weights_min_bytes_per_chip"]
    phase = d["on_policy_phase"]
    assert phase["rules"]["stale"]["kv_read_ratio"] >= phase["rules"]["one"]["kv_read_ratio"] >= 1
    assert d["full_slots"]["roofline_s"] <= d["full_slots"]["estimate_s"]


def test_serving_layout_copy_is_counted_and_drops_the_decode_collectives(report, variant):
    """EngineConfig.serving_layout = 'tensor' on a pure-FSDP mesh: the engine holds whole weights on each chip (a
    copy, resident beside the train state and outside the train step), and decode needs no per-layer
    all-reduces over 'fsdp'."""
    r = variant
    res = r["resident"]
    assert res["serving_params"] == r["decode"]["weights_bytes_per_chip"] > res["params"]
    assert r["resident_bytes_per_device"] == (report["resident_bytes_per_device"] + res["serving_params"]
                                              + res["ref_params"])
    before, after = report["decode"]["collectives_per_step"], r["decode"]["collectives_per_step"]
    assert after["count"] < before["count"] and after["bytes"] < before["bytes"]


def test_kl_compiles_the_reference_pass_and_counts_its_params(report, variant):
    """kl_coef > 0: the packed log-prob pass of the reference is compiled (at the train step's packed batch, the
    reference params in the train state's layout), the reference params are resident through every program, and
    the report says so; without the KL (and no OPS filter or pi_old) there is no such pass."""
    assert set(report["programs"]) == {"train_step", "prefill", "decode"}
    assert set(variant["programs"]) == {"train_step", "prefill", "decode", "logprobs", "extend"}
    assert variant["logprobs_for"] == ["reference"]
    res, logprobs = variant["resident"], variant["programs"]["logprobs"]
    assert res["ref_params"] == res["params"] == report["resident"]["params"] > 0
    assert logprobs["argument_bytes"] >= res["params"] and logprobs["flops"] > 0
    # a forward without the backward over the same rows: fewer FLOPs than the update
    assert logprobs["flops"] < variant["programs"]["train_step"]["flops"]
    peaks, base = variant["peak_bytes_by_program"], report["peak_bytes_by_program"]
    # every program runs beside the reference params (and the serving copy of the variant)
    extra = res["ref_params"] + res["serving_params"]
    assert peaks["train_step"] >= base["train_step"] + extra
    assert peaks["logprobs"] >= variant["resident_bytes_per_device"] + logprobs["temp_bytes"]
    assert variant["peak_bytes_per_device"] > report["peak_bytes_per_device"]
    text = fit.format_report(variant)
    assert "logprobs" in text and "for reference" in text and "reference params" in text


def test_tool_use_compiles_the_reply_extension_beside_the_engine(report, variant):
    """ToolUseConfig.enabled: Engine.extend (every slot's reply at once, 64 tokens each) compiles with the TPU
    layout, counted beside the train state like decode, within the plan (its keys come one block of pages at a
    time)."""
    extend, peaks = variant["programs"]["extend"], variant["peak_bytes_by_program"]
    assert "extend" not in report["programs"] and extend["flops"] > 0
    assert peaks["extend"] <= variant["peak_bytes_per_device"] <= variant["budget_bytes_per_device"]


def test_scale_reads_no_spec_and_imports_nothing_from_run():
    """scale/ is pure analysis: the run's programs come in assembled (run/programs.py), no arrow points back up."""
    import ast
    from pathlib import Path

    for path in sorted(Path(fit.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("rollverify_jax.run") for n in names), (path.name, names)


@pytest.fixture(scope="module")
def async_report(tmp_path_factory):
    """The tiny run in the asynchronous mode on a v5p slice of 2 hosts x 4 chips, 2 + 2 a host: the learner's
    programs on the train mesh's 4 chips, the engine's on the rollout mesh's 4. A batch of 8 rows keeps the train
    step's compile to seconds."""
    out = tmp_path_factory.mktemp("aot") / "async.json"
    aot.main(["--gin_file=configs/tiny_rollverify_async.gin", *(f"--gin_param={p}" for p in PARAMS),
              "--gin_param=RolloutConfig.batch_groups = 4", "--gin_param=RolloutConfig.group_size = 2",
              "--gin_param=AsyncConfig.rollout_devices = 2", "--gin_param=AsyncConfig.rollout_mesh = (1, -1, 1)",
              "--topology=v5p:2x2x2", f"--json={out}"])
    return json.loads(out.read_text())


def test_async_compiles_each_side_on_its_own_mesh_and_reports_both(async_report):
    """Each host's first two chips (by id) decode, its last two train; the train chips hold the train state and
    run the train step, the rollout chips hold the serving weights, their staging copy and the KV pool and run
    prefill and decode; each side's peak is against the chip's HBM, and both fit."""
    r = async_report
    train, rollout = r["meshes"]["train"], r["meshes"]["rollout"]
    assert r["num_devices"] == 8 and train["num_devices"] == rollout["num_devices"] == 4
    assert rollout["devices"] == [0, 1, 4, 5] and train["devices"] == [2, 3, 6, 7]  # host 0: ids 0-3, host 1: 4-7
    assert r["mesh"] == train["mesh"] == r["rollout_mesh"] == rollout["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert set(train["peak_bytes_by_program"]) == {"train_step"}
    assert set(rollout["peak_bytes_by_program"]) == {"prefill", "decode"}
    res = r["resident"]
    assert res["serving_params"] == res["staging_params"] == r["decode"]["weights_bytes_per_chip"] > 0
    assert train["resident_bytes_per_device"] == res["train_state"]  # no KV, no serving copy on the train chips
    assert rollout["resident_bytes_per_device"] == 2 * res["serving_params"] + res["kv_pool"]
    decode = r["programs"]["decode"]  # its arguments are the serving weights and the pool; the staging copy waits
    assert rollout["peak_bytes_by_program"]["decode"] == (decode["argument_bytes"] + decode["output_bytes"]
                                                          - decode["alias_bytes"] + decode["temp_bytes"]
                                                          + res["staging_params"])
    assert train["fits"] and rollout["fits"] and r["fits"]
    assert r["peak_bytes_per_device"] == max(train["peak_bytes_per_device"], rollout["peak_bytes_per_device"])
    text = fit.format_report(r)
    assert "rollout mesh" in text and "train mesh" in text and "staging copy" in text


@pytest.fixture(scope="module")
def lora_report(tmp_path_factory):
    """The tiny run with rank-16 LoRA (configs/tiny_rollverify_lora.gin) at the same shapes: the engine runs the
    adapted model, so its programs take the base and the adapters."""
    out = tmp_path_factory.mktemp("aot") / "lora.json"
    aot.main(["--gin_file=configs/tiny_rollverify_lora.gin", *(f"--gin_param={p}" for p in PARAMS), f"--json={out}"])
    return json.loads(out.read_text())


def test_lora_compiles_the_adapted_engine_and_counts_the_frozen_base_once(lora_report):
    """A LoRA run's fit report: the engine's prefill and decode compile on the adapted graph (they took the plain
    model's before: 'Incorrect number of leaves'); the frozen base is resident once, an argument of the train step
    and of the engine's programs (no serving copy in the train layout); the train state and a publish hold the
    adapters alone."""
    r = lora_report
    res, lora = r["resident"], r["lora"]
    assert set(r["programs"]) == {"train_step", "prefill", "decode"}
    assert res["frozen_base"] > res["params"] > 0 and res["serving_params"] == 0
    assert r["resident_bytes_per_device"] == res["train_state"] + res["kv_pool"] + res["frozen_base"]
    train, decode = r["programs"]["train_step"], r["programs"]["decode"]
    assert train["argument_bytes"] >= res["train_state"] + res["frozen_base"]
    assert decode["argument_bytes"] >= res["frozen_base"] + res["params"] + res["kv_pool"]
    # each program's peak: what it allocates plus the resident bytes it does not take (the KV pool; the moments)
    peaks = r["peak_bytes_by_program"]
    assert peaks["train_step"] == (train["argument_bytes"] + train["output_bytes"] - train["alias_bytes"]
                                   + train["temp_bytes"] + res["kv_pool"])
    assert peaks["decode"] == (decode["argument_bytes"] + decode["output_bytes"] - decode["alias_bytes"]
                               + decode["temp_bytes"] + res["train_state"] - res["params"])
    # the publish moves the adapters (2 x 16 x (in + out) per adapted weight, float32 in the tiny config)
    from rollverify_jax.models.qwen3 import model_config

    cfg = model_config(**{"preset": "tiny", "num_hidden_layers": 2, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 128})
    h, q, kv, m = cfg.hidden_size, 2 * 128, 128, cfg.intermediate_size
    per_layer = 16 * ((h + q) * 2 + (h + kv) * 2 + 2 * (h + m) + (m + h))
    assert lora["trainable_params"] == 2 * per_layer
    assert r["publish_bytes"] == 4 * lora["trainable_params"] < r["model_param_bytes"]
    assert lora["publish_fraction"] == pytest.approx(r["publish_bytes"] / (r["model_param_bytes"] - r["publish_bytes"]))
    assert "LoRA:" in fit.format_report(r) and r["fits"]
