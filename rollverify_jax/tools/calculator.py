"""A calculator tool: arithmetic on integers and floats, evaluated from Python's syntax tree, never with eval.

Allowed: numbers, + - * / // % **, unary + and -, parentheses. Everything is bounded (expression length,
integer size, exponent), so a call costs microseconds whatever the policy writes, and runs in the trainer's
process. Anything else (a name, a call, an attribute, ``^``) is refused with a message saying what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import time

from rollverify_jax.tools.registry import ToolResult, ToolStatus

MAX_EXPRESSION_CHARS = 1000
MAX_INT_DIGITS = 1000
_MAX_INT_BITS = math.floor(MAX_INT_DIGITS * math.log2(10))  # 10**1000 (1001 digits) is past it
_ALLOWED = "numbers, + - * / // % **, unary minus and parentheses"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute; the message is the policy's to read."""


def _pow(a: int | float, b: int | float) -> int | float:
    if isinstance(a, int) and isinstance(b, int) and b >= 0 and abs(a) > 1:
        # |a| ** b has about b * log2|a| bits: refuse before computing a number too big to print.
        if b * (abs(a).bit_length() - 1) > _MAX_INT_BITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_DIGITS} digits)")
    result = a ** b
    if isinstance(result, complex):
        raise CalculatorError("complex result (a negative number to a fractional power)")
    return result


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (a trailing ``=`` is ignored); CalculatorError otherwise."""
    text = expression.strip().removesuffix("=").strip()
    if not text:
        raise CalculatorError(f"empty expression; write {_ALLOWED}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text[:80]!r}; write {_ALLOWED}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError("expression too deeply nested") from None
    try:
        return _checked(_eval(tree.body))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large for a float") from None
    except RecursionError:
        raise CalculatorError("expression too deeply nested") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"{node.value!r} is not a number; the calculator takes {_ALLOWED}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("^ is not a power here: write ** (2**10)")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}: the calculator takes {_ALLOWED}, no names")
    if isinstance(node, ast.Attribute):
        raise CalculatorError(f"attribute access is not allowed: the calculator takes {_ALLOWED}")
    if isinstance(node, ast.Call):
        raise CalculatorError(f"function calls are not allowed: the calculator takes {_ALLOWED}")
    operator_node = isinstance(node, ast.BinOp | ast.UnaryOp)
    what = f"the operator {type(node.op).__name__}" if operator_node else type(node).__name__
    raise CalculatorError(f"{what} is not allowed: the calculator takes {_ALLOWED}")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number (float overflow)")
    return value


def format_number(value: int | float) -> str:
    """An int in full; a float to 15 significant digits (0.1 + 0.2 is 0.3, 6 / 3 is 2)."""
    return str(value) if isinstance(value, int) else f"{value:.15g}"


@dataclasses.dataclass(frozen=True)
class CalculatorTool:
    """``<calculator>2+3*4</calculator>`` -> ``14``."""

    name: str = "calculator"
    description: str = f"Evaluates an arithmetic expression: {_ALLOWED}. Example: (2 + 3) * 4 ** 2 / 7"

    def call(self, arguments: str) -> ToolResult:
        start = time.perf_counter()
        try:
            output, status, error = format_number(evaluate(arguments)), ToolStatus.OK, ""
        except CalculatorError as e:
            output, status, error = "", ToolStatus.ERROR, str(e)
        return ToolResult(output, status, time.perf_counter() - start, error)
