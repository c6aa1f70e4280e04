"""The shape plan: a run's programs are known before it starts, and a run compiles nothing outside them."""

import pytest

from rollverify_jax import schedule_rules, train
from rollverify_jax.rollout import engine as engine_lib
from rollverify_jax.run import builder, shape_plan
from rollverify_jax.run.programs import logprob_pass_users, plan_for
from rollverify_jax.run.spec import RunSpec, parse_gin


def test_ladders_are_finite_and_end_at_their_cap():
    assert schedule_rules.ladder(32, 320, 4) == [32, 128, 320]
    assert schedule_rules.ladder(1, 64, 4) == [1, 4, 16, 64]
    assert schedule_rules.prefill_rows(2048, 256, 4 * 22528, 4) == [1, 4, 16, 44]
    assert schedule_rules.live_slot_buckets(64, True, 4) == [16, 64]
    assert schedule_rules.live_page_buckets(20, True, 4) == [5, 20]
    with pytest.raises(ValueError, match="ratio"):
        schedule_rules.ladder(1, 8, 1)


def test_compile_log_names_each_program_once_and_check_flags_unplanned_ones():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def twice(x):
        return 2 * x
    three, four = jnp.ones(3), jnp.ones(4)
    with shape_plan.CompileLog() as log:
        twice.lower(three).compile()
        twice(three)  # compiled ahead: not compiled again
        twice(four)
    assert log.names == ["twice", "twice"] and all(s >= 0 for s in log.seconds)
    plan = shape_plan.ShapePlan((shape_plan.PlannedProgram("x", "twice"),))
    assert plan.check(log.names) == ["twice: compiled 2 programs, the plan has 1"]
    assert plan.check(["twice"]) == []


@pytest.mark.parametrize("config, most", [("qwen3_8b_dapo", 40), ("qwen3_8b_64k_dapo", 40)])
def test_real_configs_plan_at_most_40_programs(config, most):
    """Every program of a real config, one-time setup included, from the spec alone (deviceless)."""
    parse_gin([f"configs/{config}.gin"], [])
    plan = plan_for(RunSpec.from_gin())[0]
    assert len(plan) + sum(shape_plan.SETUP.values()) <= most
    assert {p.family for p in plan.programs} >= {"prefill", "decode", "verify", "train_step"}


@pytest.mark.end_to_end
@pytest.mark.parametrize("config, groups, warmup", [("tiny_rollverify", 16, "1"), ("tiny_tool_rollverify", 4, "0")])
def test_a_run_compiles_only_planned_programs(config, groups, warmup, tmp_path, monkeypatch):
    """The tiny default and the tool config train (2 steps: the second resumes and verifies; smaller batches)
    with JAX's compile log on: every compiled program is in the plan (by name and count), every engine dispatch
    ran one of the plan's buckets, and the run compiled at most 30 programs. The default compiles its plan ahead
    (the run then compiles none of it again); the tool config compiles each program at first use."""
    monkeypatch.setenv("ROLLVERIFY_WARMUP", warmup)
    engines, trainers = [], []
    opened, built = engine_lib.Engine._open, builder.build_trainer
    monkeypatch.setattr(engine_lib.Engine, "_open", lambda self, *a: (engines.append(self), opened(self, *a))[1])
    monkeypatch.setattr(builder, "build_trainer", lambda *a, **k: (trainers.append(built(*a, **k)), trainers[-1])[1])
    args = [f"--gin_file=configs/{config}.gin", f"--workdir={tmp_path}", "--gin_param=TrainConfig.num_steps=2",
            f"--gin_param=RolloutConfig.batch_groups={groups}", "--gin_param=TrainConfig.eval_size=4",
            "--gin_param=EvalConfig.at_start=False",
            "--gin_param=TrainConfig.time_budget_s=0"]
    with shape_plan.CompileLog() as log:
        train.main(args)
    spec = RunSpec.from_json((tmp_path / "spec.json").read_text())
    (engine,) = engines
    plan = shape_plan.plan_run(spec, engine.plan, spec.eval.sampling(spec.sampling), trainers[0].train_state,
                               logprob_pass_users(spec))
    assert plan.check(log.names) == [], log.counts()
    planned = {(p.family.removeprefix("eval_"), tuple(v for _, v in p.dims)) for p in plan.programs}
    assert engine.dispatched <= planned, engine.dispatched - planned
    assert len(log.names) <= 30


def test_tpu_decode_buckets_are_whole_kernel_blocks():
    """The Pallas TPU kernel reads whole blocks of pages_per_compute_block pages: every live page bucket of a TPU
    plan is a multiple of it (the 8B's 352-page table: 8, 24, 88, 352 instead of 6, 22, 88, 352)."""
    parse_gin(["configs/qwen3_8b_dapo.gin"], [])
    plan = plan_for(RunSpec.from_gin())[0]
    pages = [dict(p.dims)["pages"] for p in plan.of("decode")]
    assert pages and all(p % 4 == 0 for p in pages) and max(pages) == 352
