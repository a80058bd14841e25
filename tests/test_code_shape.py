"""The protocol layer and the engines stay readable: no file in gateway/api or engines/ over 600
lines, no function over 60; the engine interface knows no protocol and no tool format."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "gateway" / "api"
ENGINES = ROOT / "engines"
MAX_FILE, MAX_FUNCTION = 600, 60


@pytest.mark.parametrize("tree", [API, ENGINES], ids=["gateway/api", "engines"])
def test_no_file_is_over_600_lines(tree: Path) -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted(tree.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE}
    assert not long, long


@pytest.mark.parametrize("tree", [API, ENGINES], ids=["gateway/api", "engines"])
def test_no_function_is_over_60_lines(tree: Path) -> None:
    long = {}
    for p in sorted(tree.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := (node.end_lineno or node.lineno) - start + 1) > MAX_FUNCTION:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, long


# What only a protocol or a model family's tool format knows: the engine interface never says it.
FOREIGN_WORDS = ("openai", "anthropic", "ollama", "hermes", "tool_call", "response_format", "messages")


def test_the_engine_interface_knows_no_protocol_and_no_tool_format() -> None:
    code = "\n".join(line.split("#")[0] for line in (ENGINES / "base.py").read_text().lower().splitlines())
    found = [w for w in FOREIGN_WORDS if w in code]
    assert not found, found


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    node = ast.parse(f"def f():\n{body}\n").body[0]
    assert isinstance(node, ast.FunctionDef) and (node.end_lineno or 0) - node.lineno + 1 > MAX_FUNCTION


ADAPTERS = ("openai", "anthropic", "ollama")


def imports_of(source: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` a module's source imports (at any depth of its code), one per import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if any(n == p or n.startswith(f"{p}.") for p in packages)][:1]
    return found


def _engine_imports(source: str) -> list[str]:
    """The modules of the `engines` package a module's source imports."""
    return imports_of(source, ("engines",))


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
