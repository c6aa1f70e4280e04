"""Copying a tree of arrays from one group of devices to another without waiting for it: the learner's weights,
sharded over the train mesh, published to the rollout mesh's serving layout while decode keeps running.

Why not a plain ``jax.device_put(x, dst)`` (JAX 0.10.2, checked on CPU; docs/multihost.md, "Weights between two
meshes"): in one process it copies, but when the layout changes (e.g. fsdp-sharded to replicated) it goes through
the host (``x._value``) and blocks the caller until the array is computed, i.e. until the train step is done; only
a layout-preserving put is an asynchronous device-to-device copy. With several processes and both meshes spanning
every process (each host gives some devices to rollout and the rest to training), it raises "For a cross-host
reshard in multi-controller JAX, input and target sharding should have the same set of devices", with or without
the cross-host transfer socket flags (those serve a put from one process's devices to another's).

What ``reshard`` does instead, every step of which returns at dispatch:
1. one jitted program on the source devices reshards every leaf to a *staging* layout: the destination's
   partitioning laid over the source devices so that each process's source devices hold the shards its own
   destination devices need (collectives between the source devices, across processes as any program's);
2. each process copies those shards device to device into its destination devices (a layout-preserving
   ``device_put``: local, asynchronous) and assembles them with ``jax.make_array_from_single_device_arrays``.
No byte crosses a process boundary outside the step-1 program, which is why no transfer server is needed.

Memory: while a copy is in flight each source device holds one destination device's shard of every leaf (for the
serving layout, the weights split over 'tensor' only: ``bytes / tensor`` per train device), beside its own
training state; where a process has too few source devices for that, each source device holds the whole tree
(``tree_bytes``) instead, and ``staging_sharding`` says which. The destination devices hold the new copy beside the
one they serve until the caller drops the old.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

COPY_AXIS = "_copy"  # the staging mesh's extra axis: copies of the destination's shards over the source devices


def tree_bytes(tree: Any) -> int:
    """Global bytes of every array leaf of ``tree`` (each array counted once, whatever its replication): what a
    publish moves to the destination layout."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


def _spec_axes(spec: PartitionSpec) -> list[str]:
    """The mesh axes a PartitionSpec splits over, in their order of first use."""
    out: list[str] = []
    for entry in spec:
        for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
            if a not in out:
                out.append(a)
    return out


@functools.lru_cache(maxsize=256)
def staging_sharding(src_devices: tuple[jax.Device, ...], dst: Sharding) -> Sharding:
    """The layout over ``src_devices`` (in the source arrays' device order, which a program's output must keep)
    from which every process can fill its own devices of ``dst`` locally.

    For a ``NamedSharding`` ``dst``: its spec over the source devices as a mesh of the axes the spec splits over
    (their sizes as in ``dst``) and a ``_copy`` axis for the rest, first or last, whichever leaves each shard
    that a process's ``dst`` devices hold on one of that process's source devices (each source device then
    holds one destination shard). Where neither does (a process with fewer source devices than distinct shards
    it needs, a count that does not divide), or ``dst`` is another kind of sharding: replicated over the source
    devices (each holds the whole array)."""
    replicated = NamedSharding(Mesh(np.array(src_devices), (COPY_AXIS,)), PartitionSpec())
    if not isinstance(dst, NamedSharding):
        return replicated
    axes = _spec_axes(dst.spec)
    sizes = [dst.mesh.shape[a] for a in axes]
    if len(src_devices) % math.prod(sizes):
        return replicated
    copies = len(src_devices) // math.prod(sizes)
    names = list(dst.mesh.axis_names)
    needed: dict[int, set[tuple[int, ...]]] = defaultdict(set)  # process -> shard coordinates along ``axes``
    for pos in np.ndindex(*dst.mesh.devices.shape):
        needed[dst.mesh.devices[pos].process_index].add(tuple(pos[names.index(a)] for a in axes))
    for shape, mesh_names in (((copies, *sizes), (COPY_AXIS, *axes)), ((*sizes, copies), (*axes, COPY_AXIS))):
        grid = np.array(src_devices, dtype=object).reshape(shape)
        held: dict[int, set[tuple[int, ...]]] = defaultdict(set)
        for pos in np.ndindex(*shape):
            held[grid[pos].process_index].add(tuple(pos[mesh_names.index(a)] for a in axes))
        if all(coords <= held[p] for p, coords in needed.items()):
            return NamedSharding(Mesh(grid, mesh_names), dst.spec)
    return replicated


@functools.lru_cache(maxsize=64)
def _stage_fn(shardings: tuple[Sharding, ...]):
    """One jitted program placing a list of arrays on ``shardings`` (cached: a publish per step reuses it)."""
    return jax.jit(lambda *xs: xs, out_shardings=shardings)


