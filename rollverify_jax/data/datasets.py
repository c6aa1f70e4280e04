"""Prompt datasets: the presets (DAPO-Math-17k, AIME, GSM8K, MATH, MATH-500) and verl's parquet layout
(``sources``), weighted mixtures (``mixture``), the synthetic task, TFDS array_record + grain, and a
deterministic resumable batch iterator.

Every loader returns a random-access sequence of records (a list, or a ``grain.MapDataset`` for TFDS), so
``PromptIterator`` can shuffle by index and resume from two integers. A record is a JSON-serialisable dict (it is
checkpointed with the paused groups):

* ``prompt: str`` -- the problem text with its template applied: what a non-chat policy sees, and the user turn
  of a chat prompt (``TrainConfig.chat_template``) when the record has no ``messages``;
* ``answer: str`` -- the gold answer, extracted (GSM8K's ``#### 42``, MATH's last ``\\boxed{}``);
* ``data_source: str`` -- verl's field, which reward grades it (``RewardScorer.by_data_source``): the row's own,
  else the preset's name (``"openai/gsm8k"``, ``"math_dapo"``, ...). The synthetic task's records (and TFDS
  builds, whose features are prompt/answer text) carry none: read it with ``data.data_source_of``, which says
  ``"unknown"`` then;
* optional ``messages: list[{"role", "content"}]`` -- the whole chat prompt as the file gives it, system
  messages included, its last user turn with the template applied (verl's ``prompt`` column);
* optional ``extra_info: dict`` -- kept whole (verl's ``extra_info``; a preset's other columns, e.g. MATH's
  ``solution``, ``level``): a reward function receives it.
* optional ``agent_name: str`` -- verl's agent loop for the row, ``"single_turn_agent"`` or ``"tool_agent"``
  (a verl multi-turn file's top-level column; its tool arguments stay in ``extra_info``: ``sources``).

Keys that are not set are absent, never null, so a record of the two original keys hashes as before
(``records_fingerprint``).

TFDS works here without TensorFlow (``tfds_source``, imported only by the TFDS functions: tensorflow_datasets is
slow to import and no other path needs it; what both sides need of a build is ``math_prompts``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from rollverify_jax.data import mixture, synthetic, synthetic_tools
from rollverify_jax.data import sources as files
from rollverify_jax.data.math_prompts import tfds_dir
from rollverify_jax.data.sources import (  # noqa: F401  (the names this module has always exported)
    DAPO_TEMPLATE,
    TEMPLATES,
    DatasetSchemaError,
    apply_dapo_template,
    apply_template,
)

Record = dict[str, Any]

def load_synthetic(n: int = 4096, seed: int = 0, split: str = "train", **task_kwargs) -> list[Record]:
    """Prompt/answer records of the synthetic task (no template: the tiny model has its own format; no
    data_source key: its records stay as runs before that key hashed them)."""
    if n < 1:
        raise ValueError(f"load_synthetic needs n >= 1, got {n}")
    return [
        {"prompt": r["prompt"], "answer": r["answer"]}
        for r in synthetic.make_split(n, seed, split=split, **task_kwargs)
    ]


def load_synthetic_tools(n: int = 4096, seed: int = 0, split: str = "train", **task_kwargs) -> list[Record]:
    """Prompt/answer records of the tool variant of the synthetic task (``synthetic_tools``): the same records as
    ``load_synthetic``'s, for a policy that calls the calculator (``ToolUseConfig``)."""
    if n < 1:
        raise ValueError(f"load_synthetic_tools needs n >= 1, got {n}")
    return [
        {"prompt": r["prompt"], "answer": r["answer"]}
        for r in synthetic_tools.make_split(n, seed, split=split, **task_kwargs)
    ]


load_dapo_jsonl, load_dapo_parquet = files.FILE_LOADERS["dapo_jsonl"], files.FILE_LOADERS["dapo_parquet"]
load_aime_jsonl, load_aime_parquet = files.FILE_LOADERS["aime_jsonl"], files.FILE_LOADERS["aime_parquet"]


