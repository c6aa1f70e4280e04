"""This project's rollout engine side by side with Hugging Face transformers and Google Tunix, interleaved in one run.

Same weights (``assets/tiny_policy``, a 0.8M-parameter Qwen3 in HF format), same prompts (``--problems`` synthetic
problems x ``--samples`` samples, encoded with the policy's tokenizer), same sampling (T = 1, no top-k/top-p).
Each system runs in its own persistent worker process (``tests/drills/peers/*_worker.py``; JSON lines over
stdin/stdout), so rounds interleave without reloading and only one system runs at a time:

- project: ``Engine`` + ``Scheduler`` (continuous batching over ``concurrent`` slots, page size 16, 8 decode steps
  per dispatch), in this checkout's ``.venv``;
- transformers: ``AutoModelForCausalLM.generate`` (PyTorch CPU), static batches of ``concurrent`` prompts (left
  padded), also in ``.venv`` (the test extras pin torch and transformers);
- Tunix: its Qwen3 model and ``Sampler``, static batches of ``concurrent`` prompts, in its own virtual environment
  (``--tunix-env``, built on first use: ``pip install google-tunix==0.1.7``; Tunix pins safetensors below 0.8).

First the correctness check: greedy continuations of 8 prompts must be identical across the systems and the logits of
a forward pass within 1e-4 of the project's; the benchmark stops otherwise (exit status 1). Then ``--rounds``
interleaved rounds (the order rotates each round) of:

- RL generation: EOS on, at most ``--max-new`` new tokens (the tiny policy's lengths are long-tailed), at 64 and 256
  concurrent;
- fixed length: ``--fixed-new`` tokens each (EOS ignored), at 64 and 256 concurrent;
- start-up (the first ``--startup-rounds`` rounds): a fresh process's time from launch to its first generated tokens
  (load, build the 64-concurrent generator, its warm-up, then one token for 64 prompts). Cold: the project (and
  Tunix) with an empty persistent compilation cache; warm: the same again with the cache it populated;
- one GRPO update of the 256 rows the project generated (project: packed rows; Tunix: its GRPO learner's padded
  path; Tunix's packed path applies no attention mask off TPU).

tokens/s is generated tokens (EOS included) over the wall-clock of the whole workload. Reported: medians per system,
and the median of the per-round paired ratios project / peer; the goals are checked against the faster peer
(throughput) or the slower peer (start-up). The table goes to docs/benchmarks.md unless ``--no-write``.

Usage: python tests/drills/bench_peers.py [--rounds 5] [--startup-rounds 3] [--systems project transformers tunix]
       [--problems 32 --samples 8] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny_policy"
PEERS = Path(__file__).resolve().parent / "peers"
WORK = ROOT / "runs" / "peer_bench"  # logs, compilation caches (runs/ is git-ignored)
TUNIX_VERSION = "0.1.7"
DEFAULT_TUNIX_ENV = Path("~/.cache/rollverify_jax/peers/tunix").expanduser()
SYSTEMS = ("project", "transformers", "tunix")
LABEL = {"project": "project", "transformers": "transformers", "tunix": "Tunix"}
LOGIT_TOL = 1e-4
CHECK_PROMPTS = 8
GOAL_DECODE, GOAL_RL, GOAL_WARM, GOAL_COLD = 1.2, 2.0, 1.0, 2.0


class BenchError(Exception):
    """A user-facing failure: bad input or a peer environment that cannot be built (exit status 2)."""


class CheckFailed(Exception):
    """The systems disagree: no timing is meaningful (exit status 1)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# Environments


