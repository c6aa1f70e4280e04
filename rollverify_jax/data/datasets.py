"""Prompt datasets: DAPO-Math-17k / AIME files, the synthetic task, TFDS array_record + grain, and a
deterministic resumable batch iterator.

Every loader returns a random-access sequence of records ``{"prompt": str, "answer": str}`` (a list, or a
``grain.MapDataset`` for TFDS), so ``PromptIterator`` can shuffle by index and resume from two integers.

TFDS works here without TensorFlow: ``GeneratorBasedBuilder`` with ``file_format='array_record'`` writes
array_record shards through the ``array_record`` module, and ``as_data_source`` reads them back with pure
Python decoding (``Text`` features come back as ``bytes``). Only ``as_dataset`` (tf.data) needs TensorFlow,
and nothing here calls it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow_datasets as tfds

from rollverify_jax.data import synthetic

Record = dict[str, str]

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
_TEMPLATE_HEAD = DAPO_TEMPLATE.split("{problem}")[0].strip()

DAPO_FIELDS = ("prompt", "reward_model.ground_truth")
AIME_FIELDS = ("problem", "answer")


class DatasetSchemaError(ValueError):
    """A row lacks a field or has the wrong type; the message names the field, the file and the row."""


# ----------------------------------------------------------------------------------------------------------
# Prompt template.


def apply_dapo_template(problem: str) -> str:
    """Wrap a problem in DAPO's prompt; a prompt that already carries the template is kept as is."""
    if _TEMPLATE_HEAD in problem:
        return problem
    return DAPO_TEMPLATE.replace("{problem}", problem)


# ----------------------------------------------------------------------------------------------------------
# Raw rows.


def _check_file(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"dataset file not found: {path!r} (check the path bound in the gin config; "
            "scripts/prepare_data.py converts DAPO-Math-17k and AIME downloads into it)"
        )
    return path


def _iter_jsonl(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
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


def _iter_parquet(path: str, fields: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of a parquet file, reading only the top-level columns the fields need."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file: {e}") from e
    columns = list(dict.fromkeys(field.split(".")[0] for field in fields))
    for column in columns:
        if column not in schema.names:
            raise DatasetSchemaError(
                f"{path}: row 0: missing field {column!r} (the parquet file has no such column; "
                f"columns: {schema.names})"
            )
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=columns, batch_size=8192):
        for value in batch.to_pylist():
            yield f"row {row}", value
            row += 1


def _get_field(row: dict[str, Any], field: str, path: str, where: str) -> Any:
    """A dotted field (``reward_model.ground_truth``) from a nested row; missing or null is an error."""
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise DatasetSchemaError(f"{path}: {where}: missing field {field!r}")
        value = value[part]
    return value


