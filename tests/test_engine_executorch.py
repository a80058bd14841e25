"""The ExecuTorch engine on SmolLM2 exported from the shipped GGUF to an XNNPACK program: logits
against transformers fp32, sampling controls, a method's KV reused across requests, chat through
the gateway's HTTP API with the openai SDK, and `gateway parity` against llama.cpp."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engines.base import EngineConfig, ModelLoadError, SamplingParams
from gateway.chat.template import ChatMessage
from tests.chat import chat_request
from tests.conftest import MODEL, chat_answers_paris, converted_gateway, parity_against_llamacpp

pytest.importorskip("executorch", reason="executorch is not installed (pip install -e '.[executorch]')")

from engines.executorch import ExecuTorchEngine  # noqa: E402

QUESTION = "What is the capital of France?"


def _engine(pte: Path, parallel: int = 1) -> ExecuTorchEngine:
    e = ExecuTorchEngine(EngineConfig(model_path=str(pte), backend="cpu", context_length=2048, parallel=parallel))
    asyncio.run(e.load())
    return e


async def _text(e: ExecuTorchEngine, content: str, sp: SamplingParams) -> tuple[str, Any]:
    req = chat_request(e, (ChatMessage(role="user", content=content),), sp)
    parts, last = [], None
    async for ev in e.generate(req):
        parts.append(ev.text)
        last = ev
    return "".join(parts), last


def test_the_partition_report_says_what_xnnpack_took(pte_xnnpack: Path) -> None:
    report = json.loads((pte_xnnpack / "partition.json").read_text())
    meta = json.loads((pte_xnnpack / "executorch_config.json").read_text())
    assert meta["delegate"] == "xnnpack" and meta["max_seq"] >= 2 and (pte_xnnpack / "model.pte").stat().st_size > 1e8
    # Every linear layer is XNNPACK's; what stays on portable kernels is listed by operator.
    assert report["delegate_calls"] > 0 and report["delegated_share"] > 0.5, report
    assert "llama.custom_sdpa.default" in report["fallback"], report


def test_logits_match_transformers_fp32(pte_xnnpack: Path, hf_reference: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = hf_reference
    e = _engine(pte_xnnpack)
    try:
        ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:300]  # > max_seq: chunked
        got = asyncio.run(e.logits(ids))
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float().numpy()
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) < 2e-3
        assert (got.argmax(-1) == want.argmax(-1)).all()
    finally:
        asyncio.run(e.close())


def test_greedy_is_deterministic_and_a_warm_method_answers_as_a_cold_one(pte_xnnpack: Path) -> None:
    """The method's KV cache keeps the last request's tokens; a request that shares them prefills
    only the rest, and its greedy answer equals the one from a freshly loaded program."""
    greedy = SamplingParams(max_tokens=24, temperature=0)
    e = _engine(pte_xnnpack)
    try:
        first, ev = asyncio.run(_text(e, QUESTION, greedy))
        assert "Paris" in first and ev.usage.completion_tokens > 0
        again, _ = asyncio.run(_text(e, QUESTION, greedy))  # the whole prompt is in the cache
        other, _ = asyncio.run(_text(e, "List three colours.", greedy))  # diverges after the template's start
    finally:
        asyncio.run(e.close())
    cold = _engine(pte_xnnpack)
    try:
        cold_other, _ = asyncio.run(_text(cold, "List three colours.", greedy))
    finally:
        asyncio.run(cold.close())
    assert again == first
    assert other == cold_other and other != first


def test_sampling_seed_stop_and_length(pte_xnnpack: Path) -> None:
    e = _engine(pte_xnnpack)
    try:
        hot = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7)
        a, _ = asyncio.run(_text(e, "Tell me a story.", hot))
        b, _ = asyncio.run(_text(e, "Tell me a story.", hot))
        c, _ = asyncio.run(_text(e, "Tell me a story.", SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=8)))
        assert a == b and a != c
        text, ev = asyncio.run(_text(e, QUESTION, SamplingParams(max_tokens=24, temperature=0, stop=("Paris",))))
        assert "Paris" not in text and ev.finish_reason == "stop" and ev.stop_sequence == "Paris"
        _, ev = asyncio.run(_text(e, QUESTION, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        assert ev.finish_reason == "length" and ev.usage.completion_tokens == 3
    finally:
        asyncio.run(e.close())


def test_a_program_of_another_delegate_or_folder_is_a_load_error(pte_xnnpack: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="xnnpack program; the vulkan engine needs vulkan"):
        asyncio.run(ExecuTorchEngine(EngineConfig(model_path=str(pte_xnnpack), backend="vulkan")).load())
    with pytest.raises(ModelLoadError, match="gateway convert"):
        asyncio.run(ExecuTorchEngine(EngineConfig(model_path=str(tmp_path), backend="cpu")).load())


def test_gateway_serves_chat_through_executorch(pte_xnnpack: Path, tmp_path: Path, default_registry: Any) -> None:
    server = converted_gateway("executorch", "pte", {"precision": "fp32", "provider": "xnnpack"}, pte_xnnpack,
                               tmp_path, default_registry)
    try:
        chat_answers_paris(server, "executorch/cpu")
        msgs: Any = [{"role": "user", "content": QUESTION}]
        # What the API checks of every engine: a grammar this runtime lacks is a 400 naming it.
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": msgs, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
        assert r.status_code == 400 and "executorch" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        server.stop()


def test_parity_llamacpp_vs_executorch_on_the_same_weights(pte_xnnpack: Path, tmp_path: Path) -> None:
    """`gateway parity`: llama.cpp on the Q4_1 GGUF as reference, ExecuTorch/XNNPACK on the same
    weights dequantised to fp32 as candidate, within the cross-runtime tolerance."""
    report = parity_against_llamacpp("executorch", tmp_path)
    assert 0 < report["overall"]["mean_kl"] < 0.02

