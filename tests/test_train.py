"""The main job end to end on a small random policy: metrics, configs, checkpoints, exact resume."""

import json
import re

import gin
import jax
import numpy as np
import pytest
from shared import run_params

from rollverify_jax import evaluate, train
from rollverify_jax.models import load_pretrained
from rollverify_jax.run import builder
from rollverify_jax.run.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.run.spec import RunSpec, parse_gin
from rollverify_jax.run.trainer import Trainer

DESIGN_KEYS = {"step", "time/wall", "time/rollout", "time/verify", "time/train", "rollout/tokens_per_s",
               "rollout/slot_utilization", "reward/mean", "policy/entropy", "ops/token_mean", "verify/acceptance",
               "verify/acceptance_window", "mode/on_policy", "response/length_mean", "response/length_max"}


def _train(policy, workdir, mode, steps, extra=()):
    train.main([f"--workdir={workdir}", *[f"--gin_param={p}" for p in run_params(policy, mode, steps, extra)]])
    return read_metrics(workdir / "metrics.jsonl")


def test_run_writes_metrics_config_and_checkpoints(policy, tmp_path, capsys):
    # A run killed after its step-0 evaluation (no checkpoint yet) left a row behind: it is redone, not doubled.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    metrics = _train(policy, tmp_path / "run", "rollverify", 2)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        assert DESIGN_KEYS <= set(m), DESIGN_KEYS - set(m)
        assert m["mode/on_policy"] == 0 and 0 <= m["rollout/slot_utilization"] <= 1
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]
    assert metrics[-1]["learning_rate"] == pytest.approx(3e-3)  # gin bindings reach the optimizer
    assert "RolloutConfig.mode = 'rollverify'" in (tmp_path / "run" / "operative_config.gin").read_text()
    # spec.json reads back, without gin, as the spec the run was given, with the fingerprint its checkpoints hold.
    parse_gin([], run_params(policy, "rollverify", 2))
    spec = RunSpec.from_gin()
    saved = RunSpec.from_json((tmp_path / "run" / "spec.json").read_text())
    assert saved == spec and saved.settings() == spec.settings()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))
    capsys.readouterr()
    evaluate.main([f"--checkpoint={tmp_path / 'run'}", "--k=2"])  # the run's own spec.json, --k bound on top
    out = capsys.readouterr().out
    assert "avg@2 = " in out and "pass@2 = " in out and "4 problems x 2 samples" in out


def test_uniform_groups_leave_the_loss(policy, tmp_path):
    """With the DAPO group filter, groups whose rewards are all equal leave the loss and the others stay."""
    metrics = _train(policy, tmp_path / "run", "on_policy", 2,
                     (*LENGTH_REWARD, "TrainConfig.skip_uniform_groups = True"))
    for m in metrics[1:]:
        assert m["filter/kept_fraction"] == pytest.approx(1.0 - m["reward/uniform_group_fraction"])
    assert any(0.0 < m["reward/uniform_group_fraction"] < 1.0 for m in metrics[1:])


def test_extra_complete_groups_train_in_the_step_that_completed_them(policy, tmp_path):
    """'train': every group complete at a phase's end is in its batch (B or more groups), padded with rows outside
    the loss: the loss sees exactly the trained groups' response tokens."""
    metrics = _train(policy, tmp_path / "run", "partial", 3, ("RolloutConfig.extra_complete_groups = 'train'",
                                                             "LearnerConfig.pack_sequences = True"))
    steps = [m for m in metrics if "batch/groups" in m]
    assert len(steps) == 3 and all(m["batch/groups"] >= 2 for m in steps)
    assert any(m["batch/groups"] > 2 for m in steps)
    for m in steps:
        assert m["train/loss_tokens"] == pytest.approx(m["response/length_mean"] * m["batch/groups"] * 4)


