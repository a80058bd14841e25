"""The protocol layer stays readable: no file in gateway/api over 600 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parent.parent / "gateway" / "api"
MAX_FILE, MAX_FUNCTION = 600, 60


def _modules() -> list[Path]:
    return sorted(API.rglob("*.py"))


def test_no_file_in_the_protocol_layer_is_over_600_lines() -> None:
    long = {str(p.relative_to(API)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_FILE}
    assert not long, long


def test_no_function_in_the_protocol_layer_is_over_60_lines() -> None:
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := (node.end_lineno or node.lineno) - start + 1) > MAX_FUNCTION:
                    long[f"{p.relative_to(API)}:{node.lineno} {node.name}"] = n
    assert not long, long


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    node = ast.parse(f"def f():\n{body}\n").body[0]
    assert isinstance(node, ast.FunctionDef) and (node.end_lineno or 0) - node.lineno + 1 > MAX_FUNCTION
