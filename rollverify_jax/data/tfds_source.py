"""The TFDS side of the ``tfds`` dataset: the ``MathPrompts`` builder and the reader of its array_record builds.

Kept out of ``datasets`` so that only a run that converts or reads a TFDS build imports tensorflow_datasets (it
is slow to import and pulls in much of its own stack): ``datasets.build_tfds`` and ``datasets.load_tfds`` import
this module when called, and ``datasets.MathPrompts`` resolves to the class here on first access. What the two
share (the build's version, the loaders it converts from) is ``math_prompts``: this module imports nothing of
``datasets``.

TFDS works here without TensorFlow: ``GeneratorBasedBuilder`` with ``file_format='array_record'`` writes
array_record shards through the ``array_record`` module, and ``as_data_source`` reads them back with pure
Python decoding (``Text`` features come back as ``bytes``). Only ``as_dataset`` (tf.data) needs TensorFlow,
and nothing here calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow_datasets as tfds

from rollverify_jax.data.math_prompts import FILE_LOADERS, MATH_PROMPTS_VERSION


class MathPrompts(tfds.core.GeneratorBasedBuilder):
    """Converts a DAPO/AIME file into array_record shards of ``{prompt, answer}`` text records.

    One builder config per converted source (``config_name``), so several sources share a ``data_dir``:
    ``<data_dir>/math_prompts/<config_name>/1.0.0``. An existing build is reused; delete it to rebuild.
    """

    VERSION = tfds.core.Version(MATH_PROMPTS_VERSION)
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


def data_source(path: str, split: str) -> Sequence[dict[str, Any]]:
    """The random-access records of one split of the build at ``path`` (raw TFDS examples: text as bytes)."""
    return tfds.builder_from_directory(path).as_data_source(split=split)
