"""Converts downloaded DAPO-Math-17k, verl RL, AIME 2024 / 2025 and GSM8K files into the files the configs read.

    python -m rollverify_jax.data.prepare raw/dapo-math-17k.parquet --output data/dapo-math-17k.parquet
    python -m rollverify_jax.data.prepare raw/aime_2024.parquet --output data/aime-2024.jsonl
    python -m rollverify_jax.data.prepare raw/aime2025-I.jsonl raw/aime2025-II.jsonl --output data/aime-2025.jsonl
    python -m rollverify_jax.data.prepare raw/dapo-math-17k.parquet --format array_record --output data/tfds
    python -m rollverify_jax.data.prepare raw/gsm8k/main/train-00000-of-00001.parquet --output data/gsm8k-train.parquet
    python -m rollverify_jax.data.prepare raw/verl/train.parquet --output data/verl-train.parquet

Inputs are parquet, JSONL or JSON (a list of objects) files, or directories holding them (a Hugging Face dataset
download). The schema is detected from the columns (``--kind`` forces it):

* DAPO-Math-17k: ``prompt`` (chat messages ``[{"role": "user", "content": ...}]`` or a string) and
  ``reward_model.ground_truth``. Written in the same schema (the ``dapo_parquet`` / ``dapo_jsonl`` loaders read
  it), one row per distinct prompt: the dataset repeats each of its ~17.9K problems about 100 times.
* verl RL: the same two columns, with what DAPO-Math-17k's schema cannot hold (``verl_fields``: a prompt that is
  more than one user turn, e.g. a system message or earlier tool turns; ``extra_info`` keys beyond ``index``; an
  ``agent_name``). Every row is written with verl's columns (``data_source``, ``prompt``, ``ability``,
  ``reward_model``, ``extra_info``, ``agent_name``) as the file gives them, one for one (no deduplication: rows
  of one prompt may differ in ``extra_info``; the loader's ``deduplicate=True`` does it), checked as the
  ``verl_parquet`` / ``verl_jsonl`` loaders check them, which read the output into the records they read from
  the input. ``--kind dapo`` on such a file is refused, naming the fields it would drop. (A parquet output from
  JSONL rows whose ``extra_info`` keys differ holds a null for the keys a row lacks, as any parquet does.)
* AIME: a problem column (``problem``, ``question``, ``Problem``, ``Question``) and an answer column (``answer``,
  ``Answer``, else ``solution`` / ``Solution``, whose last ``\\boxed{...}`` is taken). Written as ``id``,
  ``problem``, ``answer`` rows (the ``aime_jsonl`` / ``aime_parquet`` loaders read them and wrap each problem in
  DAPO's prompt template).
* GSM8K: ``question`` and ``answer``, a worked solution ending in ``#### 42`` (told apart from an AIME set by
  that line). Written in the same schema after every row's gold answer is extracted, as the ``gsm8k_jsonl`` /
  ``gsm8k_parquet`` loaders extract it (what follows ``####``, commas removed): a row without it is an error,
  never a worked solution taken as the answer. (MATH and MATH-500 downloads need no conversion: the ``math_*`` /
  ``math500_*`` loaders read them as they are.)

``--format array_record`` builds a TFDS array_record dataset of ``{prompt, answer}`` records under the output
directory instead (read through grain by the ``tfds`` loader; not for verl files, whose messages and
``extra_info`` it cannot hold). Every output is written to a temporary name, read
back through the project's loader, flushed to the disk, and only then renamed into place, so a failed run leaves no
partial file and a replaced build is put back if its swap fails. ``--config_name`` and ``--split`` are plain names
(they name a directory and files under ``--output``).
Errors print one ``error:`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollverify_jax.data import datasets, sources
from rollverify_jax.infra import storage

Row = dict[str, Any]

INPUT_SUFFIXES = (".parquet", ".jsonl", ".json")
FORMATS = ("jsonl", "parquet", "array_record")
PROBLEM_COLUMNS = ("problem", "question", "Problem", "Question")
ANSWER_COLUMNS = ("answer", "Answer")
SOLUTION_COLUMNS = ("solution", "Solution")
ID_COLUMNS = ("id", "ID", "problem_idx", "idx")
DAPO_COLUMNS = ("prompt", "reward_model")
GSM8K_COLUMNS = ("question", "answer")
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name")
KINDS = ("auto", "dapo", "verl", "aime", "gsm8k")
# A build's config name and split become one directory and part of its file names under the output directory:
# no separators, no leading dot (so never '.' or '..').
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class PrepareError(ValueError):
    """A problem with the inputs or arguments; the message names it and the fix."""


# ----------------------------------------------------------------------------------------------------------
# Reading inputs.


def input_files(inputs: Sequence[str]) -> list[Path]:
    """The files to read: each input file, or every parquet/JSONL/JSON file under an input directory."""
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in INPUT_SUFFIXES and p.is_file())
            if not found:
                raise PrepareError(f"no {'/'.join(INPUT_SUFFIXES)} files under the directory {name!r}")
            files.extend(found)
        elif not path.is_file():
            raise PrepareError(f"input file not found: {name!r} (download the dataset first and pass its path)")
        elif path.suffix not in INPUT_SUFFIXES:
            raise PrepareError(f"{name!r}: unsupported input type {path.suffix!r}; expected {INPUT_SUFFIXES}")
        else:
            files.append(path)
    return files


def columns_of(path: Path) -> list[str]:
    """Top-level column names: the parquet schema, or the keys of the first JSON row."""
    if path.suffix == ".parquet":
        try:
            return list(pq.read_schema(path).names)
        except (pa.ArrowInvalid, OSError) as e:
            raise PrepareError(f"{path} is not a readable parquet file: {e}") from e
    for row in read_rows(path):
        return list(row)
    raise PrepareError(f"{path} has no rows")


def read_rows(path: Path) -> Iterator[Row]:
    """Rows of one input file as dicts, streamed (the full DAPO-Math-17k file has 1.79M rows)."""
    if path.suffix == ".parquet":
        for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield _json_object(line, f"{path}: line {number}")
    else:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise PrepareError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(value, list):
            raise PrepareError(f"{path} must hold a JSON list of row objects, got {type(value).__name__}")
        for i, row in enumerate(value):
            if not isinstance(row, dict):
                raise PrepareError(f"{path}: item {i} is not a JSON object")
            yield row


def _json_object(line: str, where: str) -> Row:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise PrepareError(f"{where} is not a JSON object")
    return value


# ----------------------------------------------------------------------------------------------------------
# Schemas.


def detect_kind(path: Path, columns: Sequence[str]) -> str:
    """'dapo', 'gsm8k' or 'aime' from the columns (GSM8K's and AIME 2025's are alike: GSM8K's first answer is a
    worked solution with a ``####`` line); anything else is an unknown schema."""
    if all(c in columns for c in DAPO_COLUMNS):
        return "dapo"
    if all(c in columns for c in GSM8K_COLUMNS) and _is_worked_solution(next(read_rows(path), {}).get("answer")):
        return "gsm8k"
    if _first(columns, PROBLEM_COLUMNS) and _first(columns, ANSWER_COLUMNS + SOLUTION_COLUMNS):
        return "aime"
    raise PrepareError(
        f"{path}: unknown schema with columns {list(columns)}; expected DAPO-Math-17k (prompt, reward_model) or an "
        f"AIME set (one of {PROBLEM_COLUMNS} and one of {ANSWER_COLUMNS + SOLUTION_COLUMNS}); pass --kind with "
        "--problem_column / --answer_column to name the columns"
    )


def _is_worked_solution(answer: Any) -> bool:
    """GSM8K's answers end in a ``#### <answer>`` line; an AIME answer never holds one."""
    return isinstance(answer, str) and "####" in answer


def _first(columns: Sequence[str], candidates: Sequence[str]) -> str | None:
    return next((c for c in candidates if c in columns), None)


def check_columns(path: Path, columns: Sequence[str], kind: str, problem_col: str | None, answer_col: str | None):
    """The (problem, answer) columns an AIME file is read from; for DAPO, that its columns are there."""
    if kind in ("dapo", "verl", "gsm8k"):
        needed, label = {"dapo": (DAPO_COLUMNS, "DAPO-Math-17k"), "verl": (DAPO_COLUMNS, "a verl RL file"),
                         "gsm8k": (GSM8K_COLUMNS, "GSM8K")}[kind]
        missing = [c for c in needed if c not in columns]
        if missing:
            raise PrepareError(f"{path}: missing column(s) {missing} for {label} (columns: {list(columns)}); "
                               f"pass the {label} file, or --kind aime for an AIME set")
        return None, None
    problem = problem_col or _first(columns, PROBLEM_COLUMNS)
    answer = answer_col or _first(columns, ANSWER_COLUMNS) or _first(columns, SOLUTION_COLUMNS)
    for role, name, candidates in (("problem", problem, PROBLEM_COLUMNS),
                                   ("answer", answer, ANSWER_COLUMNS + SOLUTION_COLUMNS)):
        if name is None or name not in columns:
            raise PrepareError(f"{path}: missing the {role} column ({name or ' / '.join(candidates)}; columns: "
                               f"{list(columns)}); name it with --{role}_column")
    return problem, answer


def dapo_row(row: Row, path: Path, where: str) -> Row:
    """A DAPO-Math-17k row in the dataset's own schema, its fields checked as the loaders check them."""
    prompt = sources.prompt_text(sources.get_field(row, "prompt", str(path), where), str(path), where)
    truth = sources.get_field(row, "reward_model.ground_truth", str(path), where)
    answer = sources.answer_text(truth, "reward_model.ground_truth", str(path), where)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return {
        "data_source": str(row.get("data_source") or "math_dapo"),
        "prompt": [{"role": "user", "content": prompt}],
        "ability": str(row.get("ability") or "MATH"),
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": str(extra.get("index", where.split()[-1]))},
    }


def verl_fields(row: Row) -> list[str]:
    """What of a (prompt, reward_model) row DAPO-Math-17k's schema would drop (``dapo_row`` keeps the last user
    turn, data_source, ability, the ground truth and ``extra_info.index``): a verl RL file's system message,
    earlier turns, ``extra_info`` and ``agent_name``. A null is absent (parquet writes one for a key another row
    has)."""
    found = []
    prompt = row.get("prompt")
    if isinstance(prompt, list | tuple):
        turn = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], dict) else {}
        if turn.get("role") != "user" or {k for k, v in turn.items() if v is not None} - {"role", "content"}:
            found.append(f"a prompt of {len(prompt)} message(s) with roles "
                         f"{[m.get('role') if isinstance(m, dict) else m for m in prompt]!r:.80}")
    info = row.get("extra_info")
    if info is not None:
        keys = sorted(k for k, v in info.items() if v is not None and k != "index") if isinstance(info, dict) else None
        if keys is None or keys:
            found.append(f"extra_info keys {keys}" if keys else f"an extra_info of type {type(info).__name__}")
    if row.get("agent_name") is not None:
        found.append(f"agent_name {row['agent_name']!r:.40}")
    return found


