"""Calculator tool: exact arithmetic on an expression, parsed with `ast` (never eval'd).

Integers stay exact at any size (Python ints) within limits that keep one call cheap: at most
`max_digits` digits in any intermediate result and exponents up to `max_exponent`.
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from mtrain.tools.base import BaseTool, ToolError, ToolSession

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, *, max_digits: int = 1000, max_exponent: int = 10_000,
             max_length: int = 500) -> int | float:
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("calculator: expression must be a non-empty string")
    if len(expression) > max_length:
        raise ToolError(f"calculator: expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"calculator: cannot parse {expression!r}: {e.msg}") from None

    def check(v: Any) -> Any:
        # bit_length is O(1); digits = ceil(bits * log10(2)) within one, so this is the digit limit to one digit
        if isinstance(v, int) and v.bit_length() * 0.30103 > max_digits:
            raise ToolError(f"calculator: a result has more than {max_digits} digits")
        return v

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > max_exponent:
                raise ToolError(f"calculator: exponent {b} is larger than {max_exponent}")
            if isinstance(node.op, ast.Div) and isinstance(a, int) and isinstance(b, int) and b != 0:
                q = Fraction(a, b)
                return q.numerator if q.denominator == 1 else a / b  # 8/2 -> 4, exact; 1/3 -> float
            try:
                return check(_BIN[type(node.op)](a, b))
            except ZeroDivisionError:
                raise ToolError("calculator: division by zero") from None
            except OverflowError:
                raise ToolError("calculator: result too large") from None
        raise ToolError(f"calculator: unsupported element {type(node).__name__} (numbers, + - * / // % ** and "
                        f"parentheses only)")

    return ev(tree)


def format_number(v: int | float) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e16:
            return str(int(v))
        return repr(v)
    return str(v)


class CalculatorTool(BaseTool):
    schema = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (integers of any size). Example: 123456*789",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "numbers, + - * / // % ** and parentheses"}},
            "required": ["expression"]}}}

    def create(self, session: ToolSession) -> dict[str, int]:
        return {"calls": 0}

    def call(self, session: ToolSession, args: dict[str, Any]) -> str:
        session.state[self.name]["calls"] += 1
        return format_number(evaluate(args["expression"]))
