"""Every module that writes a table published under docs/ runs here on a tiny setting, so a renamed or moved name
breaks the suite, not the next regeneration of the docs: each run's tables have the columns of the published
ones (or, for the phenomenon reports, which read an archive kept in git, the published tables themselves).

Covered elsewhere: ``config_reference`` (tests/test_config_reference.py: the checked-in reference is current),
``tool_task_errors`` (tests/test_synthetic_tools.py). The bench scripts (scripts/bench_*.py: they time JAX
programs) and ``aot_table``'s compile step (a TPU compile) are checked here for their names only
(``test_every_name_a_table_script_uses_exists``); ``aot_table``'s writer runs on a report of the keys
``rollverify_jax.aot`` writes."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollverify_jax.sim import calibrate as cal

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def headers(text: str) -> list[str]:
    """The header line of every markdown table in ``text`` (a line followed by its ``| --- |`` line)."""
    lines = text.splitlines()
    return [a for a, b in zip(lines, lines[1:], strict=False) if a.startswith("| ") and b.startswith("| ---")]


def table_rows(text: str, header: str) -> list[str]:
    """The body rows of the table under ``header``."""
    lines = text.splitlines()
    start = lines.index(header) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("| ")), len(lines))
    return lines[start:end]


def run_module(monkeypatch, module, argv: list[str]) -> None:
    """``python -m <module> argv`` in this process (the modules parse ``sys.argv``)."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


# ---------------------------------------------------------------------------------------------- the simulator


