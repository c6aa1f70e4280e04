"""The main job's stops, faults and refusals end to end on a small random policy: a signal or preemption notice
commits the finished step and the run resumes, non-finite updates are skipped and a run of them stops, a full
disk is one message, a held or emptied workdir is refused. (The rest of the job: test_train.py.)"""

import json

import jax
import numpy as np
import pytest
from shared import final_state, train_run

from rollverify_jax.models import load_pretrained
from rollverify_jax.run import builder
from rollverify_jax.run.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.run.trainer import Trainer

pytestmark = [pytest.mark.end_to_end, pytest.mark.usefixtures("compilation_cache")]


def test_sigterm_saves_the_finished_step_and_the_run_resumes(policy, tmp_path, monkeypatch, capsys):
    """SIGTERM (a preemption notice) arrives during step 2's update: the step finishes, its checkpoint is committed
    although no save was due, the exit status is 143, and the same command resumes after that step. (The drill,
    ``scripts/fault_drill.py --only sigterm``, sends the signal to a separate process.) The resumed launch first
    runs the evaluation the stop skipped, has a fresh time budget (the run's wall time is far past it; it bounds
    one launch) and traces its profile window; the launch after the last step says the run is complete and builds
    nothing."""
    import os
    import signal

    real_learn = Trainer.learn

    def signalled(run, batch):
        out = real_learn(run, batch)
        if run.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "learn", signalled)
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_run(policy, workdir, "rollverify", 200, ("CheckpointConfig.save_interval_steps = 1000",))
    assert e.value.code == 143
    err = capsys.readouterr().err
    assert [m["step"] for m in read_metrics(workdir / "metrics.jsonl")] == [0, 1, 2]
    assert f"stopped by SIGTERM: checkpoint {workdir.absolute() / 'checkpoints' / '2'} committed" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handler is gone with the run
    monkeypatch.setattr(Trainer, "learn", real_learn)
    real_load = Trainer.load_state_dict

    def long_run(run, extra):  # the checkpoint says the run has spent 10^6 s already
        real_load(run, extra)
        run.wall_offset = 1e6

    monkeypatch.setattr(Trainer, "load_state_dict", long_run)
    again = ("CheckpointConfig.save_interval_steps = 1000", "TrainConfig.time_budget_s = 1000.0",
             "MetricsConfig.profile_steps = (3, 3)")
    resumed = train_run(policy, workdir, "rollverify", 4, again)
    # Step 2's evaluation (eval_every = 2), skipped by the stop, runs first on resume, as a row of its own.
    assert [m["step"] for m in resumed] == [0, 1, 2, 2, 3, 4] and resumed[-1]["time/wall"] > 1e6
    assert "eval/accuracy" not in resumed[2] and "eval/accuracy" in resumed[3] and "time/step" not in resumed[3]
    out, err = capsys.readouterr()
    assert "held-out accuracy: " in out and "(step 0) -> " in out  # the whole run's summary, not this launch's
    assert list((workdir / "profile").rglob("*.xplane.pb")) and "profile: steps 3-3 traced into" in err
    monkeypatch.setattr(builder, "build_trainer", lambda *a: pytest.fail("a complete run was built again"))
    train_run(policy, workdir, "rollverify", 4, again)
    out = capsys.readouterr().out
    assert f"run complete: {workdir.absolute()} holds checkpoint step 4 (TrainConfig.num_steps = 4); to train " \
        "further pass --gin_param=TrainConfig.num_steps=<more than 4>" in out and "held-out" not in out


def _other_host(monkeypatch, seen):
    """A second process for every all-gather of the run: its row is ``seen()`` for the 4-value stop check (signal,
    preemption, out of time, too many skipped), zeros (nothing to report) for every other decision."""
    from rollverify_jax.infra import distributed

    gathered = []

    def gather(values):
        gathered.append([int(v) for v in values])
        other = seen() if len(gathered[-1]) == 4 else [0] * len(gathered[-1])
        return np.asarray([gathered[-1], other])

    monkeypatch.setattr(distributed, "gather_ints", gather, raising=False)
    return gathered


