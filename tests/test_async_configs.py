"""The asynchronous 8B configs (configs/qwen3_8b_dapo_async_v5p.gin, configs/qwen3_8b_dapo_async_8xh200.gin): they
parse, each host's devices split into the rollout and train meshes their comments (and docs/scale.md's numbers)
assume, on the dry run's stand-in hosts and on the v5p slice's own topology devices, and the 8xH200 config holds
the settings of its memory arithmetic. Their deviceless compiles take minutes each: docs/scale.md has the numbers
and the commands; tests/test_aot.py compiles a small asynchronous run for a topology."""

from __future__ import annotations

import math

import pytest

from rollverify_jax.rollout.paged_cache import kv_bytes_per_page
from rollverify_jax.run import programs
from rollverify_jax.run.dry_run import abstract_meshes
from rollverify_jax.run.spec import RunSpec, parse_gin

V5P, H200 = "configs/qwen3_8b_dapo_async_v5p.gin", "configs/qwen3_8b_dapo_async_8xh200.gin"
GiB = 2**30


def spec_of(config: str) -> RunSpec:
    parse_gin([config], [])
    return RunSpec.from_gin()


def test_v5p_config_splits_each_host_two_and_two_over_its_slice():
    spec = spec_of(V5P)
    assert spec.rollout.mode == "async" and spec.aot.topology == "v5p:2x2x4" and spec.async_rollout.at_swap == "verify"
    train, rollout, hosts = abstract_meshes(spec, None)
    assert hosts == 4 and dict(train.shape) == dict(rollout.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    spec.check_mesh(dict(train.shape))
    assert spec.learner.micro_batch_size == 2  # one packed row per batch device of the train mesh
    assert spec.engine.num_slots % rollout.shape["fsdp"] == 0
    # The rollout chips' pool: 69.8 GiB a chip of the 85.5 planned (docs/scale.md, Asynchronous configs).
    assert spec.engine.kv_memory_bytes / rollout.size / GiB == pytest.approx(69.85, abs=0.01)


def test_v5p_config_meshes_over_the_topology_devices_are_each_hosts_first_two_and_last_two():
    """What the deviceless compile lays out: the topology's devices carry their host (process_index), and each
    host's two lowest ids decode, its other two train."""
    pytest.importorskip("libtpu", reason="the topology's devices need libtpu")
    from rollverify_jax.scale import fit

    spec = spec_of(V5P)
    devices = fit.get_topology_devices(spec.aot.topology)
    train, rollout = programs.make_meshes(spec, devices)
    by_host = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d.id)
    assert len(by_host) == 4 and all(len(ids) == 4 for ids in by_host.values())
    rollout_ids, train_ids = {d.id for d in rollout.devices.flat}, {d.id for d in train.devices.flat}
    assert not rollout_ids & train_ids and len(rollout_ids) == len(train_ids) == 8
    for ids in by_host.values():
        assert set(sorted(ids)[:2]) <= rollout_ids and set(sorted(ids)[2:]) <= train_ids


def test_h200_config_splits_the_node_four_and_four_with_the_memory_its_arithmetic_assumes():
    spec = spec_of(H200)
    engine, learner = spec.engine, spec.learner
    assert spec.rollout.mode == "async" and spec.aot.topology is None and spec.flash.impl == "cudnn"
    train, rollout, hosts = abstract_meshes(spec, 8)
    assert hosts == 1 and dict(train.shape) == dict(rollout.shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    assert abstract_meshes(spec, None)[:2] == (train, rollout)  # 4 + 4 by default: one node
    assert learner.micro_batch_size == 1  # one packed row per batch device of the train mesh
    cfg = programs.architecture(spec)
    page = kv_bytes_per_page(cfg, engine.page_size, engine.kv_dtype)
    assert engine.kv_memory_bytes / 4 / GiB == pytest.approx(88.5, abs=0.05)  # per rollout GPU
    assert engine.kv_memory_bytes // page == 40_266  # one fsdp group: every slot shares the pool
    assert engine.kv_memory_bytes // (page * math.ceil(engine.max_seq_len / engine.page_size)) == 114
    # bf16 weights + float32 Adam moments over the 4 train GPUs: the 19.1 GiB of the config's comment
    assert cfg.num_params() * 10 / 4 / GiB == pytest.approx(19.1, abs=0.05)
    assert cfg.num_key_value_heads // rollout.shape["tensor"] == 2