def test_sim_scale_prints_the_published_tables(tmp_path):
    """The documented command (docs/results/simulator.md, "Real scale") at 2 steps a run, in a clone without the
    runs p(c) was fitted on: the published fit (refitted from the counts the published JSON recorded), every
    setting in every mode (synchronous and async) in the JSON, and the five tables (three synchronous, two async)
    with the published columns and one row per setting (and mode)."""
    doc = (DOCS / "results" / "simulator.md").read_text()
    published = doc.split("<!-- scale table -->")[1] + doc.split("<!-- async table -->")[1]
    out, png = tmp_path / "scale.json", tmp_path / "speedup.png"
    done = subprocess.run([sys.executable, "-m", "rollverify_jax.studies.sim_scale", "--runs", str(tmp_path),
                           "--json", str(out), "--plot", str(png), "--tables", "--steps", "2", "--sigmas", "0.75",
                           "1.25"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tiny_fail_prob"] == json.loads((DOCS / "results" / "simulator_scale.json").read_text())[
        "tiny_fail_prob"]  # the published fit, refitted from its recorded counts
    for setting in report["settings"]:
        assert set(setting["modes"]) == {"on_policy", "partial", "rollverify", "rollverify_tiny", "rollverify_redraw"}
        assert set(setting["async"]["modes"]) == {"async_rollverify", "async_unverified", "async_keep_kv",
                                                  "async_rollverify_redraw"}
        assert all(m["device_days"] > 0 for m in [*setting["modes"].values(), *setting["async"]["modes"].values()])
    assert {r["mode"] for r in report["rows"] if r["variant"] == "default"} == {
        "on_policy", "partial", "rollverify", "async_rollverify", "async_unverified", "async_keep_kv"}
    assert headers(done.stdout) == headers(published)
    for header, n in zip(headers(published), (4, 16, 3, 4, 16), strict=True):
        assert len(table_rows(done.stdout, header)) == len(table_rows(published, header)) == n
    assert png.stat().st_size > 0


def _metrics(step, num_slots: int, sequences: int, max_new: int, scale: float) -> dict:
    """A replayed step as the metrics a run logs (``calibrate``'s keys), its times scaled (another seed's
    machine load)."""
    return {"step": step.step, "mode/on_policy": int(step.on_policy), "time/step": scale * step.step_s,
            "time/rollout": scale * step.rollout_s, "time/train": scale * step.train_s,
            "time/verify": scale * step.verify_s, "rollout/decode_time": scale * step.decode_s,
            "rollout/prefill_time": scale * step.prefill_s, "rollout/dispatches": step.dispatches,
            "rollout/tokens": step.tokens_generated, "rollout/prefill_tokens": step.prefill_tokens,
            "rollout/shared_prompt_tokens": step.shared_prompt_tokens,
            "rollout/slot_utilization": step.slot_utilization(num_slots), "train/loss_tokens": step.batch_tokens,
            "response/length_mean": step.batch_tokens / sequences,
            "response/length_max": min(max_new, 3 * step.batch_tokens // sequences), **step.verify_metrics()}


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory) -> list[str]:
    """Run directories (spec.json + metrics.jsonl) of the tiny config, on-policy and RollVerify, seeds 0 and 1:
    7 steps replayed by the simulator at stated rates, the seeds' times 10% apart."""
    from rollverify_jax import simulate as sim
    from rollverify_jax.sim import predict
    from rollverify_jax.sim.shape import sim_config, sim_costs

    costs = {"decode_step_s": 0.01, "decode_slot_s": 1e-4, "prefill_call_s": 0.02, "prefill_token_s": 1e-5,
             "verify_token_s": 1e-5, "train_step_s": 1.0, "train_token_s": 1e-4, "step_overhead_s": 0.5}
    spec = sim.spec_from_gin(["configs/tiny_rollverify.gin"], [
        "SimConfig.segment_fail_prob = (0.3,)", "SimConfig.length_median = 30.0",
        *(f"CostModel.{k} = {v}" for k, v in costs.items())])
    shape = sim.shape_of(spec)
    inputs = predict.build_inputs(sim_config(spec), shape, [], costs=sim_costs(spec))
    root, runs = tmp_path_factory.mktemp("sim_runs"), []
    for mode in ("on_policy", "rollverify"):
        replay = predict.run_mode(mode, shape, inputs, 7)
        for seed in (0, 1):
            run = root / f"{mode.replace('_', '')}_s{seed}"
            run.mkdir()
            (run / "spec.json").write_text(json.dumps({**spec, "rollout": {**spec["rollout"], "mode": mode}}))
            (run / "metrics.jsonl").write_text("".join(
                json.dumps(_metrics(s, shape.num_slots, shape.batch_groups * shape.group_size,
                                    shape.max_new_tokens, 1 + 0.1 * seed)) + "\n" for s in replay.steps))
            runs.append(str(run))
    return runs


def test_sim_seeds_writes_the_published_tables(sim_runs, tmp_path, monkeypatch):
    """The calibration tables of docs/results/simulator.md at its documented ``--skip 1 5``, on four replayed
    runs (the length fit memoised: the runs' on-policy lengths are one replay's, so every held-out pool fits
    the same numbers)."""
    from rollverify_jax.studies import sim_seeds

    monkeypatch.setattr(cal, "fit_group_lognormal", functools.lru_cache(cal.fit_group_lognormal))
    md, out = tmp_path / "seeds.md", tmp_path / "seeds.json"
    sim_seeds.main(["--runs", *sim_runs, "--skip", "1", "5", "--md", str(md), "--json", str(out)])
    text = md.read_text()
    published = set(headers((DOCS / "results" / "simulator.md").read_text()))
    made = headers(text)
    matrices = [h for h in made if h.startswith("| fit on | `")]  # one column per run: the runs' names
    assert len(matrices) == 2 and all(h.count("`") == 2 * len(sim_runs) for h in matrices)
    assert [h for h in made if h not in matrices and h not in published] == []
    assert len(made) == 8
    assert len(table_rows(text, made[0])) == 4 and json.loads(out.read_text())["skip"] == [1, 5]


# ------------------------------------------------------------------------------- the phenomenon reports


@pytest.mark.parametrize("name", ["phenomenon_comparison", "phenomenon_timing"])
def test_phenomenon_report_regenerates_the_published_page(name, tmp_path, monkeypatch):
    """The published page's own command, on the archive in git, writes the page as published (the plot of the
    larger one is left out: the smaller one draws its own)."""
    from rollverify_jax.studies import phenomenon

    page = (DOCS / "results" / f"{name}.md").read_text()
    command = next(x for x in page.splitlines() if x.startswith("Command: `"))[len("Command: `"):-1]
    argv = shlex.split(command)[3:]
    (tmp_path / "phenomenon").symlink_to(phenomenon.ARCHIVE)
    monkeypatch.setattr(phenomenon, "ARCHIVE", tmp_path / "phenomenon")
    monkeypatch.setattr(phenomenon, "ROOT", tmp_path)
    if name == "phenomenon_comparison":
        monkeypatch.setattr(phenomenon, "plot", lambda data, name: [f"{name}.png"])
    run_module(monkeypatch, phenomenon, argv)
    made = (tmp_path / f"{name}.md").read_text()
    body = [x for x in made.splitlines() if not x.startswith("Command: ")]
    assert body == [x for x in page.splitlines() if not x.startswith("Command: ")]
    if name == "phenomenon_timing":
        assert (tmp_path / f"{name}.png").stat().st_size > 0


# ---------------------------------------------------------------------------- the comparisons (compare.py)


@pytest.fixture
def compare_root(tmp_path, monkeypatch) -> Path:
    """A checkout's layout under tmp_path for the compare modules (their ROOT): configs/ linked, and
    runs/compare_<name>/<config>_s<seed>/metrics.jsonl of 25 steps made from the phenomenon archive's runs
    (metrics of real tiny runs)."""
    from rollverify_jax.studies import compare, merge_comparisons, phenomenon, verify_stats

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for runs_name in ("study_verify", "before", "after"):
        for config, row in (("rollverify", "rollverify"), ("rollverify_verify_finished", "rollverify_verify_finished"),
                            ("rollverify_train_extra", "partial")):
            for seed in (0, 1):
                rows = phenomenon.load(row)[seed][1]
                run = tmp_path / "runs" / f"compare_{runs_name}" / f"{config}_s{seed}"
                run.mkdir(parents=True)
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 25))
    for module in (compare, merge_comparisons, verify_stats):
        monkeypatch.setattr(module, "ROOT", tmp_path)
    return tmp_path