def _pins() -> dict[str, str]:
    """torch / transformers versions pinned in the project's test extras."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for req in extras.get("test", []):
        name, _, version = req.partition("==")
        pins[name.strip().lower()] = version.strip()
    return pins


def ensure_transformers_env(python: str) -> None:
    """transformers with the CPU torch wheel, as the test extras pin them, in this interpreter's environment."""
    probe = [python, "-c", "import torch, transformers"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return
    pins = _pins()
    torch_req = f"torch=={pins['torch']}" if "torch" in pins else "torch"
    tf_req = f"transformers=={pins['transformers']}" if "transformers" in pins else "transformers"
    log(f"installing {torch_req} (CPU wheel) and {tf_req} into {Path(python).parent.parent}")
    steps = [[python, "-m", "pip", "install", torch_req, "--index-url", "https://download.pytorch.org/whl/cpu"],
             [python, "-m", "pip", "install", tf_req]]
    for cmd in steps:
        if subprocess.run(cmd).returncode != 0:
            raise BenchError(f"could not install the transformers peer ({' '.join(cmd)} failed); install the "
                             "test extras by hand: pip install -e '.[test]'")
    if subprocess.run(probe, capture_output=True).returncode != 0:
        raise BenchError(f"torch / transformers still do not import in {python}")


def ensure_tunix_env(env: Path) -> str:
    """Tunix in its own virtual environment (it pins safetensors < 0.8, the project needs 0.8): created and
    installed on first use. Returns its python."""
    python = env / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m, tunix, jax; print(m.version('google-tunix'))"]
    if python.exists():
        got = subprocess.run(probe, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == TUNIX_VERSION:
            return str(python)
    log(f"building the Tunix {TUNIX_VERSION} environment in {env} (a few minutes)")
    build_log = env.parent / f"{env.name}_build.log"
    try:
        env.parent.mkdir(parents=True, exist_ok=True)
        with open(build_log, "w") as out:
            steps = [[sys.executable, "-m", "venv", str(env)] if not python.exists() else None,
                     [str(python), "-m", "pip", "install", "--upgrade", "pip"],
                     [str(python), "-m", "pip", "install", f"google-tunix=={TUNIX_VERSION}"]]
            for cmd in filter(None, steps):
                if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    raise BenchError(f"building the Tunix environment failed at `{' '.join(cmd)}`; see {build_log} "
                                     "(or point --tunix-env at a working one, or leave tunix out of --systems)")
    except OSError as e:
        raise BenchError(f"cannot build the Tunix environment in {env}: {e} (choose another --tunix-env, or leave "
                         "tunix out of --systems)") from e
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0 or got.stdout.strip() != TUNIX_VERSION:
        raise BenchError(f"Tunix does not import from {env} after the install: {got.stderr.strip()[-500:]}")
    return str(python)


# ----------------------------------------------------------------------------------------------------------
# Workers


class Worker:
    """One system's worker process; ``call`` sends a command and waits for its reply."""

    def __init__(self, system: str, python: str, env: dict[str, str] | None = None, tag: str = ""):
        self.system = system
        WORK.mkdir(parents=True, exist_ok=True)
        self.log_path = WORK / f"{system}{tag}.log"
        self._log = open(self.log_path, "w")
        script = PEERS / {"project": "project_worker.py", "transformers": "hf_worker.py",
                          "tunix": "tunix_worker.py"}[system]
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, cwd=ROOT, env=env)
        self._read()  # "started"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.system} worker exited ({self.proc.returncode}); its log {self.log_path}:\n"
                               + _tail(self.log_path))
        msg = json.loads(line)
        if not msg.get("ok"):
            raise RuntimeError(f"{self.system} worker failed:\n{msg.get('error')}")
        return msg

    def call(self, cmd: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError):  # already exiting: the wait below ends it
                self.call("quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return "(no log)"


def worker_env(system: str, cache_dir: Path | None) -> dict[str, str]:
    """The environment of a worker: JAX's own cache variables cleared, then the system's persistent compilation
    cache pointed at ``cache_dir`` (None: off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k not in ("JAX_COMPILATION_CACHE_DIR", "ROLLVERIFY_COMPILATION_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if system == "project":
        env["ROLLVERIFY_COMPILATION_CACHE"] = str(cache_dir) if cache_dir else "off"
    elif system == "tunix" and cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    if system == "tunix":
        env.pop("PYTHONPATH")  # its own environment only
    # transformers runs with PyTorch's own OpenMP settings (OMP_WAIT_POLICY unset) unless the caller sets them:
    # PASSIVE (threads sleep between ops) costs it about half its decode speed on this workload's tiny ops, and
    # ACTIVE (threads spin forever) takes the cores from whichever system runs next.
    return env


# ----------------------------------------------------------------------------------------------------------
# Workload


def build_prompts(problems: int, samples: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompts: each problem repeated ``samples`` times, group after group; the distinct prompts; texts)."""
    from rollverify_jax.data.datasets import load_synthetic
    from rollverify_jax.models.tokenizer import Tokenizer

    task = json.loads((POLICY / "task.json").read_text())
    records = load_synthetic(problems, seed=1, split="train", **task)
    tokenizer = Tokenizer.from_dir(POLICY)
    distinct = [list(map(int, tokenizer.encode(r["prompt"]))) for r in records]
    return [p for p in distinct for _ in range(samples)], distinct, [r["prompt"] for r in records]


def grpo_rows(prompts: list[list[int]], gen: dict, samples: int) -> dict:
    """The 256 (etc.) rows of one GRPO update: the project's own samples, with group-normalised random rewards."""
    import numpy as np

    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, size=len(prompts)).astype(np.float64).reshape(-1, samples)
    adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
    return {"prompts": prompts, "responses": gen["responses"], "logps": gen["logps"],
            "advantages": adv.reshape(-1).tolist(), "group_size": samples}