def verl_row(row: Row, path: Path, where: str) -> Row:
    """A verl RL row with verl's columns as given, once the ``verl_*`` loaders' own row parser accepts it (the
    output then reads back into the same records)."""
    parse = sources.PRESETS["verl"][0]
    parse(row, 0, str(path), where, sources.TEMPLATES["none"], None)
    return {k: row[k] for k in VERL_COLUMNS if k in row}


def aime_row(row: Row, path: Path, where: str, problem_col: str, answer_col: str, index: int) -> Row:
    """An ``id, problem, answer`` row; a solution column gives its last ``\\boxed{}``."""
    problem = row.get(problem_col)
    if not isinstance(problem, str) or not problem.strip():
        raise PrepareError(f"{path}: {where}: column {problem_col!r} must be a non-empty string")
    answer = sources.scalar_text(row.get(answer_col))
    if answer is None:
        raise PrepareError(f"{path}: {where}: column {answer_col!r} must be a string or number, got "
                           f"{row.get(answer_col)!r}")
    if _is_worked_solution(answer):
        raise PrepareError(f"{path}: {where}: column {answer_col!r} holds a worked solution with a '####' line "
                           "(GSM8K's layout), not a final answer; pass --kind gsm8k")
    if answer_col in SOLUTION_COLUMNS and not re.fullmatch(r"-?\d+", answer):
        boxed = sources.boxed_gold(answer)
        if boxed is None:
            raise PrepareError(f"{path}: {where}: no \\boxed{{...}} answer in column {answer_col!r}; pass "
                               "--answer_column with the column that holds the final answer")
        answer = boxed
    answer = sources.aime_gold(answer)  # AIME answers are integers 000-999: "033" and "33" are one answer
    if not answer:
        raise PrepareError(f"{path}: {where}: column {answer_col!r} is empty")
    row_id = next((row[c] for c in ID_COLUMNS if row.get(c) is not None), index)
    return {"id": str(row_id), "problem": problem.strip(), "answer": answer}


