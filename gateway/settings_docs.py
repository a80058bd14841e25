"""The configuration tables of docs/configuration.md and README.md, generated from the settings
models (`gateway settings --markdown`) and the `gateway serve` parser (for its options that are not
settings, such as --recheck). `write_tables` rewrites the generated blocks of a Markdown file;
tests/test_settings_docs.py fails when a file's block differs from what the models say."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from engines.envconfig import Knob, knobs
from engines.tuning import EngineTuning
from gateway.settings import Settings

BLOCKS = ("reference", "readme")
ENGINE_NOTE = ("Read by the engines, in their worker processes, from the environment they inherit; for "
               "measuring side by side, the defaults are right for serving. `gateway serve` checks them at start.")


def _begin(name: str) -> str:
    return f"<!-- begin: gateway settings --markdown {name} (generated from the settings; edit those) -->"


def _end(name: str) -> str:
    return f"<!-- end: gateway settings --markdown {name} -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(k: Knob) -> str:
    shown = k.shown_default()
    if "shown" in k.extra or k.kind == "switch" or shown == "none":
        return shown
    return f"`{shown}`"


def _meaning(k: Knob) -> str:
    if k.kind == "choice" and not any(f"`{c}`" in k.help for c in k.choices):
        *rest, last = (f"`{c}`" for c in k.choices)
        return f"{k.help}; {', '.join(rest)} or {last}" if rest else k.help
    return k.help


def _env_cell(k: Knob) -> str:
    if k.kind == "switch":  # the value that does what the flag does
        return f"`{k.env}={0 if k.info.default else 1}`"
    return f"`{k.env}`"


def _flag_rows(serve: argparse.ArgumentParser, only: Iterable[str] | None = None) -> list[str]:
    settings = {k.name: k for k in knobs(Settings).values() if k.flag is not None}
    wanted = set(only) if only is not None else None
    rows = []
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        k = settings.get(action.dest)
        if wanted is not None and (k is None or k.name not in wanted):
            continue
        if k is None:
            default = "off" if action.default in (None, False) else f"`{action.default}`"
            rows.append(f"| `{action.option_strings[0]}` | — | {default} | {_cell(action.help or '')} |")
        else:
            default = "off" if k.kind == "switch" else _default(k)  # a switch's flag: given or not
            rows.append(f"| `{k.flag}` | {_env_cell(k)} | {_cell(default)} | {_cell(_meaning(k))} |")
    return rows


def _env_rows(ks: Iterable[Knob]) -> list[str]:
    return [f"| `{k.env}` | {_cell(_default(k))} | {_cell(_meaning(k))} |" for k in ks]


def reference(serve: argparse.ArgumentParser) -> str:
    """docs/configuration.md's tables: `gateway serve`'s options, the settings without a flag, and
    the engines' knobs."""
    gateway_envs = {k.env for k in knobs(Settings).values()}
    env_only = [k for k in knobs(Settings).values() if k.flag is None]
    engine = [k for k in knobs(EngineTuning).values() if k.env not in gateway_envs]
    return "\n".join([
        "## `gateway serve`", "",
        "| flag | environment variable | default | meaning |", "|---|---|---|---|", *_flag_rows(serve), "",
        "## Environment only", "",
        "| variable | default | meaning |", "|---|---|---|", *_env_rows(env_only), "",
        "## Engine tuning (environment only)", "", ENGINE_NOTE, "",
        "| variable | default | meaning |", "|---|---|---|", *_env_rows(engine),
    ]) + "\n"


def readme_table(serve: argparse.ArgumentParser) -> str:
    """The README's short table: the settings marked `readme`."""
    marked = [k.name for k in knobs(Settings).values() if k.extra.get("readme")]
    return "\n".join(["| flag | environment variable | default | meaning |", "|---|---|---|---|",
                      *_flag_rows(serve, marked)]) + "\n"


def tables(serve: argparse.ArgumentParser) -> dict[str, str]:
    return {"reference": reference(serve), "readme": readme_table(serve)}


def _span(text: str, name: str) -> tuple[int, int] | None:
    """Where block `name`'s content lies in `text`, between its markers (None: no such block)."""
    start = text.find(_begin(name) + "\n")
    end = text.find(_end(name), start)
    if start < 0 or end < 0:
        return None
    return start + len(_begin(name)) + 1, end


def generated_block(text: str, name: str) -> str | None:
    """What `text` holds between the markers of block `name` (None: it has no such block)."""
    span = _span(text, name)
    return text[span[0]:span[1]] if span else None


def write_tables(text: str, serve: argparse.ArgumentParser) -> str:
    """`text` with each generated block it has replaced by the current one."""
    for name, table in tables(serve).items():
        span = _span(text, name)
        if span:
            text = text[:span[0]] + table + text[span[1]:]
    return text