def _prompt_text(value: Any, path: str, where: str) -> str:
    """DAPO's ``prompt`` is a string or chat messages; the last user message is the problem text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1].get("content"), str):
            return users[-1]["content"]
    raise DatasetSchemaError(
        f"{path}: {where}: field 'prompt' must be a string or a list of chat messages "
        f'[{{"role": "user", "content": ...}}], got {type(value).__name__}'
    )


def _answer_text(value: Any, field: str, path: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetSchemaError(f"{path}: {where}: field {field!r} must be a string or number")
    return str(value).strip()


# ----------------------------------------------------------------------------------------------------------
# File loaders.


def _finish(records: list[Record], path: str, max_rows: int | None, deduplicate: bool) -> list[Record]:
    """Optional dedup (DAPO-Math-17k repeats each problem many times) and truncation; empty is an error."""
    if deduplicate:
        records = _first_per_prompt(records)
    if max_rows is not None:
        records = records[:max_rows]
    if not records:
        raise ValueError(f"dataset file {path!r} has no rows")
    return records


def _first_per_prompt(records: list[Record]) -> list[Record]:
    seen: set[str] = set()
    kept = []
    for record in records:
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            kept.append(record)
    return kept


def _load_dapo(rows: Iterator[tuple[str, dict]], path: str, apply_template: bool) -> list[Record]:
    records = []
    for where, row in rows:
        prompt = _prompt_text(_get_field(row, "prompt", path, where), path, where)
        answer = _answer_text(
            _get_field(row, "reward_model.ground_truth", path, where), DAPO_FIELDS[1], path, where
        )
        records.append(
            {"prompt": apply_dapo_template(prompt) if apply_template else prompt, "answer": answer}
        )
    return records


def _load_aime(rows: Iterator[tuple[str, dict]], path: str, apply_template: bool) -> list[Record]:
    records = []
    for where, row in rows:
        problem = _get_field(row, "problem", path, where)
        if not isinstance(problem, str):
            raise DatasetSchemaError(f"{path}: {where}: field 'problem' must be a string")
        answer = _answer_text(_get_field(row, "answer", path, where), "answer", path, where)
        records.append(
            {"prompt": apply_dapo_template(problem) if apply_template else problem, "answer": answer}
        )
    return records


def load_dapo_jsonl(
    path: str, apply_template: bool = True, deduplicate: bool = False, max_rows: int | None = None
) -> list[Record]:
    """DAPO-Math-17k rows (``prompt``, ``reward_model.ground_truth``) from JSONL."""
    path = _check_file(path)
    return _finish(_load_dapo(_iter_jsonl(path), path, apply_template), path, max_rows, deduplicate)


def load_dapo_parquet(
    path: str, apply_template: bool = True, deduplicate: bool = False, max_rows: int | None = None
) -> list[Record]:
    """DAPO-Math-17k rows from parquet (the layout the dataset ships in)."""
    path = _check_file(path)
    rows = _iter_parquet(path, DAPO_FIELDS)
    return _finish(_load_dapo(rows, path, apply_template), path, max_rows, deduplicate)


def load_aime_jsonl(
    path: str, apply_template: bool = True, deduplicate: bool = False, max_rows: int | None = None
) -> list[Record]:
    """AIME-style eval rows (``problem``, ``answer``) from JSONL, wrapped in DAPO's template."""
    path = _check_file(path)
    return _finish(_load_aime(_iter_jsonl(path), path, apply_template), path, max_rows, deduplicate)


def load_aime_parquet(
    path: str, apply_template: bool = True, deduplicate: bool = False, max_rows: int | None = None
) -> list[Record]:
    """AIME-style eval rows from parquet."""
    path = _check_file(path)
    rows = _iter_parquet(path, AIME_FIELDS)
    return _finish(_load_aime(rows, path, apply_template), path, max_rows, deduplicate)


def load_synthetic(n: int = 4096, seed: int = 0, split: str = "train", **task_kwargs) -> list[Record]:
    """Prompt/answer records of the synthetic task (no template: the tiny model has its own format)."""
    if n < 1:
        raise ValueError(f"load_synthetic needs n >= 1, got {n}")
    return [
        {"prompt": r["prompt"], "answer": r["answer"]}
        for r in synthetic.make_split(n, seed, split=split, **task_kwargs)
    ]


FILE_LOADERS: dict[str, Callable[..., list[Record]]] = {
    "dapo_jsonl": load_dapo_jsonl,
    "dapo_parquet": load_dapo_parquet,
    "aime_jsonl": load_aime_jsonl,
    "aime_parquet": load_aime_parquet,
}


# ----------------------------------------------------------------------------------------------------------
# TFDS (array_record) + grain.


