"""Writes docs/config_reference.md: every gin configurable a run reads, from the code that defines it.

The configurables are the ones ``rollverify_jax/run/spec.py`` registers (``PARTS``: gin name -> class or
function). For a dataclass, every field with its type, default and the text that documents it (its entry in the
class docstring, ``name: ...``, and the comments on or above the field); for a function or a plain class, the
keyword parameters gin can bind, documented from its docstring. Nothing is written by hand, so the reference
cannot drift from the code: ``tests/test_config_reference.py`` fails when the checked-in file is not what this
script writes. Run it again after adding or changing a field:

    python -m rollverify_jax.studies.config_reference          # rewrites docs/config_reference.md
    python -m rollverify_jax.studies.config_reference --check  # exit status 1 when the file is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

OUT = ROOT / "docs" / "config_reference.md"
COMMAND = "python -m rollverify_jax.studies.config_reference"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: str
    default: str
    doc: str
    on_resume: str  # what a resume does when it changed: 'refuses', 'warns' or 'no' (spec.resume_class)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _source_text(obj: Any) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments on its line(s) and in the comment block right above it."""
    source = _source_text(cls)
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    out = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        trailing = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments]
        out[node.target.id] = " ".join(above + trailing)
    return out


def _entry_pattern(names: list[str]) -> re.Pattern:
    """``name: text`` / ``a, b: text`` / ``a / b: text`` / ````name='x'````: text`` entries of a docstring, at a
    line start or after a ``;`` or a sentence's end, naming fields of this part only."""
    one = "(?:``)?(?:" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")(?:=[^`]*)?(?:``)?"
    return re.compile(rf"(?:^|(?<=;)|(?<=\. ))[ \t]*(?:- )?(?P<names>{one}(?:\s*[,/]\s*{one})*)\s*:\s", re.M)


def _docstring_entries(doc: str, names: list[str]) -> tuple[str, dict[str, str]]:
    """(the text before the first entry, name -> its entry's text) of a docstring."""
    if not names:
        return doc, {}
    matches = list(_entry_pattern(names).finditer(doc))
    entries: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(doc)
        text = doc[m.end():end].split("\n\n")[0].strip().rstrip(";")
        for name in re.split(r"\s*[,/]\s*", m.group("names")):
            name = name.strip("`").split("=")[0]
            entries[name] = f"{entries[name]} {text}" if name in entries else text
    head = doc[:matches[0].start()] if matches else doc
    return head.strip(), entries


def _mentions(doc: str, name: str) -> str:
    """The sentences of a docstring that name ``name`` in backticks (prose that documents several settings)."""
    sentences = re.split(r"(?<=[.)])\s+(?=[A-Z`(])", _one_line(doc))
    return " ".join(s for s in sentences if re.search(rf"`{{1,2}}{re.escape(name)}(?:\s*=[^`]*)?`{{1,2}}", s))


def _default(value: Any) -> str:
    return repr(value)