def load_mixture(sources: Sequence[Mapping[str, Any]], seed: int = 0, size: int | None = None) -> list[Record]:
    """Several datasets mixed by weight (the semantic is ``mixture``'s docstring): ``sources`` is a list of
    ``{'name': <registered dataset>, 'weight': <number > 0, default 1>, **its arguments}``, e.g.
    ``[{'name': 'gsm8k_parquet', 'weight': 2, 'path': ...}, {'name': 'math_parquet', 'path': ...}]``."""
    if isinstance(sources, str | bytes | Mapping) or not isinstance(sources, Sequence) or not sources:
        raise ValueError(f"mixture: sources must be a non-empty list of {{'name': ..., 'weight': ..., ...}} dicts, "
                         f"got {sources!r:.120}")
    parts, weights = [], []
    for i, source in enumerate(sources):
        where = f"mixture source {i}"
        if not isinstance(source, Mapping) or not isinstance(source.get("name"), str):
            raise ValueError(f"{where}: must be a dict with a 'name' (a registered dataset), got {source!r:.120}")
        kwargs = {k: v for k, v in source.items() if k not in ("name", "weight")}
        name = source["name"]
        if name == "mixture":
            raise ValueError(f"{where}: a mixture cannot hold a mixture; list its sources here instead")
        if name not in DATASETS:
            raise ValueError(f"{where}: unknown dataset {name!r}; known datasets: {sorted(DATASETS)}")
        weights.append(mixture.check_weight(source.get("weight", 1), f"{where} ({name!r})"))
        try:
            parts.append(list(get_dataset(name, **kwargs)))
        except TypeError as e:  # a keyword its loader does not take
            raise TypeError(f"{where} ({name!r}): arguments {kwargs} do not fit the loader: {e}") from None
    return mixture.mix(parts, weights, seed=seed, size=size)


# ----------------------------------------------------------------------------------------------------------
# TFDS (array_record) + grain.


def __getattr__(name: str) -> Any:
    """``MathPrompts`` (the TFDS builder) loads with tensorflow_datasets on first access (PEP 562)."""
    if name == "MathPrompts":
        from rollverify_jax.data.tfds_source import MathPrompts

        return MathPrompts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_tfds(
    source: str, source_format: str, data_dir: str, config_name: str = "default", split: str = "train"
) -> str:
    """Convert a DAPO/AIME file to array_record under ``data_dir``; returns the dataset directory."""
    from rollverify_jax.data.tfds_source import MathPrompts  # TFDS is imported only where it is used

    files.check_file(source)
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
    from rollverify_jax.data.tfds_source import data_source as tfds_data_source

    data_source = tfds_data_source(path, split)
    if len(data_source) == 0:
        raise ValueError(f"TFDS dataset {path!r} split {split!r} is empty")
    return grain.MapDataset.source(data_source).map(_decode)


# ----------------------------------------------------------------------------------------------------------
# Registry.

DATASETS: dict[str, Callable[..., Sequence[Record]]] = {
    "synthetic": load_synthetic,
    "synthetic_tools": load_synthetic_tools,
    **files.FILE_LOADERS,
    "tfds": load_tfds,
    "mixture": load_mixture,
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


# data_sources the loaders of DAPO-Math-17k and AIME files name, which their records did not carry before the
# key existed (the dataset's name, which implies them, is in the fingerprint as data.train_dataset): hashed as if
# absent, so a run started before then resumes on its unchanged data.
_IMPLIED_SOURCES = frozenset({files.DAPO_SOURCE, files.AIME_SOURCE})


def records_fingerprint(records: Sequence[Record]) -> dict[str, int | str]:
    """The number of records and a SHA-256 over them in order (each as sorted-key JSON of the keys it has): what
    a resume compares, so a data file edited in place, even to the same row count, is not resumed on other prompts
    in silence. A record of only ``prompt`` and ``answer`` hashes as it always has."""
    digest = hashlib.sha256()
    for record in records:
        if record.get("data_source") in _IMPLIED_SOURCES:
            record = {k: v for k, v in record.items() if k != "data_source"}
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

    def next_record(self) -> Record:
        """The next record, for a consumer that draws one at a time (rollout starts one group per record): an
        iterator of ``batch_size`` 1, whose position then moves one record per call."""
        if self.batch_size != 1:
            raise ValueError(f"PromptIterator.next_record draws one record at a time; this iterator has "
                             f"batch_size={self.batch_size} (use next_batch).")
        return self.next_batch()[0]

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
