"""Ollama's Modelfile, read into the fields of `/api/create` (what `ollama create -f Modelfile` sends):
FROM, PARAMETER, SYSTEM, MESSAGE, LICENSE, TEMPLATE, ADAPTER. `gateway create` uses it.

    FROM ./SmolLM2-135M-Instruct-Q4_1.gguf     # a GGUF file (or a folder of one split GGUF), or a model name
    PARAMETER temperature 0.2
    PARAMETER stop "<|im_end|>"
    SYSTEM \"\"\"You are a pirate.\"\"\"
    MESSAGE user Hello
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_COMMANDS = ("from", "parameter", "system", "message", "license", "template", "adapter", "requires")


class ModelfileError(ValueError):
    """A Modelfile that cannot be read; the message names the line."""


@dataclass
class Modelfile:
    from_: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    template: str | None = None
    adapters: list[str] = field(default_factory=list)


def _value(raw: str) -> Any:
    """A PARAMETER's value: a number where it reads as one, else the text."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 6 and text.startswith('"""') and text.endswith('"""'):
        return text[3:-3]
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def parse(text: str) -> Modelfile:
    mf = Modelfile()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i + 1
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command = command.lower()
        if command not in _COMMANDS:
            raise ModelfileError(f"line {start}: unknown instruction {command.upper()!r} "
                                 f"(known: {', '.join(c.upper() for c in _COMMANDS)})")
        rest = rest.strip()
        if command in ("parameter", "message"):
            key, _, rest = rest.partition(" ")
            rest = rest.strip()
        else:
            key = ""
        # A """ block may span lines.
        if rest.startswith('"""') and (len(rest) < 6 or not rest.endswith('"""')):
            block = [rest]
            while i < len(lines) and not lines[i].rstrip().endswith('"""'):
                block.append(lines[i])
                i += 1
            if i == len(lines):
                raise ModelfileError(f"line {start}: a \"\"\" block that is never closed")
            block.append(lines[i].rstrip())
            i += 1
            rest = "\n".join(block)
        value = _unquote(rest)
        if command != "parameter" and not value and command != "system":
            raise ModelfileError(f"line {start}: {command.upper()} needs a value")
        if command == "from":
            mf.from_ = value
        elif command == "parameter":
            if not key or not rest:
                raise ModelfileError(f"line {start}: PARAMETER needs a name and a value")
            v = value if rest.lstrip().startswith('"') else _value(value)
            if key == "stop":
                mf.parameters.setdefault("stop", []).append(str(v))
            else:
                mf.parameters[key] = v
        elif command == "system":
            mf.system = value
        elif command == "message":
            if key not in ("system", "user", "assistant"):
                raise ModelfileError(f"line {start}: MESSAGE's role must be system, user or assistant, not {key!r}")
            mf.messages.append({"role": key, "content": value})
        elif command == "license":
            mf.license.append(value)
        elif command == "template":
            mf.template = value
        elif command == "adapter":
            mf.adapters.append(value)
    if not mf.from_:
        raise ModelfileError("no FROM line: name the model or the GGUF file to start from")
    return mf


def local_files(mf: Modelfile, base: Path) -> list[Path] | None:
    """The GGUF files FROM names when it is a path (relative to the Modelfile's folder): the file, or
    every GGUF of a folder; None when FROM names a model."""
    p = Path(mf.from_).expanduser()
    p = p if p.is_absolute() else base / p
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf")
        if not found:
            raise ModelfileError(f"FROM {mf.from_}: the folder has no .gguf file")
        return found
    if mf.from_.startswith((".", "/", "~")) or mf.from_.lower().endswith(".gguf"):
        raise ModelfileError(f"FROM {mf.from_}: no such file or folder")
    return None
