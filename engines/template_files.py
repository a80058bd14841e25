"""The chat template of a Hugging Face-style model folder (ORT GenAI, CoreML, ExecuTorch models).

The template comes from the gateway's config first, then `chat_template.jinja`, then
`tokenizer_config.json`; the BOS and EOS texts from `tokenizer_config.json`. Engines report it;
the gateway renders it (gateway/chat/template.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engines.base import TemplateSource

log = logging.getLogger(__name__)


def template_source(model_dir: str | Path, override: str | None = None) -> TemplateSource | None:
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
    return TemplateSource(source, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")))


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
