"""OPS noise floor: with unchanged weights, a resume's log pi must match decode's recorded log mu far below the
segment threshold ds, or verification cuts on-policy tokens (scripts/bench_ops_floor.py measures it at length)."""

import pytest
from conftest import load_script

from rollverify_jax.models import init_model, model_config

SLOTS, NEW, CHUNK = 8, 48, 16


@pytest.fixture(scope="module")
def floor():
    return load_script("bench_ops_floor")


def _measure(floor, param: str, compute: str, kv: str) -> dict:
    model = init_model(model_config("tiny", param_dtype=param, dtype=compute), seed=0)
    return floor.measure(model, kv, SLOTS, NEW, (None, CHUNK))


def test_float32_floor_is_rounding_noise(floor):
    res = _measure(floor, "float32", "float32", "float32")
    for chunk in (None, CHUNK):
        assert res[chunk]["tokens"] == SLOTS * NEW
        assert res[chunk]["token_max"] < 1e-4, res[chunk]


@pytest.mark.parametrize("param,compute,kv,bound", [
    ("bfloat16", "bfloat16", "bfloat16", 1e-3),  # the shipped configs' dtypes: ds / 10
    ("float32", "float32", "bfloat16", 1e-4),  # the prefill attends over the K/V rounded as decode reads them
])
def test_bf16_floor_far_below_ds(floor, param, compute, kv, bound):
    res = _measure(floor, param, compute, kv)
    for chunk in (None, CHUNK):
        assert res[chunk]["segment_mean"] < bound, res[chunk]
        assert res[chunk]["segments_cut"] == 0
