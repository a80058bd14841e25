"""Typed settings read from GATEWAY_* environment variables.

A settings model (`EnvSettings` subclass) declares each setting once with `setting(...)`: its type,
default, help, the variable that sets it (GATEWAY_<NAME> unless named), the command-line flag (if
it has one), and how text is parsed (sizes, durations, on/off). `Knob` is that declaration as the
environment, the command line and the documentation see it; the same parser reads a variable and a
flag, so both give the same value. The gateway's `Settings` and the engines' `EngineTuning` are such
models; this module lives in `engines/` because engines import nothing from the gateway.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Self, Union, get_args, get_origin

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A malformed setting, said in one line that names the variable (or setting) and the value."""


# --- text parsers ---------------------------------------------------------------------------


def split_list(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_size(value: str) -> int:
    """Bytes from "4194304", "4M", "512k", "2MiB"."""
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(v[-1:], 1)
    number = v[:-1] if scale != 1 else v
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{value!r} is not a size (e.g. 4M, 512k, 2GiB)") from None
    if size <= 0:
        raise ValueError(f"size must be positive: {value!r}")
    return size


def parse_mib(value: str) -> int:
    """MiB from "2048" (a bare number is MiB, as llama-server's --cache-ram), "2G", "512M"; "0" = 0."""
    v = value.strip()
    if v.isdigit():
        return int(v)
    return parse_size(v) >> 20


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str) -> float:
    """Seconds from a number ("300", "-1") or a Go duration ("5m", "1h30m", "45s", "500ms"): Ollama's
    keep_alive spelling, used by --keep-alive too. ValueError says what is wrong with `value`."""
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    total, number, sign = 0.0, "", 1.0
    i = 0
    if text.startswith("-"):
        sign, i = -1.0, 1
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = next((u for u in ("ns", "us", "µs", "ms", "h", "m", "s") if text.startswith(u, i)), None)
        if unit is None or not number:
            raise ValueError(f"{value!r} is not a duration (e.g. 300, \"5m\", \"1h\", 0, -1)")
        total += float(number) * _UNITS[unit]
        number = ""
        i += len(unit)
    if number:
        raise ValueError(f"{value!r} is missing a unit (s, m, h)")
    return sign * total


def on_off(value: str) -> str:
    """A switch's value with the usual spellings of on and off (1, true, yes / 0, false, no) as
    `on` / `off`; anything else as written (the caller checks it)."""
    v = value.strip().lower()
    return "off" if v in OFF else "on" if v in ON else v


def parse_switch(value: str) -> bool:
    v = on_off(value)
    if v not in ("on", "off"):
        raise ValueError(value)
    return v == "on"


def format_size(n: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("k", 1024)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    for unit, scale in (("h", 3600), ("m", 60)):
        if seconds > 0 and seconds % scale == 0:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds:g}"


# --- declaring a setting --------------------------------------------------------------------

# How text becomes a value, and what the text must look like (said in errors and in --help).
PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "str": (str, "text"),
    "int": (int, "a whole number"),
    "float": (float, "a number"),
    "switch": (parse_switch, "on or off (1/0, true/false, yes/no)"),
    "list": (split_list, "a comma-separated list"),
    "size": (parse_size, "a size such as 4M, 512k or 2GiB"),
    "mib": (parse_mib, "MiB, or a size such as 512M or 2G"),
    "duration": (parse_duration, "seconds or a duration such as 5m or 1h30m"),
}


def setting(default: Any = None, help: str = "", *, env: str | None = None, flag: str | bool = False,
            parse: str | None = None, shown: str | None = None,
            choices: Sequence[str] | Callable[[], Sequence[str]] = (),
            metavar: str | None = None, readme: bool = False, secret: bool = False,
            ge: float | None = None, le: float | None = None,
            default_factory: Callable[[], Any] | None = None) -> Any:
    """One setting's declaration (a pydantic Field): `env` names its variable when it is not
    GATEWAY_<NAME>; `flag` is True for --<name> or the flag's own name (False: environment only);
    `parse` is a PARSERS key where the type alone does not say it (size, mib, duration); `shown` is
    its default as the docs say it; `choices` its allowed values (or a function of no arguments that
    says them when asked: the engines the registered runtimes offer); `readme`: in the README's table."""
    extra: dict[str, Any] = {"env": env, "parse": parse, "shown": shown, "metavar": metavar,
                             "choices": (choices if callable(choices) else list(choices) or None),
                             "readme": readme or None,
                             "flag": flag if isinstance(flag, str) else (True if flag else None)}
    kw: dict[str, Any] = {"description": help, "repr": not secret, "ge": ge, "le": le,
                          "json_schema_extra": {k: v for k, v in extra.items() if v is not None}}
    if default_factory is not None:
        return Field(default_factory=default_factory, **kw)
    return Field(default, **kw)


