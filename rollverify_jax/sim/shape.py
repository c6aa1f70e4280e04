"""What the simulator reads from a run's spec, read as plain data: the parsed ``spec.json`` of a workdir (or a
spec's ``RunSpec.to_json()``), a dict of parts (``spec["rollout"]["mode"]``), so that the simulator imports
neither gin nor JAX (``rollverify_jax/infra/spec_json.py``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from rollverify_jax.infra import spec_json
from rollverify_jax.sim.config import SimConfig
from rollverify_jax.sim.costs import CostModel, RooflineCosts
from rollverify_jax.sim.replay import TrainLayout, Workload

DEFAULT_MESH_SHAPE = (1, -1, 1)  # make_mesh.shape's default: every device on the 'fsdp' axis


def value(spec: Mapping[str, Any], name: str, default: Any = ...) -> Any:
    """``spec``'s ``part.field`` (e.g. ``'rollout.mode'``); a part missing it is one clear error, unless a
    ``default`` is given (a function part holds only its bound arguments)."""
    part, field = name.split(".")
    got = spec.get(part, {})
    if field in got:
        return got[field]
    if default is not ...:
        return default
    raise ValueError(f"the run's spec has no {name} (a spec.json written by another version of the code?).")


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the simulator reads from the run's own configurables."""

    mode: str
    batch_groups: int
    group_size: int
    max_new_tokens: int
    queue_groups: int
    num_slots: int
    steps_per_dispatch: int
    switch_window: int
    switch_threshold: float
    switching: bool
    verify_finished: bool
    num_steps: int
    mesh_shape: tuple
    live_slots: bool = True  # EngineConfig.live_slots and a pool on one device (else one bucket: all slots)
    min_prefill_len: int = 32
    max_seq_len: int = 512
    bucket_ratio: int = 2  # EngineConfig.bucket_ratio: the step of the prefill, slot and page ladders
    prefill_token_budget: int | None = None  # EngineConfig.prefill_token_budget (None: one prefill per width)
    page_size: int = 16
    live_pages: bool = True
    kv_pages_per_shard: int = 0  # pages a pool shard hands out (0: no limit)
    pool_shards: int = 1
    page_reservation: str = "incremental"
    train_layout: TrainLayout | None = None  # LearnerConfig's packed rows (None: each sequence its own row)

    def workload(self, mode: str, prompt_len: int) -> Workload:
        return Workload(mode=mode, batch_groups=self.batch_groups, group_size=self.group_size,
                        num_slots=self.num_slots, steps_per_dispatch=self.steps_per_dispatch,
                        max_new_tokens=self.max_new_tokens, prompt_len=prompt_len, queue_groups=self.queue_groups,
                        switch_window=self.switch_window, switch_threshold=self.switch_threshold,
                        switching=self.switching, verify_finished=self.verify_finished, live_slots=self.live_slots,
                        min_prefill_len=self.min_prefill_len, max_seq_len=self.max_seq_len,
                        bucket_ratio=self.bucket_ratio, prefill_token_budget=self.prefill_token_budget,
                        page_size=self.page_size, live_pages=self.live_pages,
                        kv_pages_per_shard=self.kv_pages_per_shard, pool_shards=self.pool_shards,
                        page_reservation=self.page_reservation, train_layout=self.train_layout)


def pool_shards(mesh_shape: tuple, num_slots: int) -> int:
    """Devices the engine splits the slots over (``PoolLayout.for_mesh``): the batch axes ('data', 'fsdp', the
    first two of ``make_mesh.shape``; -1 counts as 1 here) when the slots divide over them, else 1."""
    n = math.prod(max(1, int(x)) for x in mesh_shape[:2])
    return n if num_slots % n == 0 else 1


def needs_model(spec: Mapping[str, Any]) -> bool:
    """Whether the KV pool's size depends on the model's geometry (``EngineConfig.kv_memory_bytes`` is set): then
    ``run_shape`` needs its ``pool_pages``."""
    return value(spec, "engine.kv_memory_bytes") is not None


