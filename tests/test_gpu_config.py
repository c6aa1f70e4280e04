"""configs/qwen3_8b_dapo_8xh200.gin: one node of 8 H200. It parses into the settings docs/scale.md's arithmetic
uses, and --dry_run checks it and says that it cannot prove a GPU fit without GPUs."""

from __future__ import annotations

import math

import pytest
from shared import dry_run_on_small_files

from rollverify_jax.rollout.paged_cache import kv_bytes_per_page
from rollverify_jax.run.dry_run import mesh_shape
from rollverify_jax.run.programs import architecture
from rollverify_jax.run.spec import RunSpec, parse_gin

CONFIG = "configs/qwen3_8b_dapo_8xh200.gin"
GiB = 2**30


def test_config_holds_the_settings_its_memory_arithmetic_assumes():
    parse_gin([CONFIG], [])
    spec = RunSpec.from_gin()
    shape, engine, learner = mesh_shape(spec), spec.engine, spec.learner
    cfg = architecture(spec)
    topology, flash = spec.aot.topology, spec.flash.impl
    assert shape == [1, 2, 4] and topology is None and flash == "cudnn"
    assert learner.micro_batch_size == 2 == shape[0] * shape[1]  # one packed row per batch device
    assert engine.dispatch_ahead and engine.max_seq_len == 22_528 and engine.num_slots == 256
    page = kv_bytes_per_page(cfg, engine.page_size, engine.kv_dtype)
    pages_per_shard = engine.kv_memory_bytes // page // 2
    assert pages_per_shard == 36_027  # docs/scale.md, One node of 8 H200
    assert engine.kv_memory_bytes / 8 / GiB == pytest.approx(79.2, abs=0.05)
    assert engine.kv_memory_bytes // (page * math.ceil(engine.max_seq_len / engine.page_size)) == 204
    # KV heads over 'tensor' (2 a GPU) and the pool over the 2 fsdp groups with the slots (128 each).
    assert cfg.num_key_value_heads // shape[2] == 2 and engine.num_slots // shape[1] == 128


def test_dry_run_checks_the_gpu_config_and_says_it_cannot_prove_a_gpu_fit(tmp_path, capsys):
    report, out = dry_run_on_small_files(CONFIG, tmp_path, capsys)
    assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
    # bf16 weights over the 8 GPUs (norm scales are replicated over some axes: a little more)
    assert report["param_bytes_per_device"] == pytest.approx(report["params"] * 2 / 8, rel=1e-3)
    assert report["full_length_sequences_in_kv_budget"] == 204
    assert "a GPU config" in out and "tests/gpu/check_gpu.py --compile-config" in out
