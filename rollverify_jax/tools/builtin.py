"""The tools that ship with the package, built fresh for each user: ``builtin_tools(names, sandbox)`` gives a new
``ToolRegistry`` holding them, the python tool with that user's sandbox limits. Nothing is registered at import."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rollverify_jax.tools.calculator import CalculatorTool
from rollverify_jax.tools.python_tool import PythonTool
from rollverify_jax.tools.registry import Tool, ToolRegistry
from rollverify_jax.tools.sandbox import SandboxConfig

# name -> the tool, given the sandbox limits of the registry being built (the calculator runs in process).
_BUILTIN: dict[str, Callable[[SandboxConfig], Tool]] = {
    "calculator": lambda sandbox: CalculatorTool(),
    "python": lambda sandbox: PythonTool(sandbox),
}
BUILTIN_TOOL_NAMES: tuple[str, ...] = tuple(_BUILTIN)


def builtin_tools(names: Iterable[str] = BUILTIN_TOOL_NAMES, sandbox: SandboxConfig | None = None) -> ToolRegistry:
    """A new registry of the built-in tools ``names`` (ValueError naming the known ones for any other), the python
    tool with ``sandbox`` (default ``SandboxConfig()``)."""
    sandbox = sandbox or SandboxConfig()
    names = tuple(names)
    unknown = [n for n in names if n not in _BUILTIN]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r}; known tools: {sorted(_BUILTIN)}")
    return ToolRegistry(_BUILTIN[n](sandbox) for n in names)
