"""The simulator's own settings (``SimConfig``): kept apart from the ``simulate`` tool so that the run spec holds
them without importing the tool."""

from __future__ import annotations

import dataclasses

from rollverify_jax.sim.replay import CUT_LENGTHS, MODES, RULES, check_mismatch

COST_SOURCES = ("costs", "roofline")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The simulator's own settings (the run's shape comes from the run's gin configurables).

    costs: 'costs' (the ``CostModel`` bindings) or 'roofline' (``RooflineCosts`` bindings); ``--calibrate_from``
    replaces either with rates fitted on the runs. Lengths: ``lengths`` (explicit, cycled) or a lognormal
    (``length_median``, ``length_sigma``) capped at ``RolloutConfig.max_new_tokens``, ``length_group_share`` of
    its log-variance drawn once per group (the prompt's part; ``calibrate.fit_group_share`` fits it on a run's
    logged rollout samples); ``cut_length``: what a cut trajectory regenerates to ('keep' its drawn length, the
    unfavourable end; 'redraw' a fresh one given the kept prefix, the favourable end; ``LengthModel``). Where
    verification cuts
    (``CutModel``): ``segment_fail_prob = (p1, p2, ...)``, the probability that a cached segment of age 1, 2, ...
    steps fails verification (the last value repeats), and a late ramp of that hazard from step
    ``fail_ramp_start`` on (0: none), doubling every ``fail_ramp_doubling`` steps. ``rule``: the verifier's rule
    the cut model follows ('two_stage': the segment model above; 'coupled': ``VerifyConfig.rule = 'coupled'``,
    each cached token of age c matching with probability ``1 - q(c)``, ``coupled_mismatch_per_token = (q(1),
    q(2), ...)`` in [0, 1), beyond the last age A ``1 - q(c) = (1 - q(A)) ** (c / A)``: one value q gives
    ``(1 - q) ** c``; the same ramp multiplies each token's log-survival; ``calibrate.fit_coupled_mismatch``
    fits q on coupled runs).
    """

    modes: tuple = MODES
    num_steps: int | None = None  # None: TrainConfig.num_steps
    num_devices: int | None = None  # None: the product of make_mesh.shape (-1 counts as 1)
    prompt_len: int = 128
    lengths: tuple | None = None
    length_median: float = 64.0
    length_sigma: float = 1.0
    length_group_share: float = 0.0  # share of the log-length variance drawn once per group (the prompt's part)
    cut_length: str = "redraw"  # what a cut trajectory regenerates to: 'keep' its drawn length, 'redraw' a fresh one
    seed: int = 0
    segment_fail_prob: tuple = (0.0,)
    fail_ramp_start: int = 0
    fail_ramp_doubling: float = 10.0
    rule: str = "two_stage"
    coupled_mismatch_per_token: tuple = (0.0,)  # the coupled rule's q(c), per cached token of age c = 1, 2, ...
    costs: str = "costs"
    skip_steps: int = 1  # calibration: leading steps left out (they compile)
    # calibration: 'by_mode' fits the rates on the --fit_from runs (default: the on-policy runs) and compares
    # every run's steps after skip_steps; 'odd_even' fits each run's rates on its own odd steps and compares its
    # even steps
    fit_split: str = "by_mode"
    # calibration: a decode slot-step costs (1 + live page-table width / decode_width_ref) times the fitted rate
    # (0: width ignored). 240 tokens: bench_decode's live-pages ratio, 1.50x at 64 slots for a mean live width
    # of ~133 tokens against the whole 320-token table (docs/benchmarks.md)
    decode_width_ref: float = 240.0

    def __post_init__(self):
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"SimConfig.modes: unknown mode {m!r}; known: {list(MODES)}.")
        if self.cut_length not in CUT_LENGTHS:
            raise ValueError(f"SimConfig.cut_length={self.cut_length!r}; choose one of {list(CUT_LENGTHS)}.")
        if not 0.0 <= self.length_group_share <= 1.0:
            raise ValueError(f"SimConfig.length_group_share={self.length_group_share} must be in [0, 1].")
        if self.costs not in COST_SOURCES:
            raise ValueError(f"SimConfig.costs={self.costs!r}; choose one of {list(COST_SOURCES)}.")
        p = self.segment_fail_prob if isinstance(self.segment_fail_prob, list | tuple) else (self.segment_fail_prob,)
        if not p or not all(isinstance(x, int | float) and 0.0 <= x <= 1.0 for x in p):
            raise ValueError(f"SimConfig.segment_fail_prob={self.segment_fail_prob!r}: probabilities in [0, 1], "
                             "one per segment age (1, 2, ...; the last repeats).")
        if self.rule not in RULES:
            raise ValueError(f"SimConfig.rule={self.rule!r}; choose one of {list(RULES)} (VerifyConfig.rule).")
        check_mismatch(self.coupled_mismatch_per_token, "SimConfig.coupled_mismatch_per_token")
        if self.fail_ramp_start < 0 or self.fail_ramp_doubling <= 0:
            raise ValueError("SimConfig.fail_ramp_start must be >= 0 (0: no ramp) and fail_ramp_doubling > 0.")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"SimConfig.num_steps={self.num_steps} must be >= 1.")
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"SimConfig.num_devices={self.num_devices} must be >= 1.")
        if self.fit_split not in ("by_mode", "odd_even"):
            raise ValueError(f"SimConfig.fit_split={self.fit_split!r}; choose 'by_mode' or 'odd_even'.")
        if self.decode_width_ref < 0:
            raise ValueError(f"SimConfig.decode_width_ref={self.decode_width_ref} must be >= 0 (0: width ignored).")
        if self.skip_steps < 0 or self.prompt_len < 0:
            raise ValueError("SimConfig.skip_steps and SimConfig.prompt_len must be >= 0.")
