"""RunSpec: the only reader of gin, its cross-checks, the derived resume fingerprint, and the step's scoring."""

import dataclasses
import json
import re
from pathlib import Path

import gin
import numpy as np
import pytest

from rollverify_jax.rl.buffer import Group
from rollverify_jax.rl.step import score
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.run import spec as spec_lib
from rollverify_jax.run.spec import RunSpec, check_resume_settings

PACKAGE = Path(__file__).resolve().parents[1] / "rollverify_jax"


def test_no_module_but_the_spec_reads_gin():
    """gin is imported by rollverify_jax/run/spec.py alone: every other module gets its settings handed in, so no
    component can read a binding the spec (and the resume fingerprint) does not hold."""
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if re.search(r"^\s*(import gin|from gin\b)", p.read_text(), re.MULTILINE))
    assert readers == ["run/spec.py"]


def test_a_bound_value_reaches_its_part_and_the_classes_themselves_read_nothing(spec_of):
    from rollverify_jax.rl.partial_rollout import RolloutConfig

    spec = spec_of("RolloutConfig.mode = 'rollverify'", "paged_attention.impl = 'chunked'",
                   "make_mesh.shape = (2, 2, 2)", "model_config.num_hidden_layers = 3",
                   "SamplingConfig.temperature = 0.7")
    assert spec.rollout.mode == "rollverify" and spec.attention["impl"] == "chunked"
    assert spec.mesh["shape"] == (2, 2, 2) and spec.model["num_hidden_layers"] == 3
    assert spec.learner.temperature == 0.7  # the learner scores at the sampler's temperature, derived once
    gin.parse_config("RolloutConfig.mode = 'partial'")
    assert RolloutConfig().mode == "on_policy"  # a plain dataclass: gin reaches it only through the spec
    assert spec.is_bound("RolloutConfig.mode") and not spec.is_bound("RolloutConfig.group_size")


def test_the_fingerprint_is_every_compared_setting(spec_of):
    """Every field of every compared part is in the fingerprint unless listed as bookkeeping: a setting added to a
    config class is checked without anyone adding it to a list (and refuses a resume unless classed execution)."""
    spec = spec_of()
    settings = spec.settings()
    for field in spec_lib.PARTS:
        part = getattr(spec, field)
        keys = list(part) if isinstance(part, spec_lib.Bindings) else [f.name for f in dataclasses.fields(part)]
        for key in keys:
            full = f"{field}.{key}"
            expected = (field not in spec_lib.NOT_COMPARED_PARTS and full not in spec_lib.NOT_COMPARED
                        and full != "learner.loss")
            assert (full in settings) == expected, full
    assert settings["verify.ds"] == spec.verify.ds and settings["learner.ratio_against"] == "behavior"
    assert settings["flash.impl"] == spec.flash.impl  # kernel knobs too (execution: reported when changed)
    bound = spec_of("paged_attention.pages_per_compute_block = 2").settings()
    assert bound["attention.pages_per_compute_block"] == 2
    assert {k for k in bound if bound[k] != settings.get(k)} == {"attention.pages_per_compute_block"}
    assert spec_lib.resume_class("model.num_hidden_layers") == "refuses"  # a model_config override, by its part
    assert spec_lib.resume_class("some_new_part.field") == "refuses"  # unknown: run-defining until classed


POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"
BASE = (f"TrainConfig.policy_path = '{POLICY}'", "TrainConfig.train_dataset_kwargs = {'n': 64, 'split': 'train'}")
# Written here, not read from spec.py's tables: settings that change what is trained. Each must refuse a resume,
# as the run's own settings (Trainer.settings, with the data's and tokenizer's hashes) compare them; the value is
# a key the refusal must name.
MUST_REFUSE = {
    "VerifyConfig.rule = 'coupled'": "verify.rule",  # the verification rule (exact vs two-stage)
    "VerifyConfig.coupled_tolerance = 0.01": "verify.coupled_tolerance",  # the coupled rule's near-ties kept
    "SamplingConfig.noise = 'two_level'": "sampling.noise",  # how each token's noise is drawn (other samples)
    "RewardScorer.name = 'dapo'": "reward.name",  # the reward function
    "RewardScorer.overlong_buffer = 16": "reward.overlong_buffer",  # DAPO's overlong penalty
    "RewardScorer.by_data_source = {'openai/gsm8k': 'exact'}": "reward.by_data_source",  # the per-source map
    "RewardScorer.timeout_s = 1.0": "reward.timeout_s",  # a timed-out grade scores 0
    "LearnerConfig.loss_name = 'gspo'": "learner.loss_name",  # the loss
    "LossConfig.eps_high = 0.3": "loss.eps_high",
    "LossConfig.kl_coef = 0.01": "loss.kl_coef",
    "LearnerConfig.num_minibatches = 2": "learner.num_minibatches",
    "LearnerConfig.ratio_against = 'step_start'": "learner.ratio_against",
    "OptimizerConfig.learning_rate = 2e-6": "optimizer.learning_rate",  # the optimizer
    "OptimizerConfig.warmup_steps = 5": "optimizer.warmup_steps",
    "OptimizerConfig.weight_decay = 0.0": "optimizer.weight_decay",
    "RolloutConfig.mode = 'rollverify'": "rollout.mode",  # the rollout mode
    "RolloutConfig.batch_groups = 4": "rollout.batch_groups",
    "RolloutConfig.group_size = 4": "rollout.group_size",
    "RolloutConfig.max_new_tokens = 64": "rollout.max_new_tokens",
    "RolloutConfig.queue_groups = 2": "rollout.queue_groups",  # which groups a phase admits, so completes
    "RolloutConfig.extra_complete_groups = 'train'": "rollout.extra_complete_groups",
    "AsyncConfig.max_staleness = 2": "async_rollout.max_staleness",  # the asynchronous mode
    "AsyncConfig.at_swap = 'reprefill'": "async_rollout.at_swap",
    "AsyncConfig.overlap_dispatches = 2": "async_rollout.overlap_dispatches",
    "VerifyConfig.ds = 0.05": "verify.ds",  # verification thresholds
    "VerifyConfig.dt = 1.5": "verify.dt",
    "VerifyConfig.verify_finished = True": "verify.verify_finished",
    "SwitchConfig.threshold = 0.3": "switch.threshold",  # switching
    "SwitchConfig.window = 4": "switch.window",
    "SwitchConfig.enabled = False": "switch.enabled",
    "FilterConfig.ops_threshold = 0.2": "filter.ops_threshold",  # the baselines' filter
    "FilterConfig.s_max = 2": "filter.s_max",
    "SamplingConfig.temperature = 0.7": "sampling.temperature",  # sampling
    "SamplingConfig.top_p = 0.9": "sampling.top_p",
    "SamplingConfig.top_k = 20": "sampling.top_k",
    "TrainConfig.skip_uniform_groups = True": "train.skip_uniform_groups",
    "EngineConfig.num_slots = 32": "engine.num_slots",  # which trajectories a phase finishes
    "EngineConfig.kv_dtype = 'bfloat16'": "engine.kv_dtype",  # what is sampled
    "TrainConfig.param_dtype = 'bfloat16'": "train.param_dtype",
    "TrainConfig.policy_path = '<a copy of the policy>'": "train.policy_path",  # the model (its architecture: the
    # checkpoint's fingerprint, test_train_stops.py)
    "TrainConfig.seed = 1": "train.seed",
    "TrainConfig.advantage = 'rloo'": "train.advantage",
    "TrainConfig.train_dataset_kwargs = {'n': 48, 'split': 'train'}": "data.train_records",  # the data
    "SyntheticTask.max_operand = 5": "data.train_sha256",
    "ToolUseConfig.max_calls = 2": "tool_use.max_calls",
    "SandboxConfig.memory_mb = 512": "sandbox.memory_mb",
}
# Settings of how the run executes on a machine or slice: a resume follows a change, one warning line each.
EXECUTION = {
    "paged_attention.pages_per_compute_block = 2": "attention.pages_per_compute_block",  # a kernel block size
    "FlashConfig.block_q = 256": "flash.block_q",
    "EngineConfig.live_slots = False": "engine.live_slots",  # live-slot buckets
    "ToolUseConfig.workers = 16": "tool_use.workers",  # tool worker count
    "RewardScorer.num_workers = 8": "reward.num_workers",
    "make_mesh.shape = (2, -1, 1)": "mesh.shape",  # the slice's layout
    "LearnerConfig.micro_batch_size = 4": "learner.micro_batch_size",  # exact accumulation
}


