"""A tiny random-weight GGUF that carries a model family's chat template and special tokens.

Its output is noise, but under a grammar (a tool call required, a JSON format) it is well-formed,
so a family's format (its template, tags, grammar and parser) runs through the real engine and
every protocol on a model small enough for CI (well under 1 MB).

    python scripts/tiny_gguf.py OUT.gguf --template T.jinja --special "[TOOL_CALLS]" --special "[ARGS]" \\
        --eos "</s>" [--bos "<s>"] [--eog "<|call|>"]

The vocabulary is byte-level BPE with a single merge: the 256 bytes (GPT-2's byte-to-text table),
then the special tokens as control tokens; the model is a two-layer Llama.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _byte_texts() -> list[str]:
    """GPT-2's table: each byte as the printable character byte-level BPE vocabularies use."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write(path: str | Path, template: str, specials: Sequence[str], eos: str, bos: str | None = None,
          eog: Sequence[str] = (), n_embd: int = 64, n_layer: int = 2, seed: int = 0) -> Path:
    """Write the model; `eos`, `bos` and `eog` must be among `specials` (or are added to them)."""
    import gguf

    names = list(dict.fromkeys([*specials, eos, *([bos] if bos else []), *eog]))
    # One merge (two spaces), as llama.cpp's loader wants a merge list.
    space = _byte_texts()[ord(" ")]
    tokens = [*_byte_texts(), space * 2, *names]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * len(names)
    n_vocab, n_head, n_kv, n_ff = len(tokens), 4, 2, n_embd * 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random")
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{space} {space}"])
    w.add_eos_token_id(tokens.index(eos))
    if bos:
        w.add_bos_token_id(tokens.index(bos))
    w.add_add_bos_token(bool(bos))
    w.add_chat_template(template)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    head = n_embd // n_head
    w.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(n_kv * head, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(n_kv * head, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--template", required=True, help="the chat template (a .jinja file)")
    ap.add_argument("--special", action="append", default=[], help="a special token's text (repeat)")
    ap.add_argument("--eos", required=True)
    ap.add_argument("--bos")
    ap.add_argument("--eog", action="append", default=[], help="another end-of-generation token (repeat)")
    args = ap.parse_args(argv)
    write(args.out, Path(args.template).read_text(), args.special, args.eos, args.bos, args.eog)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
