"""The main job end to end on a small random policy: metrics, configs, checkpoints, exact resume. (Stops,
faults and refusals of a run: test_train_stops.py; the two files split the end-to-end runs between the workers.)"""

import contextlib
import json
import random
import re
import time
from pathlib import Path

import gin
import jax
import numpy as np
import pytest
from shared import final_state, run_params, train_run

from rollverify_jax import evaluate, train
from rollverify_jax.run import builder
from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.run.spec import RunSpec, parse_gin

pytestmark = [pytest.mark.end_to_end, pytest.mark.usefixtures("compilation_cache")]

DESIGN_KEYS = {"step", "time/wall", "time/rollout", "time/verify", "time/train", "rollout/tokens_per_s",
               "rollout/slot_utilization", "reward/mean", "policy/entropy", "ops/token_mean", "verify/acceptance",
               "verify/acceptance_window", "mode/on_policy", "response/length_mean", "response/length_max"}


def test_run_writes_metrics_config_and_checkpoints(policy, tmp_path, capsys):
    # A run killed after its step-0 evaluation (no checkpoint yet) left a row behind: it is redone, not doubled.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    metrics = train_run(policy, tmp_path / "run", "rollverify", 2)
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
    metrics = train_run(policy, tmp_path / "run", "on_policy", 2,
                     (*LENGTH_REWARD, "TrainConfig.skip_uniform_groups = True"))
    for m in metrics[1:]:
        assert m["filter/kept_fraction"] == pytest.approx(1.0 - m["reward/uniform_group_fraction"])
    assert any(0.0 < m["reward/uniform_group_fraction"] < 1.0 for m in metrics[1:])


def test_extra_complete_groups_train_in_the_step_that_completed_them(policy, tmp_path):
    """'train': every group complete at a phase's end is in its batch (B or more groups), padded with rows outside
    the loss: the loss sees exactly the trained groups' response tokens."""
    metrics = train_run(policy, tmp_path / "run", "partial", 3, ("RolloutConfig.extra_complete_groups = 'train'",
                                                             "LearnerConfig.pack_sequences = True"))
    steps = [m for m in metrics if "batch/groups" in m]
    assert len(steps) == 3 and all(m["batch/groups"] >= 2 for m in steps)
    assert any(m["batch/groups"] > 2 for m in steps)
    for m in steps:
        assert m["train/loss_tokens"] == pytest.approx(m["response/length_mean"] * m["batch/groups"] * 4)


def test_a_run_with_only_uniform_groups_trains_on_nothing(policy, tmp_path):
    """The random policy never answers right: every group is uniform, so with the DAPO group filter nothing is
    left to train on (and the packed step, which skips those rows, still runs)."""
    metrics = train_run(policy, tmp_path / "run", "on_policy", 1, ["TrainConfig.skip_uniform_groups = True"])
    m = metrics[1]
    assert m["reward/uniform_group_fraction"] == 1.0
    assert m["filter/kept_fraction"] == 0.0 and m["train/loss_tokens"] == 0.0 and m["loss"] == 0.0


# A reward that varies with the response length (DAPO's overlong penalty on a task the random policy never
# solves), so the policy learns from step 1 and a run that lost its state would differ.
LENGTH_REWARD = ("RewardScorer.overlong_buffer = 20", "RewardScorer.max_response_length = 24")
ASYNC = ("CheckpointConfig.async_save = True",)  # the default, which _params turns off


def test_resumed_run_equals_uninterrupted_run(policy, tmp_path):
    """Stop after a checkpoint taken while trajectories were paused and the policy was learning; the resumed
    steps equal an uninterrupted run exactly (every metric but timings, and the train state they end with, bit for
    bit). Saves are asynchronous, as by default."""
    full = train_run(policy, tmp_path / "full", "rollverify", 3, (*LENGTH_REWARD, *ASYNC))
    train_run(policy, tmp_path / "split", "rollverify", 2, (*LENGTH_REWARD, *ASYNC))
    assert final_state(tmp_path / "split", policy, 1)[2]["rollout"]["cache"]["paused"]  # the resume restores these
    # Step 2's checkpoint is damaged: the resume sets it aside, restores step 1 and redoes step 2.
    (tmp_path / "split" / "checkpoints" / "2" / "extra" / "metadata").unlink()
    resumed = train_run(policy, tmp_path / "split", "rollverify", 3, (*LENGTH_REWARD, *ASYNC))
    assert (tmp_path / "split" / "checkpoints" / "2.corrupt").is_dir()
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]  # no duplicated lines after the resume
    assert len({m["reward/mean"] for m in full[1:]}) > 1 and any(m["reward/uniform_group_fraction"] < 1
                                                                 for m in full[1:])
    assert any(abs(m["loss"]) > 1e-6 and m["grad_norm"] > 1e-6 for m in full[1:])
    _assert_same_rows(full, resumed)  # the steps before the resume were written by the first launch
    _assert_same_final_state(tmp_path, policy, 3)


