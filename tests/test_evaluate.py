"""Held-out evaluation: its own sampling settings, params-only restore, clear errors, logged generations."""

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import gin
import jax
import numpy as np
import optax
import pytest
from shared import POLICY, make_checkpoint

from rollverify_jax import evaluate, train
from rollverify_jax.rollout.sampling import SamplingConfig
from rollverify_jax.run import builder, evaluation
from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.run.spec import RunSpec, parse_gin

TASK = {"n": 12, "split": "test", "max_steps": 2, "length_median": 1.0, "length_sigma": 0.5, "max_value": 99,
        "max_operand": 9, "max_multiplier": 3, "holdout_fraction": 0.1}
BINDINGS = [f"TrainConfig.policy_path = '{POLICY}'", f"TrainConfig.eval_dataset_kwargs = {TASK}",
            f"TrainConfig.train_dataset_kwargs = { {**TASK, 'split': 'train'} }", "TrainConfig.eval_size = 4",
            "TrainConfig.eval_samples = 2", "TrainConfig.metrics_tensorboard = False", "RewardScorer.name = 'exact'",
            "RolloutConfig.max_new_tokens = 32", "RolloutConfig.batch_groups = 2", "RolloutConfig.group_size = 4",
            "EngineConfig.num_slots = 8", "EngineConfig.page_size = 16", "EngineConfig.max_seq_len = 64",
            "EngineConfig.steps_per_dispatch = 4", "CheckpointConfig.async_save = False"]


def _gin(extra=()):
    gin.clear_config()
    parse_gin([], [*BINDINGS, *extra])


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """An evaluator built from a checkpoint (params only), shared by the tests of EvalConfig."""
    workdir = tmp_path_factory.mktemp("run")
    make_checkpoint(workdir, 3)
    _gin()
    try:
        serving, evaluator = builder.build_policy(RunSpec.from_gin(), checkpoint=workdir)
    finally:
        gin.clear_config()
    yield evaluator
    serving.close()


def _evaluate(run, tmp_path, extra=()):
    _gin(extra)
    try:
        metrics = _respec(run).run(samples_path=tmp_path / "samples.jsonl")
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    return metrics, rows


def _respec(evaluator):
    """The built evaluator with the EvalConfig of the bindings parsed now (it changes between evaluations)."""
    return dataclasses.replace(evaluator, config=RunSpec.from_gin().eval)


def test_eval_config_defaults_keep_the_training_sampler():
    train_sampler = SamplingConfig(temperature=0.7, top_p=0.95, top_k=5)
    assert evaluation.EvalConfig().sampling(train_sampler) is train_sampler
    assert evaluation.EvalConfig(temperature=0.0).sampling(train_sampler) == SamplingConfig(0.7, 0.95, 5, greedy=True)
    assert evaluation.EvalConfig(temperature=0.3, top_p=0.5).sampling(SamplingConfig(greedy=True)) == \
        SamplingConfig(0.3, 0.5, 0, greedy=False)
    assert evaluation.EvalConfig(top_p=0.5).sampling(train_sampler) == SamplingConfig(0.7, 0.5, 5)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"samples_per_problem": 0}, {"max_new_tokens": 0},
                {"num_samples_logged": -1}):
        with pytest.raises(ValueError, match="EvalConfig"):
            evaluation.EvalConfig(**bad)


