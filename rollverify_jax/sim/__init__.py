"""The cost model and discrete-event replay behind ``python -m rollverify_jax.simulate`` (no JAX)."""

from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import AcceptanceModel, LengthModel, SimResult, Workload, simulate

__all__ = ["AcceptanceModel", "CostModel", "LengthModel", "RooflineCosts", "SimResult", "Workload", "simulate"]
