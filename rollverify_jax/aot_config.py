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
    rest)."""

    topology: str = "v5p:2x2x1"
    prefill_rows: int | None = None
    hbm_fraction: float = 0.9

    def __post_init__(self):
        if not 0 < self.hbm_fraction <= 1:
            raise ValueError(f"AotConfig.hbm_fraction={self.hbm_fraction} must be in (0, 1].")
