"""What the traced/exported decoders share: a Hugging Face Llama-family model's own modules, its
rotary frequencies, and RoPE written out (the CoreML and ExecuTorch exports differ only in how they
keep the KV cache and attend). Needs torch and transformers (the `convert` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SUPPORTED = ("llama", "mistral", "qwen2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json", "special_tokens_map.json")


class LlamaParts(torch.nn.Module):
    """The embedding, layers, norm and head of `model`, with its attention geometry and RoPE."""

    inv_freq: torch.Tensor
    embed: Any
    layers: Any
    norm: Any
    lm_head: Any

    def __init__(self, model: Any, context_length: int, target: str) -> None:
        super().__init__()
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"{target} export supports {', '.join(SUPPORTED)} models, not {cfg.model_type!r}")
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.context_length = context_length
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def load_hf(hf_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
