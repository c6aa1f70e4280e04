"""Tests for rollverify_jax.data.datasets: DAPO/AIME loaders, schema errors, TFDS + grain, PromptIterator."""

import json
import tempfile

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollverify_jax.data import datasets
from rollverify_jax.data.datasets import (
    DAPO_TEMPLATE,
    DatasetSchemaError,
    PromptIterator,
    apply_dapo_template,
    build_tfds,
    get_dataset,
    load_tfds,
)

PROBLEMS = [f"What is {i} + {i}?" for i in range(12)]


def dapo_row(i: int, templated: bool = True) -> dict:
    """A DAPO-Math-17k row: chat-message prompt (already templated, as in the dataset), nested answer."""
    content = apply_dapo_template(PROBLEMS[i]) if templated else PROBLEMS[i]
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        "extra_info": {"index": str(i)},
    }


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def dapo_jsonl(tmp_path) -> str:
    return write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(i) for i in range(12)])


@pytest.fixture
def dapo_parquet(tmp_path) -> str:
    return write_parquet(tmp_path / "dapo.parquet", [dapo_row(i) for i in range(12)])


@pytest.fixture
def aime_rows() -> list[dict]:
    return [{"id": i, "problem": PROBLEMS[i], "answer": 2 * i} for i in range(12)]


def expected_records() -> list[dict[str, str]]:
    return [
        {"prompt": DAPO_TEMPLATE.replace("{problem}", PROBLEMS[i]), "answer": str(2 * i)} for i in range(12)
    ]


# -- loaders ------------------------------------------------------------------------------------------------


def test_template_is_applied_once():
    wrapped = apply_dapo_template("Find x.")
    assert wrapped.startswith("Solve the following math problem step by step.")
    assert "\n\nFind x.\n\n" in wrapped and wrapped.endswith('after "Answer:".')
    assert apply_dapo_template(wrapped) == wrapped


def test_dapo_jsonl_and_parquet(dapo_jsonl, dapo_parquet):
    assert get_dataset("dapo_jsonl", path=dapo_jsonl) == expected_records()
    assert get_dataset("dapo_parquet", path=dapo_parquet) == expected_records()


def test_dapo_string_prompt_without_template_gets_it(tmp_path):
    rows = [{"prompt": PROBLEMS[i], "reward_model": {"ground_truth": 2 * i}} for i in range(12)]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    assert get_dataset("dapo_jsonl", path=path) == expected_records()
    raw = get_dataset("dapo_jsonl", path=path, apply_template=False)
    assert raw[3] == {"prompt": PROBLEMS[3], "answer": "6"}


def test_chat_prompt_takes_the_last_user_message(tmp_path):
    """A multi-turn prompt (system, user, assistant, user): the problem is the last user message."""
    row = dapo_row(3)
    row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 9 + 9?"},
                     {"role": "assistant", "content": "18"}, row["prompt"][0]]
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    assert get_dataset("dapo_jsonl", path=path) == [expected_records()[3]]


def test_aime_jsonl_and_parquet(tmp_path, aime_rows):
    jsonl = write_jsonl(tmp_path / "aime.jsonl", aime_rows)
    parquet = write_parquet(tmp_path / "aime.parquet", aime_rows)
    assert get_dataset("aime_jsonl", path=jsonl) == expected_records()
    assert get_dataset("aime_parquet", path=parquet) == expected_records()


def test_deduplicate_and_max_rows(tmp_path):
    rows = [dapo_row(i % 3) for i in range(9)]
    path = write_parquet(tmp_path / "dup.parquet", rows)
    unique = get_dataset("dapo_parquet", path=path, deduplicate=True)
    assert [r["answer"] for r in unique] == ["0", "2", "4"]
    assert len(get_dataset("dapo_parquet", path=path, max_rows=5)) == 5


def test_synthetic_through_the_registry():
    records = get_dataset("synthetic", n=20, seed=1, split="test")
    assert len(records) == 20 and set(records[0]) == {"prompt", "answer"}
    assert records == get_dataset("synthetic", n=20, seed=1, split="test")


def test_unknown_dataset_lists_known():
    with pytest.raises(ValueError, match="known datasets: .*dapo_parquet.*synthetic.*tfds"):
        get_dataset("imagenet")


# -- bad input ----------------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        get_dataset("dapo_parquet", path=path)