class MathPrompts(tfds.core.GeneratorBasedBuilder):
    """Converts a DAPO/AIME file into array_record shards of ``{prompt, answer}`` text records.

    One builder config per converted source (``config_name``), so several sources share a ``data_dir``:
    ``<data_dir>/math_prompts/<config_name>/1.0.0``. An existing build is reused; delete it to rebuild.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "prompt/answer text records converted from DAPO-Math-17k or AIME files."}

    def __init__(
        self,
        *,
        source: str | None = None,
        source_format: str = "dapo_parquet",
        config_name: str = "default",
        split: str = "train",
        **kwargs,
    ):
        if source_format not in FILE_LOADERS:
            raise ValueError(f"unknown source_format {source_format!r}; known: {sorted(FILE_LOADERS)}")
        self._source, self._source_format, self._split = source, source_format, split
        kwargs.setdefault("file_format", "array_record")
        config = tfds.core.BuilderConfig(name=config_name, description=f"{source_format}: {source}")
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict(
            {"prompt": tfds.features.Text(), "answer": tfds.features.Text()}
        )
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__, features=features)

    def _split_generators(self, dl_manager):
        if self._source is None:
            raise ValueError("MathPrompts needs source=<path to a DAPO/AIME file> to build")
        return {self._split: self._generate_examples()}

    def _generate_examples(self):
        yield from enumerate(FILE_LOADERS[self._source_format](self._source))


def tfds_dir(data_dir: str, config_name: str = "default") -> str:
    """Where ``MathPrompts`` puts a build of config ``config_name``."""
    return os.path.join(os.fspath(data_dir), "math_prompts", config_name, str(MathPrompts.VERSION))


def build_tfds(
    source: str, source_format: str, data_dir: str, config_name: str = "default", split: str = "train"
) -> str:
    """Convert a DAPO/AIME file to array_record under ``data_dir``; returns the dataset directory."""
    _check_file(source)
    builder = MathPrompts(
        source=os.fspath(source),
        source_format=source_format,
        config_name=config_name,
        split=split,
        data_dir=os.fspath(data_dir),
    )
    builder.download_and_prepare()
    return tfds_dir(data_dir, config_name)


def _decode(example: dict[str, Any]) -> Record:
    """TFDS data sources return Text features as bytes."""
    return {
        key: value.decode("utf-8") if isinstance(value, bytes) else str(value)
        for key, value in example.items()
    }


def load_tfds(
    data_dir: str,
    config_name: str = "default",
    split: str = "train",
    source: str | None = None,
    source_format: str = "dapo_parquet",
) -> grain.MapDataset:
    """Records of a ``MathPrompts`` build as a ``grain.MapDataset``; builds it first if ``source`` is set."""
    path = tfds_dir(data_dir, config_name)
    if not os.path.isdir(path):
        if source is None:
            raise FileNotFoundError(
                f"no TFDS dataset at {path!r}; build it with "
                "build_tfds(source, source_format, data_dir, config_name) or pass source= to load_tfds"
            )
        build_tfds(source, source_format, data_dir, config_name=config_name, split=split)
    data_source = tfds.builder_from_directory(path).as_data_source(split=split)
    if len(data_source) == 0:
        raise ValueError(f"TFDS dataset {path!r} split {split!r} is empty")
    return grain.MapDataset.source(data_source).map(_decode)


# ----------------------------------------------------------------------------------------------------------
# Registry.

DATASETS: dict[str, Callable[..., Sequence[Record]]] = {
    "synthetic": load_synthetic,
    **FILE_LOADERS,
    "tfds": load_tfds,
}


def get_dataset(name: str, **kwargs) -> Sequence[Record]:
    """The dataset registered under ``name``, built with ``kwargs`` (e.g. ``path=...``)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {sorted(DATASETS)}")
    return DATASETS[name](**kwargs)


# ----------------------------------------------------------------------------------------------------------
# Prompt lengths against the room the engine leaves for a prompt.