def test_a_signal_on_one_host_stops_every_host(monkeypatch):
    """On several processes every stop decision is all-gathered: a host that saw no signal stops too, with the
    signalled host's status; so does a host whose clock is within the time budget when another's is not."""
    from rollverify_jax.run import preemption

    others = [0, 0, 0, 0]
    gathered = _other_host(monkeypatch, lambda: others)
    stop = preemption.StopRequest()
    assert not stop.agree().stop and stop.signum is None
    others = [15, 0, 0, 0]
    decision = stop.agree()
    assert decision.stop and decision.signum == stop.signum == 15 and decision.exit_status == 143
    assert gathered == [[0, 0, 0, 0], [0, 0, 0, 0]]  # each host contributes what it saw itself
    stop = preemption.StopRequest()
    for others, reason, status in (([0, 1, 0, 0], "preempted", 143), ([0, 0, 1, 0], "out_of_time", 0),
                                   ([0, 0, 0, 1], "too_many_skipped", 3), ([15, 0, 0, 1], "too_many_skipped", 3)):
        decision = stop.agree()
        assert decision.stop and getattr(decision, reason) and decision.exit_status == status, (others, decision)


def _poisoned_from(step):
    """train.learn with NaN advantages from ``step`` on: every update of those steps is skipped."""
    real_learn = Trainer.learn

    def learn(run, batch):
        if run.step + 1 >= step:
            batch = {**batch, "advantages": np.full_like(batch["advantages"], np.nan)}
        return real_learn(run, batch)
    return learn


QUICK = ("TrainConfig.eval_every = 0", "EvalConfig.at_start = False", "CheckpointConfig.save_interval_steps = 1000")


@pytest.mark.parametrize("notice", ["SIGTERM", "JAX's preemption notice"])
def test_a_stop_on_a_skipped_step_commits_the_last_good_state(policy, tmp_path, monkeypatch, capsys, notice):
    """The notice comes during step 2, whose update is skipped (NaN): the stop still commits the state in memory
    (the skipped update changed nothing, so it is step 1's params) instead of losing every step since the last
    interval save, and JAX's own notice exits with the preemption status too (it exited 0)."""
    import os
    import signal

    poisoned = _poisoned_from(2)

    def learn(run, batch):
        out = poisoned(run, batch)
        if run.step == 2 and notice == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "learn", learn)
    monkeypatch.setattr(Checkpointer, "reached_preemption", lambda self, step: notice != "SIGTERM" and step == 2)
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_run(policy, workdir, "on_policy", 4, QUICK)
    assert e.value.code == 143
    err = capsys.readouterr().err
    assert f"stopped by {notice}: checkpoint {workdir.absolute() / 'checkpoints' / '2'} committed" in err
    assert [m["train/skipped_updates"] for m in read_metrics(workdir)] == [0, 1]
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        assert ckpt.all_steps() == [2]


def test_another_hosts_clock_past_the_budget_stops_every_host_and_commits_a_skipped_last_step(policy, tmp_path,
                                                                                              monkeypatch, capsys):
    """Within the budget on this host's clock, past it on the other's (after step 2): both end after step 2
    (with the final evaluation), where before each host compared its own clock and this one went on alone. Step
    2's update is skipped (NaN): as the last step, its state is committed anyway."""
    monkeypatch.setattr(Trainer, "learn", _poisoned_from(2))
    budget_spent = [0, 0, 0, 0]

    def learn_then_budget(run, batch, learn=Trainer.learn):
        out = learn(run, batch)
        if run.step == 2:
            budget_spent[2] = 1  # the other host's clock passes the budget now
        return out

    monkeypatch.setattr(Trainer, "learn", learn_then_budget)
    _other_host(monkeypatch, lambda: budget_spent)
    workdir = tmp_path / "run"
    metrics = train_run(policy, workdir, "on_policy", 5, (*QUICK, "TrainConfig.time_budget_s = 1e9"))
    assert [m["step"] for m in metrics] == [1, 2] and "eval/accuracy" in metrics[-1]
    assert metrics[-1]["train/skipped_updates"] == 1
    # A budget stop does not look like a finished run: the last line says so, and how to go on.
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("stopped at step 2 of 5: this launch's time budget (TrainConfig.time_budget_s = 1e+09 s)")
    assert "the same command continues it" in last
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        assert ckpt.all_steps() == [2]


