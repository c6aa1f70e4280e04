"""The LoRA configs for one host: configs/qwen3_8b_dapo_lora_v5e8.gin (one TPU v5e-8, its fit proven by the deviceless
compile recorded in docs/scale.md, "LoRA on one host", not rerun here: it takes many minutes) and
configs/qwen3_8b_dapo_lora_1xh200.gin (one H200, arithmetic). They parse into the settings those plans assume, and
--dry_run checks the GPU one and reports the adapters it trains."""

from __future__ import annotations

import pytest
from shared import dry_run_on_small_files

from rollverify_jax.rollout.paged_cache import kv_bytes_per_page
from rollverify_jax.run.dry_run import mesh_shape
from rollverify_jax.run.programs import architecture
from rollverify_jax.run.spec import RunSpec, parse_gin

V5E8, H200 = "configs/qwen3_8b_dapo_lora_v5e8.gin", "configs/qwen3_8b_dapo_lora_1xh200.gin"
GiB = 2**30
# Rank 16 on q, k, v, o (4,096 -> 4,096, 1,024, 1,024, 4,096) and gate, up, down (4,096 <-> 12,288) of 36 layers.
ADAPTER_PARAMS = 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))


def _spec(path: str) -> RunSpec:
    parse_gin([path], [])
    return RunSpec.from_gin()


@pytest.mark.parametrize("path, shape, kv_gib_per_device", [(V5E8, [1, 1, 8], 4.66), (H200, [1, 1, 1], 55.88)])
def test_lora_configs_hold_the_settings_their_plans_assume(path, shape, kv_gib_per_device):
    full = _spec("configs/qwen3_8b_dapo.gin")
    spec = _spec(path)
    engine, learner, lora = spec.engine, spec.learner, spec.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32.0, r"layers/\d+/(self_attn|mlp)")
    assert spec.optimizer.learning_rate == pytest.approx(10 * full.optimizer.learning_rate)  # LoRA without regret
    assert mesh_shape(spec) == shape and engine.max_seq_len == full.engine.max_seq_len == 22_528
    batch_devices = shape[0] * shape[1]
    assert learner.micro_batch_size == batch_devices  # one packed row per batch device
    assert engine.prefill_token_budget == batch_devices * engine.max_seq_len
    assert engine.serving_layout == "train"  # the engine decodes from the frozen base itself: no copy
    assert engine.kv_memory_bytes / shape[2] / GiB == pytest.approx(kv_gib_per_device, abs=0.01)
    cfg = architecture(spec)
    assert kv_bytes_per_page(cfg, engine.page_size, engine.kv_dtype) == 144 * 1024 * engine.page_size
    if path == V5E8:
        assert spec.aot.topology == "v5e:2x4" and cfg.rules()["sequence"] == ("tensor",)
        assert cfg.num_key_value_heads // shape[2] == 1  # one KV head a chip
    else:
        assert spec.aot.topology is None and spec.flash.impl == "cudnn"


def test_dry_run_checks_the_one_gpu_lora_config_and_reports_its_adapters(tmp_path, capsys):
    report, out = dry_run_on_small_files(H200, tmp_path, capsys)
    assert report["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1} and report["lora_rank"] == 16
    assert report["trainable_params"] == ADAPTER_PARAMS == 43_646_976  # 0.53% of the 8.19B
    assert report["param_bytes_per_device"] == 2 * ADAPTER_PARAMS  # bf16 adapters: what a publish moves
    assert report["frozen_param_bytes_per_device"] == 2 * report["params"]  # the whole bf16 base, held once
    assert report["full_length_sequences_in_kv_budget"] == 18
    assert "a GPU config" in out