def gsm8k_row(row: Row, path: Path, where: str) -> Row:
    """A GSM8K row in its own schema, once its gold answer extracts as the ``gsm8k_*`` loaders extract it."""
    question = sources.text_field(sources.get_field(row, "question", str(path), where), "question", str(path), where)
    solution = sources.text_field(sources.get_field(row, "answer", str(path), where), "answer", str(path), where)
    sources.extracted(sources.gsm8k_gold(solution), "answer", str(path), where,
                      "a worked solution ending in '#### <answer>'")
    return {"question": question, "answer": solution}


class _VerlFile(Exception):
    """A file read as DAPO-Math-17k turned out to hold verl fields: it is read again as verl."""


def convert(files: Sequence[Path], kind: str, problem_col: str | None, answer_col: str | None,
            keep_duplicates: bool) -> tuple[str, list[Row], int]:
    """(kind, rows in the project's schema, rows read) over every input file. A (prompt, reward_model) file is
    DAPO-Math-17k until a row holds what that schema would drop (``verl_fields``); then the file is read again
    as verl (one pass for DAPO-Math-17k's 1.79M rows)."""
    rows: list[Row] = []
    seen: set[str] = set()
    read = 0
    auto = kind == "auto"
    for path in files:
        columns = columns_of(path)
        file_kind = detect_kind(path, columns) if auto else kind
        args = (rows, seen, problem_col, answer_col, keep_duplicates, read, auto)
        try:
            read += _convert_file(path, columns, file_kind, kind, *args)
        except _VerlFile:
            file_kind = "verl"
            read += _convert_file(path, columns, file_kind, kind, *args)
        kind = file_kind
    if not rows:
        raise PrepareError(f"the inputs {[str(f) for f in files]} hold no rows")
    return kind, rows, read


