"""What a compiled program does per run, read from its optimized HLO text (``compiled.as_text()``): the
collectives (kind, count, bytes, group size; loop bodies weighted by their trip counts) and the Mosaic
kernels' grids. The cost and memory analyses say neither: they count a loop body once and skip custom calls.

Only ``mosaic_kernels`` imports JAX (to read the kernels' serialized MLIR); the collective count is text only.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s([a-z][a-z0-9-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([^\s,)}]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: ``bytes`` of its full (gathered / reduced) array, ``group`` devices taking
    part, ``count`` times it runs per program run (trip counts of the loops around it multiplied)."""

    kind: str
    bytes: int
    group: int
    count: int
    name: str

    @property
    def bytes_sent(self) -> float:
        """Bytes one device sends per run of this instruction on a ring: all-reduce 2 (g-1)/g N, all-gather,
        reduce-scatter and all-to-all (g-1)/g N, a permute N."""
        g = max(self.group, 1)
        if self.kind == "collective-permute":
            return float(self.bytes)
        share = (g - 1) / g
        return (2 * share if self.kind == "all-reduce" else share) * self.bytes


def _array_bytes(text: str) -> list[int]:
    """Byte size of every ``dtype[dims]`` array named in ``text``, in order (layouts ignored)."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        out.append(int(math.prod(int(d) for d in dims.split(",") if d) * size))
    return out


def _group_size(line: str) -> int:
    """Devices per replica group, from the three ways XLA prints ``replica_groups`` (1 if absent)."""
    m = re.search(r"replica_groups=\{(\{[^}]*\})", line)
    if m:
        return len(m.group(1).strip("{}").split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:
        return 2
    return 1


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """Instruction lines of each computation, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            comps[current].append(line)
    return comps, entry


def _trip_count(line: str, condition: list[str], comps: dict[str, list[str]]) -> int | None:
    """A counted loop's trip count: XLA's ``known_trip_count`` when it printed one, else the one integer constant
    its condition (or a fusion the condition calls) compares the counter with, counting from 0."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    if known:
        return int(known.group(1))
    lines = list(condition)
    for cond_line in condition:
        lines += comps.get(dict(_CALLEE.findall(cond_line)).get("calls", ""), [])
    consts = [int(c) for x in lines for c in re.findall(r"s32\[\][^=]*\bconstant\((-?\d+)\)", x)]
    if len(consts) == 1 and any("direction=LT" in x for x in lines):
        return consts[0]
    return None


def collectives(text: str) -> list[Collective]:
    """Every collective of the program, counted per run: an instruction inside a while loop's body counts its
    trip count (read from the loop's condition; 1 when it cannot be read) times the counts of the loops
    around it. Asynchronous pairs count once (at their start)."""
    comps, entry = _computations(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text()).")
    weight: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in comps or depth > 64:
            return
        weight[name] += times
        for line in comps[name]:
            m = _INSTR.match(line)
            op = m.group(3) if m else ""
            if op in ("async-done", "async-update"):
                continue  # the async-start visited the wrapped computation
            callees = dict(_CALLEE.findall(line))
            if op == "while" and "body" in callees:
                trips = _trip_count(line, comps.get(callees.get("condition", ""), []), comps) or 1
                visit(callees["body"], times * trips, depth + 1)
                visit(callees.get("condition", ""), times * (trips + 1), depth + 1)
                continue
            for callee in callees.values():
                visit(callee, times, depth + 1)
            for group in _CALLEES.findall(line):
                for callee in re.findall(r"%([^\s,]+)", group):
                    visit(callee, times, depth + 1)

    visit(entry, 1)
    out = []
    for name, lines in comps.items():
        if not weight.get(name):
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3)
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in COLLECTIVES:
                continue
            sizes = _array_bytes(m.group(2))
            if op == "all-gather-start":  # (operands..., outputs...)
                sizes = sizes[len(sizes) // 2:]
            elif op == "collective-permute-start":  # (operand, output, context scalars)
                sizes = sizes[1:2]
            out.append(Collective(kind, sum(sizes), _group_size(line), weight[name], m.group(1)))
    return out


def summarize(items: list[Collective], runs: int = 1) -> dict:
    """Counts and bytes per kind, divided by ``runs`` (e.g. the decode steps of one dispatch)."""
    kinds: dict[str, dict] = {}
    for c in items:
        k = kinds.setdefault(c.kind, {"count": 0.0, "bytes": 0.0, "bytes_sent": 0.0})
        k["count"] += c.count / runs
        k["bytes"] += c.bytes * c.count / runs
        k["bytes_sent"] += c.bytes_sent * c.count / runs
    return {"count": sum(k["count"] for k in kinds.values()), "bytes": sum(k["bytes"] for k in kinds.values()),
            "bytes_sent": sum(k["bytes_sent"] for k in kinds.values()), "by_kind": kinds}


def mosaic_kernels(text: str) -> list[dict]:
    """Each distinct Mosaic (Pallas TPU) kernel of the program: the instruction that calls it (its name without
    the ``.N`` suffix), the kernel's own name, grid (``iteration_bounds``) and the grid dimensions' semantics
    (empty where the kernel does not state them, e.g. XLA's own ragged-dot kernels). A leading 'parallel'
    dimension of size 2 is split over a chip's two TensorCores (megacore); size 1 runs on one of them."""
    calls = re.findall(r'%([^\s=]+)\s*=[^\n]*custom_call_target="tpu_custom_call"[^\n]*?"custom_call_config":'
                       r'\{"body":"([^"]*)"', text)
    if not calls:
        return []
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.mosaic.python import tpu

    out, seen = [], set()
    for instruction, body in calls:
        base = re.sub(r"\.\d+$", "", instruction)
        if (base, body) in seen:
            continue
        seen.add((base, body))
        entry = {"instruction": base, "name": base, "grid": [], "dimension_semantics": []}
        with mlir.make_ir_context() as ctx:  # JAX's upstream dialects (func, arith, ...), then Mosaic's
            tpu.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            try:
                module = str(ir.Module.parse(base64.b64decode(body)))
            except Exception as e:  # a kernel serialized in a form this MLIR cannot read: say so, do not fail
                out.append({**entry, "error": str(e).splitlines()[0]})
                continue
        name = re.search(r'sym_name = "([^"]+)"', module)
        bounds = re.search(r"iteration_bounds = array<i64: ([0-9, ]+)>", module)
        sem = re.search(r"dimension_semantics = \[([^\]]*)\]", module)
        out.append({**entry, "name": name.group(1) if name else base,
                    "grid": [int(x) for x in bounds.group(1).split(",")] if bounds else [],
                    "dimension_semantics": re.findall(r"<(\w+)>", sem.group(1)) if sem else []})
    return out
