"""Joining a multi-process JAX program: every host runs the same command, one process per host (or per GPU).

``initialize`` wraps ``jax.distributed.initialize``: with no coordinator given, JAX detects the cluster itself
(TPU pod slices through the TPU metadata, SLURM through its environment variables, ...); on CPU it switches the
collectives to gloo, so several processes on one machine form one mesh (how the tests run multi-host). A dead
peer is noticed within ``heartbeat_timeout_s`` and the survivors exit with an error instead of hanging.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int = 60,
               initialization_timeout_s: int = 300) -> None:
    """Connects this process to the others (before any other JAX call that touches devices).

    heartbeat_timeout_s: a process that died or hangs is noticed by the others within this time, and they exit
    with an error instead of waiting in a collective. initialization_timeout_s: how long the processes wait at
    start for all of them to join.
    """
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError("--coordinator_address, --num_processes and --process_id go together: give all three, "
                         "or none to let JAX detect the cluster (TPU pod, SLURM).")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id={process_id} must be in [0, --num_processes={num_processes}).")
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)


def initialize_from_flags(args, timeouts: Mapping[str, int] | None = None) -> None:
    """Joins the other processes when the flags of ``cli.add_process_flags`` ask for it (before anything touches a
    device). ``timeouts``: ``initialize``'s heartbeat / initialization timeouts (the spec's ``distributed``)."""
    if args.distributed or args.coordinator_address or args.num_processes is not None or args.process_id is not None:
        initialize(args.coordinator_address, args.num_processes, args.process_id, **dict(timeouts or {}))


def is_main_process() -> bool:
    """Process 0 writes what must be written once (metrics, configs, samples, exports)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here for the others (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather_ints(values) -> np.ndarray:
    """Every process's ``values`` (small ints), one row per process: ``[processes, len(values)]``. The input of a
    decision every host must take alike (stop, set a checkpoint aside, refuse to start), so no host acts on what
    only it saw; every process calls it at the same point, like any collective. One process: its own row."""
    mine = np.asarray(values, np.int32).reshape(-1)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), mine.size)


def fetch(tree):
    """Device arrays -> host numpy, whole on every process. On one process ``jax.device_get``; on several, an
    array sharded over other hosts' devices is all-gathered first (every process must call this together), so
    every host decides from the same values."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def to_global(tree, mesh):
    """Host numpy arrays that are equal on every process -> global arrays, rows over the mesh's batch axes (0-d
    arrays replicated); each process fills only its own devices' shards."""
    # Imported here: the reward graders' worker processes import this module and need no Flax.
    from rollverify_jax.infra import mesh as mesh_lib

    def one(x):
        if isinstance(x, jax.Array):
            return x
        x = np.asarray(x)
        sharding = mesh_lib.batch_sharding(mesh, x.ndim) if x.ndim else mesh_lib.replicated(mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(one, tree)


def share_across_processes(compute, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Items ``0..n-1`` dealt round-robin over the processes: ``compute(indices) -> (values [len], counts [k])``
    runs on each process's share, and every process gets all ``n`` values and the counts summed over processes
    (all processes call this together). One process computes everything."""
    if jax.process_count() == 1:
        return compute(np.arange(n))
    from jax.experimental import multihost_utils

    p, me = jax.process_count(), jax.process_index()
    values, counts = compute(np.arange(me, n, p))
    per = -(-n // p)
    mine = np.zeros(per + len(counts), np.float64)
    mine[: len(values)], mine[per:] = values, counts
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, per + k]
    out = np.empty(n, np.float64)
    for q in range(p):
        share = np.arange(q, n, p)
        out[share] = every[q, : len(share)]
    return out, every[:, per:].sum(axis=0)


class ProcessesDiverged(RuntimeError):
    """Hosts decided differently from what should be the same values: continuing would train a different batch
    on each host's devices."""


def digest(value) -> int:
    """A stable 63-bit hash of nested dicts / lists / numpy arrays / JSON scalars (arrays by dtype, shape, bytes)."""
    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(f"<{k}>".encode())
                feed(v[k])
        elif isinstance(v, list | tuple):
            h.update(f"[{len(v)}".encode())
            for item in v:
                feed(item)
        elif isinstance(v, np.ndarray | np.generic | jax.Array):
            a = np.ascontiguousarray(np.asarray(v))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(json.dumps(v, default=repr).encode())
    feed(value)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_same_on_every_process(step: int, **decisions) -> None:
    """Compares a hash of each named host-side decision across processes; raises ``ProcessesDiverged`` naming
    those that differ. Every process calls it at the same point (it is a collective). A decision may be given as
    a function that returns it, so one process never builds what it would not compare."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(decisions)
    mine = np.asarray([digest(v() if callable(v) else v) for v in (decisions[n] for n in names)], np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, decisions]
    differ = [n for i, n in enumerate(names) if (every[:, i] != every[0, i]).any()]
    if differ:
        raise ProcessesDiverged(
            f"step {step}: the processes decided {', '.join(differ)} differently (hashes per process: "
            f"{ {n: every[:, names.index(n)].tolist() for n in differ} }). Every host must run the same code, "
            "config, data files and seeds; check that they read the same files and no host-local setting differs.")
