"""A Llama-3-8B-shaped GGUF with random weights, for speed work where no real 8B model can be had
(decode and prefill speed do not depend on the weights).

    PYTHONPATH=<llama.cpp>/gguf-py python3 benchmarks/make_random_llama8b.py VOCAB_GGUF OUT_F16_GGUF [--ctx 32768]
    <llama.cpp build>/bin/llama-quantize OUT_F16_GGUF OUT_Q4_K_M_GGUF Q4_K_M

VOCAB_GGUF is llama.cpp's models/ggml-vocab-llama-bpe.gguf (Llama 3's tokenizer and hyperparameters,
no tensors); the weights are N(0, 0.02) in F16 (one random block, tiled), norms are ones.
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


def main() -> int:
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than Llama-3-8B's 32 (a quick check)")
    args = ap.parse_args()
    r = gguf.GGUFReader(args.vocab)
    f = {k: v.contents() for k, v in r.fields.items()}
    n_vocab, n_embd, n_ff = f["llama.vocab_size"], f["llama.embedding_length"], f["llama.feed_forward_length"]
    n_layer, n_head, n_kv = f["llama.block_count"], f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
    head = n_embd // n_head
    n_layer = args.layers or n_layer
    w = gguf.GGUFWriter(args.out, "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "llama.context_length", "general.file_type",
                                              "llama.block_count"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    w.add_context_length(args.ctx)
    w.add_block_count(n_layer)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 24) * 0.02).astype(np.float16)

    def weight(rows: int, cols: int) -> np.ndarray:
        return np.resize(block, rows * cols).reshape(rows, cols)

    w.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weight(n_head * head, n_embd))
        w.add_tensor(p + "attn_k.weight", weight(n_kv * head, n_embd))
        w.add_tensor(p + "attn_v.weight", weight(n_kv * head, n_embd))
        w.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {args.out}: {n_layer} layers, {n_embd} wide, vocab {n_vocab}, ctx {args.ctx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