@pytest.fixture(scope="module")
def base_settings(tmp_path_factory):
    import shutil

    from rollverify_jax.run import builder

    other = tmp_path_factory.mktemp("other") / "policy"
    shutil.copytree(POLICY, other)

    def settings_of(*bindings):
        bindings = [b.replace("<a copy of the policy>", str(other)) for b in bindings]
        spec_lib.parse_gin([], [*BASE, *bindings])
        try:
            return builder.resume_settings(RunSpec.from_gin())[1]
        finally:
            gin.clear_config()
    return settings_of, settings_of()


@pytest.mark.parametrize("binding", list(MUST_REFUSE))
def test_a_changed_run_defining_setting_refuses_a_resume(base_settings, binding, capsys):
    settings_of, saved = base_settings
    named = rf"other run-defining settings:\n(.*\n)*  {re.escape(MUST_REFUSE[binding])}: checkpoint "
    with pytest.raises(ValueError, match=named):
        check_resume_settings(saved, settings_of(binding), allow=False)
    check_resume_settings(saved, settings_of(binding), allow=True)  # --allow_changed_settings: listed, continued
    assert "resuming with changed settings (--allow_changed_settings):\n" in capsys.readouterr().out


def test_a_changed_model_override_refuses_a_resume(spec_of):
    """A random policy's architecture (a model_config override) is run-defining like every other part."""
    saved = spec_of("model_config.num_hidden_layers = 3").settings()
    with pytest.raises(ValueError, match=r"  model\.num_hidden_layers: checkpoint 3, now 2"):
        check_resume_settings(saved, spec_of("model_config.num_hidden_layers = 2").settings(), allow=False)


def test_a_changed_execution_setting_resumes_with_one_warning_each(base_settings, capsys):
    """A resume on another machine, slice or kernel follows the new values, each said in one line; with a
    run-defining change beside them the refusal lists that one alone."""
    settings_of, saved = base_settings
    current = settings_of(*EXECUTION)
    check_resume_settings(saved, current, allow=False)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(EXECUTION), lines
    for key, line in zip(sorted(EXECUTION.values()), lines, strict=True):
        assert line.startswith(f"warning: execution setting {key} changed (checkpoint ") and "followed" in line
    with pytest.raises(ValueError, match="optimizer.learning_rate") as e:
        check_resume_settings(saved, {**current, "optimizer.learning_rate": 1.0}, allow=False)
    assert "attention." not in str(e.value) and "flash." not in str(e.value)
    check_resume_settings(saved, current, allow=False, source="spec.json", report_execution=False)
    assert capsys.readouterr().out == ""  # the spec.json check leaves the report to the checkpoint's


def test_a_checkpoint_from_before_the_split_resumes_on_another_kernel(base_settings, capsys):
    """Format-2 checkpoints compared kernel and layout settings as run-defining (and held no compile cache or
    process settings): they resume with a changed one, reported."""
    settings_of, saved = base_settings
    old = {k: v for k, v in saved.items() if not k.startswith(("compile_cache.", "distributed."))}
    assert old["settings.format"] == 2 and "attention.pages_per_compute_block" in old
    check_resume_settings(old, settings_of("paged_attention.pages_per_compute_block = 2",
                                           "compilation_cache.dir = '/elsewhere'"), allow=False)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "attention.pages_per_compute_block changed (checkpoint 4, now 2)" in out[0]


def test_a_checkpoint_of_the_hand_kept_list_resumes_against_the_derived_one(spec_of, capsys):
    spec = spec_of()
    current = {**spec.settings(), "inputs.rollout_dtype": "float32"}
    legacy = {"rollout.mode": "on_policy", "loss.name": "grpo", "advantage": "grpo", "policy_path":
              spec.train.policy_path, "engine.compute_dtype": "float32", "verify.ds": spec.verify.ds}
    check_resume_settings(legacy, current, allow=False)
    with pytest.raises(ValueError, match=r"(?s)learner\.loss_name: checkpoint 'gspo', now 'grpo'.*verify\.ds"):
        check_resume_settings({**legacy, "loss.name": "gspo", "verify.ds": 0.5}, current, allow=False)


