"""rollverify_jax.data.prepare: DAPO-Math-17k and AIME downloads in their public schemas become files the project's
loaders read back; bad inputs end with one ``error:`` line and exit status 2, leaving no partial output."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollverify_jax.data import prepare as prepare_lib
from rollverify_jax.data.datasets import DAPO_TEMPLATE, PromptIterator, apply_dapo_template, get_dataset, load_tfds


def prepare(*argv) -> None:
    prepare_lib.main([str(a) for a in argv])


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dapo_rows(n: int, repeats: int) -> list[dict]:
    """DAPO-Math-17k's layout: templated chat prompts, each problem repeated ``repeats`` times."""
    return [{"data_source": "math_dapo",
             "prompt": [{"role": "user", "content": apply_dapo_template(f"What is {i} + {i}?")}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": f"id-{i}-{r}"}} for r in range(repeats) for i in range(n)]


def templated(problem: str, answer: str, data_source: str | None = "aime") -> dict:
    """A record of the DAPO (``data_source="math_dapo"``) or AIME loaders; None: a TFDS build's (prompt/answer)."""
    source = {} if data_source is None else {"data_source": data_source}
    return {"prompt": DAPO_TEMPLATE.replace("{problem}", problem), "answer": answer, **source}


def test_dapo_parquet_is_deduplicated_and_reads_back(tmp_path, capsys):
    source = write_parquet(tmp_path / "dapo-math-17k.parquet", dapo_rows(5, repeats=3))
    out = tmp_path / "data" / "dapo.parquet"
    prepare(source, "--output", out)
    expected = [templated(f"What is {i} + {i}?", str(2 * i), "math_dapo") for i in range(5)]
    assert get_dataset("dapo_parquet", path=str(out)) == expected
    row = pq.read_table(out).to_pylist()[1]
    assert row["reward_model"] == {"ground_truth": "2", "style": "rule"} and row["extra_info"] == {"index": "id-1-0"}
    report = capsys.readouterr().out
    assert "5 dapo problems from 15 rows" in report and "10 duplicate prompts dropped" in report
    assert f"TrainConfig.train_dataset_kwargs = {{'path': '{out}'}}" in report
    assert [p.name for p in out.parent.iterdir()] == ["dapo.parquet"]  # no temporary file left


def test_dapo_jsonl_string_prompts_keep_duplicates(tmp_path):
    rows = [{"prompt": "Find x.", "reward_model": {"ground_truth": 7}}] * 2
    out = tmp_path / "dapo.jsonl"
    prepare(write_jsonl(tmp_path / "in.jsonl", rows), "--output", out, "--keep_duplicates")
    assert get_dataset("dapo_jsonl", path=str(out)) == [templated("Find x.", "7", "math_dapo")] * 2
    assert json.loads(out.read_text().splitlines()[0])["prompt"] == [{"role": "user", "content": "Find x."}]


def test_aime_2024_hf_layout_to_jsonl(tmp_path):
    """HuggingFaceH4/aime_2024: id, problem, solution, answer, url, year; the answer column wins."""
    rows = [{"id": 60 + i, "problem": f"Find {i}.", "solution": f"So \\boxed{{99{i}}}.", "answer": f"00{i}",
             "url": "https://example.org", "year": "2024"} for i in range(3)]
    out = tmp_path / "aime-2024.jsonl"
    prepare(write_parquet(tmp_path / "train-00000-of-00001.parquet", rows), "--output", out)
    assert get_dataset("aime_jsonl", path=str(out)) == [templated(f"Find {i}.", str(i)) for i in range(3)]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["60", "61", "62"]


def test_aime_2025_two_jsonl_files_question_column_to_parquet(tmp_path):
    part1 = write_jsonl(tmp_path / "aime2025-I.jsonl", [{"question": "Q1", "answer": 70}])
    part2 = write_jsonl(tmp_path / "aime2025-II.jsonl", [{"question": "Q2", "answer": "588"}])
    out = tmp_path / "aime-2025.parquet"
    prepare(part1, part2, "--output", out)
    assert get_dataset("aime_parquet", path=str(out)) == [templated("Q1", "70"), templated("Q2", "588")]


def test_aime_capitalised_columns_json_list_in_a_directory(tmp_path):
    (tmp_path / "download").mkdir()
    (tmp_path / "download" / "aime.json").write_text(json.dumps([{"Problem": "P", "Answer": 33.0}]))
    out = tmp_path / "aime.jsonl"
    prepare(tmp_path / "download", "--output", out)
    assert get_dataset("aime_jsonl", path=str(out)) == [templated("P", "33")]


def test_aime_solution_column_gives_its_boxed_answer(tmp_path):
    rows = [{"problem": "P", "solution": "Work. Hence \\boxed{\\frac{1}{2}}."}, {"problem": "Q", "solution": "042"}]
    out = tmp_path / "aime.jsonl"
    prepare(write_jsonl(tmp_path / "in.jsonl", rows), "--output", out)
    assert [r["answer"] for r in get_dataset("aime_jsonl", path=str(out))] == ["\\frac{1}{2}", "42"]


def test_named_columns(tmp_path):
    rows = [{"text": "P", "label": "5"}]
    out = tmp_path / "aime.jsonl"
    prepare(write_jsonl(tmp_path / "in.jsonl", rows), "--output", out, "--kind", "aime",
            "--problem_column", "text", "--answer_column", "label")
    assert get_dataset("aime_jsonl", path=str(out)) == [templated("P", "5")]


def test_gsm8k_gold_answer_is_what_follows_the_hashes(tmp_path, capsys):
    """openai/gsm8k (question, answer = a worked solution ending in '#### 1,234') used to convert, exit 0, as an AIME
    set whose gold answer was the whole solution (every reward 0); now it is told apart by its '####' line, every
    row's gold answer is extracted as the gsm8k loaders extract it, and a row without one is one error line."""
    rows = [{"question": "How many?", "answer": "1,000 + 234 = <<1000+234=1234>>1,234\n#### 1,234"},
            {"question": "And now?", "answer": "2 * 3 = 6\n#### 6"}]
    out = tmp_path / "gsm8k-train.parquet"
    prepare(write_parquet(tmp_path / "train-00000-of-00001.parquet", rows), "--output", out)
    assert [r["answer"] for r in get_dataset("gsm8k_parquet", path=str(out))] == ["1234", "6"]
    assert "TrainConfig.train_dataset = 'gsm8k_parquet'" in capsys.readouterr().out
    rows.append({"question": "Broken?", "answer": "a solution that lost its final line"})
    source = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    err = fails(capsys, source, "--output", tmp_path / "o.jsonl")
    assert "gsm8k.jsonl: row 2: cannot extract the gold answer from field 'answer'" in err and "####" in err
    err = fails(capsys, write_jsonl(tmp_path / "mixed.jsonl", rows[2:] + rows[:1]), "--kind", "aime",
                "--output", tmp_path / "o.jsonl")
    assert "mixed.jsonl: row 1: column 'answer' holds a worked solution" in err and "--kind gsm8k" in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.fixture
def tfds_tmp(tmp_path, monkeypatch):
    """TFDS makes a scratch dir per fresh builder; keep it under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_array_record_build_reads_through_grain(tmp_path, tfds_tmp, capsys):
    source = write_parquet(tmp_path / "dapo.parquet", dapo_rows(4, repeats=2))
    data_dir = tmp_path / "tfds"
    prepare(source, "--output", data_dir, "--format", "array_record")
    records = get_dataset("tfds", data_dir=str(data_dir), config_name="dapo")
    assert isinstance(records, grain.MapDataset) and len(records) == 4
    expected = [templated(f"What is {i} + {i}?", str(2 * i), None) for i in range(4)]
    assert sorted((records[i] for i in range(4)), key=lambda r: int(r["answer"])) == expected
    assert len(PromptIterator(records, batch_size=3).next_batch()) == 3
    assert "TrainConfig.train_dataset = 'tfds'" in capsys.readouterr().out
    # A second build of the same name replaces the first; no scratch directory is left behind.
    prepare(write_parquet(tmp_path / "dapo2.parquet", dapo_rows(2, repeats=1)), "--output", data_dir,
            "--format", "array_record")
    assert len(load_tfds(str(data_dir), config_name="dapo")) == 2
    assert [p.name for p in data_dir.iterdir()] == ["math_prompts"]


# -- errors ---------------------------------------------------------------------------------------------------


def fails(capsys, *argv) -> str:
    """Runs the script expecting exit status 2 and one ``error:`` line on stderr; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        prepare(*argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_unknown_schema(tmp_path, capsys):
    source = write_jsonl(tmp_path / "other.jsonl", [{"text": "x", "label": 1}])
    err = fails(capsys, source, "--output", tmp_path / "out.jsonl")
    assert "other.jsonl: unknown schema with columns ['text', 'label']" in err and "--problem_column" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_columns(tmp_path, capsys):
    aime = write_parquet(tmp_path / "aime.parquet", [{"problem": "P", "answer": "1"}])
    err = fails(capsys, aime, "--kind", "dapo", "--output", tmp_path / "out.jsonl")
    assert "aime.parquet: missing column(s) ['prompt', 'reward_model'] for DAPO-Math-17k" in err
    err = fails(capsys, aime, "--answer_column", "Answer", "--output", tmp_path / "out.jsonl")
    assert "missing the answer column (Answer;" in err and "--answer_column" in err


def test_missing_file_and_bad_rows(tmp_path, capsys):
    assert "input file not found: " in fails(capsys, tmp_path / "nope.parquet", "--output", tmp_path / "o.jsonl")
    rows = [{"prompt": "p", "reward_model": {"ground_truth": "1"}}, {"prompt": "q", "reward_model": {"style": "r"}}]
    err = fails(capsys, write_jsonl(tmp_path / "dapo.jsonl", rows), "--output", tmp_path / "o.jsonl")
    assert "dapo.jsonl: row 1: missing field 'reward_model.ground_truth'" in err
    no_box = write_jsonl(tmp_path / "sol.jsonl", [{"problem": "P", "solution": "no final answer"}])
    assert "no \\boxed{...} answer in column 'solution'" in fails(capsys, no_box, "--output", tmp_path / "o.jsonl")
    null = write_parquet(tmp_path / "null.parquet", [{"problem": "P", "answer": "1"}, {"problem": None, "answer": "2"}])
    assert "null.parquet: row 1: column 'problem' must be" in fails(capsys, null, "--output", tmp_path / "o.jsonl")
    assert "cannot tell the output format" in fails(capsys, null, "--output", tmp_path / "o.txt")
    assert not (tmp_path / "o.jsonl").exists()


def test_a_failed_write_keeps_the_previous_output(tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "aime.jsonl", [{"problem": "P", "answer": "1"}])
    out = tmp_path / "aime-out.jsonl"
    out.write_text("previous\n")

    def unreadable(*args, **kwargs):
        raise ValueError("read-back failed")

    monkeypatch.setattr(prepare_lib.datasets, "get_dataset", unreadable)
    assert "read-back failed" in fails(capsys, source, "--output", out)
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aime-out.jsonl", "aime.jsonl"]


@pytest.mark.parametrize("flag, name", [("--config_name", "ABS"), ("--config_name", ".."), ("--config_name", "a/../b"),
                                        ("--config_name", "."), ("--split", "../train")])
def test_a_build_name_never_escapes_the_output_directory(tmp_path, tfds_tmp, capsys, flag, name):
    """An absolute --config_name (or one with '..') used to move the directory it named into the scratch
    directory and delete it; now one line, exit 2, before any input is read."""
    victim = tmp_path / "victim"
    (victim / "1.0.0").mkdir(parents=True)
    (victim / "1.0.0" / "keep.txt").write_text("mine")
    source = write_parquet(tmp_path / "dapo.parquet", dapo_rows(2, repeats=1))
    name = str(victim) if name == "ABS" else name
    err = fails(capsys, source, "--output", tmp_path / "tfds", "--format", "array_record", flag, name)
    assert f"{flag}={name!r} must be a plain name" in err
    assert (victim / "1.0.0" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dapo.parquet", "victim"]


def test_a_failed_swap_puts_the_previous_build_back(tmp_path, tfds_tmp, capsys, monkeypatch):
    """The rename of a new build into place fails: the previous build (moved aside first) is back under its name
    and still loads; no scratch directory is left."""
    script = prepare_lib
    data_dir = tmp_path / "tfds"
    prepare(write_parquet(tmp_path / "dapo.parquet", dapo_rows(4, repeats=1)), "--output", data_dir,
            "--format", "array_record")
    capsys.readouterr()
    real = os.replace

    def replace(src, dst):
        if Path(src).parent.name == "math_prompts" and Path(src).parent.parent.name == "build":
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(script.os, "replace", replace)
    with pytest.raises(SystemExit) as exit_info:  # (TFDS's progress bars go to stderr too)
        prepare(write_parquet(tmp_path / "dapo2.parquet", dapo_rows(2, repeats=1)), "--output", data_dir,
                "--format", "array_record")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: [Errno 28] No space left on device" in err and "Traceback" not in err
    monkeypatch.undo()
    assert len(load_tfds(str(data_dir), config_name="dapo")) == 4
    assert [p.name for p in data_dir.iterdir()] == ["math_prompts"]


def test_outputs_are_on_the_disk_before_their_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    script = prepare_lib
    monkeypatch.setattr(script.os, "replace", lambda s, d: (renamed.append((len(synced), s)), real_replace(s, d)))
    prepare(write_jsonl(tmp_path / "aime.jsonl", [{"problem": "P", "answer": "1"}]), "--output", tmp_path / "o.jsonl")
    (count, src), = renamed
    assert any(p == str(src) for p in synced[:count]), (synced, renamed)


def verl_rows() -> list[dict]:
    """A verl RL file (the layout of tests/test_datasets.py's verl files): a system message, earlier tool turns,
    extra_info beyond an index (tools_kwargs), agent_name, its own data_source; two rows share a prompt."""
    system = {"role": "system", "content": "Call the calculator before answering."}
    return [{"data_source": f"src_{i % 2}", "agent_name": "tool_agent" if i else None,
             "prompt": [system, {"role": "user", "content": f"What is {i % 3} + {i % 3}?"}],
             "ability": "math", "reward_model": {"ground_truth": str(2 * (i % 3)), "style": "rule"},
             "extra_info": {"index": i, "split": "train", "need_tools_kwargs": True,
                            "tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": str(2 * (i % 3))}}}}}
            for i in range(4)]


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_a_verl_file_keeps_its_fields_and_reads_back_as_the_verl_loader_reads_it(tmp_path, capsys, suffix):
    """A verl RL parquet is not DAPO-Math-17k: its system message, extra_info and agent_name are kept, every row
    (no deduplication), so the verl loader reads the converted file into the records it reads from the input."""
    source = write_parquet(tmp_path / "verl.parquet", verl_rows())
    out = tmp_path / f"out.{suffix}"
    prepare(source, "--output", out)
    expected = get_dataset("verl_parquet", path=str(source))
    assert expected[0]["messages"][0]["role"] == "system" and "tools_kwargs" in expected[0]["extra_info"]
    assert get_dataset(f"verl_{suffix}", path=str(out)) == expected
    report = capsys.readouterr().out
    assert "4 verl problems from 4 rows" in report and f"TrainConfig.train_dataset = 'verl_{suffix}'" in report
    # A DAPO-Math-17k file (one user turn, extra_info of an index only) stays DAPO, deduplicated.
    prepare(write_parquet(tmp_path / "dapo.parquet", dapo_rows(2, repeats=2)), "--output", tmp_path / "dapo.jsonl")
    assert "2 dapo problems from 4 rows" in capsys.readouterr().out


def test_a_verl_file_is_refused_where_its_fields_would_be_lost(tmp_path, tfds_tmp, capsys):
    source = write_parquet(tmp_path / "verl.parquet", verl_rows())
    err = fails(capsys, source, "--kind", "dapo", "--output", tmp_path / "o.jsonl")
    assert "verl.parquet: row 0 holds a prompt of 2 message(s) with roles ['system', 'user']" in err
    assert "extra_info keys ['need_tools_kwargs', 'split', 'tools_kwargs']" in err and "--kind verl" in err
    err = fails(capsys, source, "--output", tmp_path / "tfds", "--format", "array_record")
    assert "verl RL file" in err and "verl_parquet" in err
    dapo = write_parquet(tmp_path / "dapo.parquet", dapo_rows(2, repeats=1))
    err = fails(capsys, dapo, source, "--output", tmp_path / "o.jsonl")
    assert "verl.parquet holds verl rows but the inputs before it hold dapo rows" in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "tfds").exists()