def test_default_evaluation_logs_generations_that_agree_with_its_metrics(eval_run, tmp_path):
    assert eval_run.engine.version == 3  # the checkpoint's step
    metrics, rows = _evaluate(eval_run, tmp_path, ["EvalConfig.num_samples_logged = 100", "EvalConfig.at_k = (1,)"])
    assert set(metrics) >= {"eval/avg@2", "eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2", "eval/accuracy",
                            "eval/response_length", "eval/grader_errors", "eval/grader_timeouts"}
    assert metrics["eval/grader_errors"] == metrics["eval/grader_timeouts"] == 0.0
    assert len(rows) == 4 * 2 and {r["step"] for r in rows} == {3}
    assert set(rows[0]) == {"step", "problem", "sample", "prompt", "response", "answer", "reward", "num_tokens"}
    assert [s.name for s in eval_run.sets] == [""]
    prompts = [r["prompt"] for r in eval_run.sets[0].records]
    answers = [r["answer"] for r in eval_run.sets[0].records]
    assert all(r["prompt"] == prompts[r["problem"]] and r["answer"] == answers[r["problem"]] for r in rows)
    correct = np.array([r["reward"] > 0.5 for r in rows])
    assert 0 < correct.mean() and metrics["eval/accuracy"] == pytest.approx(correct.mean())
    assert metrics["eval/response_length"] == pytest.approx(np.mean([r["num_tokens"] for r in rows]))
    by_problem = correct.reshape(4, 2)  # rows are problem by problem, sample by sample
    assert metrics["eval/pass@1"] == pytest.approx(correct.mean())
    assert metrics["eval/pass@2"] == pytest.approx(by_problem.any(axis=1).mean())
    assert metrics["eval/maj@1"] == pytest.approx(np.mean([  # one vote: its sample's grade, if it gave an answer
        r["reward"] > 0.5 and evaluation.vote_key(r["response"]) is not None for r in rows if r["sample"] == 0]))
    # A bounded log shows different problems first.
    _, few = _evaluate(eval_run, tmp_path, ["EvalConfig.num_samples_logged = 5"])
    assert [(r["problem"], r["sample"]) for r in few] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]


def test_eval_config_sets_k_temperature_and_length_apart_from_training(eval_run, tmp_path):
    sampler = eval_run.engine.sampling
    metrics, rows = _evaluate(eval_run, tmp_path, ["EvalConfig.temperature = 0.0", "EvalConfig.max_new_tokens = 6",
                                                   "EvalConfig.num_samples_logged = 100"])
    # Greedy: one sample per problem (training's 2 would be the same response twice), the greedy continuation.
    assert "eval/avg@1" in metrics and "eval/avg@2" not in metrics and len(rows) == 4
    assert max(r["num_tokens"] for r in rows) == 6
    assert eval_run.engine.sampling is sampler  # training's sampler is back after the evaluation
    for bad in ("EvalConfig.samples_per_problem = 3", "EvalConfig.at_k = (2,)"):  # k greedy copies: refused
        _gin(["EvalConfig.temperature = 0.0", bad])
        try:
            with pytest.raises(ValueError, match="EvalConfig.temperature=0 is greedy"):
                RunSpec.from_gin()
        finally:
            gin.clear_config()
    _, sampled = _evaluate(eval_run, tmp_path, ["EvalConfig.samples_per_problem = 3",
                                                "EvalConfig.num_samples_logged = 100"])
    assert any(len({r["response"] for r in sampled if r["problem"] == i}) > 1 for i in range(4))
    longest = max(len(eval_run.prompts.encode(r)) for r in eval_run.sets[0].records)
    _gin([f"EvalConfig.max_new_tokens = {64 - longest + 1}"])
    try:
        with pytest.raises(ValueError, match=f"EvalConfig.max_new_tokens=.*longest eval prompt .{longest} tokens"):
            _respec(eval_run).run()
    finally:
        gin.clear_config()
    _gin(["EvalConfig.at_k = (1, 3)"])  # 2 samples per problem: refused before anything is sampled
    try:
        with pytest.raises(ValueError, match=r"at_k=\(1, 3\) asks for k = \[3\] but the primary eval set has 2 "):
            _respec(eval_run).settings()
    finally:
        gin.clear_config()


def _cli(args, extra=()):
    evaluate.main([*args, *[f"--gin_param={p}" for p in [*BINDINGS, *extra]]])


