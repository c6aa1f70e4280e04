"""Tools for multi-turn tool use (ReTool-style): a registry class, a calculator, a sandboxed python tool, and the
text helpers a rollout uses to find a call and render the reply (docs/tools.md). Importing this registers nothing:
each user builds its own ``ToolRegistry`` (``builtin_tools(names, sandbox)``); nothing runs until a tool is
called. JAX-free."""

from rollverify_jax.tools.builtin import BUILTIN_TOOL_NAMES, builtin_tools
from rollverify_jax.tools.calculator import CalculatorError, CalculatorTool, evaluate
from rollverify_jax.tools.calls import format_tool_output, parse_tool_call
from rollverify_jax.tools.python_tool import PythonTool, strip_code_fence
from rollverify_jax.tools.registry import Tool, ToolRegistry, ToolResult, ToolStatus
from rollverify_jax.tools.sandbox import SandboxConfig, SandboxRun, check_sandbox, run_sandboxed

__all__ = [
    "BUILTIN_TOOL_NAMES", "CalculatorError", "CalculatorTool", "PythonTool", "SandboxConfig", "SandboxRun", "Tool",
    "ToolRegistry", "ToolResult", "ToolStatus", "builtin_tools", "check_sandbox", "evaluate", "format_tool_output",
    "parse_tool_call", "run_sandboxed", "strip_code_fence",
]
