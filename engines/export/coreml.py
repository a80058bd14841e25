"""Hugging Face Llama-family checkpoint -> stateful CoreML ML program (Apple's KV-cache pattern).

The traced module takes `input_ids` (1, q) and an explicit additive `causal_mask` (1, 1, q, end),
keeps its KV cache in two buffers that become CoreML states (`keyCache`, `valueCache`,
(layers, 1, kv_heads, context, head_dim)), and returns `logits` (1, q, vocab).  Attention is
written out eagerly here instead of calling the transformers model, whose mask and cache code
does not trace (transformers 5); the weights are the transformers model's own modules.
Needs torch, transformers and coremltools (the `convert` extra).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.attention import causal_mask
from engines.export.decoder_parts import TOKENIZER_FILES, LlamaParts, load_hf

log = logging.getLogger(__name__)



class KVCacheDecoder(LlamaParts):
    """A Llama-family decoder with an explicit causal mask and its KV cache in buffers."""

    keyCache: torch.Tensor  # noqa: N815 - the CoreML state names
    valueCache: torch.Tensor  # noqa: N815

    def __init__(self, model: Any, context_length: int, cache_dtype: torch.dtype = torch.float16) -> None:
        super().__init__(model, context_length, "CoreML")
        shape = (len(self.layers), 1, self.n_kv, context_length, self.head_dim)
        self.register_buffer("keyCache", torch.zeros(shape, dtype=cache_dtype))
        self.register_buffer("valueCache", torch.zeros(shape, dtype=cache_dtype))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        q_len = input_ids.shape[-1]
        end = causal_mask.shape[-1]
        start = end - q_len  # tokens already in the cache
        pos = torch.arange(q_len, dtype=torch.float32) + start
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale)[None, None]
        sin = (emb.sin() * self.rope_scale)[None, None]
        h = self.embed(input_ids)
        group = self.n_heads // self.n_kv
        scale = self.head_dim ** -0.5
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, q_len, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, q_len, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, q_len, self.n_kv, self.head_dim).transpose(1, 2)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            self.keyCache[i, :, :, start:end, :] = k.to(self.keyCache.dtype)
            self.valueCache[i, :, :, start:end, :] = v.to(self.valueCache.dtype)
            keys = self.keyCache[i, :, :, :end, :].to(q.dtype).repeat_interleave(group, dim=1)
            values = self.valueCache[i, :, :, :end, :].to(q.dtype).repeat_interleave(group, dim=1)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + causal_mask
            out = torch.matmul(torch.softmax(scores, dim=-1), values)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(1, q_len, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]

    def reset(self) -> None:
        self.keyCache.zero_()
        self.valueCache.zero_()


def hf_to_coreml(hf_dir: Path, out: Path, precision: str, context_length: int) -> Path:
    """Trace, convert (macOS 15 target, fp16 compute), optionally int4-quantise; returns the .mlpackage."""
    import coremltools as ct

    decoder = KVCacheDecoder(load_hf(hf_dir), context_length)
    decoder.eval()
    example = (torch.zeros((1, 2), dtype=torch.int32), torch.from_numpy(causal_mask(2, 5).astype(np.float32)))
    traced = torch.jit.trace(decoder, example, check_trace=False)  # type: ignore[no-untyped-call]
    decoder.reset()
    query = ct.RangeDim(lower_bound=1, upper_bound=context_length, default=1)
    end = ct.RangeDim(lower_bound=1, upper_bound=context_length, default=1)
    cache = tuple(decoder.keyCache.shape)
    mlmodel = ct.convert(
        traced,
        inputs=[
            ct.TensorType(shape=(1, query), dtype=np.int32, name="input_ids"),
            ct.TensorType(shape=(1, 1, query, end), dtype=np.float16, name="causal_mask"),
        ],
        outputs=[ct.TensorType(dtype=np.float16, name="logits")],
        states=[
            ct.StateType(wrapped_type=ct.TensorType(shape=cache, dtype=np.float16), name="keyCache"),
            ct.StateType(wrapped_type=ct.TensorType(shape=cache, dtype=np.float16), name="valueCache"),
        ],
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,  # prediction is impossible off macOS; the spec is all we need
    )
    if precision == "int4":
        config = ct.optimize.coreml.OptimizationConfig(
            global_config=ct.optimize.coreml.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=32
            )
        )
        mlmodel = ct.optimize.coreml.linear_quantize_weights(mlmodel, config=config)
    package = out / "model.mlpackage"
    mlmodel.save(str(package))
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)
    meta = {"context_length": context_length, "vocab_size": int(decoder.lm_head.out_features),
            "inputs": ["input_ids", "causal_mask"], "states": ["keyCache", "valueCache"], "outputs": ["logits"]}
    (out / "coreml_config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return package


if __name__ == "__main__":  # the child-process entry of `gateway convert --to coreml`
    import sys

    if len(sys.argv) != 5:
        sys.exit("usage: python -m engines.export.coreml HF_DIR OUT_DIR PRECISION CONTEXT_LENGTH")
    hf_to_coreml(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
