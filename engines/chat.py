"""Chat templates for runtimes that ship a Hugging Face-style model folder (ORT GenAI, CoreML).

Renders the model's Jinja template the way transformers does (sandboxed, `trim_blocks`,
`lstrip_blocks`, `raise_exception`), so prompts match the reference tokenization.  The template
comes from the gateway's config first, then `chat_template.jinja`, then `tokenizer_config.json`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engines.base import ChatMessage
from engines.thinking import render_thinking, template_traits

log = logging.getLogger(__name__)


class ChatTemplate:
    """A compiled chat template with the model's special-token texts."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               thinking: bool | None = None) -> str:
        """The prompt text, with thinking as asked (engines/thinking.py).  Raises whatever the
        template raises (e.g. unsupported roles)."""
        turns = [{"role": m.role, "content": m.content} for m in messages]
        return render_thinking(lambda kw: self._render(turns, add_generation_prompt, kw), thinking)

    def traits(self) -> dict[str, str]:
        """What the template does with reasoning (engines/thinking.py), for EngineInfo.extra."""
        return template_traits(lambda turns, kw: self._render(turns, True, kw), self.source)

    def _render(self, turns: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        return self._template.render(messages=turns, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The template of a model folder (or `override`), or None if it has none."""
        d = Path(model_dir)
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except ValueError:
                log.warning("ignoring unreadable %s", cfg_path)
        source = override
        if source is None and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        if source is None:
            raw = cfg.get("chat_template")
            if isinstance(raw, list):  # named templates: take "default"
                raw = next((t.get("template") for t in raw if t.get("name") == "default"), None)
            source = raw if isinstance(raw, str) else None
        if not source:
            return None
        return cls(source, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")))


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