def test_evaluate_reads_only_the_params(tmp_path, capsys):
    """A checkpoint whose optimizer state has another structure and whose host state is gone still evaluates,
    with exactly the checkpoint's params."""
    saved = make_checkpoint(tmp_path / "run", 2, optimizer=optax.sgd(0.1, momentum=0.9))
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "2" / "extra")
    _gin()
    try:
        serving, _ = builder.build_policy(RunSpec.from_gin(), checkpoint=tmp_path / "run" / "checkpoints" / "2")
    finally:
        gin.clear_config()
    serving.close()
    got = dict(jax.tree_util.tree_leaves_with_path(serving.engine.params))
    for path, want in jax.tree_util.tree_leaves_with_path(saved):
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want), err_msg=str(path))
    # A second eval set, reported under its own name, with its own size and samples per problem.
    second = {**TASK, "name": "synthetic", "seed": 5, "size": 3, "k": 3}
    _cli([f"--checkpoint={tmp_path / 'run'}", f"--samples_out={tmp_path / 'out' / 's.jsonl'}"],
         ["EvalConfig.num_samples_logged = 3", f"TrainConfig.eval_sets = {{'second': {second}}}"])
    out = capsys.readouterr().out
    assert "4 problems x 2 samples: avg@2 = " in out and "maj@2 = " in out
    assert "second: 3 problems x 3 samples: avg@3 = " in out and "pass@3 = " in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "s.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [r.get("eval_set") for r in rows] == [None] * 3 + ["second"] * 3


def test_pass_at_k_is_the_unbiased_estimator_and_maj_at_k_votes_on_extracted_answers():
    n = 5
    for c in range(n + 1):
        for k in range(1, n + 1):  # 1 - C(n-c, k) / C(n, k): the chance that k of the n samples hold a correct one
            want = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert evaluation.pass_at_k(n, np.array([c]), k)[0] == pytest.approx(want, abs=1e-12), (c, k)
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        evaluation.pass_at_k(2, np.array([1]), 3)
    answers = [["7", "8", "8", None], ["7", "8", None, None], [None, None, None, None], ["3", "3", "4", "4"]]
    correct = np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]], bool)
    # 2 of 3 votes wrong; a 1-1 tie goes to the first answer; no votes is wrong; maj@2 sees only "3"s.
    assert evaluation.majority_correct(answers, correct, 4).tolist() == [False, True, False, False]
    assert evaluation.majority_correct(answers, correct, 1).tolist() == [True, True, False, False]
    assert [evaluation.vote_key(t) for t in ("so\nAnswer:  1 / 2", "\\boxed{x+1}", "none")] == ["1 / 2", "x+1", None]
    with pytest.raises(ValueError, match=r"at_k=\(8,\) asks for k = \[8\] but each problem has 4 samples"):
        evaluation.sample_metrics(correct, answers, (8,))


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("typo, message", [
    ("runz", "No checkpoint under"), ("run/checkpoint", "No checkpoint under"),
    ("run/checkpoints/9", r"No committed checkpoint for step 9 .*available steps: \[4\]"),
])
def test_a_mistyped_checkpoint_is_one_error_and_creates_nothing(tmp_path, capsys, typo, message):
    make_checkpoint(tmp_path / "run", 4)
    # A save still in flight and a step never committed (a run that is training): a reader leaves both alone.
    (tmp_path / "run" / "checkpoints" / "6.orbax-checkpoint-tmp-123").mkdir()
    (tmp_path / "run" / "checkpoints" / "5").mkdir()
    before = _tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        _cli([f"--checkpoint={tmp_path / typo}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert err.count("error: ") == 1 and re.search(message, err), err
    assert _tree(tmp_path) == before


def test_a_workdir_without_spec_json_is_one_error_naming_the_way_out(tmp_path, capsys):
    """A run from before spec.json: evaluate says so in one line and names --gin_file, which still reads it."""
    make_checkpoint(tmp_path / "run", 1)
    (tmp_path / "run" / "spec.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([f"--checkpoint={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert "spec.json does not exist" in err and "--gin_file=<workdir>/config.gin" in err, err


def test_a_training_run_can_skip_its_step_0_evaluation_and_logs_its_generations(tmp_path):
    def run(workdir, extra):
        train.main([f"--workdir={workdir}", "--gin_param=TrainConfig.num_steps = 0",
                    *[f"--gin_param={p}" for p in [*BINDINGS, *extra]]])
        return read_metrics(workdir / "metrics.jsonl")

    skipped = run(tmp_path / "skip", ["EvalConfig.at_start = False"])
    assert skipped == [] and not (tmp_path / "skip" / "samples").exists()
    evaluated = run(tmp_path / "eval", ["EvalConfig.num_samples_logged = 3"])
    assert [m["step"] for m in evaluated] == [0] and "eval/avg@2" in evaluated[0]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["step"] == 0 and r["response"] is not None for r in rows)