def test_a_run_with_only_uniform_groups_trains_on_nothing(policy, tmp_path):
    """The random policy never answers right: every group is uniform, so with the DAPO group filter nothing is
    left to train on (and the packed step, which skips those rows, still runs)."""
    metrics = _train(policy, tmp_path / "run", "on_policy", 1, ["TrainConfig.skip_uniform_groups = True"])
    m = metrics[1]
    assert m["reward/uniform_group_fraction"] == 1.0
    assert m["filter/kept_fraction"] == 0.0 and m["train/loss_tokens"] == 0.0 and m["loss"] == 0.0


# A reward that varies with the response length (DAPO's overlong penalty on a task the random policy never
# solves), so the policy learns from step 1 and a run that lost its state would differ.
LENGTH_REWARD = ("RewardScorer.overlong_buffer = 20", "RewardScorer.max_response_length = 24")
ASYNC = ("CheckpointConfig.async_save = True",)  # the default, which _params turns off


def _final_state(workdir, policy):
    fingerprint = builder.model_fingerprint(load_pretrained(policy))
    with Checkpointer(workdir, CheckpointConfig(async_save=False), model_fingerprint=fingerprint) as ckpt:
        step, state, extra = ckpt.restore()
    return step, jax.tree.leaves(state), extra


def test_resumed_run_equals_uninterrupted_run(policy, tmp_path):
    """Stop after a checkpoint taken while trajectories were paused and the policy was learning; the resumed
    steps equal an uninterrupted run exactly (every metric but timings, and the train state they end with, bit for
    bit). Saves are asynchronous, as by default."""
    full = _train(policy, tmp_path / "full", "rollverify", 4, (*LENGTH_REWARD, *ASYNC))
    _train(policy, tmp_path / "split", "rollverify", 3, (*LENGTH_REWARD, *ASYNC))
    # Step 3's checkpoint is damaged: the resume sets it aside, restores step 2 and redoes step 3.
    (tmp_path / "split" / "checkpoints" / "3" / "extra" / "metadata").unlink()
    resumed = _train(policy, tmp_path / "split", "rollverify", 4, (*LENGTH_REWARD, *ASYNC))
    assert (tmp_path / "split" / "checkpoints" / "3.corrupt").is_dir()
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]  # no duplicated lines after the resume
    assert len({m["reward/mean"] for m in full[1:]}) > 1 and any(m["reward/uniform_group_fraction"] < 1
                                                                 for m in full[1:])
    assert any(abs(m["loss"]) > 1e-6 and m["grad_norm"] > 1e-6 for m in full[1:])
    for a, b in zip(full, resumed, strict=True):  # the steps before the resume were written by the first launch
        a, b = _untimed(a), _untimed(b)
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        differ = {k: (a[k], b[k]) for k in a if not _same_value(a[k], b[k])}
        assert not differ, f"step {a['step']}: {differ}"
    (step_a, state_a, extra_a), (step_b, state_b, extra_b) = _final_state(tmp_path / "full", policy), \
        _final_state(tmp_path / "split", policy)
    assert step_a == step_b == 4 and len(state_a) == len(state_b)
    for x, y in zip(state_a, state_b, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert extra_a["data"] == extra_b["data"] and extra_a["rollout"]["next_uid"] == extra_b["rollout"]["next_uid"]


def _untimed(m: dict) -> dict:
    """A metrics row without what depends on the clock (timings, throughput, the wall time a resume carries)."""
    return {k: v for k, v in m.items() if not (k.startswith("time/") or k.endswith(("per_s", "_time")))}


def _same_value(x, y) -> bool:
    """Exactly equal; NaN equals NaN (a rate with nothing to count)."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y))


def test_low_acceptance_switches_to_on_policy_for_good(policy, tmp_path):
    """Window 1 and threshold 1: the first cycle that cuts anything switches the run to on-policy rollout; the
    cache is dropped, nothing is verified afterwards, and the checkpoint records the switch."""
    metrics = _train(policy, tmp_path / "run", "rollverify", 4,
                     (*LENGTH_REWARD, "SwitchConfig.window = 1", "SwitchConfig.threshold = 1.0"))[1:]
    first = next(i for i, m in enumerate(metrics) if m["verify/num_verified"] > 0)
    switch = metrics[first]
    assert switch["verify/acceptance"] < 1.0 and switch["mode/switch_step"] == switch["step"]
    assert switch["verify/acceptance_window"] == pytest.approx(switch["verify/acceptance"])
    assert all(m["mode/on_policy"] == 0 and "mode/switch_step" not in m for m in metrics[:first])
    assert metrics[first + 1:], "the run should go on after the switch"
    for m in metrics[first + 1:]:
        assert m["mode/on_policy"] == 1 and m["cache/size"] == 0 and m["verify/num_verified"] == 0
        assert m["staleness/max"] == 0
    _, _, extra = _final_state(tmp_path / "run", policy)
    assert switch["mode/dropped_at_switch"] >= switch["cache/size"] > 0  # paused + finished members waiting
    saved = extra["rollout"]["switch"]
    assert int(saved["on_policy"]) == 1 and int(saved["switch_step"]) == switch["step"]
    assert int(extra["rollout"]["on_policy"]) == 1 and not extra["rollout"]["cache"]["paused"]


def test_staleness_filter_drops_exactly_the_stale_trajectories(policy, tmp_path):
    """s_max = 0: a batch holding any resumed (stale) trajectory trains on less than all of it, a fresh batch on
    all of it."""
    metrics = _train(policy, tmp_path / "run", "partial", 4,
                     (*LENGTH_REWARD, "FilterConfig.name = 'staleness'", "FilterConfig.s_max = 0"))[1:]
    assert any(m["staleness/max"] > 0 for m in metrics)
    for m in metrics:
        assert (m["filter/kept_fraction"] < 1.0) == (m["staleness/max"] > 0), m["step"]
        assert m["filter/kept_fraction"] > 0.0 or m["staleness/mean"] >= 1.0


def test_ops_filter_keeps_fresh_trajectories_and_drops_shifted_ones(policy, tmp_path):
    metrics = _train(policy, tmp_path / "run", "partial", 4,
                     (*LENGTH_REWARD, "FilterConfig.name = 'ops'", "FilterConfig.ops_threshold = 0.05"))[1:]
    for m in metrics:
        if m["staleness/max"] == 0:  # sampled by the current policy: train-time OPS is rounding noise
            assert m["filter/kept_fraction"] == 1.0, m["step"]
    assert any(m["filter/kept_fraction"] < 1.0 for m in metrics)


def test_ratio_against_the_step_start_policy_leaves_staleness_uncorrected(policy, tmp_path):
    """The pi_old ablation with one update per step: the loss's ratio is 1 at every token (nothing is clipped,
    stale or not), while the train-time OPS against mu still shows the stale batches' shift."""
    metrics = _train(policy, tmp_path / "run", "partial", 4,
                     (*LENGTH_REWARD, "LearnerConfig.ratio_against = 'step_start'"))[1:]
    assert any(m["staleness/max"] > 0 for m in metrics)
    for m in metrics:
        assert m["ops/token_mean_vs_step_start"] < 1e-4 and m["policy/clip_fraction"] == 0.0, m["step"]
        assert abs(m["policy/ratio_mean"] - 1.0) < 1e-4, m["step"]
        if m["staleness/max"] > 0:  # a resumed trajectory's tokens came from an older policy
            assert m["ops/token_mean"] > 1e-3, m["step"]


