"""Command-line options generated from a settings model: each setting with a flag becomes one
option (its name, parser, choices, help and default as declared), so adding a setting adds its flag.
A flag not given leaves the setting to its GATEWAY_* variable, then to its default."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from pydantic_settings import BaseSettings

from engines.envconfig import Knob, knobs

METAVARS = {"size": "SIZE", "mib": "SIZE", "duration": "DURATION", "list": "LIST"}


def add_setting_options(parser: argparse.ArgumentParser, model: type[BaseSettings],
                        names: Iterable[str] | None = None) -> None:
    """An option for each setting of `model` that has a flag (those in `names` only, when given),
    stored under the setting's own name."""
    chosen = set(names) if names is not None else None
    for k in knobs(model).values():
        if k.flag is not None and (chosen is None or k.name in chosen):
            parser.add_argument(k.flag, dest=k.name, default=None, help=option_help(k), **_how(k))


def given_settings(args: argparse.Namespace, model: type[BaseSettings]) -> dict[str, Any]:
    """The settings the command line gave (None: not given)."""
    return {k.name: getattr(args, k.name, None) for k in knobs(model).values() if k.flag is not None}


def option_help(k: Knob) -> str:
    # A switch's flag sets the opposite of its default: its own help says what it does.
    default = "" if k.kind == "switch" else f" (default: {k.shown_default().replace('`', '')})"
    return (k.help.replace("`", "") + default).replace("%", "%%")


def _how(k: Knob) -> dict[str, Any]:
    if k.kind == "switch":
        return {"action": "store_const", "const": not k.info.default}
    how: dict[str, Any] = {"type": _parser(k)}
    if k.choices:
        how["choices"] = k.choices
    if not k.choices:
        how["metavar"] = k.extra.get("metavar") or METAVARS.get(k.kind) or (k.flag or k.name).lstrip("-").upper().replace("-", "_")
    return how


def _parser(k: Knob) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return k.parse(text)
        except ValueError as exc:  # argparse says "argument --flag: must be ..., not '...'"
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = k.kind
    return parse
