"""A workdir that shows a run was there, but has no checkpoint to restore, is not silently started over."""

import json

import pytest

from rollverify_jax.run.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.run.fresh_start import check_fresh_start


def _workdir(tmp_path, rows=(), aside=()):
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    if rows:
        (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                                       for s in rows))
    for name in aside:
        (workdir / "checkpoints" / name / "state").mkdir(parents=True)
    return workdir


@pytest.mark.parametrize("rows", [(), (0,)], ids=["new workdir", "only the step-0 evaluation"])
def test_a_workdir_without_history_starts_at_step_0(tmp_path, capsys, rows):
    workdir = _workdir(tmp_path, rows)
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        check_fresh_start(workdir, ckpt, allow=False)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("rows, aside, found", [
    ((0, 1, 2, 3), (), "metrics.jsonl has 3 rows of training steps (up to step 3)"),
    ((), ("4.corrupt", "6.uncommitted"), "checkpoints/ holds 4.corrupt, 6.uncommitted (set aside"),
], ids=["metric rows", "set-aside steps"])
def test_a_workdir_with_history_and_no_checkpoint_is_refused(tmp_path, rows, aside, found):
    workdir = _workdir(tmp_path, rows, aside)
    before = (workdir / "metrics.jsonl").read_text() if rows else None
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        with pytest.raises(ValueError, match="has no checkpoint that can be restored, but a run was there") as err:
            check_fresh_start(workdir, ckpt, allow=False)
    assert found in str(err.value) and "--restart_from_scratch" in str(err.value)
    if rows:
        assert (workdir / "metrics.jsonl").read_text() == before


def test_restart_from_scratch_starts_over_and_keeps_the_old_metrics(tmp_path, capsys):
    workdir = _workdir(tmp_path, (1, 2), ("2.corrupt",))
    before = (workdir / "metrics.jsonl").read_text()
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        check_fresh_start(workdir, ckpt, allow=True)
    err = capsys.readouterr().err
    assert "warning: --restart_from_scratch: starting" in err and "kept as metrics.before_restart.jsonl" in err
    assert not (workdir / "metrics.jsonl").exists()
    assert (workdir / "metrics.before_restart.jsonl").read_text() == before
    assert (workdir / "checkpoints" / "2.corrupt").is_dir()  # the evidence stays
