"""A run spec as plain JSON, and back: the workdir's ``spec.json``, read without gin and without JAX.

A spec's values are JSON scalars, tuples (gin's tuples and the dataclasses' defaults; a function part's bound
lists are frozen to tuples), dicts with string keys and frozen dataclasses. Tuples are written as JSON arrays and
every array reads back as a tuple; the rare Python list (a list inside a ``dict`` field) is written as
``{"__list__": [...]}`` so that it reads back as a list and the round trip is exact. A dataclass is written as
its fields and read back through its class (a nested dataclass field through the field's annotated class). This
module imports neither gin nor JAX: the simulator reads ``spec.json`` through it (``rollverify_jax.sim``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC_FILE = "spec.json"  # in every training workdir, beside operative_config.gin
SPEC_FORMAT = 1
_LIST = "__list__"


def to_plain(value: Any, where: str = "spec") -> Any:
    """``value`` as JSON-able data (tuples as arrays, lists tagged, dataclasses and mappings as objects); anything
    JSON cannot hold exactly is refused, naming ``where`` it is."""
    if isinstance(value, Mapping):  # before dataclasses: a function part's Bindings is a frozen mapping
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has the key {k!r}: a spec's dict keys must be strings to be written as "
                                "JSON.")
            out[k] = to_plain(v, f"{where}.{k}")
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, list):
        return {_LIST: [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{where} = {value!r} ({type(value).__name__}) cannot be written as JSON; a spec holds numbers, "
                    "strings, tuples, dicts and dataclasses.")


def from_plain(value: Any) -> Any:
    """The inverse of ``to_plain`` where no class is known: arrays as tuples, tagged lists as lists, objects as
    dicts."""
    if isinstance(value, list):
        return tuple(from_plain(v) for v in value)
    if isinstance(value, dict):
        if set(value) == {_LIST}:
            return [from_plain(v) for v in value[_LIST]]
        return {k: from_plain(v) for k, v in value.items()}
    return value


@functools.cache
def _dataclass_fields(cls: type) -> dict[str, type | None]:
    """Each field's class where it is a dataclass (a nested part, e.g. ``LearnerConfig.loss``), else None."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) if dataclasses.is_dataclass(hints.get(f.name)) else None
            for f in dataclasses.fields(cls)}


def dataclass_from_plain(cls: type, value: Mapping[str, Any], where: str = "spec") -> Any:
    """``cls`` built from its plain fields (``to_plain``); a field missing from ``value`` takes its default, one
    that ``cls`` does not have is refused, naming it."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object of {cls.__name__}'s fields, got {value!r}.")
    fields = _dataclass_fields(cls)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no field {unknown[0]!r} (was the spec written by another "
                         "version of the code?).")
    kwargs = {k: dataclass_from_plain(fields[k], v, f"{where}.{k}") if fields[k] is not None and isinstance(v, dict)
              else from_plain(v) for k, v in value.items()}
    return cls(**kwargs)


def dumps(plain: Mapping[str, Any]) -> str:
    return json.dumps(plain, indent=1, sort_keys=False) + "\n"


def read(path: str | Path, hint: str = "") -> dict[str, Any]:
    """A local ``spec.json`` (or the workdir holding one) as plain data, checked to be a spec of a known format;
    ``hint``: what to do without one, added to the error."""
    path = Path(path)
    if path.is_dir() or path.name != SPEC_FILE:
        path = path / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: training writes its run's {SPEC_FILE} at every start, so "
                                f"this run started before {SPEC_FILE} was written, or is not a training workdir."
                                + (f" {hint}" if hint else ""))
    return loads(path.read_text(), str(path))


def loads(text: str, where: str) -> dict[str, Any]:
    """A spec's JSON text as plain data, checked to be a spec of a known format (``where``: its file, for errors)."""
    try:
        plain = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e.msg}, line {e.lineno}); it is written atomically, so it was "
                         "damaged after the run wrote it.") from e
    check_format(plain, where)
    return plain


def check_format(plain: Any, where: str) -> None:
    if not isinstance(plain, dict) or plain.get("format") != SPEC_FORMAT:
        found = plain.get("format") if isinstance(plain, dict) else type(plain).__name__
        raise ValueError(f"{where} is not a run spec of format {SPEC_FORMAT} (found format {found!r}).")
