"""The shape plan: every program a run compiles, listed from its spec before anything is built.

Each engine and learner program is compiled for a finite list of buckets (``EnginePlan``'s ladders: prefill rows x
widths, decode slots x pages, the tool replies' widths; the learner's packed batch), so a run's program count is
known in advance: ``--warmup`` compiles it before the first step (``compile_ahead``), ``aot`` / ``--dry_run``
report it, and a test trains the tiny configs with JAX's compile log on and checks every program against it
(``check``). Padding waste is reported per prefill width at the config's length model (``SimConfig``'s prompt
length and lognormal response lengths).

What a plan lists is a program key: (family, jit function name, bucket dims). Families: 'prefill' (rows, width:
new prompts and resumes share it, its log-prob pass is a runtime branch), 'activate', 'decode' (slots, pages),
'extend' (width; tool use only), 'verify' (width; the two-stage rule's jitted verifier), 'coupled_prefill' (rows,
width: the coupled rule's resume prefill, its argmax check beside the log-probs), 'train_step', 'logprob' (when
``logprob_pass_users`` names a
user), 'helper' (the engine's fixed-shape bookkeeping programs) and 'setup' (one-time programs at start: the
decode state's allocation, the params' placement, the sampling key).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from rollverify_jax import schedule_rules

VERIFY_MODES = ("rollverify", "async")  # rollout modes whose resumes run the jitted verifier
REPLY_FRAME_TOKENS = 16  # a tool reply's frame and the call's closing tag, besides ToolUseConfig.max_reply_tokens

# The engine's fixed-shape helpers (one program each) and the one-time setup programs, by the name JAX logs.
HELPERS = ("_activate_fn", "_move_slots_fn", "_deactivate_fn")
# The params' placement (infra/transfer) and the train state's first copy (rl/learner), the decode state's zeros,
# and the sampling key's seeding (two programs).
SETUP = {"<lambda>": 2, "_zero_decode_state": 1, "_threefry_seed": 1, "stage": 1}


@dataclasses.dataclass(frozen=True)
class PlannedProgram:
    """One compiled program: its family, the jit function's name (as JAX's compile log names it) and its bucket."""

    family: str
    name: str
    dims: tuple[tuple[str, int | None], ...] = ()
    waste: float | None = None  # padding share of the bucket at the length model (prefill widths)

    def label(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims)
        return f"{self.family}({dims})" if dims else self.family


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    programs: tuple[PlannedProgram, ...]

    def __len__(self) -> int:
        return len(self.programs)

    def of(self, family: str) -> list[PlannedProgram]:
        return [p for p in self.programs if p.family == family]

    def counts(self) -> dict[str, int]:
        """Programs per family, in plan order."""
        return dict(collections.Counter(p.family for p in self.programs))

    def names(self) -> collections.Counter:
        """Planned programs per jit function name (setup programs: at most their listed count)."""
        out = collections.Counter(p.name for p in self.programs)
        out.update(SETUP)
        return out

    def check(self, compiled: Sequence[str]) -> list[str]:
        """Problems with a run's compiled programs (jit names from ``CompileLog``): a name the plan does not
        list, or more programs of a name than the plan holds. Empty: every compile was planned."""
        planned, seen = self.names(), collections.Counter(compiled)
        return [f"{name}: compiled {n} programs, the plan has {planned.get(name, 0)}"
                for name, n in sorted(seen.items()) if n > planned.get(name, 0)]

    def summary(self) -> str:
        """One line: the count and its families."""
        parts = ", ".join(f"{n} {family}" for family, n in self.counts().items())
        return f"{len(self)} programs ({parts}; plus at most {sum(SETUP.values())} one-time setup programs)"

    def table(self) -> str:
        """The plan as text, one family per line (prefill widths with their padding waste)."""
        lines = [self.summary()]
        for family in self.counts():
            programs = self.of(family)
            lines.append(f"  {family}: " + ", ".join(" ".join(f"{k}={v}" for k, v in p.dims) or p.name
                                                     for p in programs))
        widths = {dict(p.dims)["width"]: p.waste for p in self.of("prefill")
                  if p.waste is not None and not math.isnan(p.waste)}  # nan: no sequence of the model that wide
        if widths:
            lines.append("  prefill padding at the length model (one sequence per row, before packing): "
                         + ", ".join(f"width {w}: {waste:.0%}" for w, waste in sorted(widths.items())))
        return "\n".join(lines)


def length_model_sample(spec, n: int = 4096) -> np.ndarray:
    """``n`` sequence lengths (prompt + response) at the simulator's length model (``SimConfig``, drawn group by
    group as the simulator draws them: ``sim.replay.LengthModel``)."""
    from rollverify_jax.sim.replay import LengthModel

    sim, group = spec.sim, spec.rollout.group_size
    model = LengthModel(spec.rollout.max_new_tokens, sim.lengths, sim.length_median, sim.length_sigma, sim.seed,
                        sim.length_group_share)
    response = [x for _ in range(-(-n // group)) for x in model.draw(group)][:n]
    return sim.prompt_len + np.asarray(response, np.int64)


def prefill_waste(widths: Sequence[int], lengths: np.ndarray) -> dict[int, float]:
    """Per width bucket, the padding share of a row holding one sequence of the bucket (its last token is not
    prefilled): 1 - mean(tokens) / width over the sequences the bucket takes."""
    tokens = np.maximum(lengths - 1, 1)
    out = {}
    lo = 0
    for w in widths:
        mine = tokens[(tokens > lo) & (tokens <= w)]
        out[w] = float(1 - mine.mean() / w) if mine.size else float("nan")
        lo = w
    return out


def engine_programs(engine_plan, *, tool_use: bool = False, max_reply_tokens: int | None = None,
                    lengths: np.ndarray | None = None, tag: str = "") -> list[PlannedProgram]:
    """The programs of one engine static (an ``EnginePlan`` and one sampler): prefill buckets, activation,
    decode buckets, and with ``tool_use`` the extend widths up to the longest reply. ``tag`` prefixes the
    families (an evaluation sampler compiles its own)."""
    waste = prefill_waste(engine_plan.prefill_widths(), lengths) if lengths is not None else {}
    out = [PlannedProgram(tag + "prefill", "_prefill_fn", (("rows", r), ("width", w)), waste.get(w))
           for w in engine_plan.prefill_widths() for r in engine_plan.prefill_rows(w)]
    pages = engine_plan.live_page_buckets() if engine_plan.config.live_pages else [None]
    out += [PlannedProgram(tag + "decode", "_generate_fn", (("slots", s), ("pages", p)))
            for s in engine_plan.live_slot_buckets() for p in pages]
    if tool_use:
        widths = engine_plan.extend_widths()
        if max_reply_tokens is not None:  # a reply with its frame: within the bucket holding it
            top = schedule_rules.smallest_holding(widths, max_reply_tokens + REPLY_FRAME_TOKENS)
            widths = widths[: widths.index(top) + 1]
        out += [PlannedProgram(tag + "extend", "_extend_fn", (("width", w),)) for w in widths]
    return out


def plan_run(spec, engine_plan, eval_sampling=None, train_state=None, logprob_users: Sequence[str] = ()
             ) -> ShapePlan:
    """The shape plan of a run of ``spec`` whose engine is laid out as ``engine_plan`` (``run/programs.py``'s
    ``make_engine_plan``; deviceless works). ``eval_sampling``: the evaluation's sampler when it differs from
    training's (its engine programs compile again for it). ``train_state``: the learner's (abstract) state, whose
    replicated arrays a checkpoint writes in per-replica slices (``checkpoint_programs``). ``logprob_users``:
    ``run/programs.logprob_pass_users`` (a log-prob pass compiles beside the train step)."""
    lengths = length_model_sample(spec)
    tool = bool(spec.tool_use.enabled)
    reply = spec.tool_use.max_reply_tokens if tool else None
    out = engine_programs(engine_plan, tool_use=tool, max_reply_tokens=reply, lengths=lengths)
    if eval_sampling is not None and eval_sampling != engine_plan.sampling:
        out += engine_programs(engine_plan, tool_use=tool, max_reply_tokens=reply, tag="eval_")
    out += [PlannedProgram("helper", name) for name in HELPERS]
    if spec.rollout.mode in VERIFY_MODES and spec.verify.rule == "coupled":  # its check runs in the resume prefill
        out += [PlannedProgram("coupled_prefill", "_prefill_fn", (("rows", r), ("width", w)))
                for w in engine_plan.prefill_widths() for r in engine_plan.prefill_rows(w)]
    elif spec.rollout.mode in VERIFY_MODES:
        out += [PlannedProgram("verify", "_verify_arrays", (("width", w),)) for w in engine_plan.prefill_widths()]
    out += learner_programs(spec)
    if train_state is not None:
        out += checkpoint_programs(train_state)
    if logprob_users:
        out += [PlannedProgram("logprob", p.name.replace("train_step", "logprob"), p.dims)
                for p in learner_programs(spec)]
    return ShapePlan(tuple(out))


def learner_programs(spec) -> list[PlannedProgram]:
    """The train step's programs: one with ``LearnerConfig.micro_batch_size`` (every batch runs the largest
    packed layout, looping over the micro-batches its tokens fill), else one per packed row bucket the batch's
    rows can round to (``schedule_rules.row_bucket``, 1 up to one row per sequence)."""
    if spec.learner.micro_batch_size is not None:
        return [PlannedProgram("train_step", "train_step")]
    most = spec.rollout.batch_groups * spec.rollout.group_size
    buckets = sorted({schedule_rules.row_bucket(n) for n in range(1, most + 1)})
    return [PlannedProgram("train_step", "train_step", (("rows", r),)) for r in buckets]


def checkpoint_programs(train_state) -> list[PlannedProgram]:
    """orbax's replica-parallel save slices (``run/checkpoint.py``): a replicated array whose per-replica slice
    holds at least ``REPLICA_SLICE_MIN_BYTES`` is written in one slice per replica, each its own program (one per
    shard shape, dtype and replica). None on one device."""
    import jax

    from rollverify_jax.run.checkpoint import REPLICA_SLICE_MIN_BYTES

    out, seen = [], set()
    for a in jax.tree.leaves(train_state):
        sharding = getattr(a, "sharding", None)
        if sharding is None:
            continue
        shard = sharding.shard_shape(a.shape)
        replicas = len(sharding.device_set) // max(1, math.prod(n // m for n, m in zip(a.shape, shard, strict=True)))
        nbytes = math.prod(shard) * np.dtype(a.dtype).itemsize
        axis = next((i for i, n in enumerate(shard) if n % replicas == 0 and n >= replicas), None)
        key = (shard, str(a.dtype))
        if replicas > 1 and axis is not None and nbytes // replicas >= REPLICA_SLICE_MIN_BYTES and key not in seen:
            seen.add(key)
            out += [PlannedProgram("checkpoint", "slice", (("shape", str(shard)), ("replica", r)))
                    for r in range(replicas)]
    return out


# --------------------------------------------------------------------------------------------------------------
# What a run compiled: JAX's compile log.

# One line per XLA compile (an in-memory cache hit, e.g. after compile_ahead, logs none; a persistent cache load
# logs its load time).
_COMPILED = re.compile(r"Finished XLA compilation of (?:jit|pjit)\((?P<name>.*)\) in (?P<s>[0-9.e-]+) sec")


class CompileLog(logging.Handler):
    """Records every program XLA compiles inside the block: its name and seconds (JAX's ``jax_log_compiles``,
    whose lines it keeps from the console). Thread-safe; ``names`` and ``seconds`` in compile order."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []
        self.seconds: list[float] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        match = _COMPILED.search(record.getMessage())
        if match:
            with self._lock:
                self.names.append(match.group("name"))
                self.seconds.append(float(match.group("s")))

    def __enter__(self) -> CompileLog:
        import jax

        self._was = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        self._loggers = [logging.getLogger(name) for name in _COMPILE_LOGGERS]
        self._propagate = [lg.propagate for lg in self._loggers]
        self._null = logging.NullHandler()  # no handler at all would send them to logging's last resort
        for lg in self._loggers:  # the compile log's lines (several per program) stay off the console
            lg.propagate = False
            lg.addHandler(self._null)
        self._loggers[1].addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        self._loggers[1].removeHandler(self)
        for lg, was in zip(self._loggers, self._propagate, strict=True):
            lg.removeHandler(self._null)
            lg.propagate = was
        jax.config.update("jax_log_compiles", self._was)

    def counts(self) -> Mapping[str, int]:
        return collections.Counter(self.names)


