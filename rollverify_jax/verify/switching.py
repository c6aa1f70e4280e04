"""Conditional switching to on-policy mode from the verification acceptance rate (METHOD.md section 4).

Once verification cuts most cached tokens, partial rollout stops paying for itself: keep the mean
acceptance rate over the last `W` cycles, and when that window is full and its mean falls below `tau`, switch
to on-policy mode for the rest of the run. The state is a small frozen dataclass updated by pure host-side
functions, so every host computes the same switch from the same replicated acceptance rates; `to_dict` /
`from_dict` put it in checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from rollverify_jax import schedule_rules

DEFAULT_WINDOW = 8
DEFAULT_THRESHOLD = 0.5


def _check_window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(
            f"switching: window (number of cycles averaged) must be an integer >= 1, got {window!r}."
        )
    return int(window)


def _check_threshold(threshold) -> float:
    if not isinstance(threshold, numbers.Real) or not (0.0 <= threshold <= 1.0):
        raise ValueError(
            f"switching: threshold (acceptance rate below which training goes on-policy) must be in [0, 1], "
            f"got {threshold!r}."
        )
    return float(threshold)


@dataclasses.dataclass(frozen=True, eq=False)
class SwitchState:
    """Acceptance window and switch decision.

    `rates: float32[W]` holds the last W acceptance rates, oldest first, right-aligned: only the last `count`
    entries are filled. `switch_step` is the training step of the switch, -1 if it never happened.
    """

    rates: np.ndarray  # [W] float32
    count: int
    on_policy: bool
    switch_step: int

    def __post_init__(self):
        rates = np.array(self.rates, dtype=np.float32)  # a private copy, then frozen like the dataclass
        if rates.ndim != 1 or rates.size < 1:
            raise ValueError(f"SwitchState: rates must be a non-empty 1-D window, got shape {rates.shape}.")
        rates.setflags(write=False)
        count, switch_step = int(self.count), int(self.switch_step)
        if not 0 <= count <= rates.size:
            raise ValueError(f"SwitchState: count must be in [0, {rates.size}], got {count}.")
        if switch_step < -1:
            raise ValueError(
                f"SwitchState: switch_step must be -1 (never) or a step >= 0, got {switch_step}."
            )
        object.__setattr__(self, "rates", rates)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "on_policy", bool(self.on_policy))
        object.__setattr__(self, "switch_step", switch_step)

    @property
    def window(self) -> int:
        return int(self.rates.size)

    def __eq__(self, other) -> bool:
        if not isinstance(other, SwitchState):
            return NotImplemented
        same_rates = np.array_equal(self.rates, other.rates)
        return same_rates and self._scalars() == other._scalars()

    def _scalars(self) -> tuple[int, bool, int]:
        return self.count, self.on_policy, self.switch_step

    __hash__ = None

    def to_dict(self) -> dict[str, np.ndarray]:
        """Numpy arrays only (no Python bools), so any checkpoint backend stores and restores it exactly."""
        return {
            "rates": self.rates.copy(),
            "count": np.asarray(self.count, np.int32),
            "on_policy": np.asarray(int(self.on_policy), np.int32),
            "switch_step": np.asarray(self.switch_step, np.int32),
        }

    @classmethod
    def from_dict(cls, d) -> SwitchState:
        """Inverse of `to_dict`; accepts numpy, JAX or Python values (whatever a checkpoint restores)."""
        missing = {"rates", "count", "on_policy", "switch_step"} - set(d)
        if missing:
            raise ValueError(
                f"SwitchState.from_dict: missing keys {sorted(missing)}; was this saved by to_dict?"
            )
        return cls(
            rates=np.asarray(d["rates"], np.float32),
            count=int(np.asarray(d["count"])),
            on_policy=bool(int(np.asarray(d["on_policy"]))),
            switch_step=int(np.asarray(d["switch_step"])),
        )


def init_switch_state(window: int = DEFAULT_WINDOW) -> SwitchState:
    """Empty window of `window` cycles, off-policy (partial rollout) mode, never switched."""
    window = _check_window(window)
    return SwitchState(rates=np.zeros(window, np.float32), count=0, on_policy=False, switch_step=-1)


def window_mean(state: SwitchState) -> float:
    """Mean acceptance over the filled part of the window; 1.0 while empty (nothing rejected yet)."""
    return schedule_rules.window_mean(state.rates[state.window - state.count :])


def update_switch_state(
    state: SwitchState, acceptance: float, step: int, threshold: float = DEFAULT_THRESHOLD
) -> SwitchState:
    """Push one cycle's acceptance rate; switch to on-policy for good once the full window's mean < threshold.

    After the switch the state is frozen: on-policy mode verifies nothing, and the switch is one-way.
    """
    threshold = _check_threshold(threshold)
    acceptance = float(acceptance)
    if not (math.isfinite(acceptance) and 0.0 <= acceptance <= 1.0):
        raise ValueError(
            f"update_switch_state: acceptance must be a rate in [0, 1], got {acceptance!r} at step {step}."
        )
    if int(step) < 0:
        raise ValueError(f"update_switch_state: step must be >= 0, got {step}.")
    if state.on_policy:
        return state
    rates = np.concatenate([state.rates[1:], np.asarray([acceptance], np.float32)])
    pushed = SwitchState(
        rates=rates, count=min(state.count + 1, state.window), on_policy=False, switch_step=-1
    )
    if schedule_rules.switch_due(pushed.rates[pushed.window - pushed.count :], pushed.window, threshold):
        return dataclasses.replace(pushed, on_policy=True, switch_step=int(step))
    return pushed


@dataclasses.dataclass(frozen=True)
class SwitchConfig:
    """Gin-tunable switching settings (`SwitchConfig.window = 8`, `SwitchConfig.threshold = 0.5`).

    `enabled = False` never switches (the naive-partial baseline and the "no switching" ablation).
    """

    window: int = DEFAULT_WINDOW  # W: the last W cycles' acceptance rates are averaged
    threshold: float = DEFAULT_THRESHOLD  # once the window is full and its mean is below this: on-policy for good
    enabled: bool = True

    def __post_init__(self):
        _check_window(self.window)
        _check_threshold(self.threshold)

    def init(self) -> SwitchState:
        return init_switch_state(self.window)

    def update(self, state: SwitchState, acceptance: float, step: int) -> SwitchState:
        """`update_switch_state` with this config's threshold; when disabled it only records the window."""
        threshold = self.threshold if self.enabled else 0.0
        return update_switch_state(state, acceptance, step, threshold=threshold)