def _type(annotation: Any) -> str:
    """An annotation as written (modules with postponed annotations keep the string)."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _summary(head: str) -> str:
    head = re.sub(r"\n\s*(Args|Attributes):\s*$", "", head.strip())
    return _one_line(head.split("\n\n")[0]) if head else ""


def describe(field_name: str, target: Any, per_call: set[str]) -> tuple[str, list[Setting]]:
    """(summary, settings) of one registered configurable."""
    from rollverify_jax.run.spec import resume_class

    doc = inspect.getdoc(target) or ""
    if dataclasses.is_dataclass(target):
        fields = [f for f in dataclasses.fields(target) if f.init]
        names = [f.name for f in fields]
        head, entries = _docstring_entries(doc, names)
        comments = _field_comments(target)
        settings = []
        for f in fields:
            if f.default is not dataclasses.MISSING:
                default = _default(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _default(f.default_factory())
            else:
                default = "(required)"
            text = " ".join(t for t in (entries.get(f.name, ""), comments.get(f.name, "")) if t) \
                or _mentions(doc, f.name)
            settings.append(Setting(f.name, _type(f.type), default, _one_line(text),
                                    resume_class(f"{field_name}.{f.name}")))
        return _summary(head), settings
    function = target.__init__ if isinstance(target, type) else target
    params = [p for p in inspect.signature(function).parameters.values()
              if p.name not in per_call and p.name != "self"
              and (p.default is not inspect.Parameter.empty or p.kind is p.VAR_KEYWORD)]
    fn_doc = doc if isinstance(target, type) else (inspect.getdoc(function) or "")
    names = [p.name for p in params] + sorted(per_call)  # the per-call ones end the entry before them
    head, entries = _docstring_entries(fn_doc, names)
    settings = []
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            settings.append(Setting(f"**{p.name}", "", "", _one_line(
                entries.get(p.name) or _mentions(fn_doc, p.name) or "any other keyword, by name (see the summary)"),
                resume_class(f"{field_name}.{p.name}")))
            continue
        annotation = "" if p.annotation is inspect.Parameter.empty else _type(p.annotation)
        text = entries.get(p.name) or _mentions(fn_doc, p.name)
        settings.append(Setting(p.name, annotation, _default(p.default), _one_line(text),
                                resume_class(f"{field_name}.{p.name}")))
    return _summary(head), settings


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def render() -> str:
    """The whole reference as markdown (deterministic: the same code gives the same bytes)."""
    from rollverify_jax.run import spec as spec_lib

    parts = spec_lib.PARTS
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the configurables `rollverify_jax/run/spec.py` registers (`PARTS`); "
        "do not edit by hand. tests/test_config_reference.py fails when this file is out of date. -->",
        "",
        "Every setting a run reads, by the name gin files bind it with. Bind one in a gin file "
        "(`RolloutConfig.batch_groups = 32`) or on the command line (`--gin_param=\"RolloutConfig.batch_groups = "
        "32\"`); every value a run used, bound or default, is written to `<workdir>/operative_config.gin`. "
        "*On resume*: what a resume does when the setting differs from the checkpoint's. *refuses*: it defines "
        "what is trained, and the resume stops with every difference named (`--allow_changed_settings` continues "
        "anyway); *warns*: it says how the run executes on this machine or slice (kernels, layout, compute "
        "buckets, worker pools), which changes nothing trained in exact arithmetic, so the new value is followed "
        "with one warning line; *no*: bookkeeping (steps, budget, evaluation, paths, reporting), not compared.",
        "",
        "| gin name | defined in | what it sets |",
        "| --- | --- | --- |",
    ]
    sections = []
    for field_name, (gin_name, target) in parts.items():
        summary, settings = describe(field_name, target, spec_lib._PER_CALL.get(field_name, set()))
        part_class = spec_lib.resume_class(f"{field_name}.*")
        module = inspect.getsourcefile(target)
        module = Path(module).resolve().relative_to(ROOT).as_posix()
        kind = "dataclass" if dataclasses.is_dataclass(target) else ("class" if isinstance(target, type)
                                                                     else "function")
        anchor = gin_name.lower()
        out.append(f"| [`{gin_name}`](#{anchor}) | `{module}` ({kind}) | {_cell(summary.split('. ')[0].rstrip('.'))} |")
        section = [f"## {gin_name}", "", f"`{module}`, {kind} `{target.__name__}`"
                   + {"no": "; not compared on resume", "warns": "; execution settings (a resume follows a change "
                      "with a warning)"}.get(part_class, "") + ".", ""]
        if summary:
            section += [summary, ""]
        section += ["| setting | type | default | on resume | what it does |", "| --- | --- | --- | --- | --- |"]
        for s in settings:
            section.append(f"| `{gin_name}.{s.name}` | {('`' + _cell(s.type) + '`') if s.type else ''} | "
                           f"{('`' + _cell(s.default) + '`') if s.default else ''} | {s.on_resume} "
                           f"| {_cell(s.doc)} |")
        sections += ["", *section]
    return "\n".join(out + sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what would be written")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"error: {args.out} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
