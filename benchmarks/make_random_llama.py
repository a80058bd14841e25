"""A Llama-shaped GGUF with random weights, for speed work where no real model of that size can be
had (decode and prefill speed do not depend on the weights), written straight in its final type.

    PYTHONPATH=<llama.cpp>/gguf-py python3 benchmarks/make_random_llama.py VOCAB_GGUF OUT_GGUF \
        [--shape 8b|70b|tiny] [--layers N] [--type f16|q8_0|q4_k] [--ctx 32768]

VOCAB_GGUF gives the tokenizer and the rope and norm settings: llama.cpp's
models/ggml-vocab-llama-bpe.gguf (Llama 3's, no tensors) or any Llama-architecture GGUF. The shape
sets the widths and heads (`8b`: Llama-3-8B's, `70b`: Llama-3-70B's, `tiny`: a few MB, for tests);
`--layers` changes the depth, e.g. `--shape 70b --layers 100` for a ~100B-shaped model past one
80 GB card. F16 weights are N(0, 0.02); quantized ones are valid blocks of random quants with small
scales. Tensors are written one at a time from a tiled random block, so a model of any size needs
only one tensor's memory and its disk space (an F16 file converted by llama-quantize would need both
files' space).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# (width, feed-forward width, attention heads, KV heads, layers)
SHAPES = {"8b": (4096, 14336, 32, 8, 32), "70b": (8192, 28672, 64, 8, 80), "tiny": (256, 512, 4, 2, 2)}
# Keys this script sets from the shape (the vocabulary file's own values are left out).
SET_KEYS = ("general.architecture", "general.file_type", "llama.context_length", "llama.block_count",
            "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.rope.dimension_count", "llama.vocab_size")


def random_blocks(kind: str, n_blocks: int = 1 << 16) -> bytes:
    """`n_blocks` valid blocks of the type: F16 values (as one "block" each), Q8_0 (f16 scale, 32
    int8 quants), or Q4_K (f16 scale and min, 12 bytes of 6-bit sub-scales, 128 bytes of nibbles)."""
    rng = np.random.default_rng(0)
    if kind == "f16":
        return (rng.standard_normal(n_blocks * 64) * 0.02).astype(np.float16).tobytes()
    if kind == "q8_0":
        blocks = np.zeros((n_blocks, 34), dtype=np.uint8)
        blocks[:, :2] = np.frombuffer(np.full(n_blocks, 0.02 / 64, dtype=np.float16).tobytes(), np.uint8).reshape(-1, 2)
        blocks[:, 2:] = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8).view(np.uint8)
        return blocks.tobytes()
    blocks = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)  # q4_k: random sub-scales and nibbles
    scale = np.frombuffer(np.full(2 * n_blocks, 0.02 / (63 * 8), dtype=np.float16).tobytes(), np.uint8)
    blocks[:, :4] = scale.reshape(-1, 4)  # d and dmin: weights within about ±0.04
    return blocks.tobytes()


def main() -> int:
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=0, help="another depth than the shape's")
    ap.add_argument("--type", choices=("f16", "q8_0", "q4_k"), default="f16")
    ap.add_argument("--ctx", type=int, default=32768)
    args = ap.parse_args()
    q = gguf.GGMLQuantizationType
    qtype = {"f16": q.F16, "q8_0": q.Q8_0, "q4_k": q.Q4_K}[args.type]
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M}[args.type]
    n_embd, n_ff, n_head, n_kv, n_layer = SHAPES[args.shape]
    n_layer = args.layers or n_layer
    head = n_embd // n_head

    r = gguf.GGUFReader(args.vocab)
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(args.out, "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in SET_KEYS or key.startswith("split."):
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    w.add_context_length(args.ctx)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head)
    w.add_vocab_size(n_vocab)
    if "llama.attention.layer_norm_rms_epsilon" not in r.fields:
        w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(file_type)
    if "tokenizer.chat_template" not in r.fields:
        w.add_chat_template(TEMPLATE)

    tensors: list[tuple[str, int, int]] = [("token_embd.weight", n_vocab, n_embd), ("output_norm.weight", 0, n_embd),
                                           ("output.weight", n_vocab, n_embd)]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", 0, n_embd), (p + "attn_q.weight", n_head * head, n_embd),
                    (p + "attn_k.weight", n_kv * head, n_embd), (p + "attn_v.weight", n_kv * head, n_embd),
                    (p + "attn_output.weight", n_embd, n_head * head), (p + "ffn_norm.weight", 0, n_embd),
                    (p + "ffn_gate.weight", n_ff, n_embd), (p + "ffn_up.weight", n_ff, n_embd),
                    (p + "ffn_down.weight", n_embd, n_ff)]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    sizes = [rows * cols // block * type_size for _, rows, cols in tensors]  # bytes of each matrix (0: a norm)
    for (name, rows, cols), nbytes in zip(tensors, sizes, strict=True):
        if not rows:  # a norm: F32 ones
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            if cols % block:
                sys.exit(f"{name}: {cols} columns are not a whole number of {args.type} blocks of {block}")
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pattern = np.frombuffer(random_blocks(args.type), dtype=np.uint8)
    for (_name, rows, cols), nbytes in zip(tensors, sizes, strict=True):
        # whole blocks: the pattern is whole blocks
        w.write_tensor_data(np.resize(pattern, nbytes) if rows else np.ones(cols, dtype=np.float32))
    w.close()
    print(f"wrote {args.out}: {args.shape}-shaped, {n_layer} layers, {n_embd} wide, vocab {n_vocab}, "
          f"{args.type}, {sum(sizes) / 2**30:.1f} GiB of weights, ctx {args.ctx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
