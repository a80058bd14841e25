"""Hugging Face Llama-family checkpoint -> ExecuTorch program (`.pte`) with a static KV cache.

The exported method `forward(tokens (1, q) int64, input_pos (1,) int64) -> logits (1, q, vocab)`
writes the new tokens' keys and values at `input_pos .. input_pos+q-1` of two mutable buffers
(`k_cache_<layer>`, `v_cache_<layer>`: (1, context, kv_heads, head_dim), fp32) with ExecuTorch's
`llama::update_cache` kernel and attends causally up to the last of them with `llama::custom_sdpa`,
so every shape but `q` is static and `q` has an upper bound (`max_seq`, the prefill chunk):
ExecuTorch plans all memory ahead, the KV cache included, and the delegates see bounded dynamic
shapes.  Rows beyond a sequence's end are never read, so a new request needs no reset and a
request that shares a prefix with the last one keeps it.

Delegates: `xnnpack` (CPU, every linear and most of the rest) or `vulkan` (GPU compute shaders;
the partitioner takes what its operator registry supports and the rest runs on ExecuTorch's
portable CPU kernels).  `partition.json` records what each delegate took and which operators fell
back.  Needs torch, transformers and executorch (the `convert` and `executorch` extras).
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engines.export.decoder_parts import TOKENIZER_FILES, LlamaParts, load_hf

log = logging.getLogger(__name__)

DELEGATES = ("xnnpack", "vulkan", "portable")
MAX_SEQ = 128  # prompt tokens per call: the upper bound of the dynamic dimension


class StaticKVDecoder(LlamaParts):
    """A Llama-family decoder whose KV cache is one buffer per layer and kind, indexed by `input_pos`."""

    def __init__(self, model: Any, context_length: int) -> None:
        super().__init__(model, context_length, "ExecuTorch")
        # One buffer per layer and kind, (1, context, kv_heads, head_dim): the layout of
        # ExecuTorch's own `llama::update_cache` and `llama::custom_sdpa` kernels, which write the
        # new rows in place and attend only up to the current position.
        shape = (1, context_length, self.n_kv, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        q_len = tokens.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)  # type: ignore[no-untyped-call]
        torch._check(start + q_len <= self.context_length)  # type: ignore[no-untyped-call]
        pos = torch.arange(q_len, dtype=torch.float32) + input_pos.to(torch.float32)  # (q,)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale)[None, :, None, :]  # (1, q, 1, head_dim)
        sin = (emb.sin() * self.rope_scale)[None, :, None, :]
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = self._rope(attn.q_proj(x).view(1, q_len, self.n_heads, self.head_dim), cos, sin)
            k = self._rope(attn.k_proj(x).view(1, q_len, self.n_kv, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(1, q_len, self.n_kv, self.head_dim)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            torch.ops.llama.update_cache(k, k_cache, start)
            torch.ops.llama.update_cache(v, v_cache, start)
            # scale None is 1/sqrt(head_dim), the models' own; the Vulkan delegate takes no other.
            out = torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0, True, None)  # (1, q, heads, hd)
            h = h + attn.o_proj(out.reshape(1, q_len, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]


def _partitioner(delegate: str) -> list[Any]:
    if delegate == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if delegate == "vulkan":
        from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

        return [VulkanPartitioner()]
    return []


def partition_report(edge_program: Any) -> dict[str, Any]:
    """What the delegate took: delegated calls, and the operators left to the portable CPU kernels."""
    gm = edge_program.graph_module
    delegated = 0
    fallback: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if "executorch_call_delegate" in name:
            delegated += 1
        elif name != "getitem":
            fallback[name] += 1
    inside: collections.Counter[str] = collections.Counter()
    for _name, sub in gm.named_children():
        original = getattr(sub, "original_module", None)
        graph = getattr(original, "graph", None) if original is not None else None
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function":
                inside[getattr(node.target, "__name__", str(node.target))] += 1
    total = sum(inside.values()) + sum(fallback.values())
    return {
        "delegate_calls": delegated,
        "delegated_ops": sum(inside.values()),
        "fallback_ops": sum(fallback.values()),
        "delegated_share": round(sum(inside.values()) / total, 4) if total else 0.0,
        "fallback": dict(fallback.most_common()),
    }


def hf_to_pte(hf_dir: Path, out: Path, delegate: str, context_length: int, max_seq: int = MAX_SEQ) -> Path:
    """Export, lower to `delegate`, write `model.pte`, the tokenizer and `executorch_config.json`."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 - registers llama::update_cache, custom_sdpa
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from torch.export import Dim, export

    if delegate not in DELEGATES:
        raise ValueError(f"unknown delegate {delegate!r}; one of {', '.join(DELEGATES)}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    decoder = StaticKVDecoder(load_hf(hf_dir), context_length).eval()
    max_seq = max(2, min(max_seq, context_length))
    example = (torch.zeros((1, 2), dtype=torch.int64), torch.zeros((1,), dtype=torch.int64))
    seq = Dim("seq", min=1, max=max_seq)
    with torch.no_grad():
        program = export(decoder, example, dynamic_shapes=({1: seq}, None), strict=False)
    edge = to_edge_transform_and_lower(
        program, partitioner=_partitioner(delegate),
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    report = partition_report(edge.exported_program())
    et = edge.to_executorch()
    (out / "model.pte").write_bytes(et.buffer)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)
    meta = {
        "context_length": context_length, "max_seq": max_seq, "delegate": delegate,
        "vocab_size": int(decoder.lm_head.out_features), "layers": len(decoder.layers),
        "kv_heads": decoder.n_kv, "head_dim": decoder.head_dim, "cache_dtype": "float32",
        "inputs": ["tokens", "input_pos"], "outputs": ["logits"], "method": "forward",
    }
    (out / "executorch_config.json").write_text(json.dumps(meta, indent=2) + "\n")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "partition.json").write_text(json.dumps(report, indent=2) + "\n")  # `gateway convert` reports it
    return out / "model.pte"


if __name__ == "__main__":  # the child-process entry of `gateway convert --to executorch`
    if len(sys.argv) != 5:
        sys.exit("usage: python -m engines.export.executorch HF_DIR OUT_DIR DELEGATE CONTEXT_LENGTH")
    hf_to_pte(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
