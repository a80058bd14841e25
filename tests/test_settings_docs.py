"""The configuration tables of docs/configuration.md and README.md are the ones the settings
models generate (`gateway settings --markdown`), and they list every option of `gateway serve`
with the variable the settings really read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engines.envconfig import knobs
from engines.tuning import EngineTuning
from gateway.cli import build_parser, main, subcommand
from gateway.settings import Settings
from gateway.settings_docs import generated_block, tables, write_tables

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"
FIX = "run `gateway settings --write README.md docs/configuration.md` and commit the result"


def _serve_options() -> set[str]:
    serve = subcommand(build_parser(), "serve")
    return {o for a in serve._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after `heading` (header and separator left out)."""
    rows: list[list[str]] = []
    for line in text[text.index(heading):].split("\n")[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]


@pytest.mark.parametrize(("path", "block"), [(CONFIG_DOC, "reference"), (README, "readme")], ids=["docs", "readme"])
def test_the_generated_tables_are_current(path: Path, block: str) -> None:
    text = path.read_text()
    found = generated_block(text, block)
    assert found is not None, f"{path.name} has no generated {block} table"
    want = tables(subcommand(build_parser(), "serve"))[block]
    assert found == want, f"{path.name}'s {block} table differs from the settings: {FIX}"


def test_every_serve_option_is_in_the_reference_table() -> None:
    documented = {m.group(1) for cells in table_rows(CONFIG_DOC.read_text(), "## `gateway serve`")
                  if (m := re.fullmatch(r"`(--[a-z0-9-]+)`", cells[0]))}
    actual = _serve_options()
    assert not actual - documented, f"docs/configuration.md lacks {sorted(actual - documented)}: {FIX}"
    assert not documented - actual, f"docs/configuration.md lists options serve lacks: {sorted(documented - actual)}"


def test_every_documented_variable_is_a_setting() -> None:
    read = {k.env for model in (Settings, EngineTuning) for k in knobs(model).values()}
    documented = set(re.findall(r"`(GATEWAY_[A-Z0-9_]+)(?:=[^`]*)?`", CONFIG_DOC.read_text()))
    assert documented <= read, f"documented but read by no setting: {sorted(documented - read)}"
    assert read <= documented, f"settings missing from docs/configuration.md: {sorted(read - documented)}"


def test_write_tables_replaces_only_the_blocks() -> None:
    serve = subcommand(build_parser(), "serve")
    stale = "intro\n" + CONFIG_DOC.read_text().replace("| `--port` |", "| `--prot` |") + "outro\n"
    fixed = write_tables(stale, serve)
    assert fixed == "intro\n" + CONFIG_DOC.read_text() + "outro\n"


def test_the_settings_command_prints_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    serve = subcommand(build_parser(), "serve")
    assert main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == tables(serve)["reference"]
    assert main(["settings", "--markdown", "readme"]) == 0
    assert capsys.readouterr().out == tables(serve)["readme"]