def _convert_file(path: Path, columns: Sequence[str], kind: str, before: str, rows: list[Row], seen: set[str],
                  problem_col: str | None, answer_col: str | None, keep_duplicates: bool, read: int,
                  auto: bool) -> int:
    """Appends ``path``'s rows as ``kind`` to ``rows`` (the inputs before it hold ``before`` rows); returns the
    rows read. Raises ``_VerlFile`` (``rows`` as it was) when an auto-detected DAPO file holds verl fields."""
    if rows and kind != before:
        raise PrepareError(f"{path} holds {kind} rows but the inputs before it hold {before} rows; "
                           "convert them separately")
    problem, answer = check_columns(path, columns, kind, problem_col, answer_col)
    start, count = len(rows), 0
    for i, raw in enumerate(read_rows(path)):
        where = f"row {i}"
        if kind == "dapo":
            extra = verl_fields(raw)
            if extra and auto:
                del rows[start:]
                raise _VerlFile
            if extra:
                raise PrepareError(f"{path}: {where} holds {'; '.join(extra)}, which the DAPO-Math-17k schema drops; "
                                   "convert it with --kind verl (read by the verl_parquet / verl_jsonl loader)")
            row = dapo_row(raw, path, where)
        elif kind == "verl":
            row = verl_row(raw, path, where)
        elif kind == "gsm8k":
            row = gsm8k_row(raw, path, where)
        else:
            row = aime_row(raw, path, where, problem, answer, read + count)
        count += 1
        key = row["prompt"][0]["content"] if kind == "dapo" else row.get("problem") or row.get("question")
        if kind == "dapo" and not keep_duplicates and key in seen:
            continue
        seen.add(key)
        rows.append(row)
    return count