def test_paused_cache_survives_checkpoint_exactly(policy, tmp_path):
    parse_gin([], run_params(policy, "rollverify", 4, ["MetricsConfig.rollout_samples_every = 4",
                                                       "MetricsConfig.rollout_samples_logged = 8"]))
    spec = RunSpec.from_gin()
    run = builder.build_trainer(spec, tmp_path)
    for _ in range(4):
        train.train_one_step(run)
    cache = run.manager.cache
    assert len(cache.paused) > 0 and any(t.num_tokens for t in cache.paused)
    # Paused at the end of a step, verified on resume under the next version, paused again.
    assert any([e["event"] for e in t.history] == ["pause", "verify", "pause"]
               and t.history[1]["version"] == t.history[0]["version"] + 1 for t in cache.paused)
    # Training rollouts logged every 4 steps: one row per group first, with versions and history.
    assert not list((tmp_path / "samples").glob("rollout_step_[123].jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "samples" / "rollout_step_4.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["step"] == 4 for r in rows)
    assert {"prompt", "response", "answer", "reward", "advantage", "versions", "draws", "history"} <= set(rows[0])
    assert all(0 <= r["versions"][0] <= r["versions"][1] <= 3 for r in rows)
    assert any(r["history"] and r["history"][-1]["event"] == "verify" for r in rows)  # resumed, then finished
    run.checkpointer.save(run.step, run.train_state, run.state_dict(1.0), force=True)
    run.close()
    back = builder.build_trainer(spec, tmp_path)
    assert back.step == 4 and back.serving.engine.version == 4
    before = {t.uid: t for t in cache.paused}
    after = {t.uid: t for t in back.manager.cache.paused}
    assert sorted(before) == sorted(after)
    for uid, t in before.items():
        u = after[uid]
        assert u.tokens == t.tokens and u.logps == t.logps and u.versions == t.versions and u.history == t.history
    assert back.manager.switch_state == run.manager.switch_state
    assert back.iterator.get_state() == run.iterator.get_state()
    back.close()


@pytest.mark.parametrize("args, match", [
    (["--gin_param=RolloutConfig.mode = 'sync'"], "Unknown rollout mode 'sync'; known modes"),
    (["--gin_param=LearnerConfig.loss_name = 'ppo2'"], "known"),
    (["--gin_param=LearnerConfig.ratio_against = 'pi_old'"], "ratio_against='pi_old': use one of"),
    (["--gin_param=TrainConfig.train_dataset = 'nope'"], "known datasets"),
    (["--gin_param=TrainConfig.num_stepz = 3"], "num_stepz"),
    (["--gin_file=configs/missing.gin"], "gin file configs/missing.gin does not exist"),
    (["--gin_param=TrainConfig.num_steps = (3"], "binding is not closed"),
    (["--gin_param=TrainConfig.num_steps = 'x'"], "value bound to TrainConfig has the wrong type"),
    (["--gin_param=TrainConfig.time_budget_s = None"], r"time_budget_s=None must be a number of seconds >= 0"),
    (["--gin_param=TrainConfig.policy_path = 'no/such/dir'"], "No config.json in no/such/dir"),
])
def test_bad_configuration_exits_with_one_message(policy, tmp_path, capsys, args, match):
    with pytest.raises(SystemExit) as exit_info:
        bindings = run_params(policy, "on_policy", 1)
        train.main([f"--workdir={tmp_path / 'bad'}", *[f"--gin_param={p}" for p in bindings], *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and re.search(match, err) and "Traceback" not in err, err
    assert err.startswith("error: ")
    assert not (tmp_path / "bad").exists()


def test_traceback_on_request(policy, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--traceback", f"--workdir={tmp_path / 'bad'}", "--gin_param=RolloutConfig.mode = 'sync'"])
    assert "Traceback" in capsys.readouterr().err


def test_dry_run_validates_without_weights(capsys):
    train.main(["--dry_run", "--gin_file=configs/tiny_rollverify.gin"])
    report = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert report["mode"] == "rollverify" and report["rows_per_step"] == 256 and report["params"] > 0
    gin.clear_config()
    with pytest.raises(SystemExit) as exit_info:  # 32 x 8 rows cannot split over data x fsdp = 3 devices
        train.main(["--dry_run", "--dry_run_devices=3", "--gin_file=configs/tiny_rollverify.gin"])
    assert exit_info.value.code == 2
    assert "do not divide over data x fsdp = 3" in capsys.readouterr().err


def test_evaluate_cli_reports_a_missing_checkpoint(policy, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([f"--checkpoint={tmp_path / 'nothing'}",
                       *[f"--gin_param={p}" for p in run_params(policy, "on_policy", 1)]])
    assert exit_info.value.code == 2 and "No checkpoint under" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize("name, mode, loss", [
    ("onpolicy", "on_policy", "grpo"), ("partial", "partial", "grpo"), ("staleness", "partial", "grpo"),
    ("opsfilter", "partial", "grpo"), ("rollverify", "rollverify", "grpo"), ("gspo", "partial", "gspo"),
    ("sapo", "partial", "sapo"), ("vespo", "partial", "vespo")])
def test_shipped_tiny_configs_run_the_mode_their_name_says(name, mode, loss):
    """The loss-reweighting baselines (GSPO / SAPO / VESPO) run on naive partial rollout, as the method compares
    them; RollVerify is only ever the config that says so."""
    parse_gin([f"configs/tiny_{name}.gin"], [])
    spec = RunSpec.from_gin()
    assert (spec.rollout.mode, spec.learner.loss_name) == (mode, loss)


def test_resume_refuses_changed_run_settings_unless_allowed(policy, tmp_path, capsys):
    """A RollVerify checkpoint resumed with mode = 'on_policy' and another ds is refused with both differences
    named (exit 2, nothing trained); --allow_changed_settings continues, on-policy for real."""
    workdir = tmp_path / "run"
    _train(policy, workdir, "rollverify", 1)
    changed = [f"--gin_param={p}" for p in run_params(policy, "on_policy", 2, ("VerifyConfig.ds = 0.5",))]
    with pytest.raises(SystemExit) as exit_info:
        train.main([f"--workdir={workdir}", *changed])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # refused by the workdir's spec.json, before anything is built
    assert "rollout.mode: spec.json 'rollverify', now 'on_policy'" in err and "verify.ds: spec.json 0.01" in err
    assert "Traceback" not in err and [m["step"] for m in read_metrics(workdir)] == [0, 1]
    (workdir / "spec.json").unlink()  # without it, the checkpoint's own fingerprint still refuses
    with pytest.raises(SystemExit) as exit_info:
        train.main([f"--workdir={workdir}", *changed])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "rollout.mode: checkpoint 'rollverify', now 'on_policy'" in err
    assert "verify.ds: checkpoint 0.01" in err and [m["step"] for m in read_metrics(workdir)] == [0, 1]
    gin.clear_config()
    train.main([f"--workdir={workdir}", "--allow_changed_settings", *changed])
    assert "resuming with changed settings" in capsys.readouterr().out
    last = read_metrics(workdir)[-1]
    assert last["step"] == 2 and last["mode/on_policy"] == 1 and last["verify/num_verified"] == 0
    assert RunSpec.from_json((workdir / "spec.json").read_text()).rollout.mode == "on_policy"  # this launch's


@pytest.mark.parametrize("mode, binding, message", [
    ("rollverify", "LearnerConfig.num_minibatches = 3", "8 rows do not split into LearnerConfig.num_minibatches=3"),
    ("on_policy", "FilterConfig.name = 'staleness'", "FilterConfig.name='staleness' needs partial rollout"),
])
def test_cross_checks_run_at_every_start_not_only_in_the_dry_run(policy, tmp_path, capsys, mode, binding, message):
    with pytest.raises(SystemExit) as exit_info:
        params = run_params(policy, mode, 1, (binding,))
        train.main([f"--workdir={tmp_path / 'run'}", *[f"--gin_param={p}" for p in params]])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert message in capsys.readouterr().err


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
        _train(policy, workdir, "rollverify", 200, ("CheckpointConfig.save_interval_steps = 1000",))
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
    resumed = _train(policy, workdir, "rollverify", 4, again)
    # Step 2's evaluation (eval_every = 2), skipped by the stop, runs first on resume, as a row of its own.
    assert [m["step"] for m in resumed] == [0, 1, 2, 2, 3, 4] and resumed[-1]["time/wall"] > 1e6
    assert "eval/accuracy" not in resumed[2] and "eval/accuracy" in resumed[3] and "time/step" not in resumed[3]
    out, err = capsys.readouterr()
    assert "held-out accuracy: " in out and "(step 0) -> " in out  # the whole run's summary, not this launch's
    assert list((workdir / "profile").rglob("*.xplane.pb")) and "profile: steps 3-3 traced into" in err
    monkeypatch.setattr(builder, "build_trainer", lambda *a: pytest.fail("a complete run was built again"))
    _train(policy, workdir, "rollverify", 4, again)
    out = capsys.readouterr().out
    assert f"run complete: {workdir.absolute()} holds checkpoint step 4 (TrainConfig.num_steps = 4); to train " \
        "further pass --gin_param=TrainConfig.num_steps=<more than 4>" in out and "held-out" not in out


def test_importing_the_trainer_loads_neither_tfds_nor_matplotlib():
    """tensorflow_datasets loads only where a TFDS dataset is built or read, matplotlib only where a plot is drawn."""
    import subprocess
    import sys

    code = "import sys, rollverify_jax.train; print(sorted(m for m in ('tensorflow_datasets', 'matplotlib') if m in " \
        "sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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
        _train(policy, workdir, "on_policy", 4, QUICK)
    assert e.value.code == 143
    err = capsys.readouterr().err
    assert f"stopped by {notice}: checkpoint {workdir.absolute() / 'checkpoints' / '2'} committed" in err
    assert [m["train/skipped_updates"] for m in read_metrics(workdir)] == [0, 1]
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        assert ckpt.all_steps() == [2]


def test_another_hosts_clock_past_the_budget_stops_every_host_and_commits_a_skipped_last_step(policy, tmp_path,
                                                                                              monkeypatch):
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
    metrics = _train(policy, workdir, "on_policy", 5, (*QUICK, "TrainConfig.time_budget_s = 1e9"))
    assert [m["step"] for m in metrics] == [1, 2] and "eval/accuracy" in metrics[-1]
    assert metrics[-1]["train/skipped_updates"] == 1
    with Checkpointer(workdir, CheckpointConfig()) as ckpt:
        assert ckpt.all_steps() == [2]


def test_nonfinite_updates_are_skipped_and_a_run_of_them_stops_with_the_good_checkpoint(policy, tmp_path,
                                                                                         monkeypatch, capsys):
    """From step 2 on every batch carries NaN advantages (injected): the updates are skipped and reported, the
    steps are not checkpointed at their interval, and the second such step in a row stops the run with exit
    status 3 after committing its state (the skipped updates changed nothing: it holds step 1's params)."""
    monkeypatch.setattr(Trainer, "learn", _poisoned_from(2))
    with pytest.raises(SystemExit) as e:
        _train(policy, tmp_path / "run", "on_policy", 6, ("TrainConfig.max_skipped_steps = 2",))
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
        _train(policy, tmp_path / "run", "on_policy", 3)
    monkeypatch.undo()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "checkpoints are intact (latest: step 1)" in err
    assert "Traceback" not in err
    assert _final_state(tmp_path / "run", policy)[0] == 1


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
            _train(policy, workdir, "on_policy", 1, QUICK)
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
        _train(policy, workdir, "on_policy", 1, QUICK)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "has no checkpoint that can be restored, but a run was there" in err and "3.corrupt" in err
    assert "metrics.jsonl has 3 rows of training steps (up to step 3)" in err and "--restart_from_scratch" in err
    assert (workdir / "metrics.jsonl").read_text() == rows
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3.corrupt"]
