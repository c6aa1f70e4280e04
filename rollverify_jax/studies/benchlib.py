"""Shared bits of the benchmarks (scripts/bench_*.py, tests/gpu, tests/drills): machine description and
section-wise updates of docs/benchmarks.md. JAX is imported only to describe the machine."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script named in it; rerun the command to refresh it.\n"


def machine() -> str:
    import jax

    devices = jax.devices()
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, JAX {jax.__version__} on "
            f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], DOC.parents[1])] + sys.argv[1:])


def write_section(name: str, body: str) -> None:
    """Replaces (or appends) the section between this script's markers in docs/benchmarks.md."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    block = (f"<!-- {name}:start -->\n## {name}\n\nCommand: `{command()}`  \nMachine: {machine()}  \n"
             f"Measured: {stamp}\n\n{body.strip()}\n<!-- {name}:end -->\n")
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->\n", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    DOC.write_text(text)
    print(f"updated {DOC} [{name}]")