def test_compare_merge_and_verify_stats_write_the_published_columns(compare_root, monkeypatch, capsys):
    """``compare --skip_runs`` (docs/results/study_verify.md's report), ``merge_comparisons``
    (rollverify_fixes.md) and ``verify_stats`` (study_verify.md's per-step table) re-read runs and print the
    published columns."""
    from rollverify_jax.studies import compare, merge_comparisons, verify_stats

    configs = ["rollverify", "rollverify_verify_finished", "rollverify_train_extra"]
    run_module(monkeypatch, compare, ["--name", "study_verify", "--configs",
                                      *(f"configs/studies/{c}.gin" for c in configs), "--steps", "25",
                                      "--seeds", "0", "1", "--skip_runs"])
    made = (compare_root / "docs" / "results" / "study_verify.md").read_text()
    study = (DOCS / "results" / "study_verify.md").read_text()
    assert headers(made)[0] == headers(study)[0]
    assert len(table_rows(made, headers(made)[0])) == 3
    assert (compare_root / "docs" / "results" / "study_verify_vs_step.png").stat().st_size > 0

    capsys.readouterr()
    run_module(monkeypatch, merge_comparisons, ["--name", "fixes", "--runs", "before", "after"])
    printed = capsys.readouterr().out  # compare's table, a row per comparison (rollverify_fixes.md predates
    assert headers(printed) == [headers(study)[0].replace("| config |", "| run |", 1)]  # its seeds/steps columns)
    assert len(table_rows(printed, headers(printed)[0])) == 2
    assert (compare_root / "docs" / "results" / "fixes_vs_wall.png").stat().st_size > 0

    run_module(monkeypatch, verify_stats, ["--runs_name", "study_verify", "--configs", *configs, "--seeds", "0",
                                           "1"])
    printed = capsys.readouterr().out
    assert headers(printed) and all(h in headers(study) for h in headers(printed)), headers(printed)