# ----------------------------------------------------------------------------------------------------------
# Writing.


def output_format(output: str, fmt: str | None) -> str:
    """``--format``, else the output's extension (a directory output needs ``--format array_record``)."""
    if fmt is not None:
        return fmt
    suffix = Path(output).suffix.lstrip(".")
    if suffix in ("jsonl", "parquet"):
        return suffix
    raise PrepareError(f"cannot tell the output format of {output!r}: end it in .jsonl or .parquet, or pass "
                       "--format array_record for a TFDS directory")


def write_file(rows: Sequence[Row], path: Path, fmt: str) -> None:
    """JSONL or parquet rows (parquet keeps DAPO's nested columns as structs and lists)."""
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        pq.write_table(pa.Table.from_pylist(list(rows)), path)


def loader_name(kind: str, fmt: str) -> str:
    return f"{kind}_{fmt}"


def write_atomic(rows: Sequence[Row], output: Path, kind: str, fmt: str) -> int:
    """Writes a temporary file beside ``output``, reads it back with the project's loader, renames it into
    place; returns the number of records the loader reads."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")  # same directory: the rename is atomic
    try:
        write_file(rows, tmp, fmt)
        count = len(datasets.get_dataset(loader_name(kind, fmt), path=str(tmp)))
        storage.fsync(tmp)
        os.replace(tmp, output)
        storage.fsync_dir(output.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return count


def check_name(name: str, flag: str) -> str:
    """A build's ``--config_name`` or ``--split``: one plain path component, so the build stays inside the output
    directory (an absolute name or ``..`` would move and delete a directory elsewhere)."""
    if not NAME.fullmatch(name):
        raise PrepareError(f"{flag}={name!r} must be a plain name (letters, digits, '_', '.', '-'; not starting "
                           "with '.'): it names a directory under --output")
    return name


def write_array_record(rows: Sequence[Row], data_dir: Path, kind: str, config_name: str, split: str) -> int:
    """Builds ``<data_dir>/math_prompts/<config_name>`` in a temporary directory beside it, reads it back through
    grain, then swaps it into place (an existing build of that name is replaced; if the swap fails, it is put
    back)."""
    check_name(config_name, "--config_name")
    check_name(split, "--split")
    data_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".prepare_data.", dir=data_dir))
    try:
        source = scratch / "rows.jsonl"
        write_file(rows, source, "jsonl")
        datasets.build_tfds(str(source), loader_name(kind, "jsonl"), str(scratch / "build"), config_name, split)
        count = len(datasets.load_tfds(str(scratch / "build"), config_name=config_name, split=split))
        build = scratch / "build" / "math_prompts" / config_name
        storage.fsync(build)
        target = data_dir / "math_prompts" / config_name
        target.parent.mkdir(parents=True, exist_ok=True)
        _swap_into_place(build, target, scratch / "previous")
        storage.fsync_dir(target.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return count


def _swap_into_place(build: Path, target: Path, old: Path) -> None:
    """Renames ``build`` to ``target``, the previous ``target`` moved to ``old`` first and put back if the second
    rename fails (``old`` is removed with the scratch directory only after a good swap)."""
    previous = target.exists()
    if previous:
        os.replace(target, old)
    try:
        os.replace(build, target)
    except BaseException:
        if previous:
            os.replace(old, target)
        raise


def gin_hint(kind: str, fmt: str, output: str, config_name: str, split: str) -> str:
    """The bindings that point a config at the output."""
    role = "train" if kind in ("dapo", "verl", "gsm8k") else "eval"
    if fmt == "array_record":
        name, kwargs = "tfds", {"data_dir": output, "config_name": config_name, "split": split}
    else:
        name, kwargs = loader_name(kind, fmt), {"path": output}
    return f"TrainConfig.{role}_dataset = {name!r}\nTrainConfig.{role}_dataset_kwargs = {kwargs!r}"


# ----------------------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="parquet / JSONL / JSON files, or directories holding them")
    ap.add_argument("--output", required=True, help="output file (.jsonl, .parquet) or TFDS data_dir")
    ap.add_argument("--format", choices=FORMATS, default=None, help="default: the output's extension")
    ap.add_argument("--kind", choices=KINDS, default="auto", help="default: from the columns")
    ap.add_argument("--problem_column", default=None, help="AIME: the column holding the problem text")
    ap.add_argument("--answer_column", default=None, help="AIME: the column holding the final answer")
    ap.add_argument("--keep_duplicates", action="store_true", help="DAPO: keep every repeat of a prompt")
    ap.add_argument("--config_name", default=None, help="array_record: the build's name (default: the kind)")
    ap.add_argument("--split", default="train", help="array_record: the split name (default: train)")
    return ap.parse_args(argv)


def prepare(args: argparse.Namespace) -> str:
    """Runs the conversion; returns the report to print."""
    fmt = output_format(args.output, args.format)
    if fmt == "array_record":  # checked before the inputs are read
        if args.config_name is not None:
            check_name(args.config_name, "--config_name")
        check_name(args.split, "--split")
    files = input_files(args.inputs)
    kind, rows, read = convert(files, args.kind, args.problem_column, args.answer_column, args.keep_duplicates)
    config_name = args.config_name or kind
    if fmt == "array_record" and kind == "verl":
        raise PrepareError(f"{files[0]} is a verl RL file: an array_record build holds prompt and answer only, "
                           "not its messages and extra_info; write .parquet or .jsonl (read by the verl_parquet / "
                           "verl_jsonl loader)")
    if fmt == "array_record":
        count = write_array_record(rows, Path(args.output), kind, config_name, args.split)
    else:
        count = write_atomic(rows, Path(args.output), kind, fmt)
    dropped = f", {read - len(rows)} duplicate prompts dropped" if read != len(rows) else ""
    return (f"wrote {args.output} ({fmt}): {count} {kind} problems from {read} rows of {len(files)} file(s)"
            f"{dropped}\nin the gin config:\n{gin_hint(kind, fmt, args.output, config_name, args.split)}")


def one_line(e: Exception) -> str:
    """An error's text on one line, without the 'In call to configurable' lines gin appends."""
    lines = [line.strip() for line in str(e).splitlines() if not line.startswith("  In call to configurable")]
    return " ".join(line for line in lines if line)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        report = prepare(args)
    except (ValueError, OSError) as e:  # PrepareError and DatasetSchemaError are ValueErrors
        print(f"error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    print(report)


if __name__ == "__main__":
    main()
