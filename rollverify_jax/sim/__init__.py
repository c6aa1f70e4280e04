"""The cost model and discrete-event replay behind ``python -m rollverify_jax.simulate`` (no JAX)."""

from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import CutModel, LengthModel, SimResult, TrainLayout, Workload, simulate

__all__ = ["CostModel", "CutModel", "LengthModel", "RooflineCosts", "SimResult", "TrainLayout", "Workload", "simulate"]
