"""The text around a tool call: finding the call in a policy's output and rendering the reply it reads back.

Two tag formats (the rollout decides which its prompt teaches):
  ``<tool_call>NAME\\nARGUMENTS</tool_call>``: the first word is the tool, the rest its arguments; a JSON body
    ``{"name": ..., "arguments": ...}`` (Qwen3's / Hermes' own format) is read too.
  ``<NAME>ARGUMENTS</NAME>`` for a known tool's name, e.g. ``<calculator>2+3*4</calculator>``.
The reply is the output wrapped in ``<tool_response>`` tags (or another tag), errors as one ``Error:`` line.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable

from rollverify_jax.tools.builtin import BUILTIN_TOOL_NAMES
from rollverify_jax.tools.registry import ToolResult, ToolStatus

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_NAME_AND_ARGS = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)(.*)", re.DOTALL)


def parse_tool_call(text: str, names: Iterable[str] | None = None) -> tuple[str, str] | None:
    """The last complete tool call in ``text`` as ``(name, arguments)``, or None.

    ``names``: the tags accepted in the ``<NAME>...</NAME>`` form (default: the built-in tools). A
    ``<tool_call>`` may name any tool (an unknown one is for ``ToolRegistry.call`` to answer). Arguments are
    dedented and stripped of surrounding blank space. The last call is the one that ended generation (a rollout
    stops at a closing tag)."""
    names = sorted(BUILTIN_TOOL_NAMES if names is None else names, key=len, reverse=True)
    found: list[tuple[int, str, str]] = []
    for m in _TOOL_CALL.finditer(text):
        call = _read_tool_call_body(m.group(1))
        if call is not None:
            found.append((m.end(), *call))
    if names:
        tags = "|".join(re.escape(n) for n in names)
        for m in re.finditer(rf"<({tags})>(.*?)</\1>", text, re.DOTALL):
            found.append((m.end(), m.group(1), _clean(m.group(2))))
    if not found:
        return None
    _, name, arguments = max(found, key=lambda f: f[0])
    return name, arguments


def _read_tool_call_body(body: str) -> tuple[str, str] | None:
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            call = json.loads(stripped)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", "")
            if isinstance(args, dict) and len(args) == 1 and isinstance(next(iter(args.values())), str):
                args = next(iter(args.values()))  # {"code": "..."} or {"expression": "..."}
            return call["name"], args if isinstance(args, str) else json.dumps(args)
    m = _NAME_AND_ARGS.fullmatch(body)
    return (m.group(1), _clean(m.group(2))) if m else None


def _clean(arguments: str) -> str:
    return textwrap.dedent(arguments.strip("\n")).strip()


def format_tool_output(result: ToolResult, tag: str = "tool_response", max_chars: int = 4096) -> str:
    """The reply the policy reads: the output (``(no output)`` when empty), then ``Error: ...`` for a timeout or
    an error, the whole cut to ``max_chars``, wrapped in ``<tag>...</tag>`` (``tag=''``: bare)."""
    body = result.output.rstrip("\n")
    if result.status in (ToolStatus.TIMEOUT, ToolStatus.ERROR):
        error = "Error: " + (result.error or result.status.value)
        body = f"{body}\n{error}" if body else error
    elif not body:
        body = "(no output)"
    if len(body) > max_chars:
        marker = f"\n[reply cut at {max_chars} characters]"
        body = body[:max(max_chars - len(marker), 0)] + marker
    return f"<{tag}>\n{body}\n</{tag}>" if tag else body