def test_nonfinite_updates_are_skipped_and_a_run_of_them_stops_with_the_good_checkpoint(policy, tmp_path,
                                                                                         monkeypatch, capsys):
    """From step 2 on every batch carries NaN advantages (injected): the updates are skipped and reported, the
    steps are not checkpointed at their interval, and the second such step in a row stops the run with exit
    status 3 after committing its state (the skipped updates changed nothing: it holds step 1's params)."""
    monkeypatch.setattr(Trainer, "learn", _poisoned_from(2))
    with pytest.raises(SystemExit) as e:
        train_run(policy, tmp_path / "run", "on_policy", 6, ("TrainConfig.max_skipped_steps = 2",))
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "step 2: 1 of 1 updates skipped (non-finite loss" in err and "not checkpointed" in err
    assert "error: steps [2, 3] in a row had non-finite loss" in err and "checkpoint step 3 is committed" in err
    metrics = read_metrics(tmp_path / "run")
    assert [m["train/skipped_updates"] for m in metrics[1:]] == [0, 1, 1]
    fingerprint = builder.model_fingerprint(load_pretrained(policy))
    with Checkpointer(tmp_path / "run", CheckpointConfig(), model_fingerprint=fingerprint) as ckpt:
        assert ckpt.all_steps() == [1, 3]
        params_1 = ckpt.restore(1)[1]["params"]
        params_3 = ckpt.restore(3)[1]["params"]
    for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_3), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_full_disk_at_save_time_is_one_message_and_keeps_the_checkpoints(policy, tmp_path, monkeypatch, capsys):
    """The commit of step 2's checkpoint fails with ENOSPC: exit status 2, one message naming the workdir and the
    latest intact checkpoint, no traceback; step 1 restores."""
    import errno

    from orbax.checkpoint._src.path import atomicity

    from rollverify_jax.run.checkpoint import Checkpointer as RealCheckpointer

    real_save = RealCheckpointer.save

    def save(self, step, *a, **kw):
        if step == 2:
            async def no_space(_):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", no_space)
        return real_save(self, step, *a, **kw)

    monkeypatch.setattr(RealCheckpointer, "save", save)
    with pytest.raises(SystemExit) as e:
        train_run(policy, tmp_path / "run", "on_policy", 3)
    monkeypatch.undo()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "checkpoints are intact (latest: step 1)" in err
    assert "Traceback" not in err
    assert final_state(tmp_path / "run", policy)[0] == 1