def _assert_same_rows(a_rows: list[dict], b_rows: list[dict]) -> None:
    """Two runs' metrics rows are equal, timings aside."""
    for a, b in zip(a_rows, b_rows, strict=True):
        a, b = _untimed(a), _untimed(b)
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        differ = {k: (a[k], b[k]) for k in a if not _same_value(a[k], b[k])}
        assert not differ, f"step {a['step']}: {differ}"


def _assert_same_final_state(tmp_path, policy, steps: int) -> None:
    """The runs in ``full`` and ``split`` end at step ``steps`` with the same train state, bit for bit, and the
    same data and rollout state."""
    (step_a, state_a, extra_a), (step_b, state_b, extra_b) = final_state(tmp_path / "full", policy), \
        final_state(tmp_path / "split", policy)
    assert step_a == step_b == steps and len(state_a) == len(state_b)
    for x, y in zip(state_a, state_b, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert extra_a["data"] == extra_b["data"] and extra_a["rollout"]["next_uid"] == extra_b["rollout"]["next_uid"]


TOOL_POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_tool_policy"
_TOOL_TASK = ("'max_steps': 4, 'length_median': 2.0, 'length_sigma': 0.5, 'max_value': 99999, 'max_start': 99, "
              "'max_operand': 9, 'min_factor': 11, 'max_factor': 999, 'tool_fraction': 0.4, 'max_tool_steps': 4, "
              "'holdout_fraction': 0.1")
# The tiny tool-use default (configs/tiny_tool_base.gin: its policy, task and tool protocol) at the tiny runs'
# sizes: problems of at most 4 steps (prompts <= 43 tokens, solutions <= 95), responses cut at 48 tokens, so some
# calls are made in every step and the long tail is paused mid-turn or mid-call.
TOOL_RUN = (f"TrainConfig.policy_path = '{TOOL_POLICY}'", "TrainConfig.train_dataset = 'synthetic_tools'",
            "TrainConfig.train_dataset_kwargs = {'n': 256, 'split': 'train', " + _TOOL_TASK + "}",
            "TrainConfig.eval_dataset = 'synthetic_tools'",
            "TrainConfig.eval_dataset_kwargs = {'n': 8, 'split': 'test', " + _TOOL_TASK + "}",
            "ToolUseConfig.enabled = True", "ToolUseConfig.tools = ('calculator',)",
            "ToolUseConfig.call_end_token = '</calculator>'", "ToolUseConfig.reply_prefix = '<tool_response>'",
            "ToolUseConfig.reply_suffix = '</tool_response>'", "ToolUseConfig.max_calls = 8",
            "ToolUseConfig.max_reply_tokens = 32", "RolloutConfig.max_new_tokens = 48",
            "EngineConfig.max_seq_len = 96")


class _Killed(BaseException):
    """A ``kill -9`` stand-in: nothing in a run catches it, and it stops the launch where it is raised."""


@contextlib.contextmanager
def _killed_in_rollout(monkeypatch, also=lambda scheduler: True):
    """The launch run inside is killed (``_Killed``) in step 2's rollout, once its scheduler has run 2 dispatches
    and ``also(scheduler)`` holds; afterwards the scheduler steps as usual again."""
    from rollverify_jax.rl.partial_rollout import RolloutManager
    from rollverify_jax.rollout.scheduler import Scheduler

    phases, run_phase, step = [], RolloutManager.run_phase, Scheduler.step

    def dying_step(self):
        if len(phases) == 2 and self.stats.dispatches >= 2 and also(self):
            raise _Killed
        return step(self)

    monkeypatch.setattr(RolloutManager, "run_phase", lambda self: (phases.append(1), run_phase(self))[1])
    monkeypatch.setattr(Scheduler, "step", dying_step)
    with pytest.raises(_Killed):
        yield
    monkeypatch.setattr(Scheduler, "step", step)


def test_a_tool_use_run_resumes_as_it_runs_whatever_its_tools_latency(tmp_path, monkeypatch):
    """Tool-use runs are held to the resume test too, with every calculator call made slow at random (0 to 30 ms,
    other draws in each launch): two uninterrupted launches log the same step, and one killed in step 2's rollout
    (with calls running) resumes from step 1's checkpoint (trajectories paused mid-turn or mid-call in it) to the
    uninterrupted run's metrics and train state, bit for bit. Four train steps and a part in all."""
    from rollverify_jax.rollout.tool_use import ToolEnvironment

    rng, run = random.Random(0), ToolEnvironment._run
    monkeypatch.setattr(ToolEnvironment, "_run",
                        lambda self, text: (time.sleep(rng.choice([0.0, 0.001, 0.01, 0.03])), run(self, text))[1])
    no_first_eval = (*TOOL_RUN, "EvalConfig.at_start = False")  # the last step's evaluation is compared all the same
    full = train_run(TOOL_POLICY, tmp_path / "full", "rollverify", 2, no_first_eval)
    assert [m["step"] for m in full] == [1, 2]
    # Calls in every step; replies served by extend (step 2's calls may all be taken by the pause instead)
    assert all(m["tools/calls"] > 0 for m in full) and sum(m["rollout/extend_tokens"] for m in full) > 0
    assert len({m["reward/mean"] for m in full}) > 1

    with _killed_in_rollout(monkeypatch, also=lambda scheduler: bool(scheduler.waits)):  # calls running
        train_run(TOOL_POLICY, tmp_path / "split", "rollverify", 2, no_first_eval)
    _assert_same_rows(full[:1], read_metrics(tmp_path / "split" / "metrics.jsonl"))  # the step before the kill
    assert any(t.get("env_spans") for t in final_state(tmp_path / "split", TOOL_POLICY)[2]["rollout"]["cache"]
               ["paused"])
    resumed = train_run(TOOL_POLICY, tmp_path / "split", "rollverify", 2, no_first_eval)
    _assert_same_rows(full, resumed)
    _assert_same_final_state(tmp_path, TOOL_POLICY, 2)


def _untimed(m: dict) -> dict:
    """A metrics row without what depends on the clock (timings, throughput, the wall time a resume carries)."""
    return {k: v for k, v in m.items()
            if not (k.startswith("time/") or k.endswith(("per_s", "_time", "time_share", "wait_s")))}


def _same_value(x, y) -> bool:
    """Exactly equal; NaN equals NaN (a rate with nothing to count)."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y))


def test_low_acceptance_switches_to_on_policy_for_good(policy, tmp_path):
    """Window 1 and threshold 1: the first cycle that cuts anything switches the run to on-policy rollout; the
    cache is dropped, nothing is verified afterwards, and the checkpoint records the switch."""
    metrics = train_run(policy, tmp_path / "run", "rollverify", 4,
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
    _, _, extra = final_state(tmp_path / "run", policy)
    assert switch["mode/dropped_at_switch"] >= switch["cache/size"] > 0  # paused + finished members waiting
    saved = extra["rollout"]["switch"]
    assert int(saved["on_policy"]) == 1 and int(saved["switch_step"]) == switch["step"]
    assert int(extra["rollout"]["on_policy"]) == 1 and not extra["rollout"]["cache"]["paused"]


def test_staleness_filter_drops_exactly_the_stale_trajectories(policy, tmp_path):
    """s_max = 0: a batch holding any resumed (stale) trajectory trains on less than all of it, a fresh batch on
    all of it."""
    metrics = train_run(policy, tmp_path / "run", "partial", 4,
                     (*LENGTH_REWARD, "FilterConfig.name = 'staleness'", "FilterConfig.s_max = 0"))[1:]
    assert any(m["staleness/max"] > 0 for m in metrics)
    for m in metrics:
        assert (m["filter/kept_fraction"] < 1.0) == (m["staleness/max"] > 0), m["step"]
        assert m["filter/kept_fraction"] > 0.0 or m["staleness/mean"] >= 1.0


def test_ops_filter_keeps_fresh_trajectories_and_drops_shifted_ones(policy, tmp_path):
    metrics = train_run(policy, tmp_path / "run", "partial", 4,
                     (*LENGTH_REWARD, "FilterConfig.name = 'ops'", "FilterConfig.ops_threshold = 0.05"))[1:]
    for m in metrics:
        if m["staleness/max"] == 0:  # sampled by the current policy: train-time OPS is rounding noise
            assert m["filter/kept_fraction"] == 1.0, m["step"]
    assert any(m["filter/kept_fraction"] < 1.0 for m in metrics)


def test_ratio_against_the_step_start_policy_leaves_staleness_uncorrected(policy, tmp_path):
    """The pi_old ablation with one update per step: the loss's ratio is 1 at every token (nothing is clipped,
    stale or not), while the train-time OPS against mu still shows the stale batches' shift."""
    metrics = train_run(policy, tmp_path / "run", "partial", 4,
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
    (["--gin_param=TrainConfig.policy_path = 'no/such/dir'"], "TrainConfig.policy_path: no/such/dir does not exist"),
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
    train_run(policy, workdir, "rollverify", 1)
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


def test_importing_the_trainer_loads_neither_tfds_nor_matplotlib():
    """tensorflow_datasets loads only where a TFDS dataset is built or read, matplotlib only where a plot is drawn."""
    import subprocess
    import sys

    code = "import sys, rollverify_jax.train; print(sorted(m for m in ('tensorflow_datasets', 'matplotlib') if m in " \
        "sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