def run_shape(spec: Mapping[str, Any], pool_pages: Callable[[int], int] | None = None) -> RunShape:
    """The run's settings from its plain spec (no model is built). ``pool_pages(shards)``: the KV pool's pages
    over that many shards (``rollout.engine.pool_pages`` of the spec's model), needed only when the spec sets a
    KV budget (``needs_model``); without one the pool holds every slot at ``max_seq_len``."""
    slots, max_seq_len, page_size = (value(spec, f"engine.{k}") for k in ("num_slots", "max_seq_len", "page_size"))
    mesh = tuple(value(spec, "mesh.shape", DEFAULT_MESH_SHAPE))
    shards = pool_shards(mesh, slots)
    if needs_model(spec):
        if pool_pages is None:
            raise ValueError("EngineConfig.kv_memory_bytes is set: the KV pool's pages depend on the model, so "
                             "run_shape needs pool_pages.")
        pages = pool_pages(shards)
    else:  # engine.pool_pages without a budget: every slot at max_seq_len plus each shard's scratch page
        pages = slots * -(-max_seq_len // page_size) + shards
    learner = {k: value(spec, f"learner.{k}") for k in ("num_minibatches", "micro_batch_size", "tail_row_width",
                                                          "pack_sequences", "ppo_epochs")}
    # train.select packs into the engine's max_seq_len; pack_for_learner rounds rows up to the batch devices
    layout = TrainLayout(width=max_seq_len, **learner, row_multiple=math.prod(max(1, int(x)) for x in mesh[:2]))
    return RunShape(mode=value(spec, "rollout.mode"), batch_groups=value(spec, "rollout.batch_groups"),
                    group_size=value(spec, "rollout.group_size"), max_new_tokens=value(spec, "rollout.max_new_tokens"),
                    queue_groups=value(spec, "rollout.queue_groups"), num_slots=slots,
                    steps_per_dispatch=value(spec, "engine.steps_per_dispatch"),
                    switch_window=value(spec, "switch.window"), switch_threshold=value(spec, "switch.threshold"),
                    switching=value(spec, "switch.enabled"), verify_finished=value(spec, "verify.verify_finished"),
                    num_steps=value(spec, "train.num_steps"), mesh_shape=mesh,
                    live_slots=value(spec, "engine.live_slots") and shards == 1,
                    min_prefill_len=value(spec, "engine.min_prefill_len"), max_seq_len=max_seq_len,
                    # specs written before the shape ladders had neither: ratio 2, no budget, as then
                    bucket_ratio=value(spec, "engine.bucket_ratio", 2),
                    prefill_token_budget=value(spec, "engine.prefill_token_budget", None),
                    page_size=page_size, live_pages=value(spec, "engine.live_pages"),
                    kv_pages_per_shard=pages // shards - 1, pool_shards=shards,
                    page_reservation=value(spec, "engine.page_reservation"), train_layout=layout)


# The settings a calibration run must share with the simulated spec: (spec field, RunShape field).
SHAPE_SETTINGS = {"rollout.batch_groups": "batch_groups", "rollout.group_size": "group_size",
                  "rollout.max_new_tokens": "max_new_tokens", "engine.num_slots": "num_slots",
                  "engine.steps_per_dispatch": "steps_per_dispatch"}


def check_same_shape(shape: RunShape, run_spec: Mapping[str, Any], where: str) -> None:
    """A calibration run (its plain spec) replayed with another run's shape would compare unlike work: refuse it.
    A setting the run's spec does not hold is not compared."""
    for name, field in SHAPE_SETTINGS.items():
        got = value(run_spec, name, None)
        if got is not None and got != getattr(shape, field):
            raise ValueError(f"{where} ran with {name} = {got}, the simulated config has {getattr(shape, field)}: "
                             f"simulate the run's own spec (leave --gin_file out, or pass "
                             f"--gin_file={where}/config.gin) or leave the run out.")


def sim_config(spec: Mapping[str, Any]) -> SimConfig:
    """The spec's ``SimConfig``."""
    return spec_json.dataclass_from_plain(SimConfig, spec.get("sim", {}), "sim")


def sim_costs(spec: Mapping[str, Any]) -> CostModel | RooflineCosts:
    """The cost source ``SimConfig.costs`` names, from the spec."""
    if sim_config(spec).costs == "roofline":
        return spec_json.dataclass_from_plain(RooflineCosts, spec.get("roofline", {}), "roofline")
    return spec_json.dataclass_from_plain(CostModel, spec.get("cost_model", {}), "cost_model")
