"""Helpers more than one test module uses (the fixtures are in conftest.py): the tiny run's gin bindings, the
train CLI on them and the state it ends with, a checkpoint of the shipped tiny policy with its params moved, and
the verifier's plain-Python reference."""

import json
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollverify_jax import train
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import load_pretrained
from rollverify_jax.rl import learner as learner_lib
from rollverify_jax.run import builder, run_dir
from rollverify_jax.run.checkpoint import CheckpointConfig, Checkpointer
from rollverify_jax.run.metrics import read_metrics
from rollverify_jax.run.spec import RunSpec, parse_gin

POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"


def run_params(policy, mode, steps, extra=()):
    """The gin bindings of a tiny training run of ``policy`` (the ``policy`` fixture) in ``mode``."""
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


def train_run(policy, workdir: Path, mode: str, steps: int, extra=()) -> list[dict]:
    """Runs the train CLI on ``run_params(policy, mode, steps, extra)`` in ``workdir``; returns its metrics rows."""
    train.main([f"--workdir={workdir}", *[f"--gin_param={p}" for p in run_params(policy, mode, steps, extra)]])
    return read_metrics(workdir / "metrics.jsonl")


def final_state(workdir: Path, policy, step: int | None = None):
    """Checkpoint ``step`` (default: the latest) of a run of ``policy``: (step, the train state's leaves, the extra
    state)."""
    fingerprint = builder.model_fingerprint(load_pretrained(policy))
    with Checkpointer(workdir, CheckpointConfig(async_save=False), model_fingerprint=fingerprint) as ckpt:
        step, state, extra = ckpt.restore(step)
    return step, jax.tree.leaves(state), extra


def make_checkpoint(workdir: Path, step: int, optimizer=None, scale: float = 0.004):
    """A run's checkpoint of the tiny policy with its params moved away from the policy's (so a test that
    reads the initial weights instead fails); returns those params."""
    model = load_pretrained(POLICY)
    optimizer = optimizer or learner_lib.make_optimizer(learner_lib.OptimizerConfig())
    state = learner_lib.init_train_state(model, optimizer, mesh_lib.make_mesh())
    rng = np.random.default_rng(step)
    params = jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(x.dtype), state.params)
    with Checkpointer(workdir, CheckpointConfig(async_save=False),
                      model_fingerprint=builder.model_fingerprint(model)) as ckpt:
        ckpt.save(step, state.replace(params=params), {"settings": {"policy_path": str(POLICY)}}, force=True)
    parse_gin([], [f"TrainConfig.policy_path = '{POLICY}'"])
    run_dir.write_spec(workdir, RunSpec.from_gin())  # the run's spec.json, as training writes it
    return params


def reference_keep(ops_row, versions_row, n, ds, dt):
    """The two-stage rule (docs/method.md) in plain Python, one trajectory. Returns (keep, segment means
    examined)."""
    keep1, means, t = n, [], 0
    while t < n:
        s = t
        while t < n and versions_row[t] == versions_row[s]:
            t += 1
        mean = sum(float(x) for x in ops_row[s:t]) / (t - s)
        means.append(mean)
        if mean >= ds:
            keep1 = s
            break
    for t in range(keep1):
        if ops_row[t] >= dt:
            return t, means
    return keep1, means


def dry_run_on_small_files(gin_file, tmp_path, capsys) -> tuple[dict, str]:
    """``train --dry_run`` of a real config on a 4-record DAPO JSONL train set and a 1-record AIME parquet eval set
    written under ``tmp_path``: (the JSON report, the whole output)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "reward_model": {"ground_truth": str(i)}}
            for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{"problem": "1 + 1?", "answer": "2"}]), tmp_path / "eval.parquet")
    params = ["TrainConfig.train_dataset = 'dapo_jsonl'",
              f"TrainConfig.train_dataset_kwargs = {{'path': '{tmp_path / 'train.jsonl'}'}}",
              "TrainConfig.eval_dataset = 'aime_parquet'",
              f"TrainConfig.eval_dataset_kwargs = {{'path': '{tmp_path / 'eval.parquet'}'}}"]
    train.main(["--dry_run", f"--gin_file={gin_file}", *[f"--gin_param={p}" for p in params]])
    out = capsys.readouterr().out
    return json.loads(out.split("dry run OK: ", 1)[1].splitlines()[0]), out