# ----------------------------------------------------------------------------------------------------------
# Correctness


def check(workers: dict[str, Worker], distinct: list[list[int]], max_new: int) -> str:
    """Greedy continuations identical and logits within LOGIT_TOL of the project's, or CheckFailed."""
    import numpy as np

    prompts = distinct[:CHECK_PROMPTS]
    greedy, logits = {}, {}
    for name, w in workers.items():
        greedy[name] = w.call("generate", prompts=prompts, slots=CHECK_PROMPTS, eos=True, max_new=max_new, seed=0,
                              greedy=True, return_tokens=True)["responses"]
        logits[name] = [np.asarray(x) for x in w.call("logits", prompts=prompts)["logits"]]
    lines = []
    for name in workers:
        if name == "project":
            continue
        same = sum(a == b for a, b in zip(greedy["project"], greedy[name], strict=True))
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits["project"], logits[name], strict=True))
        lines.append(f"{LABEL[name]}: greedy continuations identical {same}/{len(prompts)}, "
                     f"max |logit difference| {diff:.1e}")
        log(f"check {lines[-1]}")
        if same != len(prompts) or not diff <= LOGIT_TOL:
            bad = next((i for i, (a, b) in enumerate(zip(greedy["project"], greedy[name], strict=True)) if a != b),
                       None)
            detail = "" if bad is None else (f"; first differing prompt #{bad}: project {greedy['project'][bad][:40]} "
                                             f"vs {greedy[name][bad][:40]}")
            raise CheckFailed(f"{LABEL[name]} disagrees with the project ({lines[-1]}; tolerance {LOGIT_TOL:g})"
                              f"{detail}")
    lengths = [len(r) for r in greedy["project"]]
    lines.append(f"greedy continuation lengths {lengths}")
    return "; ".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Reporting


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired(a: list[float], b: list[float]) -> float:
    return med([x / y for x, y in zip(a, b, strict=True)]) if a and b else float("nan")


