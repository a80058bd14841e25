"""Model families' formats of tool calls and reasoning, chosen from the model's chat template.

`detect` reads a template's source as llama-server does, most specific format first; models.yaml's
`tool_format:` names one instead (`named`). A template that renders no tools gets the generic
format: the gateway's own rewrite (gateway/chat/formats/rewrite.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines.base import EngineConfig
from gateway.chat.formats.base import Format
from gateway.chat.formats.command_r7b import CommandR7B
from gateway.chat.formats.deepseek import DeepSeekR1, DeepSeekV31
from gateway.chat.formats.functionary import Functionary
from gateway.chat.formats.granite import Granite
from gateway.chat.formats.harmony import Harmony
from gateway.chat.formats.hermes import Hermes
from gateway.chat.formats.llama3 import Llama3
from gateway.chat.formats.mistral import Mistral, MistralV11
from gateway.chat.formats.qwen3_coder import Qwen3Coder
from gateway.chat.formats.rewrite import Generic
from gateway.chat.template import ChatTemplate

GENERIC = Generic()
# Most specific first: a later format's tags may appear in an earlier one's template (Qwen3-Coder's
# holds Hermes' <tool_call>; Functionary's is a Llama 3 one with its own `>>>` recipients; Mistral
# v11's templates hold v3's tag).
FORMATS: tuple[Format, ...] = (Harmony(), Qwen3Coder(), DeepSeekR1(), DeepSeekV31(), CommandR7B(), Functionary(), Llama3(),
                               MistralV11(), Mistral(), Granite(), Hermes())


def detect(template: ChatTemplate | None) -> Format:
    """The format a model's template speaks (the generic one when it renders no tools)."""
    return detect_text(template.source.text if template is not None else None)


def detect_text(text: str | None) -> Format:
    """The format a template's source speaks (the generic one for none)."""
    if not text:
        return GENERIC
    return next((f for f in FORMATS if f.detects(text)), GENERIC)


def serving(name: str | None, template: ChatTemplate | None) -> Format:
    """The format a model is served with: models.yaml's `tool_format`, else its template's."""
    return named(name) if name else detect(template)


def named(name: str) -> Format:
    """A format by name (models.yaml `tool_format:`). Raises KeyError."""
    for f in (*FORMATS, GENERIC):
        if f.name == name:
            return f
    raise KeyError(name)


def names() -> list[str]:
    return [f.name for f in (*FORMATS, GENERIC)]


async def prepared(tool_format: str | None, template: ChatTemplate | None, config: EngineConfig | None,
                   cache_dir: Path) -> Format:
    """The format of a served model (models.yaml's `tool_format`, else its template's), with what
    it needs of the model made (off the event loop, once). Raises KeyError for an unknown name,
    and FormatUnavailable (a ModelNotAvailable: 503) naming why the format cannot be used."""
    fmt = serving(tool_format, template)
    if not fmt.ready:
        await asyncio.to_thread(fmt.prepare, cache_dir, config.model_path if config is not None else None)
    return fmt