def test_empty_file_names_the_path(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl.*no rows"):
        get_dataset("dapo_jsonl", path=str(path))


def test_row_missing_a_nested_field(tmp_path):
    rows = [dapo_row(0), {"prompt": "p", "reward_model": {"style": "rule"}}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        DatasetSchemaError, match=r"bad\.jsonl: row 1 \(line 2\): missing field 'reward_model.ground_truth'"
    ):
        get_dataset("dapo_jsonl", path=path)


def test_parquet_row_with_a_null_field(tmp_path, aime_rows):
    aime_rows[2]["answer"] = None
    path = write_parquet(tmp_path / "nulls.parquet", aime_rows)
    with pytest.raises(DatasetSchemaError, match=r"nulls\.parquet: row 2: missing field 'answer'"):
        get_dataset("aime_parquet", path=path)


def test_parquet_missing_column(tmp_path):
    path = write_parquet(tmp_path / "nocol.parquet", [{"problem": "p", "solution": "s"}])
    with pytest.raises(DatasetSchemaError, match=r"nocol\.parquet: row 0: missing field 'answer'"):
        get_dataset("aime_parquet", path=path)


def test_bad_prompt_type_and_bad_json(tmp_path):
    path = write_jsonl(tmp_path / "type.jsonl", [{"prompt": 5, "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DatasetSchemaError, match="type.jsonl: row 0 .*'prompt' must be a string or a list"):
        get_dataset("dapo_jsonl", path=path)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "a", "answer": 1}\n{"problem": \n')
    with pytest.raises(DatasetSchemaError, match=r"broken.jsonl: row 1 \(line 2\) is not valid JSON"):
        get_dataset("aime_jsonl", path=str(broken))


# -- TFDS array_record + grain ------------------------------------------------------------------------------


@pytest.fixture
def tfds_tmp(tmp_path, monkeypatch):
    """TFDS makes a scratch dir per fresh builder (looking for GCS metadata); keep it under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_tfds_round_trip(tmp_path, dapo_parquet, tfds_tmp):
    data_dir = str(tmp_path / "tfds")
    out = build_tfds(dapo_parquet, "dapo_parquet", data_dir, config_name="dapo")
    assert any(p.name.startswith("math_prompts-train.array_record") for p in (tmp_path / "tfds").rglob("*"))
    records = load_tfds(data_dir, config_name="dapo")
    assert isinstance(records, grain.MapDataset) and out.endswith("math_prompts/dapo/1.0.0")
    got = [records[i] for i in range(len(records))]
    by_answer = lambda r: int(r["answer"])
    assert sorted(got, key=by_answer) == expected_records()
    batch = PromptIterator(records, batch_size=4, seed=0).next_batch()
    assert len(batch) == 4 and isinstance(batch[0]["prompt"], str)


def test_tfds_through_the_registry_builds_on_demand(tmp_path, aime_rows, tfds_tmp):
    source = write_jsonl(tmp_path / "aime.jsonl", aime_rows)
    data_dir = str(tmp_path / "tfds")
    with pytest.raises(FileNotFoundError, match="no TFDS dataset at .*aime24"):
        get_dataset("tfds", data_dir=data_dir, config_name="aime24")
    records = get_dataset(
        "tfds", data_dir=data_dir, config_name="aime24", source=source, source_format="aime_jsonl"
    )
    assert len(records) == 12 and {r["answer"] for r in records} == {str(2 * i) for i in range(12)}


# -- PromptIterator -----------------------------------------------------------------------------------------


def take(iterator: PromptIterator, n: int) -> list[list[dict]]:
    return [next(iterator) for _ in range(n)]


def test_epochs_are_permutations_with_fresh_orders():
    records = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    batches = take(PromptIterator(records, batch_size=5, seed=7), 6)
    epochs = [[r["prompt"] for b in batches[k : k + 2] for r in b] for k in (0, 2, 4)]
    for order in epochs:
        assert sorted(order, key=int) == [str(i) for i in range(10)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert take(PromptIterator(records, batch_size=5, seed=7), 6) == batches
    assert take(PromptIterator(records, batch_size=5, seed=8), 6) != batches


def test_batches_cross_epoch_boundaries_and_no_shuffle_keeps_order():
    records = [{"prompt": str(i), "answer": str(i)} for i in range(5)]
    it = PromptIterator(records, batch_size=3, seed=0, shuffle=False)
    assert [[r["prompt"] for r in b] for b in take(it, 3)] == [
        ["0", "1", "2"],
        ["3", "4", "0"],
        ["1", "2", "3"],
    ]
    assert it.get_state()["epoch"] == 1 and it.get_state()["index"] == 4


def test_resume_gives_the_same_batches():
    records = datasets.load_synthetic(n=37, seed=0)
    original = PromptIterator(records, batch_size=8, seed=3)
    take(original, 7)  # crosses an epoch boundary
    state = json.loads(json.dumps(original.get_state()))
    expected = take(original, 9)
    resumed = PromptIterator(records, batch_size=8, seed=3)
    resumed.set_state(state)
    assert take(resumed, 9) == expected


def test_bad_state_and_empty_source():
    records = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    it = PromptIterator(records, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="num_records=3"):
        it.set_state({"epoch": 0, "index": 0, "seed": 0, "shuffle": True, "num_records": 3})
    with pytest.raises(ValueError, match="out of range"):
        it.set_state({"epoch": 0, "index": 5})
    with pytest.raises(ValueError, match="empty dataset"):
        PromptIterator([], batch_size=1)


# -- prompt lengths against the engine's room for a prompt ---------------------------------------------------


def test_length_summary_counts_prompts_over_the_limit():
    stats = datasets.length_summary([5, 10, 11, 3, 10], max_prompt_len=10)
    assert stats == {"count": 5, "min": 3, "mean": 7.8, "p50": 10, "p99": 11, "max": 11, "max_prompt_len": 10,
                     "over_limit": 1}
    assert datasets.length_summary([], 10) == {"count": 0, "max_prompt_len": 10, "over_limit": 0}


def test_drop_long_prompts_keeps_order_and_the_boundary():
    records = [{"prompt": str(i), "answer": str(i)} for i in range(5)]
    kept, dropped = datasets.drop_long_prompts(records, [10, 11, 1, 10, 12], max_prompt_len=10)
    assert [r["answer"] for r in kept] == ["0", "2", "3"] and dropped == 2
    with pytest.raises(ValueError, match="5 records but 4 prompt lengths"):
        datasets.drop_long_prompts(records, [1, 2, 3, 4], 10)
