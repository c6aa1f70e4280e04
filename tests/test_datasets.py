"""Tests for rollverify_jax.data.datasets: the presets (DAPO, AIME, GSM8K, MATH, MATH-500) and verl's layout in
their public schemas, gold-answer extraction, templates, mixtures, schema errors, TFDS + grain, PromptIterator."""

import gc
import hashlib
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
from rollverify_jax.data.sources import BOXED_INSTRUCTION, scalar_text

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


def expected_records(data_source: str | None = "math_dapo") -> list[dict[str, str]]:
    """What the DAPO loaders give (AIME's: ``data_source="aime"``; a TFDS build's: None, prompt/answer only)."""
    source = {} if data_source is None else {"data_source": data_source}
    return [
        {"prompt": DAPO_TEMPLATE.replace("{problem}", PROBLEMS[i]), "answer": str(2 * i), **source} for i in range(12)
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
    assert raw[3] == {"prompt": PROBLEMS[3], "answer": "6", "data_source": "math_dapo"}
    assert get_dataset("dapo_jsonl", path=path, template="none") == raw


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
    assert get_dataset("aime_jsonl", path=jsonl) == expected_records("aime")
    assert get_dataset("aime_parquet", path=parquet) == expected_records("aime")


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
    """TFDS makes a scratch dir per fresh builder (looking for GCS metadata); keep it under tmp_path. Garbage that
    earlier tests in this worker left is collected first: collected while TFDS's lazy-import context is active,
    an object's finaliser warning makes pytest import ``tracemalloc`` through etils' lazy module and fail."""
    gc.collect()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_tfds_round_trip(tmp_path, dapo_parquet, tfds_tmp):
    data_dir = str(tmp_path / "tfds")
    out = build_tfds(dapo_parquet, "dapo_parquet", data_dir, config_name="dapo")
    assert any(p.name.startswith("math_prompts-train.array_record") for p in (tmp_path / "tfds").rglob("*"))
    records = load_tfds(data_dir, config_name="dapo")
    assert isinstance(records, grain.MapDataset) and out.endswith("math_prompts/dapo/1.0.0")
    got = [records[i] for i in range(len(records))]
    by_answer = lambda r: int(r["answer"])
    assert sorted(got, key=by_answer) == expected_records(None)  # a build holds prompt/answer text
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


def test_next_record_walks_the_batches_of_one_and_refuses_larger_batches():
    """Rollout draws a record per group (``next_record``): the records, state and resume of batches of one."""
    records = datasets.load_synthetic(n=7, seed=0)
    one, batches = PromptIterator(records, batch_size=1, seed=3), PromptIterator(records, batch_size=1, seed=3)
    assert [one.next_record() for _ in range(10)] == [r for b in take(batches, 10) for r in b]  # crosses an epoch
    assert one.get_state() == batches.get_state() == {**one.get_state(), "epoch": 1, "index": 3}
    with pytest.raises(ValueError, match="batch_size=2 .use next_batch"):
        PromptIterator(records, batch_size=2).next_record()


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


# -- presets in their public schemas: gold answers, templates, data_source, extra_info ----------------------


def test_gsm8k_gold_is_what_follows_the_hashes(tmp_path):
    """openai/gsm8k: 'answer' is a worked solution ending in '#### 1,234'; the gold is 1234, the solution is kept
    in extra_info, the prompt gets the boxed instruction; a row without '####' is refused, naming row and field."""
    rows = [{"question": "Tom has 1,000 apples and buys 234. How many?",
             "answer": "He has 1,000 + 234 = <<1000+234=1234>>1,234 apples.\n#### 1,234"},
            {"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}]
    path = write_parquet(tmp_path / "gsm8k-train.parquet", rows)
    records = get_dataset("gsm8k_parquet", path=path)
    assert [r["answer"] for r in records] == ["1234", "42"]
    assert records[1] == {"prompt": "What is 6 * 7?\n\n" + BOXED_INSTRUCTION, "answer": "42",
                          "data_source": "openai/gsm8k", "extra_info": {"index": 1, "solution": rows[1]["answer"]}}
    assert get_dataset("gsm8k_parquet", path=path, template="none")[1]["prompt"] == "What is 6 * 7?"
    assert get_dataset("gsm8k_parquet", path=path, apply_template=False)[1]["prompt"] == "What is 6 * 7?"
    custom = get_dataset("gsm8k_parquet", path=path, template="Q: {problem}\nA:", data_source="gsm8k")[1]
    assert custom["prompt"] == "Q: What is 6 * 7?\nA:" and custom["data_source"] == "gsm8k"
    with pytest.raises(ValueError, match="neither a known template .*'boxed'.*containing '{problem}'"):
        get_dataset("gsm8k_parquet", path=path, template="Solve it.")
    with pytest.raises(ValueError, match="apply_template=False and template='boxed' disagree"):
        get_dataset("gsm8k_parquet", path=path, template="boxed", apply_template=False)
    rows.append({"question": "Q?", "answer": "The whole solution, and no final line."})
    bad = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(DatasetSchemaError, match=r"gsm8k\.jsonl: row 2 \(line 3\): cannot extract the gold answer "
                                                 r"from field 'answer': expected a worked solution ending in '####"):
        get_dataset("gsm8k_jsonl", path=bad)


def test_math_gold_is_the_last_boxed_and_math500_has_its_own_answer(tmp_path):
    math_rows = [{"problem": "Half of one?", "level": "Level 1", "type": "Algebra",
                  "solution": r"First $\boxed{2}$ is wrong; it is $\boxed{\frac{1}{2}}$."},
                 {"problem": "Two?", "level": "Level 2", "type": "Algebra", "solution": r"So it is \boxed 2."}]
    records = get_dataset("math_jsonl", path=write_jsonl(tmp_path / "math.jsonl", math_rows))
    assert [r["answer"] for r in records] == [r"\frac{1}{2}", "2"]
    assert records[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert records[0]["prompt"].endswith("\\boxed{}.") and records[0]["prompt"].startswith("Half of one?")
    assert records[0]["extra_info"] == {"index": 0, "level": "Level 1", "type": "Algebra",
                                        "solution": math_rows[0]["solution"]}
    math500 = [{"problem": "P", "solution": r"... \boxed{3\sqrt{2}}", "answer": r"3\sqrt{2}", "subject": "Geometry",
                "level": 3, "unique_id": "test/geometry/1.json"}]
    (record,) = get_dataset("math500_parquet", path=write_parquet(tmp_path / "math500.parquet", math500))
    assert record["answer"] == r"3\sqrt{2}" and record["data_source"] == "HuggingFaceH4/MATH-500"
    assert record["extra_info"]["unique_id"] == "test/geometry/1.json" and "answer" not in record["extra_info"]
    math_rows.append({"problem": "Q", "solution": "No final answer here."})
    with pytest.raises(DatasetSchemaError, match=r"math\.parquet: row 2: cannot extract the gold answer from field "
                                                 r"'solution': expected a worked solution with a final \\boxed"):
        get_dataset("math_parquet", path=write_parquet(tmp_path / "math.parquet", math_rows))


def test_aime_2024_and_2025_public_schemas(tmp_path):
    """AIME 2024 (Maxwell-Jia: ID, Problem, Solution, Answer as integers) and AIME 2025 (problem, answer as text
    with leading zeros): one record shape, the answer as AIME's integer, DAPO's template by default."""
    aime24 = write_parquet(tmp_path / "aime_2024.parquet", [
        {"ID": "2024-I-1", "Problem": "Find x.", "Solution": "... so 204.", "Answer": 204}])
    aime25 = write_jsonl(tmp_path / "aime_2025.jsonl", [{"id": 0, "problem": "Find y.", "answer": "033"}])
    (r24,) = get_dataset("aime_parquet", path=aime24)
    (r25,) = get_dataset("aime_jsonl", path=aime25, data_source="aime_2025")
    assert r24 == {"prompt": apply_dapo_template("Find x."), "answer": "204", "data_source": "aime"}
    assert r25 == {"prompt": apply_dapo_template("Find y."), "answer": "33", "data_source": "aime_2025"}


def verl_rows() -> list[dict]:
    """verl's RL parquet layout: chat prompt with a system message, data_source, ability, reward_model, nested
    extra_info."""
    return [{"data_source": "my_source",
             "prompt": [{"role": "system", "content": "You are a careful solver."},
                        {"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math",
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": i, "split": "train", "meta": {"tags": ["add", "easy"], "difficulty": 0.5}}}
            for i in range(3)]


def test_verl_parquet_keeps_the_chat_prompt_source_and_extra_info_whole(tmp_path):
    rows = verl_rows()
    for name, path in (("verl_parquet", write_parquet(tmp_path / "train.parquet", rows)),
                       ("verl_jsonl", write_jsonl(tmp_path / "train.jsonl", rows))):
        records = get_dataset(name, path=path)
        assert records[1] == {"prompt": "What is 1 + 1?", "answer": "2", "data_source": "my_source",
                              "messages": rows[1]["prompt"], "extra_info": rows[1]["extra_info"]}
    boxed = get_dataset("verl_parquet", path=str(tmp_path / "train.parquet"), template="boxed")[0]
    assert boxed["messages"][0] == rows[0]["prompt"][0]  # the system message as given
    assert boxed["messages"][1]["content"] == boxed["prompt"] == "What is 0 + 0?\n\n" + BOXED_INSTRUCTION
    del rows[2]["data_source"]
    with pytest.raises(DatasetSchemaError, match=r"row 2 \(line 3\): missing field 'data_source'.*data_source=\.\.\."):
        get_dataset("verl_jsonl", path=write_jsonl(tmp_path / "nosource.jsonl", rows))
    assert get_dataset("verl_jsonl", path=str(tmp_path / "nosource.jsonl"), data_source="d")[2]["data_source"] == "d"


def test_a_record_round_trips_through_a_paused_group_checkpoint(tmp_path):
    """Records are checkpointed with the paused groups: a verl record with nested extra_info and chat messages
    comes back equal through PausedCache.to_dict, the checkpoint's JSON encoding and from_dict."""
    from rollverify_jax.rl.buffer import Group, PausedCache
    from rollverify_jax.run.checkpoint import decode_extra, encode_extra

    record = get_dataset("verl_parquet", path=write_parquet(tmp_path / "v.parquet", verl_rows()))[2]
    record["extra_info"]["meta"]["none"], record["extra_info"]["unicode"] = None, "数学 é"
    cache = PausedCache()
    cache.add_group(Group(group_id=7, size=2, record=record))
    restored = PausedCache.from_dict(decode_extra(json.loads(json.dumps(encode_extra(cache.to_dict())))))
    assert restored.groups[7].record == record


def test_old_records_hash_as_before():
    """Runs started before data_source existed resume: two-field records hash exactly as the loaders' records did
    then (sorted-key JSON lines), and so do DAPO records that now name their implied 'math_dapo'."""
    old = [{"prompt": apply_dapo_template(p), "answer": str(i)} for i, p in enumerate(PROBLEMS)]
    digest = hashlib.sha256()
    for record in old:
        digest.update(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n")
    before = {"records": len(old), "sha256": digest.hexdigest()}
    assert datasets.records_fingerprint(old) == before
    assert datasets.records_fingerprint([{**r, "data_source": "math_dapo"} for r in old]) == before
    assert datasets.records_fingerprint([{**r, "data_source": "openai/gsm8k"} for r in old]) != before
    assert datasets.records_fingerprint([{**old[0], "extra_info": {"a": 1}}, *old[1:]]) != before


# -- verl's multi-turn / tool-agent files ------------------------------------------------------------------------


def tool_agent_rows() -> list[dict]:
    """The three shapes of verl's multi-turn RL files: a tool agent row as gsm8k_tool_agent_loop.py writes it
    (agent_name, system turn, tools_kwargs with the ground truth, interaction_kwargs, need_tools_kwargs); a ReTool
    row (agent_name, no extra_info); a row as dapo_multiturn_w_tool.py writes it (no agent_name, tools_kwargs of
    another tool), whose prompt also holds an earlier tool call and its reply."""
    system = {"role": "system", "content": "Call calc_gsm8k_reward before answering. Answer as '#### <answer>'."}
    return [
        {"data_source": "openai/gsm8k", "agent_name": "tool_agent",
         "prompt": [system, {"role": "user", "content": "What is 2 + 3?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
         "extra_info": {"split": "train", "index": 0, "need_tools_kwargs": True,
                        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}},
                        "interaction_kwargs": {"query": "What is 2 + 3?", "ground_truth": "5"}}},
        {"data_source": "aime_2024", "agent_name": "tool_agent",
         "prompt": [{"role": "user", "content": "Find x."}], "reward_model": {"ground_truth": "204"}},
        {"data_source": "math_dapo",
         "prompt": [{"role": "user", "content": "What is 1 + 1?"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "code_interpreter",
                                                                       "arguments": '{"code": "print(1 + 1)"}'}}]},
                    {"role": "tool", "content": "2"},
                    {"role": "user", "content": "And 2 + 2?"}],
         "reward_model": {"ground_truth": "4"},
         "extra_info": {"index": 2, "need_tools_kwargs": True,
                        "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": "4"}}}}},
    ]


def test_verl_tool_agent_files_keep_agent_name_and_their_multi_turn_fields(tmp_path):
    """agent_name is kept on the record and extra_info whole (tools_kwargs, interaction_kwargs, need_tools_kwargs),
    from jsonl as the file holds it and from parquet with the nulls parquet writes for keys other rows have; the
    prompt's tool turns are kept in the messages; each record says which agent loop it asks for; a tool agent's
    record round-trips through a paused group's checkpoint."""
    from rollverify_jax.data.plugins import agent_of
    from rollverify_jax.rl.buffer import Group, PausedCache
    from rollverify_jax.run.checkpoint import decode_extra, encode_extra

    rows = tool_agent_rows()
    records = get_dataset("verl_jsonl", path=write_jsonl(tmp_path / "tools.jsonl", rows))
    assert records[0] == {"prompt": "What is 2 + 3?", "answer": "5", "data_source": "openai/gsm8k",
                          "agent_name": "tool_agent", "messages": rows[0]["prompt"],
                          "extra_info": rows[0]["extra_info"]}
    assert records[1] == {"prompt": "Find x.", "answer": "204", "data_source": "aime_2024", "agent_name": "tool_agent",
                          "messages": rows[1]["prompt"]}
    assert "agent_name" not in records[2] and records[2]["messages"] == rows[2]["prompt"]
    assert records[2]["prompt"] == "And 2 + 2?" and records[2]["extra_info"] == rows[2]["extra_info"]
    assert [agent_of(r) for r in records] == ["tool_agent"] * 3  # the last by its tools_kwargs, as verl ran it
    from_parquet = get_dataset("verl_parquet", path=write_parquet(tmp_path / "tools.parquet", rows))
    assert [r.get("agent_name") for r in from_parquet] == ["tool_agent", "tool_agent", None]
    tools = from_parquet[2]["extra_info"]["tools_kwargs"]
    assert tools == {"calc_gsm8k_reward": None, "code_interpreter": {"create_kwargs": {"ground_truth": "4"}}}
    assert from_parquet[2]["messages"][1]["tool_calls"] == rows[2]["prompt"][1]["tool_calls"]
    assert from_parquet[0]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"] == {
        "create_kwargs": {"ground_truth": "5"}}
    assert [agent_of(r) for r in from_parquet] == ["tool_agent"] * 3
    single = get_dataset("verl_jsonl", path=write_jsonl(tmp_path / "single.jsonl", [
        {**rows[1], "agent_name": "single_turn_agent"}, {k: v for k, v in rows[1].items() if k != "agent_name"}]))
    assert [agent_of(r) for r in single] == ["single_turn_agent", "single_turn_agent"]
    assert single[1] == {k: v for k, v in records[1].items() if k != "agent_name"}  # nothing added to a plain row
    cache = PausedCache()
    cache.add_group(Group(group_id=3, size=2, record=from_parquet[0]))
    restored = PausedCache.from_dict(decode_extra(json.loads(json.dumps(encode_extra(cache.to_dict())))))
    assert restored.groups[3].record == from_parquet[0]
    # agent_name is hashed (a file edited to another agent loop does not resume on it); a row without one adds nothing.
    assert datasets.records_fingerprint(single[1:]) != datasets.records_fingerprint(records[1:2])


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(agent_name="react_agent"),
     r"field 'agent_name' is 'react_agent'; supported agent loops: 'single_turn_agent' \(one response\) and "
     r"'tool_agent'"),
    (lambda r: r.update(agent_name=3), r"field 'agent_name' is 3; supported agent loops"),
    (lambda r: r["extra_info"].update(tools_kwargs=["calc_gsm8k_reward"]),
     r"field 'extra_info.tools_kwargs' must be a dict \{tool name"),
    (lambda r: r["extra_info"]["tools_kwargs"].update(calc_gsm8k_reward="5"),
     r"field 'extra_info.tools_kwargs.calc_gsm8k_reward' must be a dict with keys among \['create_kwargs'"),
    (lambda r: r["extra_info"]["tools_kwargs"].update(calc_gsm8k_reward={"create_kwarg": {"ground_truth": "5"}}),
     r"field 'extra_info.tools_kwargs.calc_gsm8k_reward' has unknown key\(s\) \['create_kwarg'\]"),
    (lambda r: r["extra_info"]["tools_kwargs"].update(calc_gsm8k_reward={"create_kwargs": "5"}),
     r"field 'extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs' must be a dict of the tool's arguments"),
    (lambda r: r["extra_info"].update(need_tools_kwargs="yes"),
     r"field 'extra_info.need_tools_kwargs' must be true or false, got 'yes'"),
    (lambda r: r["extra_info"].pop("tools_kwargs"),
     r"field 'extra_info.need_tools_kwargs' is true but 'extra_info.tools_kwargs' gives no tool's arguments"),
    (lambda r: r["extra_info"].update(interaction_kwargs="gsm8k"),
     r"field 'extra_info.interaction_kwargs' must be a dict, got 'gsm8k'"),
    (lambda r: r["extra_info"]["interaction_kwargs"].update(name=""),
     r"field 'extra_info.interaction_kwargs.name' must be a non-empty string"),
    (lambda r: r["prompt"].append({"role": "assistant", "content": None, "tool_calls": []}),
     r"field 'prompt': message 2 \('assistant'\) must have a string 'content', got None \(a turn that only calls a "
     r"tool writes \"\" as its content"),
    (lambda r: r["prompt"][0].pop("role"), r"field 'prompt': message 0 has no 'role'"),
    (lambda r: r["prompt"].append({"role": "assistant", "content": "", "tool_calls": "calc"}),
     r"field 'prompt': message 2: 'tool_calls' must be a list, got str"),
    (lambda r: r.update(prompt=[r["prompt"][0]]), r"field 'prompt' has no user message \(roles: \['system'\]\)"),
])
def test_malformed_multi_turn_rows_are_refused_naming_file_row_and_field(tmp_path, edit, message):
    rows = tool_agent_rows()
    edit(rows[0])
    rows = [rows[1], rows[0]]  # the bad row is row 1
    with pytest.raises(DatasetSchemaError, match=r"bad\.jsonl: row 1 \(line 2\): " + message):
        get_dataset("verl_jsonl", path=write_jsonl(tmp_path / "bad.jsonl", rows))


