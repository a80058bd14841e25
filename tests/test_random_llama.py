"""benchmarks/make_random_llama.py: a Llama-shaped GGUF with random weights written straight in its
final type (the speed benchmarks' models; a ~100B-shaped one for splitting across GPUs), loaded and
run by the real llama.cpp engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines.llamacpp.engine import LlamaCppEngine, LlamaCppOptions
from gateway.models.gguf_info import read_gguf
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.test_engine_llamacpp import _req, _run


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_k"])
async def test_a_random_model_in_each_type_loads_and_generates(tmp_path: Path, kind: str) -> None:
    reg = load_registry(ROOT / "models.yaml")
    vocab = reg.resolve(reg.models["smollm2-135m-instruct"], "gguf")  # its tokenizer and rope settings
    out = tmp_path / f"tiny-{kind}.gguf"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/make_random_llama.py"), str(vocab), str(out),
                          "--shape", "tiny", "--layers", "3", "--type", kind, "--ctx", "512"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    info = read_gguf(out)
    assert info.get("llama.block_count") == 3 and info.get("llama.embedding_length") == 256
    weight_types = {t.type for t in info.tensors if len(t.shape) == 2}
    assert weight_types == {{"f16": 1, "q8_0": 8, "q4_k": 12}[kind]}  # ggml's type ids
    per_weight = {"f16": 2.0, "q8_0": 34 / 32, "q4_k": 144 / 256}[kind]
    weights = 2 * 49152 * 256 + 3 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 512)
    assert sum(t.nbytes for t in info.tensors if len(t.shape) == 2) == weights * per_weight  # the type's size
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=str(out), context_length=512, parallel=2))
    await e.load()
    try:
        tokens, _ = await _run(e, _req("Hello there", max_tokens=6, ignore_eos=True))
    finally:
        await e.close()
    assert len(tokens) == 6
