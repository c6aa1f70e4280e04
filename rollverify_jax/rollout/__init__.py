"""Rollout: paged KV cache, paged attention, the decode engine and continuous batching."""

from rollverify_jax.rollout.engine import DecodeState, Engine, EngineConfig
from rollverify_jax.rollout.sampling import SamplingConfig, sample_tokens
from rollverify_jax.rollout.scheduler import Scheduler, validate_request
from rollverify_jax.rollout.stats import RolloutStats
from rollverify_jax.rollout.trajectory import Trajectory

__all__ = ["DecodeState", "Engine", "EngineConfig", "RolloutStats", "SamplingConfig", "Scheduler",
           "Trajectory", "sample_tokens", "validate_request"]