def test_a_second_launch_in_a_workdir_is_refused_and_deletes_nothing(policy, tmp_path, capsys):
    """Another launch holds the workdir, its step-3 save in flight: this launch refuses (exit 2, naming the
    holder) before anything touches the checkpoints; it used to remove that save as an interrupted one."""
    import subprocess
    import sys

    workdir = tmp_path / "run"
    in_flight = workdir / "checkpoints" / "3.orbax-checkpoint-tmp"
    (in_flight / "state").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        import socket
        import time

        (workdir / "run.lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                     "started": time.time(), "started_utc": "now"}))
        with pytest.raises(SystemExit) as e:
            train_run(policy, workdir, "on_policy", 1, QUICK)
    finally:
        holder.kill()
        holder.wait()
    assert e.value.code == 2
    assert f"is in use by another launch (pid {holder.pid} on host" in capsys.readouterr().err
    assert (in_flight / "state").is_dir() and json.loads((workdir / "run.lock").read_text())["pid"] == holder.pid


def test_a_workdir_whose_checkpoints_were_all_set_aside_refuses_to_start_over(policy, tmp_path, capsys):
    """Every checkpoint was set aside (damaged), the metrics go to step 3: starting over would begin at step 0
    and empty metrics.jsonl. The run refuses (exit 2, naming what it found) and leaves the workdir as it was."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "3.corrupt" / "state").mkdir(parents=True)
    rows = "".join(json.dumps({"step": s, "reward/mean": 0.25}) + "\n" for s in range(4))
    (workdir / "metrics.jsonl").write_text(rows)
    with pytest.raises(SystemExit) as e:
        train_run(policy, workdir, "on_policy", 1, QUICK)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "has no checkpoint that can be restored, but a run was there" in err and "3.corrupt" in err
    assert "metrics.jsonl has 3 rows of training steps (up to step 3)" in err and "--restart_from_scratch" in err
    assert (workdir / "metrics.jsonl").read_text() == rows
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3.corrupt"]


def _truncate_array_files(step_dir):
    """Cuts each data file of the state's arrays (the per-process OCDBT files past 1 kB) to half its length."""
    for path in step_dir.glob("state/ocdbt.process_*/d/*"):
        if path.stat().st_size > 1000:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_run_complete_only_for_a_whole_last_checkpoint_of_this_run(policy, tmp_path, monkeypatch, capsys):
    """A workdir whose run reached num_steps is called complete only once its last checkpoint is known whole and
    this run's, as a resume would check it, and nothing is built for it: changed execution settings are reported
    and followed, another run-defining setting or model is refused (exit 2, naming it). A truncated array file or
    a deleted item in that checkpoint is no complete run: the launch resumes, sets the step aside and redoes it
    (it used to print "run complete" and exit 0 over the damage, and accept any settings and model)."""
    import shutil

    own = tmp_path / "policy"  # a copy whose config.json can say another model
    shutil.copytree(policy, own)
    workdir, quick = tmp_path / "run", ("TrainConfig.eval_every = 0", "EvalConfig.at_start = False")
    train_run(own, workdir, "on_policy", 2, quick)
    rows = (workdir / "metrics.jsonl").read_text()
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(builder, "build_trainer", lambda *a: pytest.fail("a complete run was built"))
        m.setattr(builder, "load_policy", lambda *a: pytest.fail("a model was loaded"))
        execution = ("paged_attention.pages_per_compute_block = 2", "EngineConfig.live_slots = False",
                     "ToolUseConfig.workers = 16")
        train_run(own, workdir, "on_policy", 2, (*quick, *execution))
        out = capsys.readouterr().out
        assert f"run complete: {workdir.absolute()} holds checkpoint step 2" in out
        assert out.count("warning: execution setting ") == 3
        assert "tool_use.workers changed (checkpoint None, now 16)" in out
        changed = (*quick, "OptimizerConfig.learning_rate = 1e-3")
        for source in ("spec.json", "checkpoint"):  # the last launch's spec.json first; without it, the checkpoint's
            with pytest.raises(SystemExit) as e:
                train_run(own, workdir, "on_policy", 2, changed)
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"optimizer.learning_rate: {source} 0.003, now 0.001" in err, err
            if source == "spec.json":
                (workdir / "spec.json").rename(tmp_path / "spec.json")
        (tmp_path / "spec.json").rename(workdir / "spec.json")
        config = json.loads((own / "config.json").read_text())
        (own / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
        with pytest.raises(SystemExit) as e:
            train_run(own, workdir, "on_policy", 2, quick)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "was saved for a different model; differing fields: num_hidden_layers: " \
            "checkpoint=2, current=3" in err, err
        (own / "config.json").write_text(json.dumps(config))
    assert (workdir / "metrics.jsonl").read_text() == rows
    checkpoints = workdir / "checkpoints"
    _truncate_array_files(checkpoints / "2")
    resumed = train_run(own, workdir, "on_policy", 2, (*quick, "ToolUseConfig.workers = 16"))
    out, err = capsys.readouterr()
    assert "checkpoint step 2 is not whole (state/ocdbt.process_0/d/" in out and "is shorter than" in out
    assert "run complete" not in out and "tool_use.workers changed (checkpoint None, now 16): followed" in out
    assert "checkpoint: step 2 cannot be read" in err and "moved to 2.corrupt" in err
    assert [m["step"] for m in resumed] == [1, 2] and "resumed from checkpoint step 1" in out
    shutil.rmtree(checkpoints / "2" / "extra")  # the redone step's host state, deleted
    train_run(own, workdir, "on_policy", 2, quick)
    out, err = capsys.readouterr()
    assert "checkpoint step 2 is not whole (its 'extra' item is missing)" in out and "moved to 2.corrupt-1" in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2", "2.corrupt", "2.corrupt-1"]
    train_run(own, workdir, "on_policy", 2, quick)
    assert "run complete: " in capsys.readouterr().out