# ------------------------------------------------------------------- the aot table, planted bugs, mutation


def _aot_report() -> dict:
    """A report with the keys ``rollverify_jax.aot --json`` writes that ``aot_table`` reads."""
    program = {"compile_s": 10.0, "temp_bytes": 2**30, "argument_bytes": 2**31, "output_bytes": 2**30,
               "alias_bytes": 0, "flops": 1e12}
    return {"params": 8.2e9, "context": 20480, "topology": "v5p-32", "mesh": {"data": 1, "fsdp": 4, "tensor": 4},
            "resident": {"train_state": 30 * 2**30, "kv_pool": 20 * 2**30, "serving_params": 4 * 2**30},
            "resident_bytes_per_device": 54 * 2**30, "peak_bytes_per_device": 80 * 2**30, "peak_program": "train_step",
            "hbm_bytes_per_device": 95 * 2**30, "fits": True, "commit": "abc1234",
            "programs": {"train_step": program, "prefill": program, "decode": program},
            "estimate": {"train_step_s": 33.0, "train_mfu": 0.45},
            "train": {"train_useful_token_fraction": 0.88, "train_micro_batches_per_update": 1.5,
                      "train_speedup_vs_unpacked": 2.0},
            "decode": {"full_slots": {"estimate_tokens_per_s_per_chip": 1000.0,
                                      "roofline_tokens_per_s_per_chip": 1500.0}},
            "decode_roofline_fraction": 0.5}


def test_aot_table_rewrites_the_published_tables_from_reports(tmp_path, monkeypatch):
    from rollverify_jax.studies import aot_table

    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "qwen3_8b_dapo.json").write_text(json.dumps(_aot_report()))
    scale = (DOCS / "scale.md").read_text()
    (tmp_path / "scale.md").write_text(scale)
    monkeypatch.setattr(aot_table, "ROOT", tmp_path)
    run_module(monkeypatch, aot_table, ["--configs", "configs/qwen3_8b_dapo.gin", "--reports", "reports",
                                        "--out", "scale.md", "--skip_compile"])
    made = (tmp_path / "scale.md").read_text()
    published = scale.split("<!-- aot table -->")[1]
    assert headers(made.split("<!-- aot table -->")[1]) == headers(published)
    assert made.split("<!-- aot table -->")[0] == scale.split("<!-- aot table -->")[0]


def test_planted_bugs_dry_run_plants_every_bug_and_prints_the_published_table(monkeypatch, capsys):
    """``--dry_run``: every bug still plants (its line occurs once in its file), every test it names exists, and
    the table has docs/planted_bugs.md's columns, one row per bug; no test runs and no file is written."""
    from rollverify_jax.studies import planted_bugs

    run_module(monkeypatch, planted_bugs, ["--dry_run"])
    printed = capsys.readouterr().out
    published = (DOCS / "planted_bugs.md").read_text()
    assert headers(printed) == headers(published)
    assert len(table_rows(printed, headers(printed)[0])) == len(planted_bugs.BUGS)


def test_planted_bugs_merge_remeasures_some_rows_and_keeps_the_others():
    """``--only ... --merge``: the rows run now are replaced (each naming its commit), every other published row is
    kept as it is, and the count is of the whole table."""
    from rollverify_jax.studies import planted_bugs

    published = (DOCS / "planted_bugs.md").read_text()
    old_rows = table_rows(published, headers(published)[0])
    first, last = planted_bugs.BUGS[0], planted_bugs.BUGS[-1]
    text = planted_bugs.merged(published, [(first, False, 3.0, "5 passed"), (last, True, 4.0, "1 failed")], "abc1234")
    rows = table_rows(text, headers(text)[0])
    assert headers(text) == headers(published) and len(rows) == len(planted_bugs.BUGS)
    assert rows[0] == (f"| {first.name} | `{first.path}` | `test_verifier.py` | **no** | 5 passed (3 s; measured at "
                       "`abc1234`) |")
    assert rows[-1].startswith(f"| {last.name} |") and "| yes | 1 failed (4 s; measured at `abc1234`) |" in rows[-1]
    kept = {r.split(" | ")[0]: r for r in old_rows}
    for bug, row in zip(planted_bugs.BUGS[1:-1], rows[1:-1], strict=True):
        assert row == kept.get(f"| {bug.name}", planted_bugs._row(bug, None, 0.0, "")), bug.name
    assert text.endswith(f"Caught: {sum(' | yes | ' in r for r in rows)} of {len(rows)}.\n")


