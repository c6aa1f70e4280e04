"""Tools a policy can call during a rollout, by name, in a ``ToolRegistry`` instance (no global registry: each
rollout environment holds the tools it was built with, ``builtin.builtin_tools``).

A tool turns its arguments (the text between the call's tags) into a ``ToolResult``; it never raises for bad
input: a refusal or failure is a result with a short message the policy can read, so nothing a policy writes
can stop the trainer. ``ToolRegistry.call`` adds that guarantee for any registered tool.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
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


class ToolRegistry:
    """Tools by name, one registry per user (each rollout environment builds its own): registering a tool in one
    never changes another's, so two environments in one process, with different tools or sandbox limits, do not
    interfere."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Add (or replace) a tool under ``tool.name``: a letter or ``_`` first, then letters, digits, ``_.-`` (the
        name is a tag in the policy's text)."""
        if not isinstance(tool, Tool):
            raise TypeError(f"ToolRegistry.register needs an object with name, description and call(arguments) -> "
                            f"ToolResult; got {tool!r}")
        if not isinstance(tool.name, str) or not _NAME.fullmatch(tool.name):
            raise ValueError(f"tool name {tool.name!r} is not a valid tag name: use a letter or '_' first, then "
                             "letters, digits, '_', '.' or '-'")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        """The tool registered under ``name`` (ValueError listing the known names otherwise)."""
        if name not in self._tools:
            raise ValueError(f"unknown tool {name!r}; known tools: {sorted(self._tools)}")
        return self._tools[name]

    def call(self, name: str, arguments: str) -> ToolResult:
        """Call a registered tool; an unknown name or a tool that raises becomes an error result, never an
        exception."""
        try:
            tool = self.get(name)
        except ValueError as e:
            return ToolResult("", ToolStatus.ERROR, 0.0, str(e))
        try:
            return tool.call(arguments)
        except Exception as e:  # noqa: BLE001  (a tool's bug must not reach the trainer)
            return ToolResult("", ToolStatus.ERROR, 0.0, f"tool {name!r} failed: {type(e).__name__}: {e}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._tools))

    def __contains__(self, name: object) -> bool:
        return name in self._tools
