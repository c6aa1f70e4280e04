"""How the code is put together, in numbers a maintainer checks after a restructuring (run from a checkout's root;
its own ``rollverify_jax`` is the one measured, so an older commit's worktree can be measured with this script):

    python -m rollverify_jax.studies.code_stats [--step]

- per entry point: the package modules its source imports (``from rollverify_jax...``, at any depth in the
  file) and the package modules loaded once it is imported;
- the ten longest functions of the package (lines from ``def`` to the last line of the body);
- with ``--step``: the package modules whose code runs during one training step of the tiny config (the
  second step of a 2-step run, so compile-time tracing is the same as any later step's), from a profile hook.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
ENTRY_POINTS = ("train", "evaluate", "export", "simulate", "aot")


def package_files() -> list[Path]:
    return sorted((ROOT / "rollverify_jax").rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_imports(path: Path) -> set[str]:
    """The package modules a file imports by name (``from rollverify_jax import a`` counts ``rollverify_jax.a``)."""
    known = {module_name(p) for p in package_files()}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollverify_jax"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rollverify_jax"))
    return out - {"rollverify_jax"}


def loaded_modules(entry: str) -> int:
    code = (f"import sys; import rollverify_jax.{entry}; "
            "print(len([m for m in sys.modules if m.startswith('rollverify_jax.')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else -1


def longest_functions(n: int = 10) -> list[tuple[int, str]]:
    found = []
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((node.end_lineno - node.lineno + 1, f"{module_name(path)}.{node.name}"))
    return sorted(found, reverse=True)[:n]


def step_modules() -> list[str]:
    """The package modules whose functions run during the second step of a 2-step tiny run."""
    import tempfile

    from rollverify_jax import train

    seen: set[str] = set()
    calls = {"n": 0}
    real = train.train_one_step

    def profiled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != 2:
            return real(*args, **kwargs)

        def hook(frame, event, arg):
            if event == "call":
                name = frame.f_globals.get("__name__", "")
                if name.startswith("rollverify_jax"):
                    seen.add(name)
        sys.setprofile(hook)
        try:
            return real(*args, **kwargs)
        finally:
            sys.setprofile(None)

    train.train_one_step = profiled
    with tempfile.TemporaryDirectory() as tmp:
        train.main(["--gin_file=configs/tiny_rollverify.gin", f"--workdir={tmp}/run",
                    "--gin_param=TrainConfig.num_steps = 2", "--gin_param=TrainConfig.eval_every = 0",
                    "--gin_param=TrainConfig.eval_size = 4", "--gin_param=EvalConfig.at_start = False"])
    if calls["n"] < 2:
        raise RuntimeError(f"the 2-step run made {calls['n']} steps: nothing was traced")
    return sorted(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", action="store_true", help="also trace one training step (about a minute)")
    args = ap.parse_args()
    files = package_files()
    flat = [p for p in files if p.parent == ROOT / "rollverify_jax" and p.name != "__init__.py"]
    print(f"package: {len(files)} files, {sum(len(p.read_text().splitlines()) for p in files)} lines; "
          f"{len(flat)} top-level modules")
    for entry in ENTRY_POINTS:
        path = ROOT / "rollverify_jax" / f"{entry}.py"
        if path.exists():
            imports = sorted(source_imports(path))
            print(f"{entry}: imports {len(imports)} package modules, loads {loaded_modules(entry)}: "
                  + ", ".join(m.removeprefix("rollverify_jax.") for m in imports))
    print("ten longest functions:")
    for lines, name in longest_functions():
        print(f"  {lines:4d}  {name}")
    if args.step:
        modules = step_modules()
        print(f"one step visits {len(modules)} package modules: "
              + ", ".join(m.removeprefix("rollverify_jax.") for m in modules))


if __name__ == "__main__":
    main()