def _bare(annotation: Any) -> Any:
    """The annotation without its `| None`."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


@dataclass(frozen=True)
class Knob:
    """One setting of a model as the environment, the command line and the documentation see it."""

    name: str
    info: FieldInfo
    env: str
    flag: str | None

    @property
    def extra(self) -> dict[str, Any]:
        e = self.info.json_schema_extra
        return e if isinstance(e, dict) else {}

    @property
    def help(self) -> str:
        return self.info.description or ""

    @property
    def kind(self) -> str:
        named = self.extra.get("parse")
        if named:
            return str(named)
        t = _bare(self.info.annotation)
        if get_origin(t) is Literal or self.choices:
            return "choice"
        if get_origin(t) is tuple:
            return "list"
        return {bool: "switch", int: "int", float: "float"}.get(t, "str")

    @property
    def choices(self) -> tuple[str, ...]:
        t = _bare(self.info.annotation)
        if get_origin(t) is Literal:
            return tuple(str(a) for a in get_args(t))
        choices = self.extra.get("choices") or ()
        return tuple(choices() if callable(choices) else choices)

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        ge = next((m.ge for m in self.info.metadata if hasattr(m, "ge")), None)
        le = next((m.le for m in self.info.metadata if hasattr(m, "le")), None)
        return ge, le

    def expectation(self) -> str:
        """What a value must be: "a whole number >= 0", "auto, on or off"."""
        if self.kind == "choice":
            *rest, last = self.choices
            return f"{', '.join(rest)} or {last}" if rest else last
        text = PARSERS[self.kind][1]
        ge, le = self.bounds
        if ge is not None and le is not None:
            return f"{text} {ge:g}-{le:g}"
        return f"{text} >= {ge:g}" if ge is not None else f"{text} <= {le:g}" if le is not None else text

    def parse(self, text: str) -> Any:
        """The value `text` sets (ValueError "must be ..., not '...'" when it is malformed)."""
        try:
            value = self._convert(text.strip())
        except ValueError:
            raise ValueError(f"must be {self.expectation()}, not {text!r}") from None
        ge, le = self.bounds
        if isinstance(value, int | float) and not ((ge is None or value >= ge) and (le is None or value <= le)):
            raise ValueError(f"must be {self.expectation()}, not {text!r}")
        return value

    def _convert(self, text: str) -> Any:
        if self.kind != "choice":
            return PARSERS[self.kind][0](text)
        value = on_off(text) if set(self.choices) >= {"on", "off"} else text
        if value not in self.choices:
            raise ValueError(text)
        return value

    def shown_default(self) -> str:
        """The default as --help and the docs say it."""
        if "shown" in self.extra:
            return str(self.extra["shown"])
        d = self.info.default
        if isinstance(d, bool):
            return "on" if d else "off"
        if d is None or d == ():
            return "none"
        if self.kind == "size":
            return format_size(int(d))
        if self.kind == "duration":
            return format_duration(float(d))
        return f"{d:g}" if isinstance(d, float) else str(d)


# --- models ---------------------------------------------------------------------------------


class _Environment(EnvSettingsSource):
    """Each setting's variable from `env` (os.environ when None), as written; an empty one is unset.
    The model's field validator parses the text, so it reads the same as the setting's flag."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if env is None else env
        super().__init__(settings_cls, case_sensitive=True)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = knob(self.settings_cls, field_name).env
        return self._env.get(name, "").strip() or None, field_name, False

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool) -> Any:
        return value


class EnvSettings(BaseSettings):
    """A frozen settings model read from GATEWAY_* variables by `from_env` (constructing it directly
    reads nothing: the values given, defaults for the rest). Text values, from the environment or
    from Python, are parsed by each setting's `Knob`."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", frozen=True, extra="forbid")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @field_validator("*", mode="before")
    @classmethod
    def _parse_text(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and info.field_name is not None:
            return knob(cls, info.field_name).parse(value)
        return value

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """The settings of `env` (os.environ when None), `overrides` (None: not given) over them.
        SettingError names the variable (or the setting) of a malformed value."""
        found = _Environment(cls, env)()
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**{**found, **given})
        except ValidationError as exc:
            raise SettingError(describe(cls, exc, set(found) - set(given))) from None

    @classmethod
    def read(cls, name: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting's value from the environment alone (its default when unset)."""
        k = knob(cls, name)
        text = (os.environ if env is None else env).get(k.env, "").strip()
        if not text:
            return cls.model_fields[name].get_default(call_default_factory=True)
        try:
            return k.parse(text)
        except ValueError as exc:
            raise SettingError(f"{k.env} {exc}") from None


@cache
def knobs(model: type[BaseSettings]) -> dict[str, Knob]:
    """Every setting of `model`, in declaration order."""
    prefix = model.model_config.get("env_prefix", "")
    out: dict[str, Knob] = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        flag = extra.get("flag")
        out[name] = Knob(name, info, str(extra.get("env") or prefix + name.upper()),
                         None if flag is None else str(flag) if flag is not True else "--" + name.replace("_", "-"))
    return out


def knob(model: type[BaseSettings], name: str) -> Knob:
    return knobs(model)[name]


def describe(model: type[BaseSettings], exc: ValidationError, from_env: set[str]) -> str:
    """A ValidationError in one line: `GATEWAY_PORT must be a whole number, not 'x'`."""
    parts = []
    for err in exc.errors():
        if not err["loc"]:  # the model's own check of several settings together
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        name = str(err["loc"][0])
        if name not in model.model_fields:
            parts.append(f"unknown setting {name!r}")
            continue
        k = knob(model, name)
        where = k.env if name in from_env else name
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ValueError) and str(cause).startswith("must be"):
            parts.append(f"{where} {cause}")
        else:
            parts.append(f"{where} must be {k.expectation()}, not {err['input']!r}")
    return "; ".join(parts)