def test_the_response_cap_is_bound_once(spec_of):
    spec = spec_of("RolloutConfig.max_new_tokens = 96", "RewardScorer.overlong_buffer = 16")
    assert spec.reward["max_response_length"] == 96 and spec.loss.max_response_length == 96
    assert spec.learner.loss.max_response_length == 96
    assert spec_of("RolloutConfig.max_new_tokens = 96", "LossConfig.max_response_length = 96").loss \
        .max_response_length == 96
    with pytest.raises(ValueError, match="RewardScorer.max_response_length=64 differs from RolloutConfig"):
        spec_of("RolloutConfig.max_new_tokens = 96", "RewardScorer.max_response_length = 64")


def test_cross_checks_and_wrong_types_are_one_clear_error(spec_of):
    with pytest.raises(ValueError, match="needs partial rollout"):
        spec_of("FilterConfig.name = 'staleness'")
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        spec_of("RolloutConfig.max_new_tokens = 600", "EngineConfig.max_seq_len = 512")
    with pytest.raises(ValueError, match="do not split into LearnerConfig.num_minibatches=3"):
        spec_of("LearnerConfig.num_minibatches = 3")
    with pytest.raises(ValueError, match="a value bound to RolloutConfig has the wrong type"):
        spec_of("RolloutConfig.group_size = 'eight'")


class _ExactScorer:
    """Grades text == answer, so a reward graded against another trajectory's record shows."""

    def score(self, texts, answers, lengths, records=None):
        assert [r["answer"] for r in records] == list(answers)  # each response's own record reaches the reward
        return [float(t == a) for t, a in zip(texts, answers, strict=True)], {}


def _group(gid: int, answer: str, responses: dict[int, str]) -> Group:
    group = Group(group_id=gid, size=len(responses), record={"prompt": f"p{gid}", "answer": answer})
    for uid, text in responses.items():  # inserted out of uid order
        t = Trajectory(uid=uid, group_id=gid, prompt=np.zeros(2, np.int32), seed=uid, max_new_tokens=8)
        t.tokens = [ord(c) for c in text]
        group.finished[uid] = t
    return group


def test_every_reward_is_graded_against_its_own_trajectorys_record():
    groups = [_group(0, "11", {1: "11", 0: "12"}), _group(1, "22", {3: "21", 2: "22"}),
              _group(2, "33", {5: "33", 4: "33"})]
    scored = score(groups, lambda tokens: "".join(map(chr, tokens)), _ExactScorer(), "grpo")
    assert [t.uid for t in scored.trajs] == [0, 1, 2, 3, 4, 5]  # group by group, uid order within a group
    np.testing.assert_array_equal(np.sign(scored.advantages), [-1, 1, 1, -1, 0, 0])
    np.testing.assert_array_equal(scored.uniform, [False, False, False, False, True, True])
    assert scored.metrics["reward/mean"] == pytest.approx(4 / 6)


class _SeenScorer:
    """Keeps the records the reward receives and grades 1 when the response ends with the answer."""

    def __init__(self):
        self.records = []

    def score(self, texts, answers, lengths, records=None):
        self.records += records
        return [float(t.endswith(a)) for t, a in zip(texts, answers, strict=True)], {}


