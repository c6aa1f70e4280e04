"""Tools a policy can call during a rollout, registered by name like the rewards (``data/rewards.py``).

A tool turns its arguments (the text between the call's tags) into a ``ToolResult``; it never raises for bad
input: a refusal or failure is a result with a short message the policy can read, so nothing a policy writes
can stop the trainer. ``call_tool`` adds that guarantee for any registered tool.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Protocol, runtime_checkable

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class ToolStatus(enum.StrEnum):
    """How a call ended: ``output_truncated`` still has output (its first bytes), the others have an error."""

    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"
    OUTPUT_TRUNCATED = "output_truncated"


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """output: what the tool printed or computed; error: one short line naming the problem (empty when ok);
    elapsed_s: wall time of the call."""

    output: str
    status: ToolStatus
    elapsed_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == ToolStatus.OK


@runtime_checkable
class Tool(Protocol):
    """A tool: a name (the tag a policy uses), a description (for the system prompt) and ``call``."""

    name: str
    description: str

    def call(self, arguments: str) -> ToolResult: ...


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    """Add (or replace) a tool under ``tool.name``: a letter or ``_`` first, then letters, digits, ``_.-`` (the
    name is a tag in the policy's text)."""
    if not isinstance(tool, Tool):
        raise TypeError(f"register_tool needs an object with name, description and call(arguments) -> ToolResult; "
                        f"got {tool!r}")
    if not isinstance(tool.name, str) or not _NAME.fullmatch(tool.name):
        raise ValueError(f"tool name {tool.name!r} is not a valid tag name: use a letter or '_' first, then letters, "
                         "digits, '_', '.' or '-'")
    TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    """The tool registered under ``name`` (ValueError listing the known names otherwise)."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; known tools: {sorted(TOOLS)}")
    return TOOLS[name]


def call_tool(name: str, arguments: str) -> ToolResult:
    """Call a registered tool; an unknown name or a tool that raises becomes an error result, never an exception."""
    try:
        tool = get_tool(name)
    except ValueError as e:
        return ToolResult("", ToolStatus.ERROR, 0.0, str(e))
    try:
        return tool.call(arguments)
    except Exception as e:  # noqa: BLE001  (a tool's bug must not reach the trainer)
        return ToolResult("", ToolStatus.ERROR, 0.0, f"tool {name!r} failed: {type(e).__name__}: {e}")