def _bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A shard's index as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=4096)
def _copy_plan(staged: Sharding, dst: Sharding, shape: tuple[int, ...],
               ) -> tuple[tuple[jax.Device, tuple[slice, ...] | None, jax.Device], ...]:
    """For each of this process's ``dst`` devices: the local staging device whose shard has its index (slice
    None) or holds it within a larger one (the slice of that shard it needs), and the device itself. Cached:
    every publish copies the same way."""
    have = [(device, _bounds(index, shape)) for device, index in staged.addressable_devices_indices_map(shape).items()]
    plan = []
    for device, index in dst.addressable_devices_indices_map(shape).items():
        want = _bounds(index, shape)
        exact = [d for d, b in have if b == want]
        wider = [(d, b) for d, b in have
                 if all(lo <= w0 and w1 <= hi for (lo, hi), (w0, w1) in zip(b, want, strict=True))]
        if exact:
            plan.append((exact[0], None, device))
        elif wider:
            d, b = wider[0]
            plan.append((d, tuple(slice(w0 - lo, w1 - lo) for (lo, _), (w0, w1) in zip(b, want, strict=True)), device))
        else:
            raise RuntimeError(f"process {jax.process_index()}: no local staged shard holds {index} for {device} "
                               f"(staged on {staged}).")
    return tuple(plan)


def _local_sources(staged: jax.Array, dst: Sharding) -> tuple[list[jax.Array], list[jax.Device]]:
    """What to copy where to lay ``staged`` (placed by ``staging_sharding``) out on this process's ``dst``
    devices: for each, the local staged shard with its index, or the part it needs of a larger one."""
    data = {shard.device: shard.data for shard in staged.addressable_shards}
    plan = _copy_plan(staged.sharding, dst, tuple(staged.shape))
    return ([data[src] if part is None else data[src][part] for src, part, _ in plan],
            [device for _, _, device in plan])


def reshard(tree: Any, shardings: Any) -> Any:
    """``tree`` placed on ``shardings`` (a matching tree of ``Sharding``s, or a prefix of it, e.g. one sharding
    for all), returned at dispatch: the copies run while the caller goes on, and ``jax.block_until_ready`` on
    the result waits for them. Works between disjoint device sets, in one process or several (every process
    calls it alike, as a collective). Leaves already on their destination devices are resharded by one jitted
    program; host arrays are put directly."""
    is_sharding = lambda s: isinstance(s, Sharding)  # noqa: E731
    flat_dst, dst_def = jax.tree.flatten(shardings, is_leaf=is_sharding)
    subtrees = dst_def.flatten_up_to(tree)
    leaves, dsts, defs = [], [], []
    for sub, s in zip(subtrees, flat_dst, strict=True):
        sub_leaves, sub_def = jax.tree.flatten(sub)
        leaves += sub_leaves
        dsts += [s] * len(sub_leaves)
        defs.append((sub_def, len(sub_leaves)))

    out: list = [None] * len(leaves)
    groups: dict[tuple[jax.Device, ...], list[tuple[int, Sharding]]] = defaultdict(list)
    for i, (x, s) in enumerate(zip(leaves, dsts, strict=True)):
        if not isinstance(x, jax.Array):
            out[i] = jax.device_put(x, s)
            continue
        src = tuple(x.sharding._device_assignment)  # a program's outputs keep its inputs' device order
        if x.sharding.device_set != s.device_set:
            groups[src].append((i, staging_sharding(src, s)))
        elif tuple(s._device_assignment) == src:
            groups[src].append((i, s))
        else:  # the same devices in another order: JAX's own reordering reshard
            out[i] = jax.device_put(x, s)
    copies: list[tuple[int, jax.Array, int]] = []  # (leaf, staged array, number of shards to copy)
    sources, devices = [], []
    for items in groups.values():  # one program per source device order (a program runs on one)
        staged = _stage_fn(tuple(s for _, s in items))(*[leaves[i] for i, _ in items])
        for (i, _), y in zip(items, staged, strict=True):
            if y.sharding.device_set == dsts[i].device_set:
                out[i] = y
                continue
            src_shards, dst_devices = _local_sources(y, dsts[i])
            copies.append((i, y, len(src_shards)))
            sources += src_shards
            devices += dst_devices
    copied = jax.device_put(sources, devices)  # every local device-to-device copy of the publish, batched
    start = 0
    for i, y, n in copies:
        out[i] = jax.make_array_from_single_device_arrays(y.shape, dsts[i], copied[start:start + n], dtype=y.dtype)
        start += n

    rebuilt, start = [], 0
    for sub_def, n in defs:
        rebuilt.append(jax.tree.unflatten(sub_def, out[start:start + n]))
        start += n
    return jax.tree.unflatten(dst_def, rebuilt)