_COMPILE_LOGGERS = ("jax._src.interpreters.pxla", "jax._src.dispatch")  # where jax_log_compiles writes


# --------------------------------------------------------------------------------------------------------------
# Compiling the plan ahead of the first step.

def compile_ahead(plan: ShapePlan, engine, learner=None, train_state=None, batch_rows: int | None = None,
                  threads: int | None = None, progress: bool = True) -> dict:
    """Compiles ``plan``'s engine programs (and, with ``learner``, its train step) for the very arguments the run
    will pass (the engine's params and decode state, host arrays of each bucket's shapes), ``threads`` at a time
    (XLA compiles outside the GIL), so the run's calls find them compiled (JAX keeps a lowered program's
    executable in memory; the persistent cache, when on, keeps it for the next start too). Evaluation-only and
    one-time programs compile when first used. Returns {'programs', 'seconds', 'wall_s'}."""
    import concurrent.futures
    import os
    import time

    import jax
    from tqdm import tqdm

    from rollverify_jax.rollout import engine as engine_lib
    from rollverify_jax.verify import verifier

    cfg = engine.config
    n, pps = cfg.num_slots, engine.allocator.pages_per_seq

    def host(*shape, dtype=np.int32):
        return jax.ShapeDtypeStruct(shape, dtype)
    static, params, state = engine._static(), engine.params, engine.state

    def lowering(p: PlannedProgram):
        d = dict(p.dims)
        if p.family in ("prefill", "coupled_prefill"):
            r, w = d["rows"], d["width"]
            packed = engine_lib.PackedPrefill(*[host(r, w)] * 6, *[host(n)] * 3,
                                              *[host(engine.plan.copy_capacity(w))] * 2, host())
            # The coupled check's keys only where the engine passes them: an argument more is another program.
            keys = (((host(r, w, dtype=np.uint32), host(r, w), host(dtype=np.float32)),)
                    if p.family == "coupled_prefill" else ())
            return lambda: engine_lib._prefill_jit.lower(static, params, state, packed, host(dtype=bool), *keys)
        if p.family == "decode":
            slots = None if d["slots"] == n else d["slots"]
            return lambda: engine_lib._generate_jit.lower(static, params, state, cfg.steps_per_dispatch,
                                                          d["pages"], slots, cfg.decode_stop_finished or None)
        if p.family == "extend":
            w = d["width"]
            return lambda: engine_lib._extend_jit.lower(
                static, params, state, host(n, w), host(n, w), host(n, w, dtype=bool), *[host(n)] * 3,
                host(n, dtype=np.uint32), host(n), host(n, pps), host(n, dtype=bool))
        if p.family == "verify":
            w = d["width"]
            return lambda: verifier._two_stage_verify_detail.lower(
                host(n, w, dtype=np.float32), host(n, w, dtype=np.float32), host(n, w), host(n),
                host(dtype=np.float32), host(dtype=np.float32))
        if p.name == "_activate_fn":
            return lambda: engine_lib._activate_fn.lower(state, *[host(n)] * 5, host(n, dtype=np.uint32),
                                                         host(n, pps), host(n, dtype=bool))
        if p.name == "_move_slots_fn":
            return lambda: engine_lib._move_slots_fn.lower(state, host(n), host(n))
        if p.name == "_deactivate_fn":
            return lambda: engine_lib._deactivate_fn.lower(state, host(n, dtype=bool))
        if p.family == "train_step" and learner is not None and not p.dims:
            batch = learner.abstract_batch(batch_rows, cfg.max_seq_len)
            if jax.process_count() == 1:  # the step gets host arrays (Learner._place), which carry no sharding
                batch = {k: host(*v.shape, dtype=v.dtype) for k, v in batch.items()}
            return lambda: learner.step_program.lower(train_state, batch, learner.frozen)
        return None

    todo = [(p, fn) for p in plan.programs if (fn := lowering(p)) is not None]

    def one(item) -> float:
        t0 = time.perf_counter()
        item[1]().compile()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    workers = threads or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        seconds = list(tqdm(pool.map(one, todo), total=len(todo), desc="compiling ahead", unit="program",
                            disable=not progress))
    return {"programs": len(todo), "seconds": round(sum(seconds), 1), "wall_s": round(time.perf_counter() - t0, 1)}
