"""ExecuTorch's Vulkan delegate on SmolLM2: the whole graph lowered to Vulkan, run by the backend
that scripts/install-executorch.sh builds for the installed wheel, on the host's Vulkan device
(Mesa's lavapipe in CI): logits against transformers fp32 and the XNNPACK program, chat through the
gateway with `X-Engine: executorch/vulkan`, and `gateway parity` against llama.cpp's Vulkan build.

Skipped, with the reason, where the Vulkan backend is not built (its sources are in no package
registry: the build needs the pinned source snapshots) or no Vulkan device exists."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import EngineConfig, ModelLoadError
from tests.conftest import chat_answers_paris, converted_gateway, parity_against_llamacpp

pytest.importorskip("executorch", reason="executorch is not installed (pip install -e '.[executorch]')")

from engines.executorch import VULKAN_LIB_ENV, ExecuTorchEngine, load_vulkan_backend  # noqa: E402


def _engine(pte: Path, backend: str) -> ExecuTorchEngine:
    e = ExecuTorchEngine(EngineConfig(model_path=str(pte), backend=backend, context_length=2048, parallel=1,
                                      device_key="0" if backend == "vulkan" else ""))
    asyncio.run(e.load())
    return e


def test_the_vulkan_partitioner_takes_the_whole_graph(pte_vulkan: Path) -> None:
    """The seed's capability-based partitioning: every operator of the decoder, the KV-cache update
    and attention included, is in one Vulkan subgraph; nothing falls back to portable kernels."""
    report = json.loads((pte_vulkan / "partition.json").read_text())
    meta = json.loads((pte_vulkan / "executorch_config.json").read_text())
    assert meta["delegate"] == "vulkan" and meta["max_seq"] >= 2
    assert report["delegate_calls"] == 1 and report["delegated_share"] == 1.0 and report["fallback"] == {}, report


def test_vulkan_logits_match_transformers_and_xnnpack(pte_vulkan: Path, pte_xnnpack: Path,
                                                      hf_reference: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = hf_reference
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:300]  # > max_seq: chunked
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    e = _engine(pte_vulkan, "vulkan")
    try:
        assert e.info.backend == "vulkan" and e.info.extra["delegate"] == "vulkan"
        got = asyncio.run(e.logits(ids))
    finally:
        asyncio.run(e.close())
    x = _engine(pte_xnnpack, "cpu")
    try:
        xnn = asyncio.run(x.logits(ids))
    finally:
        asyncio.run(x.close())
    assert got.shape == want.shape
    err = float(np.abs(got - want).max())
    print(f"Vulkan vs transformers fp32: max |d| {err:.2e}; vs XNNPACK {float(np.abs(got - xnn).max()):.2e}")
    assert err < 2e-3
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_a_missing_vulkan_backend_is_a_load_error_naming_the_build(pte_vulkan: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VULKAN_LIB_ENV, str(tmp_path / "none.so"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_vulkan_backend()
    with pytest.raises(ModelLoadError, match="does not exist"):
        asyncio.run(ExecuTorchEngine(EngineConfig(model_path=str(pte_vulkan), backend="vulkan")).load())


def test_gateway_serves_chat_on_executorch_vulkan(pte_vulkan: Path, tmp_path: Path, default_registry: Any) -> None:
    server = converted_gateway("executorch", "pte", {"precision": "fp32", "provider": "vulkan"}, pte_vulkan,
                               tmp_path, default_registry, engine="vulkan", parallel=1)
    try:
        chat_answers_paris(server, "executorch/vulkan", max_tokens=16)
    finally:
        server.stop()


def test_parity_llamacpp_vulkan_vs_executorch_vulkan(pte_vulkan: Path, tmp_path: Path) -> None:
    """Two Vulkan runtimes on the same weights: llama.cpp's Vulkan build on the Q4_1 GGUF as
    reference, ExecuTorch's Vulkan delegate on them dequantised to fp32 as candidate."""
    report = parity_against_llamacpp("executorch", tmp_path, engine="vulkan")
    assert 0 < report["overall"]["mean_kl"] < 0.02
