"""List the modules and functions of a source tree over a size limit.

    python scripts/check_sizes.py [--root engines] [--max-file 600] [--max-function 60]

A function's length runs from its first decorator to its last line, docstring and comments
included. Exits 1 when something is over a limit.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def oversized(root: Path, max_file: int, max_function: int) -> list[str]:
    """One line per module over `max_file` lines and per function over `max_function`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if (lines := len(source.splitlines())) > max_file:
            found.append(f"{path}: {lines} lines (file limit {max_file})")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := (node.end_lineno or node.lineno) - start + 1) > max_function:
                    found.append(f"{path}:{node.lineno} {node.name}: {n} lines (function limit {max_function})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("engines"))
    parser.add_argument("--max-file", type=int, default=600)
    parser.add_argument("--max-function", type=int, default=60)
    args = parser.parse_args()
    found = oversized(args.root, args.max_file, args.max_function)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