def fmt(x: float, unit: str = "") -> str:
    if x != x:
        return "-"
    return f"{x:,.0f}{unit}" if x >= 100 else f"{x:.2f}{unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved throughput rounds")
    ap.add_argument("--startup-rounds", type=int, default=3, help="rounds that also measure start-up (0: none)")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--concurrent", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-new", type=int, default=200, help="RL generation: most new tokens (EOS on)")
    ap.add_argument("--fixed-new", type=int, default=128, help="fixed-length workload: new tokens (EOS off)")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="transformers: torch.set_num_threads (default: the core count)")
    ap.add_argument("--no-grpo", action="store_true", help="skip the GRPO update row")
    ap.add_argument("--tunix-env", type=Path, default=DEFAULT_TUNIX_ENV)
    ap.add_argument("--no-write", action="store_true", help="print the table only; leave docs/benchmarks.md")
    args = ap.parse_args()
    if "project" not in args.systems:
        ap.error("--systems must include project (every ratio is project / peer)")
    for name in ("rounds", "problems", "samples", "max_new", "fixed_new", "torch_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.startup_rounds < 0 or args.startup_rounds > args.rounds:
        ap.error("--startup-rounds must be in [0, --rounds]")
    if any(c < 1 for c in args.concurrent):
        ap.error("--concurrent values must be >= 1")
    if not (POLICY / "config.json").exists():
        ap.error(f"{POLICY} is missing")
    try:
        return run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckFailed as e:
        print(f"correctness check failed: {e}", file=sys.stderr)
        return 1


def run(args) -> int:
    t_start = time.perf_counter()
    load = os.getloadavg()
    systems = [s for s in SYSTEMS if s in args.systems]
    pythons = {"project": sys.executable, "transformers": sys.executable}
    if "transformers" in systems:
        ensure_transformers_env(sys.executable)
    if "tunix" in systems:
        pythons["tunix"] = ensure_tunix_env(args.tunix_env.expanduser())

    prompts, distinct, _ = build_prompts(args.problems, args.samples)
    longest = max(len(p) for p in prompts)
    max_seq_len = max(320, -(-(longest + max(args.max_new, args.fixed_new)) // 16) * 16)
    prompt_width = 1 << (longest - 1).bit_length()  # Tunix pads prompts to one width: one compile
    log(f"{len(prompts)} prompts ({args.problems} problems x {args.samples}), {longest} tokens at most; "
        f"context {max_seq_len}")
    workloads = [(kind, c) for kind in ("rl", "fixed") for c in args.concurrent]
    spec = {"rl": dict(eos=True, max_new=args.max_new), "fixed": dict(eos=False, max_new=args.fixed_new)}
    configs = [{"slots": c, "eos": spec[k]["eos"]} for k, c in workloads]
    configs.append({"slots": CHECK_PROMPTS, "eos": True, "greedy": True})
    setup_kw = dict(policy=str(POLICY), configs=configs, max_seq_len=max_seq_len, prompt_width=prompt_width,
                    max_new=max(args.max_new, args.fixed_new), torch_threads=args.torch_threads)

    workers: dict[str, Worker] = {}
    try:
        versions = {}
        for name in systems:
            log(f"starting the {LABEL[name]} worker (load, build, warm-up)")
            cache = WORK / "xla_workers" / name if name != "transformers" else None
            workers[name] = Worker(name, pythons[name], worker_env(name, cache))
            versions[name] = workers[name].call("setup", **setup_kw)
            log(f"  {LABEL[name]} ready in {versions[name]['seconds']:.1f} s: "
                + ", ".join(f"{k} {v}" for k, v in versions[name].items() if k not in ("ok", "seconds", "eos_ids")))

        log("correctness check")
        check_line = check(workers, distinct, args.max_new)

        log("warm-up: every workload once per system (every shape compiled)")
        warm_gen = {}
        for kind, c in workloads:
            for name, w in workers.items():
                warm_gen[(name, kind, c)] = w.call("generate", prompts=prompts, slots=c, seed=999,
                                                   return_tokens=(name == "project" and kind == "rl"),
                                                   **spec[kind])

        grpo = None
        if not args.no_grpo:
            rows = grpo_rows(prompts, warm_gen[("project", "rl", args.concurrent[0])], args.samples)
            grpo = {}
            for name, w in workers.items():
                if name == "transformers":
                    continue
                try:
                    info = w.call("grpo_setup", rows=rows, width=max_seq_len)
                    grpo[name] = {"info": info, "times": []}
                    log(f"  GRPO update ready on {LABEL[name]}: {info}")
                except RuntimeError as e:
                    log(f"  GRPO update unavailable on {LABEL[name]}: {str(e).strip().splitlines()[-1]}")

        rates = {(name, kind, c): [] for name in systems for kind, c in workloads}
        lengths = {}
        startup = {(name, temp): [] for name in systems for temp in ("cold", "warm")}
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            log(f"round {r + 1}/{args.rounds} (order: {', '.join(LABEL[s] for s in order)})")
            for kind, c in workloads:
                for name in order:
                    out = workers[name].call("generate", prompts=prompts, slots=c, seed=r, **spec[kind])
                    rates[(name, kind, c)].append(out["tokens"] / out["seconds"])
                    lengths.setdefault((name, kind), []).extend(out["lengths"])
                    log(f"  {kind:5s} {c:4d} concurrent  {LABEL[name]:12s} {out['tokens']:7d} tokens "
                        f"{out['seconds']:7.2f} s  {out['tokens'] / out['seconds']:8.0f} tok/s")
            if grpo:
                for name in order:
                    if name in grpo:
                        s = workers[name].call("grpo")["seconds"]
                        grpo[name]["times"].append(s)
                        log(f"  GRPO update {LABEL[name]:12s} {s:.2f} s")
            if r < args.startup_rounds:
                for name in order:
                    cache = WORK / "xla_startup" / f"{name}_{r}"
                    shutil.rmtree(cache, ignore_errors=True)
                    for temp in ("cold", "warm"):
                        s = measure_startup(name, pythons[name], cache, setup_kw, prompts, args.concurrent[0])
                        startup[(name, temp)].append(s)
                        log(f"  start-up {temp} {LABEL[name]:12s} {s:6.1f} s")
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        for w in workers.values():
            w.close()

    body, table = report(args, systems, versions, rates, lengths, startup, grpo, check_line, prompts, max_seq_len,
                         prompt_width, time.perf_counter() - t_start, load)
    print("\n" + table + "\n")
    if not args.no_write:
        from rollverify_jax.studies import benchlib

        benchlib.write_section("Peers: project vs transformers vs Tunix (bench_peers.py)", body)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


def measure_startup(name: str, python: str, cache: Path, setup_kw: dict, prompts: list[list[int]],
                    concurrent: int) -> float:
    """Seconds from launching a fresh worker to its first generated tokens for ``concurrent`` prompts (load, build
    the generator of the RL workload at that concurrency, its warm-up, then one token each)."""
    kw = dict(setup_kw, configs=[{"slots": concurrent, "eos": True}])
    t0 = time.perf_counter()
    w = Worker(name, python, worker_env(name, cache if name != "transformers" else None), tag="_startup")
    try:
        w.call("setup", **kw)
        w.call("first_tokens", prompts=prompts, slots=concurrent, eos=True)
        return time.perf_counter() - t0
    finally:
        w.close()


def report(args, systems, versions, rates, lengths, startup, grpo, check_line, prompts, max_seq_len, prompt_width,
           wall, load) -> tuple[str, str]:
    peers = [s for s in systems if s != "project"]
    head = ("| workload | " + " | ".join(LABEL[s] for s in systems) + " | "
            + " | ".join(f"project / {LABEL[p]}" for p in peers) + " |")
    rows = [head, "|" + " --- |" * (1 + len(systems) + len(peers))]
    goals = []
    names = {"rl": f"RL generation, EOS on (at most {args.max_new} new tokens)",
             "fixed": f"fixed length, {args.fixed_new} tokens each"}
    for kind in ("rl", "fixed"):
        for c in args.concurrent:
            cells = [fmt(med(rates[(s, kind, c)])) + " tok/s" for s in systems]
            ratios = [paired(rates[("project", kind, c)], rates[(p, kind, c)]) for p in peers]
            rows.append(f"| {names[kind]}, {c} concurrent | " + " | ".join(cells) + " | "
                        + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
            if peers:
                fastest = max(peers, key=lambda p: med(rates[(p, kind, c)]))
                ratio = paired(rates[("project", kind, c)], rates[(fastest, kind, c)])
                target = GOAL_RL if kind == "rl" else GOAL_DECODE
                what = "RL generation" if kind == "rl" else "per-token decode (fixed length)"
                goals.append(_goal(f"{what} at {c} concurrent >= {target:g}x the faster peer ({LABEL[fastest]})",
                                   ratio, target, higher=True))
    if any(startup.values()):
        for temp in ("cold", "warm"):
            cells = [fmt(med(startup[(s, temp)]), " s") for s in systems]
            ratios = [paired(startup[("project", temp)], startup[(p, temp)]) for p in peers]
            rows.append(f"| start-up to first tokens, {temp} cache | " + " | ".join(cells) + " | "
                        + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
        if peers:
            slowest = max(peers, key=lambda p: med(startup[(p, "warm")]))
            for temp, target in (("warm", GOAL_WARM), ("cold", GOAL_COLD)):
                ratio = paired(startup[("project", temp)], startup[(slowest, "warm")])
                goals.append(_goal(f"start-up, {temp} compilation cache, <= {target:g}x the slower peer's "
                                   f"({LABEL[slowest]}, {fmt(med(startup[(slowest, 'warm')]), ' s')})",
                                   ratio, target, higher=False))
    if grpo and "project" in grpo:
        cells = []
        for s in systems:
            cells.append(fmt(med(grpo[s]["times"]), " s") + (" (packed)" if s == "project" else " (padded)")
                         if s in grpo else "-")
        ratios = [f"{paired(grpo[p]['times'], grpo['project']['times']):.2f}x faster" if p in grpo else "-"
                  for p in peers]
        rows.append(f"| one GRPO update, {len(prompts)} rows | " + " | ".join(cells) + " | " + " | ".join(ratios)
                    + " |")
    table = "\n".join(rows)

    mean_len = {k: statistics.mean(v) for k, v in lengths.items() if k[1] == "rl"}
    max_len = {k: max(v) for k, v in lengths.items() if k[1] == "rl"}
    lens = ", ".join(f"{LABEL[s]} mean {mean_len[(s, 'rl')]:.0f} / max {max_len[(s, 'rl')]}" for s in systems)
    vers = "; ".join(
        f"{LABEL[s]} " + ", ".join(f"{k} {v}" for k, v in versions[s].items()
                                   if k not in ("ok", "seconds", "eos_ids", "cache", "threads", "omp_wait_policy"))
        for s in systems)
    grpo_note = ""
    omp = os.environ.get("OMP_WAIT_POLICY", "unset (PyTorch's default)")
    if grpo:
        grpo_note = (
            "GRPO update: one step (forward, backward, AdamW with gradient clipping at 1.0) over the project's own "
            "RL-generation samples with group-normalised random rewards. Project: `Learner.train_step` on "
            f"packed rows (width {max_seq_len}). Tunix: its registered `grpo` policy loss (`algo_core.grpo_loss_fn`, "
            "`GRPOConfig` with beta 0, token-mean) on padded rows (prompts left padded, completions right padded) "
            "under `nnx.value_and_grad` and an `nnx.Optimizer` in one `nnx.jit`, the body of its trainer's "
            "`_train_step` (the RL cluster around it is not built); its packed path is not compared (its packed RL "
            "attention applies no mask off TPU: log-probs off by up to 12.7 nats). Time per update after compiling, "
            "median over rounds."
            + ("" if "tunix" in grpo or "tunix" not in systems else " Tunix's update did not run here (see the "
               "worker's log under runs/peer_bench/)."))
    body = "\n".join([
        table, "",
        "Goals (project / the faster peer for throughput, / the slower peer's warm start-up for start-up; "
        "medians of paired per-round ratios):", "",
        *[f"- {g}" for g in goals], "",
        f"Workload: `{POLICY.relative_to(ROOT)}` (a 0.8M-parameter Qwen3, float32), {args.problems} synthetic "
        f"problems x {args.samples} samples = {len(prompts)} sequences, T = 1 with no top-k/top-p. RL generation "
        f"response lengths ({lens}). tokens/s: generated tokens (EOS included) over the wall-clock of the whole "
        f"workload (admission, prefill, decode). Medians of {args.rounds} interleaved rounds (order rotating), "
        f"start-up over {args.startup_rounds} of them. Load average (1 min) at the start / end of the run: "
        f"{load[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows "
        "every system; the interleaving spreads it over them).",
        "",
        "Systems: project: `Engine` + `Scheduler` (continuous batching, `concurrent` slots, page size 16, 8 decode "
        f"steps per dispatch, context {max_seq_len}); transformers: `generate` (PyTorch CPU, float32, "
        f"`torch.set_num_threads({args.torch_threads})`, `OMP_WAIT_POLICY={omp}`, top_k=0, top_p=1), static "
        "batches of `concurrent` prompts, left padded, fixed length by `min_new_tokens`; Tunix: its Qwen3 + "
        f"`Sampler` (cache {prompt_width} prompt + "
        f"{max(args.max_new, args.fixed_new)} tokens), static batches of `concurrent` prompts; each in its own "
        "worker process, one running at a time. Versions: " + vers + ".",
        "",
        "Start-up: a fresh process's time from launch to its first generated tokens (load, build the "
        f"{args.concurrent[0]}-concurrent generator and its warm-up - the project compiles nothing ahead: the "
        "first admission compiles the shapes it uses - then one new token for each prompt). Cold: the project "
        "and Tunix with an empty "
        "persistent compilation cache; warm: again with the cache the cold start wrote (transformers compiles "
        "nothing: both are plain restarts).",
        "",
        grpo_note,
        "",
        f"Correctness, checked before timing: {check_line} (tolerance {LOGIT_TOL:g}). Tunix's Qwen3 ignores "
        "`rope_theta` (always 1e6; the tiny policy uses 1e6). Whole run: {:.0f} s.".format(wall),
    ])
    goal_text = "\n".join(goals)
    return body, table + "\n\n" + goal_text


def _goal(what: str, ratio: float, target: float, higher: bool) -> str:
    if ratio != ratio:
        return f"{what}: not measured"
    met = ratio >= target if higher else ratio <= target
    by = ratio / target if higher else target / ratio
    verdict = f"met ({by:.2f}x the target)" if met else f"missed (at {by:.2f}x the target)"
    return f"{what}: {ratio:.2f}x, {verdict}"


if __name__ == "__main__":
    sys.exit(main())
