"""The main job end to end on a small random policy: metrics, configs, checkpoints, exact resume."""

import gin
import numpy as np
import pytest

from rollverify_jax import evaluate, train
from rollverify_jax.data.synthetic import char_vocabulary
from rollverify_jax.metrics import read_metrics
from rollverify_jax.models import build_char_tokenizer, init_model, model_config, save_pretrained

DESIGN_KEYS = {"step", "time/wall", "time/rollout", "time/verify", "time/train", "rollout/tokens_per_s",
               "rollout/slot_utilization", "reward/mean", "policy/entropy", "ops/token_mean", "verify/acceptance",
               "verify/acceptance_window", "mode/on_policy", "response/length_mean", "response/length_max"}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tok = build_char_tokenizer(char_vocabulary(), ["<|endoftext|>", "<pad>"], path, eos_tokens=["<|endoftext|>"],
                               pad_token="<pad>")
    vocab = -(-tok.vocab_size // 8) * 8
    save_pretrained(init_model(model_config("tiny", vocab_size=vocab, num_hidden_layers=2), seed=3), path)
    return path


def _params(policy, mode, steps, extra=()):
    return [f"TrainConfig.policy_path = '{policy}'", f"TrainConfig.num_steps = {steps}",
            "TrainConfig.train_dataset_kwargs = {'n': 256, 'split': 'train', 'max_steps': 6}",
            "TrainConfig.eval_dataset_kwargs = {'n': 8, 'split': 'test', 'max_steps': 6}",
            "TrainConfig.eval_size = 4", "TrainConfig.eval_samples = 2", "TrainConfig.eval_every = 2",
            "TrainConfig.metrics_tensorboard = True", "RewardScorer.name = 'exact'",
            f"RolloutConfig.mode = '{mode}'", "RolloutConfig.batch_groups = 2", "RolloutConfig.group_size = 4",
            "RolloutConfig.max_new_tokens = 24", "EngineConfig.num_slots = 16", "EngineConfig.page_size = 8",
            "EngineConfig.max_seq_len = 64", "EngineConfig.steps_per_dispatch = 4",
            "OptimizerConfig.learning_rate = 3e-3", "CheckpointConfig.save_interval_steps = 1",
            "CheckpointConfig.async_save = False", *extra]


def _train(policy, workdir, mode, steps, extra=()):
    gin.clear_config()
    try:
        train.main([f"--workdir={workdir}", *[f"--gin_param={p}" for p in _params(policy, mode, steps, extra)]])
    finally:
        gin.clear_config()
    return read_metrics(workdir / "metrics.jsonl")


def test_run_writes_metrics_config_and_checkpoints(policy, tmp_path, capsys):
    metrics = _train(policy, tmp_path / "run", "rollverify", 2)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        assert DESIGN_KEYS <= set(m), DESIGN_KEYS - set(m)
        assert m["mode/on_policy"] == 0 and 0 <= m["rollout/slot_utilization"] <= 1
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]
    assert metrics[-1]["learning_rate"] == pytest.approx(3e-3)  # gin bindings reach the optimizer
    assert "RolloutConfig.mode = 'rollverify'" in (tmp_path / "run" / "operative_config.gin").read_text()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))
    capsys.readouterr()
    gin.clear_config()
    try:
        evaluate.main([f"--checkpoint={tmp_path / 'run'}", "--k=2",
                       *[f"--gin_param={p}" for p in _params(policy, "rollverify", 2)]])
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    assert "avg@2 = " in out and "pass@2 = " in out and "4 problems x 2 samples" in out


def test_uniform_groups_leave_the_loss(policy, tmp_path):
    """The random policy never answers right: every group is uniform, so with the DAPO group filter nothing is
    left to train on (and the packed step, which skips those rows, still runs)."""
    metrics = _train(policy, tmp_path / "run", "on_policy", 1, ["TrainConfig.skip_uniform_groups = True"])
    m = metrics[1]
    assert m["reward/uniform_group_fraction"] == 1.0
    assert m["filter/kept_fraction"] == 0.0 and m["train/loss_tokens"] == 0.0 and m["loss"] == 0.0


def test_resumed_run_equals_uninterrupted_run(policy, tmp_path):
    """Stop after a checkpoint taken while trajectories were paused; the resumed steps equal an uninterrupted run."""
    full = _train(policy, tmp_path / "full", "rollverify", 4)
    _train(policy, tmp_path / "split", "rollverify", 2)
    resumed = _train(policy, tmp_path / "split", "rollverify", 4)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]  # no duplicated lines after the resume
    keys = ["reward/mean", "loss", "ops/token_mean", "verify/acceptance", "response/length_mean", "cache/size"]
    for a, b in zip(full[3:], resumed[3:], strict=True):
        for k in keys:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-5, err_msg=f"step {a['step']} {k}")


def test_paused_cache_survives_checkpoint_exactly(policy, tmp_path):
    gin.clear_config()
    try:
        train.parse_gin([], _params(policy, "rollverify", 3))
        cfg = train.TrainConfig()
        run = train.build(cfg, workdir=tmp_path, for_training=True)
        for _ in range(2):
            train.train_one_step(run)
        cache = run.manager.cache
        assert len(cache.paused) > 0 and any(t.num_tokens for t in cache.paused)
        run.checkpointer.save(run.step, run.train_state, train._checkpoint_extra(run, 1.0), force=True)
        run.close()
        back = train.build(cfg, workdir=tmp_path, for_training=True)
        assert back.step == 2 and back.engine.version == 2
        before = {t.uid: t for t in cache.paused}
        after = {t.uid: t for t in back.manager.cache.paused}
        assert sorted(before) == sorted(after)
        for uid, t in before.items():
            u = after[uid]
            assert u.tokens == t.tokens and u.logps == t.logps and u.versions == t.versions
        assert back.switch_state == run.switch_state
        assert back.iterator.get_state() == run.iterator.get_state()
        back.close()
    finally:
        gin.clear_config()


@pytest.mark.parametrize("param, match", [
    ("RolloutConfig.mode = 'sync'", "known modes"),
    ("LearnerConfig.loss_name = 'ppo2'", "known"),
    ("TrainConfig.train_dataset = 'nope'", "known datasets"),
])
def test_bad_configuration_fails_at_start(policy, tmp_path, param, match):
    with pytest.raises(ValueError, match=match):
        _train(policy, tmp_path / "bad", "on_policy", 1, extra=(param,))
    assert not (tmp_path / "bad").exists()