# -- mixtures --------------------------------------------------------------------------------------------------


def test_mixture_shares_follow_the_weights_deterministically(tmp_path):
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": f"Q{i}?", "answer": f"so\n#### {i}"}
                                                   for i in range(4)])
    sources = [{"name": "synthetic", "weight": 2, "n": 100, "seed": 1},
               {"name": "synthetic", "weight": 1, "n": 10, "seed": 2},
               {"name": "gsm8k_jsonl", "weight": 1.0, "path": gsm8k}]
    parts = [get_dataset(s["name"], **{k: v for k, v in s.items() if k not in ("name", "weight")}) for s in sources]
    keys = [{json.dumps(r, sort_keys=True) for r in part} for part in parts]

    def shares(records):
        found = [[json.dumps(r, sort_keys=True) in k for k in keys].index(True) for r in records]
        return [found.count(i) for i in range(3)]

    # Default size: the largest mixture without a repeat; the 4-record source at weight 1/4 binds it (16).
    mixed = get_dataset("mixture", sources=sources, seed=0)
    assert shares(mixed) == [8, 4, 4] and len({json.dumps(r, sort_keys=True) for r in mixed}) == 16
    assert all(r["data_source"] == "openai/gsm8k" for r in mixed if "Q" in r["prompt"])
    assert mixed == get_dataset("mixture", sources=sources, seed=0)
    assert mixed != get_dataset("mixture", sources=sources, seed=1)
    # A stated size: the small source repeats, in whole passes (each of its 4 records 6 or 7 times in 25).
    big = get_dataset("mixture", sources=sources, seed=0, size=101)
    assert len(big) == 101 and shares(big) == [51, 25, 25]
    repeats = [sum(r["prompt"].startswith(f"Q{i}?") for r in big) for i in range(4)]
    assert sorted(repeats) == [6, 6, 6, 7]
    with pytest.raises(ValueError, match=r"mixture source 1 \('synthetic'\): weight must be a finite number > 0"):
        get_dataset("mixture", sources=[sources[0], {**sources[1], "weight": 0}])
    with pytest.raises(ValueError, match="mixture source 0: unknown dataset 'gsm8k'; known datasets: "):
        get_dataset("mixture", sources=[{"name": "gsm8k", "path": gsm8k}])
    with pytest.raises(TypeError, match=r"mixture source 0 \('gsm8k_jsonl'\): arguments .* do not fit the loader"):
        get_dataset("mixture", sources=[{"name": "gsm8k_jsonl", "path": gsm8k, "nope": 1}])


def test_a_missing_numeric_gold_answer_is_no_answer():
    """A float column's missing value (NaN, as JSON and pandas write it) is no gold answer, not the text 'nan'."""
    assert [scalar_text(v) for v in (33.0, 7, " 12 ", float("nan"), float("inf"), True)] == ["33", "7", "12", None,
                                                                                             None, None]