def length_summary(lengths: Sequence[int], max_prompt_len: int) -> dict[str, int | float]:
    """Prompt-token statistics and how many exceed ``max_prompt_len`` (what a dry run reports and a start
    filters)."""
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return {"count": 0, "max_prompt_len": int(max_prompt_len), "over_limit": 0}
    return {
        "count": int(values.size),
        "min": int(values.min()),
        "mean": round(float(values.mean()), 1),
        "p50": int(np.percentile(values, 50, method="lower")),
        "p99": int(np.percentile(values, 99, method="higher")),
        "max": int(values.max()),
        "max_prompt_len": int(max_prompt_len),
        "over_limit": int((values > max_prompt_len).sum()),
    }


def drop_long_prompts(
    records: Sequence[Record], lengths: Sequence[int], max_prompt_len: int
) -> tuple[list[Record], int]:
    """The records whose prompt fits ``max_prompt_len`` tokens, in order, and the number dropped.

    Filtering once at start keeps an over-long prompt from failing the run when the scheduler admits it.
    """
    if len(records) != len(lengths):
        raise ValueError(f"{len(records)} records but {len(lengths)} prompt lengths")
    kept = [record for record, n in zip(records, lengths, strict=True) if n <= max_prompt_len]
    return kept, len(records) - len(kept)


def records_fingerprint(records: Sequence[Record]) -> dict[str, int | str]:
    """The number of records and a SHA-256 over them in order (each as sorted-key JSON): what a resume compares,
    so a data file edited in place, even to the same row count, is not resumed on other prompts in silence."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        digest.update(b"\n")
    return {"records": len(records), "sha256": digest.hexdigest()}


# ----------------------------------------------------------------------------------------------------------
# Deterministic, resumable batches of prompts.


class PromptIterator:
    """Endless batches of ``batch_size`` records, epoch after epoch, each epoch shuffled by (seed, epoch).

    The position is two integers (epoch, index within the epoch's order), so ``get_state`` is JSON and
    ``set_state`` reproduces the exact following batches. A batch that crosses an epoch boundary is filled
    from the next epoch's order.
    """

    def __init__(
        self,
        records_source: Sequence[Record] | grain.MapDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"PromptIterator.batch_size must be >= 1, got {batch_size}")
        if not 0 <= seed < 2**32:
            raise ValueError(f"PromptIterator.seed must be in [0, 2**32), got {seed}")
        self.num_records = len(records_source)
        if self.num_records == 0:
            raise ValueError("PromptIterator got an empty dataset; check the dataset path and filters")
        is_dataset = isinstance(records_source, grain.MapDataset)
        self._dataset = records_source if is_dataset else grain.MapDataset.source(records_source)
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.epoch, self.index = 0, 0
        self._order: tuple[int, grain.MapDataset] | None = None

    def epoch_seed(self, epoch: int) -> int:
        """Independent 32-bit shuffle seed per (seed, epoch)."""
        return int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])

    def _epoch_dataset(self, epoch: int) -> grain.MapDataset:
        if not self.shuffle:
            return self._dataset
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self._dataset.shuffle(seed=self.epoch_seed(epoch)))
        return self._order[1]

    def next_batch(self) -> list[Record]:
        """The next ``batch_size`` records."""
        batch: list[Record] = []
        while len(batch) < self.batch_size:
            dataset = self._epoch_dataset(self.epoch)
            stop = min(self.num_records, self.index + self.batch_size - len(batch))
            batch.extend(dict(dataset[i]) for i in range(self.index, stop))
            self.index = stop
            if self.index == self.num_records:
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[Record]:
        return self.next_batch()

    def get_state(self) -> dict[str, int | bool]:
        """JSON-serialisable position; the other fields guard against resuming on different data."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": self.num_records,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume at a position from ``get_state``; a state from other data or another seed is an error."""
        for key, mine in (("num_records", self.num_records), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"PromptIterator state has {key}={state[key]!r} but this iterator has {key}={mine!r}; "
                    "the dataset or its binding changed since the checkpoint"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.num_records:
            raise ValueError(
                f"PromptIterator state out of range: epoch={epoch}, index={index}, n={self.num_records}"
            )
        self.epoch, self.index = epoch, index
