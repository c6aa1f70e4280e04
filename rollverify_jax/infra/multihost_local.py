"""Runs one training command as several JAX processes on this machine (CPU devices, gloo collectives).

The same program as a multi-host run on a TPU pod or GPU nodes, at laptop scale: each process owns
``--devices_per_process`` CPU devices and joins a coordinator on 127.0.0.1. Used by the multi-host tests and to
try a config as N hosts before renting them:

    python -m rollverify_jax.infra.multihost_local --num_processes 2 --devices_per_process 4 -- \\
        --gin_file=configs/tiny_rollverify.gin --workdir=runs/mh --gin_param="TrainConfig.num_steps=3"

Exits with the first non-zero status of any process (every process is stopped then), else 0. Each process's
output goes to ``<log_dir>/process_<i>.log``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(train_args: list[str], num_processes: int, devices_per_process: int, log_dir: Path,
           module: str = "rollverify_jax.train", timeout_s: float | None = None,
           extra_env: dict[str, str] | None = None) -> int:
    """Starts the processes, waits for all; the first failure stops the rest. Returns the exit status."""
    log_dir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **(extra_env or {}), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}
    procs = []
    for i in range(num_processes):
        log = open(log_dir / f"process_{i}.log", "w")  # noqa: SIM115  (closed with the process)
        cmd = [sys.executable, "-m", module, *train_args, f"--coordinator_address={address}",
               f"--num_processes={num_processes}", f"--process_id={i}"]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    status = 0
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [p.returncode for p, _ in procs if p.returncode not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                status = failed[0] if failed else 124
                break
            time.sleep(0.2)
        else:
            status = next((p.returncode for p, _ in procs if p.returncode), 0)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()
    return status


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--devices_per_process", type=int, default=4)
    ap.add_argument("--log_dir", default="runs/multihost_logs")
    ap.add_argument("--module", default="rollverify_jax.train", help="the entry point every process runs")
    ap.add_argument("--timeout_s", type=float, default=None)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the entry point's arguments")
    args = ap.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    status = launch(train_args, args.num_processes, args.devices_per_process, Path(args.log_dir), args.module,
                    args.timeout_s)
    print(f"{args.num_processes} processes: exit status {status}; logs in {args.log_dir}")
    raise SystemExit(status)


if __name__ == "__main__":
    main()
