"""Dataset files in their public schemas, read into records (the schema is in ``datasets``' docstring): the
presets (DAPO-Math-17k, AIME 2024 / 2025, GSM8K, MATH, MATH-500) with their gold-answer extraction, verl's
parquet layout, and the prompt templates.

Light on purpose (pyarrow, no grain/TFDS/JAX): ``rollverify_jax.data.prepare`` extracts gold answers with the same
functions the loaders use, so a file it writes and a file the loaders read directly give the same answers.

Each loader takes ``path`` plus ``template`` (the prompt template, see ``resolve_template``; the legacy
``apply_template`` boolean still works), ``data_source`` (the source named on rows that carry none; default: the
preset's name), ``deduplicate`` and ``max_rows``. A row whose gold answer cannot be extracted is a
``DatasetSchemaError`` naming the file, the row and the field: never a silently wrong answer.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollverify_jax.data.plugins import AGENTS, SINGLE_TURN_AGENT, TOOL_AGENT
from rollverify_jax.data.rewards import extract_boxed

Record = dict[str, Any]
Row = dict[str, Any]

# -- prompt templates -------------------------------------------------------------------------------------

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
# The instruction MATH / GSM8K evaluations (Qwen2.5-Math, DeepSeek-R1) append to a problem.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = {"dapo": DAPO_TEMPLATE, "boxed": "{problem}\n\n" + BOXED_INSTRUCTION, "none": "{problem}"}

# The data_source each preset names its records by (verl's names where verl has one, so a verl reward file's
# dispatch on data_source finds them).
GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH500_SOURCE = "HuggingFaceH4/MATH-500"
DAPO_SOURCE = "math_dapo"
AIME_SOURCE = "aime"

PROBLEM_FIELDS = ("problem", "Problem", "question", "Question")
ANSWER_FIELDS = ("answer", "Answer")
SOLUTION_FIELDS = ("solution", "Solution")
# What a tool's entry in verl's extra_info.tools_kwargs may hold: the keyword arguments of the tool's create,
# execute, calc_reward and release (verl/workers/rollout/sglang_rollout/sglang_rollout.py reads all four;
# verl/experimental/agent_loop/tool_agent_loop.py reads create_kwargs).
TOOL_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


class DatasetSchemaError(ValueError):
    """A row lacks a field or has the wrong type; the message names the field, the file and the row."""


def resolve_template(template: str | None, apply_template: bool | None, default: str) -> str:
    """The template text a loader applies: a name in ``TEMPLATES`` ('dapo', 'boxed', 'none'), or a custom string
    holding ``{problem}``; None takes the preset's ``default``. ``apply_template=False`` (the legacy switch of
    existing configs) means 'none'; True means the template chosen."""
    if apply_template is False:
        if template not in (None, "none"):
            raise ValueError(f"apply_template=False and template={template!r} disagree; pass only template=...")
        return TEMPLATES["none"]
    name = default if template is None else template
    if not isinstance(name, str):
        raise ValueError(f"template must be a string, got {type(name).__name__}")
    if name in TEMPLATES:
        return TEMPLATES[name]
    if "{problem}" in name:
        return name
    raise ValueError(f"template={name!r} is neither a known template {sorted(TEMPLATES)} nor a custom string "
                     "containing '{problem}' (where the problem text goes)")


def apply_template(problem: str, template: str) -> str:
    """``problem`` placed in ``template`` (at ``{problem}``; ``str.replace``, so LaTeX braces are safe). A
    problem that already carries the template (its text before ``{problem}``, or with none, after it) is kept as
    is: DAPO-Math-17k ships its prompts already templated."""
    head, _, tail = template.partition("{problem}")
    if (head.strip() and head.strip() in problem) or (not head.strip() and tail.strip()
                                                      and problem.rstrip().endswith(tail.strip())):
        return problem
    return template.replace("{problem}", problem)


def apply_dapo_template(problem: str) -> str:
    """Wrap a problem in DAPO's prompt; a prompt that already carries the template is kept as is."""
    return apply_template(problem, DAPO_TEMPLATE)


