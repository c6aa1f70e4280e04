"""A resume compares what the run reads, not only its settings: the train data's content and the tokenizer."""

import json
import re
from pathlib import Path

import pytest
from shared import run_params

from rollverify_jax import train
from rollverify_jax.data.datasets import load_synthetic, records_fingerprint
from rollverify_jax.data.synthetic import char_vocabulary
from rollverify_jax.models import Tokenizer, build_char_tokenizer
from rollverify_jax.run.metrics import read_metrics


def _write_data(path: Path, seed: int) -> Path:
    """The synthetic task's train prompts as an AIME-style JSONL file (read without DAPO's template)."""
    rows = load_synthetic(n=64, seed=seed, split="train", max_steps=6)
    path.write_text("".join(json.dumps({"problem": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    return path


def _run(workdir: Path, policy_dir: Path, data: Path, steps: int, *extra: str) -> None:
    params = run_params(policy_dir, "rollverify", steps, ("TrainConfig.train_dataset = 'aime_jsonl'",
                                                   f"TrainConfig.train_dataset_kwargs = {{'path': '{data}', "
                                                   "'apply_template': False}", "EvalConfig.at_start = False"))
    train.main([f"--workdir={workdir}", *[f"--gin_param={p}" for p in params], *extra])


def _refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _run(*args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err


# Two launches of the tiny run (the test_train.py programs): started first under xdist, compiled once through
# the session's compilation cache (conftest.py).
@pytest.mark.end_to_end
@pytest.mark.usefixtures("compilation_cache")
def test_a_data_file_edited_in_place_or_another_tokenizer_is_refused_on_resume(policy, tmp_path, capsys):  # noqa: F811
    """The data file is rewritten with other prompts, same row count: the resume used to continue on them in
    silence; now it is refused (exit 2, nothing trained) naming the data's hash, and so is a tokenizer with other
    ids; --allow_changed_settings continues."""
    data = _write_data(tmp_path / "train.jsonl", seed=0)
    workdir = tmp_path / "run"
    _run(workdir, policy, data, 1)
    rows = len(data.read_text().splitlines())
    _write_data(data, seed=1)
    assert len(data.read_text().splitlines()) == rows
    err = _refused(capsys, workdir, policy, data, 2)
    assert re.search(r"data\.train_sha256: checkpoint '[0-9a-f]{64}', now '[0-9a-f]{64}'", err), err
    assert "data.train_records" not in err and [m["step"] for m in read_metrics(workdir)] == [1]

    _write_data(data, seed=0)  # the data back as it was; the characters' ids permuted
    other = tmp_path / "tokenizer"
    build_char_tokenizer(char_vocabulary()[::-1], ["<|endoftext|>", "<pad>"], other, eos_tokens=["<|endoftext|>"],
                         pad_token="<pad>")
    err = _refused(capsys, workdir, policy, data, 2, f"--gin_param=TrainConfig.tokenizer_path = '{other}'")
    assert "tokenizer.sha256: checkpoint" in err and "data.train_sha256" not in err, err

    _write_data(data, seed=1)
    _run(workdir, policy, data, 2, "--allow_changed_settings")
    assert "resuming with changed settings" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(workdir)] == [1, 2]


def test_fingerprints_follow_content_not_names(tmp_path, policy):  # noqa: F811
    records = load_synthetic(n=8, seed=0, split="train", max_steps=6)
    same = [dict(r) for r in records]
    edited = [*records[:-1], {**records[-1], "answer": records[-1]["answer"] + "0"}]
    assert records_fingerprint(records) == records_fingerprint(same)
    assert records_fingerprint(edited)["records"] == 8 and records_fingerprint(edited) != records_fingerprint(records)
    assert records_fingerprint(records[::-1]) != records_fingerprint(records)  # the order is the run's order
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in policy.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert Tokenizer.from_dir(policy).fingerprint() == Tokenizer.from_dir(copy).fingerprint()
    other = build_char_tokenizer(char_vocabulary()[::-1], ["<|endoftext|>", "<pad>"], tmp_path / "o",
                                 eos_tokens=["<|endoftext|>"], pad_token="<pad>")
    assert other.fingerprint() != Tokenizer.from_dir(policy).fingerprint()
