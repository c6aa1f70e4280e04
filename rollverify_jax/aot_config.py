"""What the deviceless TPU compile (`rollverify_jax.aot`) targets: the slice (a gin setting every real config
names) and the chips' public figures. Kept apart from `aot` so that parsing a config never imports it."""

from __future__ import annotations

import dataclasses

import gin

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    peak_flops: float  # bf16 dense, per chip
    hbm_bandwidth: float  # bytes/s


# Public per-chip figures (Cloud TPU documentation), keyed by JAX's device_kind.
CHIPS = {
    "TPU v4": Chip(32 * GiB, 275e12, 1.2e12),
    "TPU v5 lite": Chip(16 * GiB, 197e12, 0.819e12),
    "TPU v5": Chip(95 * GiB, 459e12, 2.765e12),  # v5p
    "TPU v6 lite": Chip(32 * GiB, 918e12, 1.64e12),  # v6e
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AotConfig:
    """topology: a TPU topology name (``v5p:2x2x1``, ``v5e:4x4``, ``v6e:4x8``, ...).
    prefill_rows: rows of the compiled resume prefill (None: one per device along the batch axes).
    hbm_fraction: the share of HBM a run may plan to use (XLA's own reservations and fragmentation need the
    rest).
    response_length_median / response_length_sigma / prompt_len: the length model the estimates are read at
    (a lognormal response length capped at ``RolloutConfig.max_new_tokens``, plus the prompt): the same as the
    simulator's real-scale assumption (``SimConfig`` in configs/sim/scale_common.gin)."""

    topology: str = "v5p:2x2x1"
    prefill_rows: int | None = None
    hbm_fraction: float = 0.9
    response_length_median: float = 2500.0
    response_length_sigma: float = 1.0
    prompt_len: int = 200

    def __post_init__(self):
        if not 0 < self.hbm_fraction <= 1:
            raise ValueError(f"AotConfig.hbm_fraction={self.hbm_fraction} must be in (0, 1].")
        if self.response_length_median < 1 or self.response_length_sigma < 0 or self.prompt_len < 1:
            raise ValueError("AotConfig.response_length_median must be >= 1, response_length_sigma >= 0 and "
                             f"prompt_len >= 1; got {self.response_length_median}, {self.response_length_sigma}, "
                             f"{self.prompt_len}.")
