"""Tools for multi-turn tool use (ReTool-style): a registry, a calculator, a sandboxed python tool, and the text
helpers a rollout uses to find a call and render the reply (docs/tools.md). Importing this registers
``calculator`` and ``python`` (default limits); nothing runs until a tool is called. JAX-free."""

from rollverify_jax.tools.calculator import CalculatorError, CalculatorTool, evaluate
from rollverify_jax.tools.calls import format_tool_output, parse_tool_call
from rollverify_jax.tools.python_tool import PythonTool, strip_code_fence
from rollverify_jax.tools.registry import TOOLS, Tool, ToolResult, ToolStatus, call_tool, get_tool, register_tool
from rollverify_jax.tools.sandbox import SandboxConfig, SandboxRun, check_sandbox, run_sandboxed

register_tool(CalculatorTool())
register_tool(PythonTool())

__all__ = [
    "TOOLS", "CalculatorError", "CalculatorTool", "PythonTool", "SandboxConfig", "SandboxRun", "Tool", "ToolResult",
    "ToolStatus", "call_tool", "check_sandbox", "evaluate", "format_tool_output", "get_tool", "parse_tool_call",
    "register_tool", "run_sandboxed", "strip_code_fence",
]
