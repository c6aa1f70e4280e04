"""Errors that used to mislead or come late (issue 27 item 9): each is one line, exit status 2, before the work,
with nothing half-written."""

import errno
from pathlib import Path

import pytest
from shared import run_params

from rollverify_jax import aot, evaluate, train
from rollverify_jax.data import prompts
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.sim import calibrate

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"
TINY_GIN = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_rollverify.gin")


def _one_line_exit_2(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("error: ") == 1, err
    assert "Traceback" not in err, err
    return err


@pytest.fixture
def no_work(monkeypatch):
    """The evaluation and the compile fail the test if they start: the errors must come before them."""
    def started(*args, **kwargs):
        raise AssertionError("the work started before the bad argument was refused")
    monkeypatch.setattr(evaluate, "build_policy", started)
    monkeypatch.setattr(aot, "compile_run", started)


def test_an_unreadable_input_is_not_reported_as_a_full_workdir(policy, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Any OSError while building a run used to read 'could not write to <workdir> ... free space'."""
    def unreadable(name, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/train.jsonl")
    monkeypatch.setattr(prompts, "get_dataset", unreadable)
    params = [f"--gin_param={p}" for p in run_params(policy, "on_policy", 1)]
    err = _one_line_exit_2(capsys, train.main, [f"--workdir={tmp_path / 'run'}", *params])
    assert "cannot use /data/train.jsonl: Permission denied" in err and "one of the run's inputs" in err, err
    assert "free space" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--samples_out", "file.txt/samples.jsonl", "file.txt is a file, not a directory"),
    ("--samples_out", "a_dir", "is a directory; pass a file name"),
    ("--num_problems", "-3", "--num_problems=-3 must be >= 1"),  # used to drop the last 3 problems in silence
    ("--num_problems", "0", "--num_problems=0 must be >= 1"),  # used to be ignored
    ("--k", "0", "EvalConfig.samples_per_problem=0 must be >= 1"),  # used to be ignored
])
def test_evaluate_refuses_bad_arguments_before_it_evaluates(tmp_path, monkeypatch, capsys, no_work, flag, value,
                                                             message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("")
    (tmp_path / "a_dir").mkdir()
    err = _one_line_exit_2(capsys, evaluate.main, [f"--checkpoint={POLICY}", f"{flag}={value}"])
    assert message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "file.txt"]


def test_aot_refuses_an_unwritable_json_before_it_compiles(tmp_path, capsys, no_work):
    (tmp_path / "file.txt").write_text("")
    err = _one_line_exit_2(capsys, aot.main, [f"--json={tmp_path / 'file.txt' / 'report.json'}"])
    assert "file.txt is a file, not a directory" in err


def test_aot_writes_its_report_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "compile_run", lambda spec, topology: {"fits": True})
    monkeypatch.setattr(aot, "format_report", lambda report: "report")
    written = []
    monkeypatch.setattr(aot.storage, "write_text_atomically", lambda path, text: written.append((str(path), text)))
    aot.main([f"--json={tmp_path / 'r.json'}"])
    assert written and written[0][0] == str(tmp_path / "r.json") and '"fits": true' in written[0][1]


@pytest.mark.parametrize("shape", [(0, -1, 1), (2, 0, 1), (-2, 1, 1), (1, -1, -1)])
def test_a_mesh_shape_with_a_zero_or_negative_entry_is_one_error(shape):
    with pytest.raises(ValueError, match=r"make_mesh\.shape"):
        mesh_lib.make_mesh(shape=shape)


@pytest.mark.parametrize("args, message", [
    (["--gin_param=make_mesh.shape = (0, -1, 1)"], "each entry must be a device count >= 1, or -1"),
    (["--dry_run_devices=0"], "--dry_run_devices=0 must be >= 1"),
    (["--dry_run_devices=-8"], "--dry_run_devices=-8 must be >= 1"),
])
def test_the_dry_run_refuses_zero_devices_in_one_line(capsys, args, message):
    """Both used to raise ZeroDivisionError with a traceback."""
    err = _one_line_exit_2(capsys, train.main, ["--dry_run", f"--gin_file={TINY_GIN}", *args])
    assert message in err, err


def _run_dir(tmp_path: Path, lines: list[str]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text('{"format": 1, "rollout": {"mode": "rollverify"}}\n')
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


def test_a_torn_last_metrics_line_is_skipped_with_a_warning(tmp_path, capsys):
    """A run killed mid-write (or still writing) leaves its last line cut off: the simulator reads the lines
    before it (it used to fail on json.loads)."""
    rows = ['{"step": 0, "eval/accuracy": 0.1}', '{"step": 1, "time/step": 2.0}', '{"step": 2, "time/step": 2.5}']
    run = _run_dir(tmp_path, [*rows, '{"step": 3, "time/st'])
    data = calibrate.read_run(run)
    assert [r["step"] for r in data.steps] == [1, 2] and data.mode == "rollverify"
    assert "line 4, the last, is cut off" in capsys.readouterr().err


def test_a_damaged_metrics_line_before_the_last_is_one_error(tmp_path, capsys):
    from rollverify_jax import simulate

    run = _run_dir(tmp_path, ['{"step": 1, "time/step": 2.0}', '{"step": 2, "ti', '{"step": 3, "time/step": 2.5}'])
    err = _one_line_exit_2(capsys, simulate.main, [f"--gin_file={TINY_GIN}", f"--calibrate_from={run}"])
    assert "metrics.jsonl: line 2 is not a metrics record" in err, err


@pytest.mark.parametrize("binding, hint", [
    ("RolloutConfig.batch_group = 3", "did you mean RolloutConfig.batch_groups"),
    ("TrainConfig.num_step = 3", "did you mean TrainConfig.num_steps?"),
    ("RollotConfig.batch_groups = 3", "did you mean RolloutConfig"),
])
def test_a_misspelt_gin_setting_is_answered_with_the_real_name(tmp_path, capsys, binding, hint):
    err = _one_line_exit_2(capsys, train.main, [f"--gin_file={TINY_GIN}", f"--gin_param={binding}",
                                                 f"--workdir={tmp_path / 'run'}"])
    assert hint in err and "docs/config_reference.md" in err, err
    assert not (tmp_path / "run").exists()


def test_a_mistyped_policy_path_names_the_setting_and_the_nearest_directory(tmp_path, capsys):
    typo = POLICY.parent / "tiny_polcy"
    err = _one_line_exit_2(capsys, train.main, [f"--gin_file={TINY_GIN}", f"--workdir={tmp_path / 'run'}",
                                                 f"--gin_param=TrainConfig.policy_path = '{typo}'"])
    assert f"TrainConfig.policy_path: {typo} does not exist" in err and f"did you mean {POLICY}" in err, err
    assert not (tmp_path / "run").exists()


def test_an_uncreatable_workdir_names_the_fix(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = _one_line_exit_2(capsys, train.main, [f"--gin_file={TINY_GIN}", f"--workdir={tmp_path / 'file' / 'run'}"])
    assert f"cannot create the workdir {tmp_path / 'file' / 'run'}" in err and "--workdir=" in err, err


def test_text_a_tokenizer_cannot_encode_names_its_characters_and_where_they_come_from():
    from rollverify_jax.models.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(POLICY)
    with pytest.raises(ValueError, match=r"no token for '\?Ü' and no unknown token\. If the text comes from a "
                                         r"template \(the chat template"):
        tokenizer.encode("3+4 = ?Ü")
    with pytest.raises(ValueError, match=r"cannot encode '\?': its vocabulary has no token for '\?'"):
        tokenizer.encode_batch(["3+4", "?"])
