"""A tiny random-weight vision-language model in Gemma 3's shape: a text GGUF and its projector GGUF.

Made the way a real one is: a Hugging Face checkpoint (transformers' Gemma3ForConditionalGeneration,
a SigLIP vision tower, random weights; a SentencePiece vocabulary with Gemma's special tokens and its
chat template) converted by llama.cpp's own converter (`convert_hf_to_gguf.py` of the llama.cpp that
llama-cpp-python pins) into the model, and with `--mmproj` into the projector. Its words are noise,
but an image still becomes its tokens through llama.cpp's multimodal library, and different images
give different logits, so images run through the real engine and every protocol on a model small
enough for CI (about 1 MB together).

    python scripts/tiny_vlm.py OUT_DIR [--converter DIR]

writes OUT_DIR/tiny-gemma3-vision.gguf and OUT_DIR/mmproj-tiny-gemma3-vision.gguf. The converter is
the one `scripts/install-llama-cpp.sh` keeps beside its builds; without it the pinned sdist is fetched
(hash-checked) from the package index. Needs the dev lock (torch, transformers, sentencepiece).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "templates" / "google-gemma-3-4b-it.jinja"
NAME = "tiny-gemma3-vision"
# Gemma's turn and image tokens (after <pad> <eos> <bos> <unk>, ids 0-3 as in Gemma's vocabulary).
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 64, 8, 16  # 8x8 patches pooled 2x2: 16 tokens an image


def pinned_sdist() -> tuple[str, str]:
    """The llama-cpp-python version and sdist hash that scripts/install-llama-cpp.sh pins."""
    text = (ROOT / "scripts" / "install-llama-cpp.sh").read_text()
    version = re.search(r"^pinned_version=(\S+)", text, re.M)
    sha = re.search(r"^pinned_sha256=(\S+)", text, re.M)
    assert version and sha, "install-llama-cpp.sh names no pinned version"
    return version.group(1), sha.group(1)


def converter_dir() -> Path:
    """Where install-llama-cpp.sh keeps llama.cpp's converter for the pinned version."""
    version, _ = pinned_sdist()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("GATEWAY_LLAMA_CONVERTER") or cache / "llm-gateway" / f"llama-convert-{version}")


def fetch_converter(into: Path) -> Path:
    """The converter from the pinned sdist (fetched, hash-checked), unpacked into `into`."""
    version, sha = pinned_sdist()
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text(f"llama-cpp-python=={version} --hash=sha256:{sha}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--require-hashes", "-d", tmp, "-r", str(req)], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        unpack_converter(sdist, into)
    return into


def unpack_converter(sdist: Path, into: Path) -> None:
    """convert_hf_to_gguf.py, its `conversion` package and gguf-py, out of a llama-cpp-python sdist."""
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    part = into.with_name(into.name + ".part")
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = m.name.split("/vendor/llama.cpp/", 1)
            if len(rel) == 2 and rel[1].startswith(keep) and m.isfile():
                m.name = rel[1]
                tar.extract(m, part, filter="data")
    part.rename(into)


def _vocabulary(out: Path) -> tuple[int, dict[str, int]]:
    """A SentencePiece model with Gemma's pad/eos/bos/unk ids and byte fallback: its size, the specials' ids."""
    import sentencepiece as spm

    words = ("the a image of is what colour red green blue cat dog picture shows describe this "
             "answer question model user tell me about small large left right top bottom").split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                                   eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                                   user_defined_symbols=SPECIALS, minloglevel=2, num_threads=1)
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    ids = {s: sp.PieceToId(s) for s in SPECIALS}
    decoder = {str(i): {"content": s, "special": True} for s, i in ids.items()}
    decoder.update({str(i): {"content": s, "special": True}
                    for i, s in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])})
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
        "chat_template": TEMPLATE.read_text(), "tokenizer_class": "GemmaTokenizer"}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return int(sp.GetPieceSize()), ids


def checkpoint(out: Path, seed: int = 0) -> Path:
    """The Hugging Face checkpoint: config, random weights, tokenizer, image preprocessing."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    n_vocab, ids = _vocabulary(out)
    config = Gemma3Config(
        text_config={"vocab_size": n_vocab, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "sliding_window": 64, "max_position_embeddings": 8192,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH},
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # larger than the default init, so the logits differ visibly between images
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    _published_names(out / "model.safetensors")
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": TOKENS_PER_IMAGE,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}))
    return out


def _published_names(path: Path) -> None:
    """The tensor names of Gemma 3's published checkpoints (`vision_tower.vision_model.*`), which
    llama.cpp's converter reads; this transformers saves the vision tower without `vision_model`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {(k.replace("vision_tower.", "vision_tower.vision_model.", 1)
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def write(out_dir: str | Path, converter: Path | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Write the model and its projector into `out_dir`; returns (model, mmproj)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conv = converter or converter_dir()
    if not (conv / "convert_hf_to_gguf.py").is_file():
        conv = fetch_converter(conv)
    model, mmproj = out_dir / f"{NAME}.gguf", out_dir / f"mmproj-{NAME}.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        hf = checkpoint(Path(tmp) / "hf", seed)
        for extra, path in (([], model), (["--mmproj"], mmproj)):
            run = subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                                  "--outfile", str(path), *extra], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"llama.cpp's converter failed:\n{run.stderr[-4000:]}")
    return model, mmproj


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--converter", type=Path, help="a directory with llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for path in write(a.out_dir, a.converter, a.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
