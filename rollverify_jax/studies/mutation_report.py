"""Mutation score per module from mutmut's results (``make mutants`` runs mutmut, then this).

Reads ``mutants/**/*.meta`` (mutmut's per-file results) and ``tests/mutation_equivalents/*.toml`` (surviving
mutants judged equivalent, each with its reason), and writes the score table, the equivalent mutants and
every other survivor with its diff to ``docs/mutation.md``.

Score = detected / (generated - equivalent), where detected = killed + timeout (a mutant that makes a test
hang is caught by the timeout); "no tests" and survivors count against the score.

    python -m rollverify_jax.studies.mutation_report [--out docs/mutation.md]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.85
DETECTED = {"killed", "timeout", "segfault"}


def _status(exit_code) -> str:
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[exit_code]


def load_results() -> dict[str, dict[str, str]]:
    """module path -> {mutant name: status}."""
    out = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            out[str(meta.relative_to(ROOT / "mutants"))[: -len(".meta")]] = {k: _status(v) for k, v in codes.items()}
    return out


def load_equivalents() -> dict[str, str]:
    """mutant name -> why it is equivalent, from ``tests/mutation_equivalents/*.toml`` (one file per area)."""
    out = {}
    for path in sorted((ROOT / "tests" / "mutation_equivalents").glob("*.toml")):
        for entry in tomllib.loads(path.read_text()).get("equivalent", []):
            out[entry["mutant"]] = entry["why"]
    return out


def diff(name: str, path: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    lines = get_diff_for_mutant(name, path=path).splitlines()
    return "\n".join(x for x in lines[2:] if x.startswith(("+", "-")) and not x.startswith(("+++", "---")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "mutation.md"))
    ap.add_argument("--source_commit", default=None,
                    help="the commit whose source mutmut mutated, when it is not HEAD (e.g. a long run on a copy)")
    args = ap.parse_args()
    os.chdir(ROOT)  # mutmut reads its configuration from pyproject.toml in the working directory
    results, equivalents = load_results(), load_equivalents()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    text, rows = render(results, equivalents, commit, args.source_commit)
    Path(args.out).write_text(text)
    for row in rows:
        print(f"{row[0]:45s} {row[7]:6.1%}  ({row[2]} of {row[1] - row[5] - row[6]}; {row[3]} survived; "
              f"{row[6]} not run)")
    print(f"wrote {args.out}")


def render(results: dict[str, dict[str, str]], equivalents: dict[str, str], commit: str, source_commit: str | None,
           diff=diff) -> tuple[str, list[tuple]]:
    """docs/mutation.md from the statuses by module (``load_results``) and the equivalent mutants, and the
    table's rows (module, mutants, detected, survived, no tests, equivalent, not run, score); ``diff(name,
    path)`` gives a mutant's diff (mutmut's, by default)."""
    rows, survivors, equivalent_rows = [], [], []
    for path, statuses in results.items():
        counts = collections.Counter(statuses.values())
        eq = [n for n, s in statuses.items() if s not in DETECTED | {"not checked"} and n in equivalents]
        detected = sum(counts[s] for s in DETECTED)
        denominator = len(statuses) - len(eq) - counts["not checked"]
        score = detected / denominator if denominator else 1.0
        rows.append((path, len(statuses), detected, counts["survived"], counts["no tests"], len(eq),
                     counts["not checked"], score))
        for name, status in statuses.items():
            if status in DETECTED or status == "not checked":
                continue
            (equivalent_rows if name in equivalents else survivors).append((path, name, status))
    lines = [
        "# Mutation testing", "",
        f"`make mutants` (mutmut 3.8.1 over the modules where the method lives), reported at commit `{commit}`"
        + (f" for the source of commit `{source_commit}`." if source_commit else "."),
        "Score = mutants detected (killed, or timed out) / (mutants generated - equivalent ones). Target: "
        f"{TARGET:.0%} in every module.", "",
        "| module | mutants | detected | survived | no tests | equivalent | not run | score |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path, total, detected, survived, no_tests, eq, unchecked, score in rows:
        if unchecked == total:
            shown = "not run"
        else:
            shown = f"{score:.1%}" + ("" if score >= TARGET else " (below target)")
            if unchecked:
                shown += f" (partial: {total - unchecked} of {total} run)"
        lines.append(f"| `{path}` | {total} | {detected} | {survived} | {no_tests} | {eq} | {unchecked} | {shown} |")
    total = sum(r[1] for r in rows)
    detected = sum(r[2] for r in rows)
    eq_total = sum(r[5] for r in rows)
    unchecked = sum(r[6] for r in rows)
    lines += ["", f"All modules: {detected} of {total - eq_total - unchecked} non-equivalent mutants detected "
              f"({detected / max(1, total - eq_total - unchecked):.1%}).", ""]
    lines += ["## Equivalent mutants (they survive because nothing observable changes)", ""]
    for path, name, _ in equivalent_rows:
        lines += [f"- `{name}`: {equivalents[name]}", "", "```diff", diff(name, path), "```", ""]
    lines += ["## Surviving mutants", ""]
    if not survivors:
        lines.append("None.")
    for path, name, status in survivors:
        lines += [f"- `{name}` ({status})", "", "```diff", diff(name, path), "```", ""]
    return "\n".join(lines) + "\n", rows


if __name__ == "__main__":
    main()
