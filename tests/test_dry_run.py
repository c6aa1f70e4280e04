"""--dry_run opens the data, the tokenizer and the checkpoint directory a run reads, and a run drops prompts longer
than the engine's room for a prompt once at start (with a warning) instead of failing when one is admitted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollverify_jax import train
from rollverify_jax.data.prompts import PromptRenderer, load_prompts
from rollverify_jax.models import Tokenizer, build_char_tokenizer
from rollverify_jax.rollout.scheduler import validate_request
from rollverify_jax.run import builder
from rollverify_jax.run.spec import RunSpec, parse_gin

TINY = "configs/tiny_rollverify.gin"
ROOM = 320 - 200  # tiny_base.gin: EngineConfig.max_seq_len - RolloutConfig.max_new_tokens
LONG = "Start 1. " + "+1 " * 60 + "Compute."  # 192 characters: one token each for the tiny policy's tokenizer


def short(i: int) -> str:
    return f"Start {i}. +1 +2. Compute."


def write_dapo_jsonl(path: Path, prompts: list[str]) -> str:
    rows = [{"prompt": [{"role": "user", "content": p}], "reward_model": {"ground_truth": str(i)}}
            for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_aime_parquet(path: Path, problems: list[str]) -> str:
    pq.write_table(pa.Table.from_pylist([{"problem": p, "answer": str(i)} for i, p in enumerate(problems)]), path)
    return str(path)


def data_params(train_path: str, eval_path: str) -> list[str]:
    """Bindings pointing the tiny config at files (without DAPO's template: the tiny tokenizer lacks its letters)."""
    return ["TrainConfig.train_dataset = 'dapo_jsonl'",
            f"TrainConfig.train_dataset_kwargs = {{'path': '{train_path}', 'apply_template': False}}",
            "TrainConfig.eval_dataset = 'aime_parquet'",
            f"TrainConfig.eval_dataset_kwargs = {{'path': '{eval_path}', 'apply_template': False}}"]


def dry_run(capsys, params: list[str]) -> tuple[dict, str]:
    """Runs ``--dry_run`` on the tiny config; returns its report and stdout."""
    train.main(["--dry_run", f"--gin_file={TINY}", *[f"--gin_param={p}" for p in params]])
    out = capsys.readouterr().out
    return json.loads(out.split("dry run OK: ", 1)[1]), out


def dry_run_fails(capsys, params: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--dry_run", f"--gin_file={TINY}", *[f"--gin_param={p}" for p in params]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: dry run found") and "Traceback" not in err, err
    return err.splitlines()[0]


def test_tiny_config_dry_run_measures_its_data(capsys):
    report, out = dry_run(capsys, [])
    assert report["policy"] == "present" and report["architecture"] == "checkpoint assets/tiny_policy/config.json"
    train_data, eval_data = report["data"]["train"], report["data"]["eval"]
    assert train_data["records"] == 4096 and eval_data["records"] == 128
    stats = train_data["prompt_tokens"]
    assert stats["max_prompt_len"] == ROOM and stats["over_limit"] == 0 and 0 < stats["min"] <= stats["max"] <= ROOM
    assert "dry run: train data 'synthetic': 4096 prompts, schema OK; prompt tokens min" in out


def test_dry_run_counts_over_long_prompts_in_good_files(tmp_path, capsys):
    train_path = write_dapo_jsonl(tmp_path / "train.jsonl", [short(i) for i in range(6)] + [LONG])
    eval_path = write_aime_parquet(tmp_path / "eval.parquet", [short(i) for i in range(3)])
    report, out = dry_run(capsys, data_params(train_path, eval_path))
    stats = report["data"]["train"]["prompt_tokens"]
    assert report["data"]["train"]["records"] == 7 and stats["over_limit"] == 1 and stats["max"] == len(LONG)
    assert stats["min"] == len(short(0)) and report["data"]["eval"]["prompt_tokens"]["over_limit"] == 0
    assert "warning: 1 of 7 train prompts are longer than 120 tokens" in out and "drops them at start" in out


def test_dry_run_fails_on_broken_files_naming_each(tmp_path, capsys):
    no_answers = tmp_path / "train.jsonl"
    no_answers.write_text(json.dumps({"prompt": short(0), "reward_model": {"ground_truth": "1"}}) + "\n"
                          + json.dumps({"prompt": short(1)}) + "\n")
    line = dry_run_fails(capsys, data_params(str(no_answers), str(tmp_path / "missing.parquet")))
    assert line.startswith("error: dry run found 2 problem(s): (1) train data 'dapo_jsonl'")
    assert "train.jsonl: row 1 (line 2): missing field 'reward_model.ground_truth'" in line
    assert "(2) eval data 'aime_parquet'" in line and "dataset file not found" in line
    assert "rollverify_jax.data.prepare" in line
    assert "In call to configurable" not in line
    train_path = write_dapo_jsonl(tmp_path / "long.jsonl", [LONG, LONG])
    line = dry_run_fails(capsys, data_params(train_path, write_aime_parquet(tmp_path / "e.parquet", [short(1)])))
    assert "every prompt is longer than 120 tokens" in line
    line = dry_run_fails(capsys, ["TrainConfig.train_dataset_kwargs = {'n': 4, 'colour': 'red'}"])
    assert "TrainConfig.train_dataset_kwargs={'n': 4, 'colour': 'red'} do not fit the loader" in line
    # Every eval set is opened too, each named, beside the primary one.
    sets = {"good": {"name": "aime_parquet", "path": write_aime_parquet(tmp_path / "g.parquet", [short(2)]),
                     "apply_template": False},
            "gone": {"name": "aime_parquet", "path": str(tmp_path / "gone.parquet")}}
    line = dry_run_fails(capsys, [f"TrainConfig.eval_sets = {sets}"])
    assert line.startswith("error: dry run found 1 problem(s): (1) eval set 'gone' data 'aime_parquet'")
    assert "dataset file not found" in line
    del sets["gone"]
    report, out = dry_run(capsys, [f"TrainConfig.eval_sets = {sets}"])
    assert report["data"]["eval_sets"]["good"]["records"] == 1 and "eval set 'good' data 'aime_parquet'" in out


def test_missing_checkpoint_is_said_and_the_preset_labelled(tmp_path, capsys):
    missing = tmp_path / "Qwen3-8B-Base"
    report, out = dry_run(capsys, [f"TrainConfig.policy_path = '{missing}'"])
    assert f"the policy checkpoint directory '{missing}' is missing: put the policy's Hugging Face checkpoint" in out
    assert "config.json" in out and "tokenizer.json" in out and "those of the gin preset 'tiny'" in out
    assert report["policy"] == "missing" and report["architecture"] == "preset 'tiny' (checkpoint missing)"
    assert "prompt lengths are not checked" in out and "prompt_tokens" not in report["data"]["train"]
    assert report["data"]["train"]["records"] == 4096  # the data is still opened


def test_incomplete_checkpoint_or_no_tokenizer_fails_the_dry_run(tmp_path, capsys):
    shutil.copy("assets/tiny_policy/config.json", tmp_path / "config.json")
    line = dry_run_fails(capsys, [f"TrainConfig.policy_path = '{tmp_path}'"])
    assert "lacks tokenizer.json, model.safetensors or model.safetensors.index.json" in line
    line = dry_run_fails(capsys, ["TrainConfig.policy_path = None"])
    assert "TrainConfig.tokenizer_path is required when policy_path is None" in line


# -- the start-time filter ----------------------------------------------------------------------------------


def test_prompt_lengths_are_those_run_encode_makes(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = build_char_tokenizer(" +.0123456789ACSaemnoprstuwihy\n", specials, tmp_path, eos_tokens=specials[:1],
                               pad_token="<pad>")
    records = [{"prompt": p, "answer": "0"} for p in (short(1), LONG, short(1), short(22))]
    for chat in (False, True):
        renderer = PromptRenderer(tok, chat=chat)
        expected = [len(tok.encode(tok.render_prompt(r["prompt"], chat=chat))) for r in records]
        assert [len(renderer.encode(r)) for r in records] == expected
        assert renderer.lengths(records, chunk=2).tolist() == expected
    assert expected[0] > len(short(1))  # the chat template's tokens are counted


def test_load_prompts_drops_over_long_prompts_once_with_a_warning(tmp_path, capsys):
    tok = PromptRenderer(Tokenizer.from_dir("assets/tiny_policy"))
    path = write_dapo_jsonl(tmp_path / "train.jsonl", [short(0), LONG, short(2), LONG])
    kwargs = {"path": path, "apply_template": False}
    kept = load_prompts("train", "dapo_jsonl", kwargs, tok, ROOM)
    assert [r["answer"] for r in kept] == ["0", "2"]
    assert ("warning: train dataset 'dapo_jsonl': dropped 2 of 4 prompts longer than 120 tokens (the room "
            f"EngineConfig.max_seq_len - RolloutConfig.max_new_tokens leaves; the longest has {len(LONG)}); "
            "2 remain.") in capsys.readouterr().out
    assert len(load_prompts("train", "dapo_jsonl", kwargs, tok, len(LONG))) == 4
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="Every prompt of the eval dataset 'dapo_jsonl' .* is longer than 10 tokens"):
        load_prompts("eval", "dapo_jsonl", kwargs, tok, 10)


def test_a_run_starts_without_the_over_long_prompts(tmp_path, capsys):
    """build_trainer filters train and eval data, so every prompt the scheduler will see is admissible."""
    train_path = write_dapo_jsonl(tmp_path / "train.jsonl", [short(i) for i in range(5)] + [LONG] * 3)
    eval_path = write_aime_parquet(tmp_path / "eval.parquet", [LONG, short(7), short(8)])
    parse_gin([TINY], data_params(train_path, eval_path) + ["TrainConfig.eval_size = 5"])
    run = builder.build_trainer(RunSpec.from_gin(), tmp_path / "run")
    try:
        out = capsys.readouterr().out
        assert "warning: train dataset 'dapo_jsonl': dropped 3 of 8 prompts" in out
        assert "warning: eval dataset 'aime_parquet': dropped 1 of 3 prompts" in out
        eval_records = run.evaluator.sets[0].records
        assert run.iterator.num_records == 5 and [r["answer"] for r in eval_records] == ["1", "2"]
        for record in [run.iterator.next_record() for _ in range(5)] + eval_records:
            validate_request(run.serving.prompts.encode(record), 200, 320)  # what the scheduler checks on admission
    finally:
        run.close()


def test_a_mesh_with_minus_one_is_laid_on_the_devices_this_machine_has(capsys, monkeypatch):
    """The tiny config's mesh (1, -1, 1) used to be reported on 8 devices on any machine, a one-device CPU too."""
    import jax
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    report, _ = dry_run(capsys, [])
    assert report["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    report, _ = dry_run(capsys, ["make_mesh.shape = (1, 2, 2)"])  # a fixed shape: its own count
    assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}


def test_the_async_dry_run_lays_out_the_rollout_and_train_meshes(capsys):
    """configs/tiny_rollverify_async.gin on 8 devices: half of them decode on the rollout mesh (-1, 1, 1), the
    other half train on make_mesh.shape (1, -1, 1); the report states both, as training splits them."""
    train.main(["--dry_run", "--dry_run_devices=8", "--gin_file=configs/tiny_rollverify_async.gin"])
    report = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert report["mode"] == "async" and report["hosts"] == 1
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert report["rollout_devices_per_host"] == report["train_devices_per_host"] == 4
