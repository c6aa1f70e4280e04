"""The cost model and discrete-event replay behind ``python -m rollverify_jax.simulate`` (no JAX, no gin): a run's
shape is read from its spec as plain data (``shape.run_shape`` of a ``spec.json``), a prediction is made in
``predict``, rates are fitted on runs' metrics in ``calibrate``."""

from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import CutModel, LengthModel, SimResult, TrainLayout, Workload, simulate

__all__ = ["CostModel", "CutModel", "LengthModel", "RooflineCosts", "SimResult", "TrainLayout", "Workload", "simulate"]
