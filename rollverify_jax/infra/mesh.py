"""The device mesh, the logical-axis rules, and shardings for parameters and batches (the one place).

Every parameter carries ``logical_axes`` metadata (e.g. ``('embed', 'mlp')``); the rules below map each
logical name to a mesh axis. A dimension that does not divide evenly over its mesh axes is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rollverify_jax.schedule_rules import BATCH_AXES

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", None),
    ("expert_mlp", "tensor"),
    ("norm", None),
    # The positions of the residual stream the train step's layer scan saves for its backward pass, one
    # [rows, T, hidden] array per layer (`Qwen3ForCausalLM.hidden_states`): replicated by default; 'tensor' splits
    # them over the tensor axis (a whole row no longer sits on every chip of a tensor group; each layer gathers
    # its input back).
    ("sequence", None),
)

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(shape: Sequence[int] = (1, -1, 1), axis_types: str = "auto",
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ('data', 'fsdp', 'tensor'); one entry of ``shape`` may be -1 (the rest)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_shape(shape, len(devices))
    if axis_types not in _AXIS_TYPES:
        raise ValueError(f"Unknown axis_types {axis_types!r}; use one of {sorted(_AXIS_TYPES)}.")
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(_AXIS_TYPES[axis_types],) * len(MESH_AXES),
                         devices=devices)


def split_local_devices(rollout_devices: int | float, devices: Sequence[jax.Device] | None = None,
                        ) -> tuple[list[jax.Device], list[jax.Device]]:
    """(rollout, train): each process's local devices (by id) split, its first ``rollout_devices`` (a count, or a
    fraction of its devices) to rollout and the rest to training; both lists process by process, so every process
    builds the same two meshes and a pod runs one program that drives both."""
    devices = list(devices if devices is not None else jax.devices())
    rollout, train = [], []
    for process in sorted({d.process_index for d in devices}):
        local = sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)
        n = rollout_devices if isinstance(rollout_devices, int) else round(rollout_devices * len(local))
        if not 1 <= n < len(local):
            raise ValueError(f"AsyncConfig.rollout_devices={rollout_devices!r} gives {n} of a host's {len(local)} "
                             "devices to rollout: each side needs at least one device of every host. Give the "
                             "host more devices (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8) or "
                             "another split.")
        rollout += local[:n]
        train += local[n:]
    return rollout, train


def check_shape(shape: Sequence[int]) -> list[int]:
    """``make_mesh.shape`` as a list, checked: one entry per mesh axis, each >= 1 or -1 (at most one -1)."""
    shape = list(shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"make_mesh.shape must have {len(MESH_AXES)} entries for {MESH_AXES}, got {shape}.")
    bad = [s for s in shape if isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1)]
    if bad:  # a 0 used to divide by zero
        raise ValueError(f"make_mesh.shape={tuple(shape)}: each entry must be a device count >= 1, or -1 for the "
                         f"devices left; got {bad[0]!r}.")
    if shape.count(-1) > 1:
        raise ValueError(f"make_mesh.shape may hold at most one -1, got {shape}.")
    return shape


def resolve_shape(shape: Sequence[int], num_devices: int) -> list[int]:
    """``make_mesh.shape`` over ``num_devices`` devices, its -1 replaced by the devices left."""
    shape = check_shape(shape)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"{num_devices} devices do not divide over mesh shape {shape}.")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"Mesh shape {shape} needs {math.prod(shape)} devices but {num_devices} are available; "
            "use -1 for one axis to take the rest."
        )
    return shape


def logical_axis_rules(rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = DEFAULT_RULES,
                       ) -> dict[str, tuple[str, ...]]:
    """Logical name -> tuple of mesh axes (empty tuple: replicated); gin: ``logical_axis_rules.rules``."""
    out = {}
    for name, axes in rules:
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"Rule {name!r} -> {a!r}: mesh axes are {MESH_AXES}.")
        out[name] = tuple(axes)
    return out


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: dict[str, tuple[str, ...]] | None = None) -> PartitionSpec:
    """PartitionSpec for one array; each mesh axis is used once; uneven dims are replicated."""
    rules = logical_axis_rules() if rules is None else rules
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape, strict=True):
        if name is not None and name not in rules:
            raise ValueError(f"No logical-axis rule for {name!r}; known: {sorted(rules)}.")
        axes = tuple(a for a in (rules[name] if name else ()) if a not in used and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if not axes or dim % size:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State, mesh: Mesh, rules=None) -> nnx.State:
    """PartitionSpec per parameter of an ``nnx.State`` (abstract or concrete)."""
    def spec(v):
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            return PartitionSpec()
        return logical_to_spec(axes, v.shape, mesh, rules)
    return jax.tree.map(spec, state, is_leaf=_is_var)


def param_shardings(state: nnx.State, mesh: Mesh, rules=None) -> nnx.State:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(state, mesh, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def serving_specs(state: nnx.State, mesh: Mesh, rules=None) -> nnx.State:
    """The training specs without the batch axes, except along 'experts': decode from weights split over
    'tensor' only and whole on every data x fsdp device, so each device runs its own slots' tokens through
    them, where the training layout leaves XLA two choices per step (gather the weights, or all-reduce every
    layer's activations over the batch axes). Experts split over a batch axis stay there (expert parallelism
    exchanges activations, not weights)."""
    def spec(v, train: PartitionSpec) -> PartitionSpec:
        names = v.get_metadata().get("logical_axes") or ()
        out = []
        for i, entry in enumerate(train):
            if i < len(names) and names[i] == "experts":
                out.append(entry)
                continue
            kept = tuple(a for a in _entry_axes(entry) if a not in BATCH_AXES)
            out.append(kept[0] if len(kept) == 1 else (kept or None))
        return PartitionSpec(*out)
    return jax.tree.map(spec, state, param_specs(state, mesh, rules), is_leaf=_is_var)


def serving_shardings(state: nnx.State, mesh: Mesh, rules=None) -> nnx.State:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), serving_specs(state, mesh, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _entry_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry as a tuple of mesh axes (None: ())."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension over ('data', 'fsdp'); the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_model(model: nnx.Module, mesh: Mesh, rules=None) -> nnx.Module:
    """Moves every parameter of ``model`` onto its mesh sharding (in place) and returns the model."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    placed = jax.tree.map(lambda v, s: v.replace(jax.device_put(v[...], s)), state, shardings, is_leaf=_is_var)
    nnx.update(model, placed)
    return model