def test_mutation_report_writes_the_published_table(tmp_path):
    """The report of mutmut's results (statuses by mutant) has docs/mutation.md's columns and one row per
    module; equivalent mutants (named in tests/mutation_equivalents) and survivors are listed with their diff."""
    from rollverify_jax.studies import mutation_report

    equivalents = mutation_report.load_equivalents()
    eq = next(iter(equivalents))
    results = {"rollverify_jax/rl/losses.py": {"a__mutmut_1": "killed", "a__mutmut_2": "survived", eq: "survived"},
               "rollverify_jax/verify/ops.py": {"b__mutmut_1": "timeout", "b__mutmut_2": "not checked"}}
    text, _ = mutation_report.render(results, equivalents, "abc1234", None, diff=lambda name, path: f"-{name}\n+x")
    published = (DOCS / "mutation.md").read_text()
    assert headers(text) == headers(published)[:1]
    rows = table_rows(text, headers(text)[0])
    assert rows[0] == "| `rollverify_jax/rl/losses.py` | 3 | 1 | 2 | 0 | 1 | 0 | 50.0% (below target) |"
    assert len(rows) == 2 and f"- `{eq}`: {equivalents[eq]}" in text and "- `a__mutmut_2` (survived)" in text


# ------------------------------------------------------------------------------------ names, statically


TABLE_SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("rollverify_jax/studies/*.py")])


def _package_names(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, attribute or None, line) of every ``rollverify_jax`` name the file uses: each module it imports,
    each name imported from one, and each ``alias.attr`` read off a module imported under ``alias`` (what
    ``simulate.MODES`` was when it moved)."""
    tree = ast.parse(path.read_text())
    used, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rollverify_jax"):
                    used.append((a.name, None, node.lineno))
                    if a.asname:
                        modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollverify_jax"):
            for a in node.names:
                used.append((node.module, a.name, node.lineno))
                modules[a.asname or a.name] = f"{node.module}.{a.name}"  # a submodule, or not (checked below)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.append((modules[node.value.id], node.attr, node.lineno))
    return used


def _resolve(dotted: str):
    """The module, or the attribute of a module (at any depth), that ``dotted`` names; None if there is none."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        if not dotted.startswith(e.name or ""):  # the module exists but imports something missing: say so
            raise
    parent, _, name = dotted.rpartition(".")
    owner = _resolve(parent) if parent else None
    return getattr(owner, name, None) if owner is not None else None


@pytest.mark.parametrize("path", TABLE_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_table_script_uses_exists(path):
    missing = [f"line {line}: {module}" + (f".{attr}" if attr else "") for module, attr, line in _package_names(path)
               if _resolve(module if attr is None else f"{module}.{attr}") is None]
    assert not missing, f"{path.relative_to(ROOT)} uses names that do not exist: {missing}"


def test_every_bench_script_writes_a_published_section():
    """Each ``benchlib.write_section`` title of scripts/bench_*.py is a section of docs/benchmarks.md."""
    doc = (DOCS / "benchmarks.md").read_text()
    for path in ROOT.glob("scripts/bench_*.py"):
        titles = re.findall(r'write_section\(\s*"([^"]+)"', path.read_text())
        for title in titles:
            assert f"<!-- {title}:start -->" in doc, f"{path.name}: section {title!r} is not in docs/benchmarks.md"
