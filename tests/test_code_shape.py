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


ADAPTERS = ("openai", "anthropic", "ollama")


def _engine_imports(source: str) -> list[str]:
    """The modules of the `engines` package a module's source imports (at any depth of its code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n == "engines" or n.startswith("engines.")][:1]
    return found


def test_no_protocol_adapter_imports_the_engines() -> None:
    """Adapters read the neutral events and types of gateway.conversation; serving.py alone makes
    them from the engine's output."""
    found = {str(p.relative_to(API)): hit for a in ADAPTERS for p in sorted((API / a).rglob("*.py"))
             if (hit := _engine_imports(p.read_text()))}
    assert not found, found


def test_the_check_sees_an_engine_import() -> None:
    for source in ("from engines.base import Usage\n", "import engines.base\n", "from engines import base\n",
                   "def f():\n    from engines.base import TokenEvent\n"):
        assert _engine_imports(source), source
    assert not _engine_imports("from gateway.conversation import Usage\nimport enginesque\n")
