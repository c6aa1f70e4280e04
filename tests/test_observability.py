"""Console lines off a terminal, the optional Weights & Biases logging, studies/plot_run.py and compare.py's
--configs: all on synthetic metric dicts and small metrics.jsonl files (no training)."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

from rollverify_jax.infra.cli import is_user_error
from rollverify_jax.run import metrics as metrics_lib
from rollverify_jax.run.metrics import (
    MetricsConfig,
    MetricsWriter,
    ProgressBar,
    StepLines,
    format_step_line,
    open_progress,
    open_wandb,
    read_metrics,
)
from rollverify_jax.studies import compare, phenomenon, plot_run

ROOT = Path(__file__).resolve().parents[1]

STEP = {"reward/mean": jnp.float32(0.4125), "eval/accuracy": 0.35, "mode/on_policy": 0, "verify/num_verified": 5,
        "verify/acceptance": 0.83, "ops/token_mean": 0.0012345, "rollout/tokens_per_s": 1534.4, "time/step": 3.214,
        "time/wall": 125.4, "policy/entropy": 0.7}


def _tty(monkeypatch, stdout: bool, stderr: bool) -> None:
    monkeypatch.setattr(metrics_lib.sys.stdout, "isatty", lambda: stdout, raising=False)
    monkeypatch.setattr(metrics_lib.sys.stderr, "isatty", lambda: stderr, raising=False)


# ----------------------------------------------------------------------------------------------------
# One line per step where a bar cannot draw


def test_step_line_has_the_headline_numbers():
    line = format_step_line(12, STEP, total_steps=120, mode="rollverify")
    assert line == ("step=12/120 reward=0.412 acc=0.350 mode=rollverify accept=0.830 ops=0.00123 tok/s=1534 "
                    "step_s=3.21 wall_s=125")


def test_step_line_leaves_out_what_the_step_did_not_measure():
    # No evaluation, no verified trajectory (its acceptance is a placeholder), switched to on-policy rollout.
    line = format_step_line(3, {"reward/mean": 0.5, "mode/on_policy": 1, "verify/num_verified": 0,
                                "verify/acceptance": 1.0, "time/step": 2.0})
    assert line == "step=3 reward=0.500 mode=on_policy step_s=2.00"
    assert format_step_line(0, {"eval/accuracy": 0.25, "note": "text"}, total_steps=5) == "step=0/5 acc=0.250"


@pytest.mark.parametrize(("stdout", "stderr", "style"), [(False, False, "lines"), (False, True, "lines"),
                                                         (True, False, "lines"), (True, True, "bar")])
def test_auto_progress_is_a_bar_only_on_a_terminal(monkeypatch, stdout, stderr, style):
    _tty(monkeypatch, stdout, stderr)
    assert metrics_lib.progress_style("auto") == style
    progress = open_progress(MetricsConfig(), total_steps=4, mode="partial")
    with progress:
        assert isinstance(progress, StepLines if style == "lines" else ProgressBar)
        assert not progress.disabled


class Stream(io.StringIO):
    """A log file standing in for stdout: not a terminal, and it records what had been flushed."""

    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


def test_lines_print_one_flushed_line_per_step(monkeypatch):
    stdout = Stream()
    monkeypatch.setattr(sys, "stdout", stdout)  # nohup / SLURM: stdout goes to a file
    with open_progress(MetricsConfig(), total_steps=2, mode="rollverify") as progress:
        assert isinstance(progress, StepLines)
        progress.update(0, {"eval/accuracy": 0.25, "time/wall": 3.0})
        assert stdout.flushed[-1] == "step=0/2 acc=0.250 wall_s=3\n"  # in the file now, not at exit
        progress.update(1, STEP)
        assert stdout.flushed[-1].splitlines()[-1] == format_step_line(1, STEP, 2, "rollverify")
    assert stdout.getvalue().count("\n") == 2


def test_gin_forces_either_style(monkeypatch, capsys, spec_of):
    _tty(monkeypatch, True, True)
    with open_progress(spec_of("MetricsConfig.progress = 'lines'").metrics, total_steps=3) as progress:
        progress.update(1, {"reward/mean": 0.5})  # lines on a terminal
    assert capsys.readouterr().out == "step=1/3 reward=0.500\n"
    _tty(monkeypatch, False, False)
    bar = open_progress(MetricsConfig(progress="bar"), total_steps=3)  # a bar in a log file, when asked
    assert isinstance(bar, ProgressBar) and not bar.disabled
    bar.update(2, {"reward/mean": 0.5})
    assert bar._bar.n == 2
    bar.close()
    quiet = open_progress(MetricsConfig(progress="none"), total_steps=3)
    quiet.update(1, STEP)
    assert quiet.disabled and capsys.readouterr().out == ""


def test_lines_are_silent_off_process_0(monkeypatch, capsys):
    monkeypatch.setattr(metrics_lib.jax, "process_index", lambda: 1)
    StepLines(total_steps=2).update(1, STEP)
    assert capsys.readouterr().out == ""


def test_bad_progress_style_is_a_user_error():
    with pytest.raises(ValueError, match="MetricsConfig.progress='fancy'") as e:
        MetricsConfig(progress="fancy")
    assert is_user_error(e.value)


# ----------------------------------------------------------------------------------------------------
# Weights & Biases, with a fake wandb module


class FakeRun:
    def __init__(self, calls: list):
        self.calls = calls

    def log(self, data: dict, step: int | None = None) -> None:
        self.calls.append(("log", step, dict(data)))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: (calls.append(("init", kwargs)), FakeRun(calls))[1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_off_by_default(fake_wandb, tmp_path):
    assert MetricsConfig().wandb_project is None
    assert open_wandb(MetricsConfig(), tmp_path) is None
    assert fake_wandb == []


def test_wandb_gets_every_record(fake_wandb, tmp_path, spec_of):
    spec = spec_of("MetricsConfig.wandb_project = 'rollverify'", "MetricsConfig.wandb_entity = 'lab'")
    workdir = tmp_path / "my_run"
    wandb_run = open_wandb(spec.metrics, workdir, start_step=4, gin_text=spec.gin_text)
    with MetricsWriter(workdir, use_tensorboard=False, wandb_run=wandb_run) as w:
        record = w.write(5, STEP)
        w.write(6, {"reward/mean": 0.5, "verify/regen_equal_rate": float("nan")})
        assert fake_wandb[-1][0] == "log"  # sent as it is written, not at close
    (kind, init), *logs, finish = fake_wandb
    assert kind == "init" and finish == ("finish",)
    assert {k: init[k] for k in ("project", "entity", "name", "dir")} == {
        "project": "rollverify", "entity": "lab", "name": "my_run", "dir": str(workdir)}
    assert init["config"]["start_step"] == 4 and "MetricsConfig.wandb_project = 'rollverify'" in init["config"]["gin"]
    # The record metrics.jsonl gets, as Python scalars, on W&B's step axis (the step is not a key of the dict).
    assert logs[0] == ("log", 5, {k: v for k, v in record.items() if k != "step"})
    assert type(logs[0][2]["reward/mean"]) is float and logs[0][2]["reward/mean"] == pytest.approx(0.4125)
    assert logs[1][:2] == ("log", 6) and set(logs[1][2]) == {"reward/mean", "verify/regen_equal_rate"}
    assert math.isnan(logs[1][2]["verify/regen_equal_rate"])
    assert len(read_metrics(workdir)) == 2  # the JSONL file is written as before


def test_wandb_run_name_and_process_0_only(fake_wandb, tmp_path, monkeypatch):
    run = open_wandb(MetricsConfig(wandb_project="p", wandb_run_name="seed1"), tmp_path)
    assert isinstance(run, FakeRun) and fake_wandb[0][1]["name"] == "seed1"
    monkeypatch.setattr(metrics_lib.jax, "process_index", lambda: 1)
    assert open_wandb(MetricsConfig(wandb_project="p"), tmp_path) is None and len(fake_wandb) == 1


def test_missing_wandb_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[wandb\]'") as e:
        MetricsConfig(wandb_project="p")
    assert is_user_error(e.value)  # the CLI prints one error line, exit status 2
    cfg = object.__new__(MetricsConfig)  # past the check (wandb removed after the run started)
    object.__setattr__(cfg, "wandb_project", "p")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[wandb\]'"):
        open_wandb(cfg, tmp_path)


def test_wandb_extra_is_pinned_in_pyproject():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert len(extras["wandb"]) == 1 and extras["wandb"][0].startswith("wandb==")
    # Plotting is an extra too (training never imports matplotlib); the test extra pins the same version.
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in core if d.startswith("matplotlib")] and extras["plot"][0] in extras["test"]


def test_a_resumed_run_continues_its_wandb_run(fake_wandb, tmp_path):
    """The first launch makes the workdir's W&B run id and keeps it in <workdir>/wandb_run_id; every later launch
    passes the same id with resume='allow', so W&B continues that run instead of starting a new one."""
    config = MetricsConfig(wandb_project="p")
    open_wandb(config, tmp_path / "run", start_step=0)
    run_id = (tmp_path / "run" / metrics_lib.WANDB_RUN_ID_FILE).read_text().strip()
    open_wandb(config, tmp_path / "run", start_step=5)
    open_wandb(config, tmp_path / "other", start_step=0)
    (_, first), (_, resumed), (_, other) = fake_wandb
    assert run_id.isalnum() and first["id"] == resumed["id"] == run_id and other["id"] != run_id
    assert first["resume"] == resumed["resume"] == "allow" and resumed["config"]["start_step"] == 5
    assert not list((tmp_path / "run").glob(".wandb_run_id*.tmp"))  # written atomically, nothing left over


def test_missing_matplotlib_names_the_plot_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plot\]'") as e:
        metrics_lib.pyplot()
    assert is_user_error(e.value)
    with pytest.raises(SystemExit) as e:  # the scripts: one line, exit status 2
        metrics_lib.pyplot(cli=True)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: plotting needs matplotlib, which is not installed: pip install -e '.[plot]'\n")


# ----------------------------------------------------------------------------------------------------
# MetricsConfig.profile_steps: a jax.profiler trace of a window of steps


@pytest.mark.parametrize("window", [(0, 2), (3, 2), (1,), "1-2", (1.0, 2), (True, 2)])
def test_a_bad_profile_window_is_a_user_error(window):
    with pytest.raises(ValueError, match=r"MetricsConfig.profile_steps=.* must be \(first, last\)") as e:
        MetricsConfig(profile_steps=window)
    assert is_user_error(e.value)
    assert MetricsConfig(profile_steps=[2, 3]).profile_steps == (2, 3)  # gin's list, kept hashable


def test_the_profiler_traces_its_window_only(monkeypatch, tmp_path, capsys):
    """Started at the window's first step this launch runs (a resume inside the window traces the rest of it),
    stopped after its last step, or when the run ends inside it."""
    from rollverify_jax.run import profiler as profiler_lib

    calls = []
    monkeypatch.setattr(profiler_lib.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(profiler_lib.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))

    def run(window, steps):
        calls.clear()
        prof = profiler_lib.StepProfiler(window, tmp_path)
        for step in steps:
            with prof.step(step):
                calls.append(step)
        prof.stop()
        return calls[:]

    where = str(tmp_path / "profile")
    assert run(None, [1, 2, 3]) == [1, 2, 3]
    assert run((2, 3), [1, 2, 3, 4, 5]) == [1, ("start", where), 2, 3, ("stop",), 4, 5]
    assert run((2, 3), [3, 4]) == [("start", where), 3, ("stop",), 4]  # resumed at step 3
    assert run((2, 9), [1, 2, 3]) == [1, ("start", where), 2, 3, ("stop",)]  # the run ended inside the window
    assert run((2, 3), [4, 5]) == [4, 5]
    assert "profile: steps 2-3 traced into" in capsys.readouterr().err


def test_the_profiler_writes_a_trace(tmp_path):
    import jax

    from rollverify_jax.run.profiler import StepProfiler

    prof = StepProfiler((1, 1), tmp_path)
    f = jax.jit(lambda x: (x * 2).sum())
    for step in (1, 2):
        with prof.step(step):
            f(jnp.arange(8.0)).block_until_ready()
    assert not prof.active and prof.traced == [1]
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


# ----------------------------------------------------------------------------------------------------
# rollverify_jax.studies: plot_run and compare


def _write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rollverify_rows(steps: int = 4) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.2, "time/eval": 1.0, "time/wall": 1.0}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": 0.1 * s, "policy/entropy": 0.9 - 0.1 * s, "ops/token_mean": 1e-3 * s,
                     "verify/acceptance": 0.9, "verify/num_verified": s % 2, "verify/acceptance_window": 0.8,
                     "verify/regen_equal_rate": None, "rollout/slot_utilization": 0.7, "rollout/tokens_per_s": 900.0,
                     "time/step": 2.0, "time/rollout": 1.0, "time/verify": 0.25, "time/grading": 0.25,
                     "time/train": 0.25, "time/wall": 1.0 + 2.0 * s, "mode/on_policy": 0})
    rows[-1].update({"eval/accuracy": 0.3, "time/eval": 1.0})
    return rows


def test_plot_run_writes_a_png_per_topic_and_skips_what_a_run_lacks(tmp_path, capsys):
    a = _write_run(tmp_path / "runs" / "rollverify", _rollverify_rows())
    # An on-policy run of an older version: no entropy, no verification metrics, no rollout/*, no eval.
    b = _write_run(tmp_path / "runs" / "onpolicy", [{"step": s, "reward/mean": 0.2, "time/step": 1.0,
                                                     "time/rollout": 0.5, "time/train": 0.5} for s in range(1, 4)])
    out = tmp_path / "plots"
    assert plot_run.main([str(a), str(b / "metrics.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    names = {"accuracy", "reward", "entropy", "ops", "acceptance", "rollout", "time"}
    assert {p.stem for p in out.glob("*.png")} == names
    assert all(p.stat().st_size > 1000 for p in out.glob("*.png"))
    assert "note: onpolicy has no policy/entropy; skipped" in printed
    assert "note: onpolicy has no verify/acceptance; skipped" in printed
    assert "note: rollverify has no verify/regen_equal_rate; skipped" in printed  # all null: nothing to draw
    assert "note: rollverify has no policy/entropy" not in printed
    assert printed.count("wrote ") == len(names)


def test_plot_run_leaves_out_a_figure_no_run_has(tmp_path, capsys):
    run = _write_run(tmp_path / "r", [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.25}])
    written, notes = plot_run.plot_runs([str(run)])
    assert [p.name for p in written] == ["reward.png"] and written[0].parent == run / "plots"
    assert "note: no run has any metric of acceptance.png; not written" in notes


def test_plot_run_series_and_time_split():
    rows = _rollverify_rows(4)
    steps, values = plot_run.series(rows, "verify/acceptance")
    assert steps.tolist() == [1, 3] and values.tolist() == [0.9, 0.9]  # cycles that verified something only
    assert plot_run.series(rows, "eval/accuracy")[0].tolist() == [0, 4]
    assert plot_run.time_split(rows) == {"rollout": 4.0, "verify": 1.0, "grading": 1.0, "train": 1.0, "other": 1.0,
                                         "eval": 2.0}
    assert plot_run.time_split([{"step": 0, "eval/accuracy": 0.1}]) is None
    assert plot_run.run_labels(["x/a/run", "y/b/run", "z/c"]) == ["a/run", "b/run", "c"]


@pytest.mark.parametrize("case", ["missing", "no_metrics", "empty"])
def test_plot_run_bad_input_is_one_error_line(tmp_path, capsys, case):
    good = _write_run(tmp_path / "good", _rollverify_rows(2))
    bad = tmp_path / "bad"
    if case != "missing":
        bad.mkdir()
    if case == "empty":
        (bad / "metrics.jsonl").write_text("")
    assert plot_run.main([str(good), str(bad), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0]
    assert not (tmp_path / "out").exists()  # every run is read before anything is written


def test_compare_keeps_its_default_modes():
    assert compare.entries(None, None) == {m: f"configs/tiny_{m}.gin" for m in
                                           ["onpolicy", "partial", "staleness", "opsfilter", "rollverify"]}
    assert compare.entries(["gspo"], None) == {"gspo": "configs/tiny_gspo.gin"}
    assert all((compare.ROOT / f).is_file() for f in compare.entries(None, None).values())


def test_compare_config_lists(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.gin").write_text("")
    (tmp_path / "x.gin").write_text("")
    monkeypatch.chdir(tmp_path / "a")  # each run starts in the repository root: a relative path is made absolute
    assert compare.entries([], ["x.gin"]) == {"x": str((tmp_path / "a" / "x.gin").resolve())}
    for modes, configs, match in [(["rollverify"], [str(tmp_path / "x.gin")], "not both"),
                                  (None, [str(tmp_path / "nope.gin")], "does not exist"),
                                  (None, [str(tmp_path / "x.gin"), str(tmp_path / "a" / "x.gin")], "named 'x'"),
                                  (["nomode"], None, "nomode")]:
        with pytest.raises(ValueError, match=match):
            compare.entries(modes, configs)


def test_compare_runs_any_gin_files_side_by_side(tmp_path, monkeypatch):
    base, variant = tmp_path / "base.gin", tmp_path / "variant.gin"
    base.write_text("")
    variant.write_text("")
    monkeypatch.setattr(compare, "ROOT", tmp_path / "repo")  # its runs/ and docs/results/ go there
    ran = []

    def fake_run(gin_file, workdir, steps, budget, seed, extra, quiet=False):  # a finished run, no training
        ran.append((gin_file, workdir.name, seed, steps, quiet))
        _write_run(workdir, _rollverify_rows(3))

    monkeypatch.setattr(compare, "run_mode", fake_run)
    argv = ["compare.py", "--name", "mine", "--configs", str(base), str(variant), "--steps", "3", "--seeds", "0", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    # seed-major: every config's seed 0 before any seed 1, so a stopped study has whole seeds
    assert ran == [(str(base), "base_s0", 0, 3, False), (str(variant), "variant_s0", 0, 3, False),
                   (str(base), "base_s1", 1, 3, False), (str(variant), "variant_s1", 1, 3, False)]
    report = (tmp_path / "repo" / "docs" / "results" / "mine.md").read_text()
    assert f"--configs {base} {variant} --steps 3" in report
    assert "| config | seeds |" in report and "\n| base | 2 |" in report and "\n| variant | 2 |" in report
    assert (tmp_path / "repo" / "docs" / "results" / "mine_vs_step.png").stat().st_size > 1000

    ran.clear()  # two at a time: the same runs, each with its output to a log file
    monkeypatch.setattr(sys, "argv", [*argv, "--jobs", "2"])
    compare.main()
    assert sorted(ran) == sorted((g, w, s, n, True) for g, w, s, n, _ in
                                 [(str(base), "base_s0", 0, 3, 0), (str(variant), "variant_s0", 0, 3, 0),
                                  (str(base), "base_s1", 1, 3, 0), (str(variant), "variant_s1", 1, 3, 0)])

    # a re-read reports the seeds whose runs finished and says which it left out
    unfinished = tmp_path / "repo" / "runs" / "compare_mine" / "variant_s1"
    shutil.rmtree(unfinished)
    _write_run(unfinished, _rollverify_rows(2))
    monkeypatch.setattr(sys, "argv", [*argv, "--skip_runs"])
    compare.main()
    report = (tmp_path / "repo" / "docs" / "results" / "mine.md").read_text()
    assert "\n| base | 2 |" in report and "\n| variant | 1 |" in report


def test_run_summary_counts_partial_steps_the_switch_utilization_and_time_split():
    from rollverify_jax.run.metrics import run_summary

    def step(i, on_policy, util, acc=None):
        m = {"step": i, "time/step": 10.0, "time/rollout": 6.0, "time/verify": 1.0, "time/train": 3.0,
             "mode/on_policy": on_policy, "rollout/slot_utilization": util, "verify/num_verified": 0}
        if acc is not None:
            m.update({"verify/acceptance": acc, "verify/num_verified": 5, "verify/num_cut": 2,
                      "verify/tokens_total": 40, "verify/tokens_removed": 7, "verify/regen_tokens": 3})
        return m

    metrics = [{"step": 0, "eval/accuracy": 0.2}, step(1, 0, 0.9), step(2, 0, 0.8, acc=0.6),
               step(3, 0, 1.0, acc=0.2), {**step(4, 1, 0.5), "mode/switch_step": 3}]
    assert run_summary(metrics) == [
        "held-out accuracy: 0.200 (step 0) -> 0.200 (step 0), +0.0 points",
        "rollout mode: partial for 3 of 4 steps (75% of the step time), switched to on-policy at step 3",
        "slot utilization: partial 0.90, on-policy 0.50",
        "time: 40 s in steps: rollout 24 s (60%), verify 4 s (10%), train 12 s (30%)",
        "verification: mean cycle acceptance 0.40 over 2 cycles; 4 of 10 paused trajectories cut, 14 of their 80 "
        "tokens removed, 6 regenerated"]
    assert run_summary([{"step": 0, "eval/accuracy": 0.2}, {"step": 5, "eval/accuracy": 0.35}]) == [
        "held-out accuracy: 0.200 (step 0) -> 0.350 (step 5), +15.0 points"]  # no step rows: that line only
    two_sets = [{"step": 0, "eval/accuracy": 0.2, "eval/aime/accuracy": 0.1},
                {"step": 5, "eval/accuracy": 0.35, "eval/pass@4": 0.5, "eval/maj@4": 0.4,
                 "eval/aime/accuracy": 0.15, "eval/aime/pass@2": 0.25}]
    assert run_summary(two_sets) == [
        "held-out accuracy: 0.200 (step 0) -> 0.350 (step 5), +15.0 points; last: maj@4 0.400, pass@4 0.500",
        "held-out accuracy (aime): 0.100 (step 0) -> 0.150 (step 5), +5.0 points; last: pass@2 0.250"]


def _study_rows(final_accuracy: float, steps: int = 6, on_policy: int = 0) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.2, "time/wall": 1.0}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "time/step": 2.0, "time/wall": 1.0 + 2.0 * s, "reward/mean": 0.3,
                     "policy/entropy": 0.1 + 0.01 * s, "ops/token_mean": 1e-3 * s, "mode/on_policy": on_policy,
                     "response/length_mean": 40.0, "staleness/max": 3, "staleness/mean": 1.5})
    rows[3]["eval/accuracy"] = 0.2 + (final_accuracy - 0.2) / 2  # halfway at step 3
    rows[-1]["eval/accuracy"] = final_accuracy
    return rows


def test_phenomenon_queue_archives_finished_runs_and_reports_welch_tests_from_the_archive(tmp_path, monkeypatch):
    """The issue 28 study script: seed ranges run seed-major; a run short of its steps is not archived (the queue
    resumes it later); the report reads only the archive, tests each row against the reference and finds the
    wall-clock at which a run first reaches 90% of the reference's gain."""
    ph = phenomenon
    monkeypatch.setattr(ph, "ARCHIVE", tmp_path / "docs" / "results" / "phenomenon")
    monkeypatch.setattr(ph, "ROOT", tmp_path)
    assert ph.parse_rows(["onpolicy:2", "partial:1-2"]) == [("onpolicy", 0), ("onpolicy", 1), ("partial", 1),
                                                            ("partial", 2)]
    with pytest.raises(ValueError, match="no configs/phenomenon/nope.gin"):
        ph.parse_rows(["nope:2"])
    short = _write_run(tmp_path / "runs" / "short", _study_rows(0.3, steps=4))
    assert "not archived" in ph.archive(short, ph.archive_path("partial", 0), {"steps": 6, "commit": "abc"})
    assert not ph.archive_path("partial", 0).exists()
    finals = {"onpolicy": [0.40, 0.42, 0.41], "partial": [0.30, 0.31, 0.29]}
    for row, accs in finals.items():
        for seed, acc in enumerate(accs):
            run = _write_run(tmp_path / "runs" / f"{row}_{seed}", _study_rows(acc, on_policy=row == "onpolicy"))
            meta = {"row": row, "seed": seed, "steps": 6, "commit": "abc", "command": "test"}
            assert ph.archive(run, ph.archive_path(row, seed), meta).startswith("archived")
    (ph.ARCHIVE.parent).mkdir(parents=True, exist_ok=True)
    report = ph.report(["onpolicy", "partial"], 6, "study", "onpolicy", [])
    partial_line = next(line for line in report.splitlines() if line.startswith("| naive partial | -0.110"))
    t = float(partial_line.split("t = ")[1].split(",")[0])
    assert t < -10 and "p = " in partial_line  # three seeds 0.11 apart with spread 0.01: clearly significant
    assert "| on-policy GRPO | - | 13 ± 0 | 3/3 |" in report  # reaches 0.2 + 0.9 * 0.21 at its last eval (wall 13)
    assert "| naive partial | -0.110" in report and "| 0/3 |" in report  # never reaches it
    assert (ph.ARCHIVE.parent / "study.png").is_file()
    given = ph.report(["onpolicy", "partial"], 6, "study", "onpolicy", [], target=0.25)  # partial's halfway eval
    assert "wall-clock to 0.250 (given" in given and "| naive partial | -0.110" in given and "| 7 ± 0 | 3/3 |" in given
    assert ph.label("timing/onpolicy") == "on-policy GRPO (timing)"  # a row re-run apart, e.g. alone for its speed


def test_plot_run_keeps_identical_runs_visible():
    """Two runs with the same values used to draw one line over the other, so one looked missing."""
    import numpy as np

    from rollverify_jax.studies.plot_run import lines
    x, y = np.arange(3), np.array([0.1, 0.2, 0.3])
    got = lines([("a", x, y), ("b", np.arange(0), np.arange(0)), ("c", x, y.copy()), ("d", x, y + 1)])
    assert [(i, label, legend) for i, label, _, legend in got] == [(0, "a", "a"), (2, "c", "c (= a)"), (3, "d", "d")]
    assert len({style for _, _, style, _ in got}) == 3  # each its own dash pattern
