"""What the deviceless TPU compile (`rollverify_jax.aot`) targets: the slice (a gin setting every real config
names) and the chips' public figures. Kept apart from `aot` so that parsing a config never imports it."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    peak_flops: float  # bf16 dense, per chip
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float = 0.0  # bytes/s per chip, bidirectional, over all its ICI links
    ici_links: int = 1  # ICI ports per chip (6 on a 3D torus, 4 on a 2D one)


# Public per-chip figures (Cloud TPU documentation), keyed by JAX's device_kind.
CHIPS = {
    "TPU v4": Chip(32 * GiB, 275e12, 1.2e12, 600e9, 6),
    "TPU v5 lite": Chip(16 * GiB, 197e12, 0.819e12, 400e9, 4),
    "TPU v5": Chip(95 * GiB, 459e12, 2.765e12, 1200e9, 6),  # v5p
    "TPU v6 lite": Chip(32 * GiB, 918e12, 1.64e12, 800e9, 4),  # v6e
}


@dataclasses.dataclass(frozen=True)
class AotConfig:
    """topology: a TPU topology name (``v5p:2x2x1``, ``v5e:4x4``, ``v6e:4x8``, ...).
    prefill_rows: rows of the compiled resume prefill (None: one per device along the batch axes).
    hbm_fraction: the share of HBM a run may plan to use (XLA's own reservations and fragmentation need the
    rest).
    response_length_median / response_length_sigma / prompt_len: the length model the estimates are read at
    (a lognormal response length capped at ``RolloutConfig.max_new_tokens``, plus the prompt): the same as the
    simulator's real-scale assumption (``SimConfig`` in configs/sim/scale_common.gin).
    train_mfu: the model-FLOPs utilisation the train-step estimate assumes (model FLOPs: forward and backward,
    not the remat recompute). 0.45 is MaxText's published figure for an 8B dense model (Llama 3.1 8B on v6e);
    its 65-71% for 32-70B dense models on v5p come from larger matmuls per chip than these configs' 4-8B
    shards, and it publishes no anchor for a sparse MoE, which will sit below it.
    collective_links / collective_latency_s / one_core_hbm_share: what the decode estimate assumes (none measured):
    a collective over one mesh axis is a bidirectional ring over ``collective_links`` of the chip's ICI links and
    costs ``collective_latency_s`` beyond its bytes; a Pallas kernel whose grid runs on one of a chip's two
    TensorCores reads HBM at this share of the chip's bandwidth (rollverify_jax/scale/aot_decode.py)."""

    topology: str = "v5p:2x2x1"
    prefill_rows: int | None = None
    hbm_fraction: float = 0.9
    response_length_median: float = 2500.0
    response_length_sigma: float = 1.0
    prompt_len: int = 200
    train_mfu: float = 0.45
    collective_links: int = 2
    collective_latency_s: float = 10e-6
    one_core_hbm_share: float = 0.5

    def __post_init__(self):
        if not 0 < self.hbm_fraction <= 1:
            raise ValueError(f"AotConfig.hbm_fraction={self.hbm_fraction} must be in (0, 1].")
        if self.collective_links < 1 or self.collective_latency_s < 0 or not 0 < self.one_core_hbm_share <= 1:
            raise ValueError(f"AotConfig.collective_links={self.collective_links} must be >= 1, "
                             f"collective_latency_s={self.collective_latency_s} >= 0 and one_core_hbm_share="
                             f"{self.one_core_hbm_share} in (0, 1].")
        if not 0 < self.train_mfu <= 1:
            raise ValueError(f"AotConfig.train_mfu={self.train_mfu} must be in (0, 1].")
        if self.response_length_median < 1 or self.response_length_sigma < 0 or self.prompt_len < 1:
            raise ValueError("AotConfig.response_length_median must be >= 1, response_length_sigma >= 0 and "
                             f"prompt_len >= 1; got {self.response_length_median}, {self.response_length_sigma}, "
                             f"{self.prompt_len}.")