# -- gold answers -----------------------------------------------------------------------------------------

_INTEGER = re.compile(r"[+-]?\d+")
_BOXED_SPACE = re.compile(r"\\boxed (\S[^$\n]*)")


def gsm8k_gold(solution: str) -> str | None:
    """GSM8K's ``answer`` column is a worked solution whose last line is ``#### 42``: the gold answer is what
    follows the last ``####``, thousands separators removed; None when there is no such line."""
    if "####" not in solution:
        return None
    value = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return value or None


def boxed_gold(solution: str) -> str | None:
    """The content of a worked solution's last ``\\boxed{...}`` (MATH's convention), or of a brace-less
    ``\\boxed 5`` as a few MATH solutions write it; None when there is neither."""
    boxed = extract_boxed(solution)
    if boxed is not None:
        return boxed or None
    spaced = _BOXED_SPACE.findall(solution)
    if not spaced:
        return None
    return spaced[-1].strip().rstrip(".").strip() or None


def scalar_text(value: Any) -> str | None:
    """A gold answer given as a string or a number, as text: an integral float (``33.0``, as pandas writes an
    integer column holding a null) is the integer; None for other types and for NaN / inf (a missing value)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def aime_gold(value: Any) -> str | None:
    """An AIME answer (an integer 000-999, as a string or a number) without leading zeros: ``"033"`` and
    ``33`` are one answer; other text is kept as it is."""
    text = scalar_text(value)
    if text and _INTEGER.fullmatch(text):
        return str(int(text))
    return text or None


# -- reading rows -----------------------------------------------------------------------------------------


def check_file(path: str | os.PathLike) -> str:
    """The path as a string; a missing file is a FileNotFoundError that says what belongs there."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"dataset file not found: {path!r} (check the path bound in the gin config; "
            "python -m rollverify_jax.data.prepare converts DAPO-Math-17k, AIME, GSM8K and MATH downloads into it)"
        )
    return path


def iter_jsonl(path: str) -> Iterator[tuple[str, Row]]:
    """Rows of a JSONL file with a human row label (``row i (line n)``); blank lines are skipped."""
    row = 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetSchemaError(
                    f"{path}: row {row} (line {line_number}) is not valid JSON: {e}"
                ) from e
            if not isinstance(value, dict):
                raise DatasetSchemaError(f"{path}: row {row} (line {line_number}) is not a JSON object")
            yield f"row {row} (line {line_number})", value
            row += 1


def iter_parquet(path: str, required: Sequence[str] = (), optional: Sequence[str] | None = ()
                 ) -> Iterator[tuple[str, Row]]:
    """Rows of a parquet file, reading only the top-level columns the fields need (``optional=None``: every
    column); a missing required column is an error naming it."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file: {e}") from e
    top = lambda fields: list(dict.fromkeys(field.split(".")[0] for field in fields))  # noqa: E731
    for column in top(required):
        if column not in schema.names:
            raise DatasetSchemaError(
                f"{path}: row 0: missing field {column!r} (the parquet file has no such column; "
                f"columns: {schema.names})"
            )
    columns = None if optional is None else [c for c in top([*required, *optional]) if c in schema.names]
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=columns, batch_size=8192):
        for value in batch.to_pylist():
            yield f"row {row}", value
            row += 1


def iter_rows(path: str, fmt: str, required: Sequence[str] = (), optional: Sequence[str] | None = ()
              ) -> Iterator[tuple[str, Row]]:
    """Rows of a ``jsonl`` or ``parquet`` file (parquet reads only the columns named; None: all)."""
    path = check_file(path)
    return iter_jsonl(path) if fmt == "jsonl" else iter_parquet(path, required, optional)


def get_field(row: Row, field: str, path: str, where: str) -> Any:
    """A dotted field (``reward_model.ground_truth``) from a nested row; missing or null is an error."""
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise DatasetSchemaError(f"{path}: {where}: missing field {field!r}")
        value = value[part]
    return value


def first_field(row: Row, candidates: Sequence[str], path: str, where: str) -> tuple[str, Any]:
    """(name, value) of the first of ``candidates`` the row holds (public files spell a column differently:
    ``problem`` / ``Problem``); none of them is an error naming them all."""
    for name in candidates:
        if row.get(name) is not None:
            return name, row[name]
    others = " or ".join(repr(c) for c in candidates[1:])
    also = f" (or {others})" if others else ""
    raise DatasetSchemaError(f"{path}: {where}: missing field {candidates[0]!r}{also}")


def text_field(value: Any, field: str, path: str, where: str) -> str:
    """A problem's text: a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise DatasetSchemaError(f"{path}: {where}: field {field!r} must be a non-empty string, got {value!r:.80}")
    return value


