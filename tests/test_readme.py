"""The documentation runs as written: every `gateway …` command in the fenced code blocks of
README.md and docs/ names a real subcommand with options it accepts (checked against the CLI's own
argparse parser, in-process). The configuration tables are checked by test_settings_docs.py."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
# A line that may call the command: `gateway`, `.venv/bin/gateway`, `$ gateway`, `X=1 gateway`.
MAYBE_GATEWAY = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?gateway(?:\s|$)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    args: tuple[str, ...]  # what follows `gateway`


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("gateway's parser has no subcommands")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """The block's lines with backslash continuations joined: (offset of the first line, text)."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in enumerate(block.split("\n")):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def commands_in(path: Path) -> list[Command]:
    """Every `gateway …` invocation in the file's fenced shell (or untagged) code blocks."""
    text = path.read_text()
    found: list[Command] = []
    for m in FENCE.finditer(text):
        lang = m.group(1).lower()
        if lang not in SHELL_LANGS:
            continue
        first_line = text.count("\n", 0, m.start(2)) + 1
        for offset, line in _logical_lines(m.group(2)):
            stripped = line.strip()
            if lang in ("", "console"):  # output may follow: only prompts and bare command lines
                stripped = stripped.removeprefix("$ ")
            if not MAYBE_GATEWAY.search(stripped):
                continue
            where = f"{path.relative_to(ROOT)}:{first_line + offset}"
            lexer = shlex.shlex(stripped, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as exc:
                raise AssertionError(f"{where}: not a shell line ({exc}): {line!r}") from exc
            segment: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in (";", "&&", "||", "|", "&", "(", ")"):
                    words = list(segment)
                    while words and ENV_ASSIGNMENT.match(words[0]):
                        words.pop(0)
                    if words and words[0] == "exec":
                        words.pop(0)
                    if words and Path(words[0]).name == "gateway":
                        found.append(Command(where, tuple(words[1:])))
                    segment = []
                else:
                    segment.append(tok)
    return found


ALL_COMMANDS = [c for doc in DOCS for c in commands_in(doc)]


def test_the_docs_show_gateway_commands() -> None:
    """The extraction finds what it should (a regex gone wrong must not make the check vacuous)."""
    subcommands = {c.args[0] for c in ALL_COMMANDS if c.args}
    assert {"serve", "pull", "devices", "convert", "parity"} <= subcommands, subcommands
    assert any(c.where.startswith("README.md") for c in ALL_COMMANDS)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c.where)
def test_each_documented_command_parses(command: Command) -> None:
    parser = build_parser()
    subparsers = _subparsers(parser)
    assert command.args, f"{command.where}: `gateway` without a subcommand"
    name, *rest = command.args
    assert name in subparsers, f"{command.where}: no subcommand {name!r}; gateway has {sorted(subparsers)}"
    accepted = _options(subparsers[name])
    unknown = [tok.split("=", 1)[0] for tok in rest
               if tok.startswith("-") and len(tok) > 1 and not re.fullmatch(r"-\d+(\.\d+)?", tok)
               and tok.split("=", 1)[0] not in accepted]
    assert not unknown, (f"{command.where}: `gateway {name}` does not accept {unknown}; "
                         f"it takes {sorted(accepted)}")
    try:  # values too: choices, types, required options, as the real command line parses them
        parser.parse_args(list(command.args))
    except SystemExit as exc:
        raise AssertionError(f"{command.where}: `gateway {' '.join(command.args)}` does not parse") from exc