def test_the_trainers_scoring_grades_each_group_against_its_own_answer(spec_of):
    """``Trainer.score`` as a step calls it, on the run's own parts (the policy's tokenizer decodes, the spec's
    RewardScorer grades, a data source by its own reward): groups with different answers (of different lengths)
    and rewards, handed over in an order other than their admission (group ids 2, 0, 1, members out of uid order).
    The three responses are the same in every group, so an answer, record or reward of another group shows."""
    from types import SimpleNamespace

    from rollverify_jax.data.rewards import RewardScorer
    from rollverify_jax.models.tokenizer import Tokenizer
    from rollverify_jax.run.trainer import Trainer

    spec = spec_of(f"TrainConfig.policy_path = '{POLICY}'", "RewardScorer.name = 'exact'",
                   "RewardScorer.by_data_source = {'dapo_src': 'dapo'}")
    tokenizer = Tokenizer.from_dir(POLICY)
    responses = [tokenizer.encode(f"Answer: {a}") for a in ("305", "7", "12")]
    groups = []
    for gid, answer, source in ((2, "305", "dapo_src"), (0, "7", "synthetic"), (1, "12", "synthetic")):
        group = Group(group_id=gid, size=3, record={"prompt": f"p{gid}", "answer": answer, "data_source": source})
        for j in (2, 0, 1):  # inserted out of uid order
            t = Trajectory(uid=10 * gid + j, group_id=gid, prompt=np.zeros(2, np.int32), seed=j, max_new_tokens=16)
            t.tokens = list(responses[j])
            group.finished[t.uid] = t
        groups.append(group)
    serving = SimpleNamespace(tokenizer=tokenizer, scorer=RewardScorer(**spec.reward), tools=None)
    try:
        scored = Trainer.score(SimpleNamespace(spec=spec, serving=serving), groups)
    finally:
        serving.scorer.close()
    assert [t.uid for t in scored.trajs] == [20, 21, 22, 0, 1, 2, 10, 11, 12]
    np.testing.assert_array_equal(scored.rewards, [1, -1, -1, 0, 1, 0, 0, 0, 1])  # dapo: -1 when wrong
    assert [r["answer"] for r in scored.records] == ["305"] * 3 + ["7"] * 3 + ["12"] * 3
    np.testing.assert_array_equal(np.sign(scored.advantages), [1, -1, -1, -1, 1, -1, -1, -1, 1])


def test_the_reward_sees_the_whole_interaction_of_a_multi_turn_trajectory():
    """score hands the reward each trajectory's record with num_turns and tool_calls in its extra_info (verl's
    count, from the trajectory's tool replies) for a tool agent's record or with multi_turn; a single-turn record is
    handed over as it is, and the records kept with the batch (checkpointed, logged) are never changed."""
    tool = _group(0, "11", {0: "c<r>1</r>11", 1: "11"})
    tool.record = {"prompt": "p0", "answer": "11", "agent_name": "tool_agent", "extra_info": {"index": 0}}
    tool.finished[0].env_spans = [(1, 9)]  # '<r>1</r>' is the tool's reply
    plain = _group(1, "22", {2: "c<r>2</r>22", 3: "21"})
    plain.finished[2].env_spans = [(1, 9)]
    decode = lambda tokens: "".join(map(chr, tokens))  # noqa: E731
    seen = _SeenScorer()
    scored = score([tool, plain], decode, seen, "grpo")
    np.testing.assert_array_equal(scored.rewards, [1, 1, 1, 0])
    assert [r.get("extra_info") for r in seen.records] == [
        {"index": 0, "num_turns": 4, "tool_calls": 1}, {"index": 0, "num_turns": 2, "tool_calls": 0},
        {"num_turns": 4, "tool_calls": 1}, None]
    assert seen.records[3] is plain.record and scored.records == [tool.record] * 2 + [plain.record] * 2
    assert tool.record["extra_info"] == {"index": 0} and "extra_info" not in plain.record
    seen = _SeenScorer()
    score([plain], decode, seen, "grpo", multi_turn=True)  # tools on for every record: all of them counted
    assert [r["extra_info"] for r in seen.records] == [{"num_turns": 4, "tool_calls": 1},
                                                        {"num_turns": 2, "tool_calls": 0}]


def test_the_spec_of_every_shipped_config_builds_and_round_trips_through_json(spec_of):
    """Every config under configs/ (the tiny ones, the tool-use ones, the real-scale ones, the phenomenon rows)
    parses into a spec, and its JSON (a workdir's spec.json) reads back, without gin, into an equal spec with the
    same resume fingerprint."""
    root = PACKAGE.parent
    seen = []
    for path in sorted((root / "configs").rglob("*.gin")):
        if path.parent.name == "sim":
            continue  # fragments included by the run configs
        gin.clear_config()
        spec_lib.parse_gin([str(path)], [])
        spec = RunSpec.from_gin()
        gin.clear_config()
        text = spec.to_json()
        back = RunSpec.from_json(text)
        assert back == spec and back.settings() == spec.settings() and back.to_json() == text, path
        assert json.loads(text)["rollout"]["mode"] == spec.rollout.mode  # plain data: the simulator reads it so
        seen.append(str(path.relative_to(root)))
    assert {"configs/qwen3_8b_dapo.gin", "configs/tiny_tool_rollverify.gin", "configs/tiny_base.gin"} <= set(seen)