def answer_text(value: Any, field: str, path: str, where: str) -> str:
    """A gold answer given directly (a string or a number) as text; empty is an error."""
    text = scalar_text(value)
    if text is None:
        raise DatasetSchemaError(f"{path}: {where}: field {field!r} must be a string or number, got "
                                 f"{type(value).__name__}")
    if not text:
        raise DatasetSchemaError(f"{path}: {where}: field {field!r} is empty")
    return text


def extracted(gold: str | None, field: str, path: str, where: str, expected: str) -> str:
    """An extracted gold answer, or the error that says which row and field held none, and what was expected."""
    if gold is None:
        raise DatasetSchemaError(f"{path}: {where}: cannot extract the gold answer from field {field!r}: "
                                 f"expected {expected}; fix the row, or name the column that holds the final "
                                 "answer (rollverify_jax.data.prepare --answer_column)")
    return gold


def prompt_messages(value: Any, path: str, where: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(problem text, chat messages or None) of a ``prompt`` field: a string, or chat messages whose last user
    turn is the problem (system, tool and earlier turns are kept in the messages, with their other keys:
    ``tool_calls``, ``tool_call_id``, ``name``, ... as the chat template reads them). A bad message is refused
    naming its index and key."""
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list | tuple):
        raise DatasetSchemaError(
            f"{path}: {where}: field 'prompt' must be a string or a list of chat messages "
            f'[{{"role": "user", "content": ...}}], got {type(value).__name__}'
        )
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DatasetSchemaError(f"{path}: {where}: field 'prompt': message {i} must be a dict with 'role' and "
                                     f"'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise DatasetSchemaError(f"{path}: {where}: field 'prompt': message {i} has no 'role' (a non-empty "
                                     f"string), got {m.get('role')!r:.80}")
        if not isinstance(m.get("content"), str):
            raise DatasetSchemaError(
                f"{path}: {where}: field 'prompt': message {i} ({m['role']!r}) must have a string 'content', got "
                f"{m.get('content')!r:.80} (a turn that only calls a tool writes \"\" as its content, the calls in "
                "'tool_calls')")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list | tuple):
            raise DatasetSchemaError(f"{path}: {where}: field 'prompt': message {i}: 'tool_calls' must be a list, "
                                     f"got {type(m['tool_calls']).__name__}")
    users = [i for i, m in enumerate(value) if m["role"] == "user"]
    if not users:
        raise DatasetSchemaError(f"{path}: {where}: field 'prompt' has no user message (roles: "
                                 f"{[m['role'] for m in value]}); its last user turn is the problem")
    messages = [dict(m) for m in value]
    return messages[users[-1]]["content"], messages


def prompt_text(value: Any, path: str, where: str) -> str:
    """DAPO's ``prompt`` is a string or chat messages; the last user message is the problem text."""
    return prompt_messages(value, path, where)[0]


def json_value(value: Any, field: str, path: str, where: str) -> Any:
    """``value`` unchanged when it survives a JSON round trip equal (records are checkpointed as JSON with the
    paused groups); otherwise an error naming the field."""
    try:
        ok = json.loads(json.dumps(value, ensure_ascii=False)) == value or _has_nan(value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise DatasetSchemaError(f"{path}: {where}: field {field!r} is not JSON-serialisable as it is "
                                 f"({value!r:.120}); records are checkpointed as JSON")
    return value


def _has_nan(value: Any) -> bool:
    """NaN round-trips through Python's JSON but never compares equal."""
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, dict):
        return any(_has_nan(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    return False


# -- records ----------------------------------------------------------------------------------------------


def make_record(problem: str, answer: str, template: str, data_source: str | None = None,
                messages: list[dict[str, Any]] | None = None, extra_info: dict | None = None,
                agent_name: str | None = None) -> Record:
    """A record: the templated problem, the gold answer, and the optional keys that are set (absent keys are
    not written: a two-field record hashes as before they existed). In ``messages`` the last user turn gets
    the template too."""
    record: Record = {"prompt": apply_template(problem, template), "answer": answer}
    if data_source is not None:
        record["data_source"] = data_source
    if messages is not None:
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages = [dict(m, content=record["prompt"]) if i == last_user else m for i, m in enumerate(messages)]
        record["messages"] = messages
    if extra_info is not None:
        record["extra_info"] = extra_info
    if agent_name is not None:
        record["agent_name"] = agent_name
    return record


def _source_of(row: Row, default: str | None, path: str, where: str) -> str | None:
    """The row's own ``data_source`` (verl's column), else the loader's default."""
    value = row.get("data_source")
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise DatasetSchemaError(f"{path}: {where}: field 'data_source' must be a non-empty string, got {value!r}")
    return value


def _other_columns(row: Row, used: Sequence[str], index: int, path: str, where: str,
                   renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``extra_info`` of a preset row: its row index and every column the record does not hold otherwise (a
    MATH row's ``solution``, ``level``, ``type``), so a reward function can read them."""
    renamed = renamed or {}
    info: dict[str, Any] = {"index": index}
    for key, value in row.items():
        if key in renamed:
            info[renamed[key]] = value
        elif key not in used:
            info[key] = value
    return json_value(info, "extra_info", path, where)


def finish(records: list[Record], path: str, max_rows: int | None, deduplicate: bool) -> list[Record]:
    """Optional dedup (DAPO-Math-17k repeats each problem many times) and truncation; empty is an error."""
    if deduplicate:
        seen: set[str] = set()
        kept = []
        for record in records:
            key = json.dumps([record["prompt"], record.get("messages")], sort_keys=True, ensure_ascii=False)
            if key not in seen:
                seen.add(key)
                kept.append(record)
        records = kept
    if max_rows is not None:
        records = records[:max_rows]
    if not records:
        raise ValueError(f"dataset file {path!r} has no rows")
    return records


# -- loaders ----------------------------------------------------------------------------------------------


def _dapo(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """DAPO-Math-17k (verl's layout): ``prompt`` and ``reward_model.ground_truth``; the data_source kept."""
    problem = prompt_text(get_field(row, "prompt", path, where), path, where)
    answer = answer_text(get_field(row, "reward_model.ground_truth", path, where), "reward_model.ground_truth",
                         path, where)
    return make_record(problem, answer, template, _source_of(row, data_source, path, where))


def _aime(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """AIME 2024 / 2025 (``problem``/``answer``, ``Problem``/``Answer``, or ``question``/``answer``)."""
    field, problem = first_field(row, PROBLEM_FIELDS, path, where)
    problem = text_field(problem, field, path, where)
    field, value = first_field(row, ANSWER_FIELDS, path, where)
    answer = aime_gold(answer_text(value, field, path, where))
    return make_record(problem, answer, template, _source_of(row, data_source, path, where))


def _gsm8k(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """GSM8K: ``question``, and ``answer`` the worked solution ending in ``#### 42`` (kept as
    ``extra_info.solution``)."""
    problem = text_field(get_field(row, "question", path, where), "question", path, where)
    solution = text_field(get_field(row, "answer", path, where), "answer", path, where)
    gold = extracted(gsm8k_gold(solution), "answer", path, where, "a worked solution ending in '#### <answer>'")
    info = _other_columns(row, ("question",), i, path, where, renamed={"answer": "solution"})
    return make_record(problem, gold, template, _source_of(row, data_source, path, where), extra_info=info)


def _math(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """MATH: ``problem`` and ``solution``, whose last ``\\boxed{}`` is the gold answer."""
    field, problem = first_field(row, PROBLEM_FIELDS, path, where)
    problem = text_field(problem, field, path, where)
    sfield, solution = first_field(row, SOLUTION_FIELDS, path, where)
    gold = extracted(boxed_gold(text_field(solution, sfield, path, where)), sfield, path, where,
                     "a worked solution with a final \\boxed{...}")
    info = _other_columns(row, (field,), i, path, where)
    return make_record(problem, gold, template, _source_of(row, data_source, path, where), extra_info=info)


def _math500(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """MATH-500: ``problem``, ``answer`` (the gold answer, curated) and ``solution`` (kept in extra_info)."""
    field, problem = first_field(row, PROBLEM_FIELDS, path, where)
    problem = text_field(problem, field, path, where)
    afield, value = first_field(row, ANSWER_FIELDS, path, where)
    answer = answer_text(value, afield, path, where)
    info = _other_columns(row, (field, afield), i, path, where)
    return make_record(problem, answer, template, _source_of(row, data_source, path, where), extra_info=info)


def _agent_name(row: Row, path: str, where: str) -> str | None:
    """verl's top-level ``agent_name`` (the agent loop that runs the row): one this project runs, or None."""
    name = row.get("agent_name")
    if name is None:
        return None
    if name not in AGENTS:
        raise DatasetSchemaError(
            f"{path}: {where}: field 'agent_name' is {name!r:.80}; supported agent loops: "
            f"{SINGLE_TURN_AGENT!r} (one response) and {TOOL_AGENT!r} (a response with tool calls and their "
            "replies); leave the field out for the run's default")
    return name


def _check_multi_turn(info: dict[str, Any], path: str, where: str) -> None:
    """verl's multi-turn keys of ``extra_info``, refused when malformed (a tool created without its arguments
    would grade every response wrong without a word): ``tools_kwargs`` maps a tool's name to its
    ``create_kwargs`` / ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs`` (dicts);
    ``need_tools_kwargs`` is a boolean, and true needs a tool's arguments; ``interaction_kwargs`` is a dict whose
    ``name``, if set, is a non-empty string. A null is absent (parquet writes one for a key another row has)."""
    def bad(field: str, expected: str, value: Any) -> DatasetSchemaError:
        return DatasetSchemaError(f"{path}: {where}: field 'extra_info.{field}' must be {expected}, got "
                                  f"{value!r:.80}")

    tools = info.get("tools_kwargs")
    if tools is not None:
        if not isinstance(tools, dict):
            raise bad("tools_kwargs", "a dict {tool name: {'create_kwargs': {...}, ...}}", tools)
        for tool, entry in tools.items():
            if entry is None:
                continue
            if not isinstance(entry, dict):
                raise bad(f"tools_kwargs.{tool}", f"a dict with keys among {list(TOOL_KWARGS_KEYS)}", entry)
            unknown = sorted(set(entry) - set(TOOL_KWARGS_KEYS))
            if unknown:
                raise DatasetSchemaError(f"{path}: {where}: field 'extra_info.tools_kwargs.{tool}' has unknown "
                                         f"key(s) {unknown}; a tool's arguments are {list(TOOL_KWARGS_KEYS)}")
            for kind, value in entry.items():
                if value is not None and not isinstance(value, dict):
                    raise bad(f"tools_kwargs.{tool}.{kind}", "a dict of the tool's arguments", value)
    need = info.get("need_tools_kwargs")
    if need is not None and not isinstance(need, bool):
        raise bad("need_tools_kwargs", "true or false", need)
    if need and not any(entry for entry in (tools or {}).values()):
        raise DatasetSchemaError(f"{path}: {where}: field 'extra_info.need_tools_kwargs' is true but "
                                 "'extra_info.tools_kwargs' gives no tool's arguments (e.g. "
                                 "{'my_tool': {'create_kwargs': {'ground_truth': ...}}})")
    interaction = info.get("interaction_kwargs")
    if interaction is not None:
        if not isinstance(interaction, dict):
            raise bad("interaction_kwargs", "a dict", interaction)
        name = interaction.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise bad("interaction_kwargs.name", "a non-empty string (the interaction's name)", name)


def _verl(row: Row, i: int, path: str, where: str, template: str, data_source: str | None) -> Record:
    """verl's RL parquet: ``prompt`` (chat messages, system and tool ones included), ``data_source``,
    ``reward_model.ground_truth``, ``extra_info`` (its multi-turn keys checked: ``_check_multi_turn``) and
    ``agent_name``; all of it reaches the reward (``ability`` and ``reward_model.style``, which verl never hands a
    reward function either, are dropped)."""
    problem, messages = prompt_messages(get_field(row, "prompt", path, where), path, where)
    answer = answer_text(get_field(row, "reward_model.ground_truth", path, where), "reward_model.ground_truth",
                         path, where)
    source = _source_of(row, data_source, path, where)
    if source is None:
        raise DatasetSchemaError(f"{path}: {where}: missing field 'data_source' (verl's reward routing needs "
                                 "it; pass data_source=... to name the rows that have none)")
    info = row.get("extra_info")
    if info is not None and not isinstance(info, dict):
        raise DatasetSchemaError(f"{path}: {where}: field 'extra_info' must be a dict, got {type(info).__name__}")
    if info is not None:
        _check_multi_turn(info, path, where)
    agent = _agent_name(row, path, where)
    if messages is not None:
        json_value(messages, "prompt", path, where)
    return make_record(problem, answer, template, source, messages,
                       None if info is None else json_value(info, "extra_info", path, where), agent)


# preset -> (row parser: (row, index, path, where, template, data_source) -> Record, its default template, its
# default data_source, parquet columns: required, optional; None: every column). Each is registered as
# '<preset>_jsonl' and '<preset>_parquet'.
PRESETS: dict[str, tuple[Callable[..., Record], str, str | None, tuple[str, ...], tuple[str, ...] | None]] = {
    "dapo": (_dapo, "dapo", DAPO_SOURCE, ("prompt", "reward_model"), ("data_source",)),
    "aime": (_aime, "dapo", AIME_SOURCE, (), None),
    "gsm8k": (_gsm8k, "boxed", GSM8K_SOURCE, ("question", "answer"), None),
    "math": (_math, "boxed", MATH_SOURCE, (), None),
    "math500": (_math500, "boxed", MATH500_SOURCE, (), None),
    "verl": (_verl, "none", None, ("prompt", "reward_model"), ("data_source", "extra_info", "agent_name")),
}


def load_preset(preset: str, fmt: str, path: str, template: str | None = None, apply_template: bool | None = None,
                data_source: str | None = None, deduplicate: bool = False, max_rows: int | None = None
                ) -> list[Record]:
    """Records of a ``preset`` file in ``fmt`` ('jsonl' or 'parquet'), see the module docstring."""
    parse, default_template, default_source, required, optional = PRESETS[preset]
    text = resolve_template(template, apply_template, default_template)
    path = check_file(path)
    rows = iter_rows(path, fmt, required, optional)
    source = data_source or default_source
    records = [parse(row, i, path, where, text, source) for i, (where, row) in enumerate(rows)]
    return finish(records, path, max_rows, deduplicate)


def _loader(preset: str, fmt: str) -> Callable[..., list[Record]]:
    def load(path: str, template: str | None = None, apply_template: bool | None = None,
             data_source: str | None = None, deduplicate: bool = False, max_rows: int | None = None
             ) -> list[Record]:
        return load_preset(preset, fmt, path, template, apply_template, data_source, deduplicate, max_rows)
    load.__name__ = load.__qualname__ = f"load_{preset}_{fmt}"
    load.__doc__ = f"{PRESETS[preset][0].__doc__} From {fmt}."
    return load


FILE_LOADERS: dict[str, Callable[..., list[Record]]] = {
    f"{preset}_{fmt}": _loader(preset, fmt) for preset in PRESETS for fmt in ("jsonl", "parquet")
}