def test_json_keeps_lists_apart_from_tuples_and_refuses_what_it_cannot_hold(spec_of):
    spec = spec_of("TrainConfig.train_dataset_kwargs = {'files': ['a', 'b'], 'shape': (1, 2), 'n': 8}",
                   "make_mesh.shape = (1, 2, 1)")
    back = RunSpec.from_json(spec.to_json())
    assert back == spec and back.train.train_dataset_kwargs["files"] == ["a", "b"]
    assert back.train.train_dataset_kwargs["shape"] == (1, 2) and back.mesh["shape"] == (1, 2, 1)
    assert json.loads(spec.to_json())["mesh"] == {"shape": [1, 2, 1]}  # a function part: its bindings as bound
    with pytest.raises(TypeError, match=r"train\.train_dataset_kwargs has the key 1"):
        spec_of("TrainConfig.train_dataset_kwargs = {1: 'x'}").to_json()
    plain = json.loads(spec.to_json())
    with pytest.raises(ValueError, match="RolloutConfig has no field 'modes'"):
        RunSpec.from_json({**plain, "rollout": {"modes": "partial"}})
    with pytest.raises(ValueError, match="a run spec has no part 'roll'"):
        RunSpec.from_json({**plain, "roll": {}})
    with pytest.raises(ValueError, match="not a run spec of format 1"):
        RunSpec.from_json({**plain, "format": 0})
    with pytest.raises(ValueError, match="needs partial rollout"):  # the cross-checks hold for a read spec too
        RunSpec.from_json({**plain, "filter": {**plain["filter"], "name": "staleness"}})


@pytest.mark.parametrize("params", [
    ["EvalConfig.temperature = 0.3", "TrainConfig.eval_size = 3"],
    ["SamplingConfig.temperature = 0.5", "RolloutConfig.max_new_tokens = 100", "make_mesh.shape = (1, 1, 1)"],
])
def test_bindings_on_a_read_spec_are_the_bindings_on_its_gin(params):
    """``evaluate --checkpoint=RUN --gin_param=...`` binds on top of RUN's spec.json: the same spec as the run's gin
    with those bindings, derived values (the learner's temperature, the response cap) derived again."""
    spec_lib.parse_gin(["configs/tiny_rollverify.gin"], [])
    saved = RunSpec.from_json(RunSpec.from_gin().to_json())
    bound = saved.with_bindings(params)
    spec_lib.parse_gin(["configs/tiny_rollverify.gin"], params)
    want = RunSpec.from_gin()
    gin.clear_config()
    assert dataclasses.replace(bound, gin_text="") == dataclasses.replace(want, gin_text="")
    assert bound.settings() == want.settings() and saved.with_bindings([]) is saved
    with pytest.raises(ValueError, match="make_mesh.devices is set by the code"):
        saved.with_bindings(["make_mesh.devices = 2"])


def test_eval_sets_are_checked_and_a_synthetic_one_is_held_out_by_default(spec_of):
    spec = spec_of("TrainConfig.eval_sets = {'more': {'name': 'synthetic', 'n': 8, 'size': 3, 'k': 2}}")
    assert spec.eval_set_kwargs("more") == ("synthetic", {**spec.synthetic_task, "split": "test", "n": 8}, 3)
    for bad, message in [("{'a/b': {'name': 'synthetic'}}", "set name 'a/b' must be"),
                         ("{'x': {'path': 'f.parquet'}}", r"must be a dict with the dataset's 'name'"),
                         ("{'x': {'name': 'synthetic', 'k': 0}}", r"\['k'\]=0 must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            spec_of(f"TrainConfig.eval_sets = {bad}")
