"""llama.cpp on Vulkan, for real, on Mesa's lavapipe (a software Vulkan device).

The probe lists lavapipe, `--engine vulkan` selects it, the gateway serves chat through it,
and its next-token distributions agree with the CPU engine's within the parity tolerance
(not token for token: the Vulkan kernels compute in fp16). Lavapipe decodes at a few tokens
per second and compiles pipelines on first use, so the prompts are short.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engines.base import EngineConfig, GenerationRequest, SamplingParams
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.runtime import LlamaCppOptions, found
from gateway.app import create_app
from gateway.cli import main as cli
from gateway.host.hardware import probe_host
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import MODEL, NO_CHECKS, ROOT, VULKAN, ServerThread

HOST = probe_host()
LAVAPIPE = [d for d in VULKAN.devices if d.type == "cpu"]
# In CI this must run (scripts/test.sh installs the Vulkan build and Mesa); elsewhere it may be absent.
pytestmark = pytest.mark.skipif(
    not os.environ.get("CI") and not (found(HOST).package.has("Vulkan") and LAVAPIPE),
    reason="needs the Vulkan build of llama-cpp-python and Mesa's lavapipe (scripts/test.sh installs both)",
)
PROMPT = "The capital of France is"
KL_TOLERANCE = 0.02  # nats per position: fp16 kernels vs fp32 CPU on a Q4_1 model


@pytest.fixture(scope="module")
def vulkan_gateway() -> Iterator[tuple[str, object]]:
    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), engine="vulkan", parallel=1, preload=True)
    app = create_app(settings, load_registry(ROOT / "models.yaml"), host=HOST)
    server = ServerThread(app).start(timeout=600)
    yield server.url, app
    server.stop()


def test_selection_picks_lavapipe_for_engine_vulkan(vulkan_gateway: tuple[str, object]) -> None:
    url, _ = vulkan_gateway
    health = httpx.get(f"{url}/health").json()["models"][MODEL]
    assert health["engine"] == "llamacpp/vulkan"
    assert health["device"] == LAVAPIPE[0].name


def test_chat_through_vulkan(vulkan_gateway: tuple[str, object]) -> None:
    url, _ = vulkan_gateway
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    assert r.headers["x-engine"] == "llamacpp/vulkan"
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
async def cpu_engine() -> AsyncIterator[LlamaCppEngine]:
    reg = load_registry(ROOT / "models.yaml")
    path = reg.resolve(reg.models[MODEL], "gguf")
    e = LlamaCppEngine(EngineConfig(model_path=str(path), context_length=256, parallel=1))
    await e.load()
    yield e
    await e.close()


async def test_vulkan_logits_agree_with_cpu(vulkan_gateway: tuple[str, object], cpu_engine: LlamaCppEngine) -> None:
    _, app = vulkan_gateway
    vk = app.state.manager.loaded()[0].engine  # type: ignore[attr-defined]
    # Teacher-forced on the CPU engine's greedy continuation.
    req = GenerationRequest("p", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), prompt=PROMPT)
    cont = [t async for ev in cpu_engine.generate(req) for t in ev.token_ids]
    ids = await cpu_engine.tokenize(PROMPT) + cont
    ref = _log_softmax(await cpu_engine.logits(ids))
    cand = _log_softmax(await vk.logits(ids))
    n = len(cont)
    ref, cand = ref[-n - 1 : -1], cand[-n - 1 : -1]  # the positions that predict the continuation
    kl = (np.exp(ref) * (ref - cand)).sum(axis=-1)
    top1 = float((ref.argmax(-1) == cand.argmax(-1)).mean())
    print(f"Vulkan(lavapipe) vs CPU over {n} positions: mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, top-1 {top1:.2f}")
    assert kl.mean() < KL_TOLERANCE and top1 >= 0.75
    # And a perturbation of that size would be caught: the check can fail.
    noisy = _log_softmax(cand + np.random.default_rng(0).normal(0, 1.0, cand.shape))
    assert (np.exp(ref) * (ref - noisy)).sum(axis=-1).mean() > KL_TOLERANCE


def test_gateway_parity_vulkan_vs_cpu(tmp_path: Path) -> None:
    """`gateway parity --engine vulkan --reference cpu`, as a user runs it, within tolerance."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nLa photosynthèse est\n")
    out = tmp_path / "parity.json"
    rc = cli(["parity", "--model", MODEL, "--engine", "vulkan", "--reference", "cpu", "--prompts", str(prompts),
              "--tokens", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    overall = report["overall"]
    print(f"gateway parity vulkan vs cpu: {json.dumps(overall)}")
    assert rc == 0, overall
    assert report["candidate"] == "llamacpp/vulkan" and report["passed"]


async def _vulkan_engine(prefix_cache_mib: int) -> LlamaCppEngine:
    from engines.llamacpp.ggml_devices import devices

    dev = next(d for d in devices() if d.backend == "Vulkan")
    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    e = LlamaCppEngine(LlamaCppOptions.engine_config(
        model_path=str(reg.resolve(spec, "gguf")), context_length=512, parallel=1, chat_template=spec.chat_template,
        backend="vulkan", device=dev.description, device_key=dev.name, prefix_cache_mib=prefix_cache_mib,
        pinned_host_cache="on"))
    await e.load()
    return e


async def test_the_host_prefix_cache_is_page_locked_on_a_gpu_and_restores_exactly() -> None:
    """On a device with page-locked host memory (Vulkan's, as CUDA's) the cache's entries live in it
    (DMA copies, engines/llamacpp/host_memory.py); a conversation that lost its slot restores from it
    and answers as a cold run does."""
    from tests.test_prefix_cache import TOPICS, _ask, _conversation

    e = await _vulkan_engine(prefix_cache_mib=64)
    try:
        host = e._sched.host_cache  # type: ignore[union-attr]
        # Pinned at load ("on": on Vulkan the default is pageable memory).
        assert host is not None and host.memory.pinned and host.memory.name == "Vulkan_Host"
        assert host.memory.allocations == 1 and host.memory.limit_bytes == 64 << 20
        a1, b1, a2 = _conversation(TOPICS[0], 1), _conversation(TOPICS[1], 1), _conversation(TOPICS[0], 2)
        await _ask(e, a1, max_tokens=4)
        await _ask(e, b1, max_tokens=4)  # takes the only slot: A's KV goes to page-locked memory
        assert len(host) == 1 and host.memory.used >= host.bytes > 0
        assert all(entry.block.handle is not None for entry in host._entries.values())
        text, usage = await _ask(e, a2, max_tokens=4)
        assert usage.prefix_lookup == "hit" and usage.restored_tokens >= 64, usage
        stats = e.health().prefix_cache
        assert stats is not None and stats.pinned and stats.hits == 1
    finally:
        await e.close()
    assert host.memory.used == 0 and not host.memory.pinned  # closing the engine freed the arena
    cold = await _vulkan_engine(prefix_cache_mib=0)
    try:
        cold_text, cold_usage = await _ask(cold, a2, max_tokens=4)
    finally:
        await cold.close()
    assert cold_usage.restored_tokens == 0 and text == cold_text


def test_page_locked_ranges_are_reused_and_merge() -> None:
    from engines.llamacpp.ggml_devices import devices
    from engines.llamacpp.host_memory import PinnedHostMemory
    from engines.llamacpp.prefix_cache import HostPrefixCache

    dev = next(d for d in devices() if d.backend == "Vulkan")
    assert PinnedHostMemory.for_device("CPU", 1 << 20) is None
    page = PinnedHostMemory.PAGE
    mem = PinnedHostMemory.for_device(dev.name, limit_bytes=10 * page)
    assert mem is not None
    assert mem.take(100).handle is None and not mem.pinned  # numpy memory until pinned
    assert mem.pin() and mem.pinned
    a, b, c = mem.take(3 * page), mem.take(2 * page + 1), mem.take(2 * page)
    assert (a.handle, b.handle, c.handle) == (0, 3 * page, 6 * page) and b.capacity == 3 * page
    a.array[:] = 7
    assert mem.take(3 * page).capacity == 0  # 2 pages left: no room
    mem.give(a)
    mem.give(c)  # merges with the 2 free pages after it: 4 pages at 6
    assert mem._free == [(0, 3 * page), (6 * page, 4 * page)]
    d = mem.take(page)  # best fit: the smaller free range
    assert d.handle == 0
    mem.give(d)
    mem.give(b)  # everything free again, merged into one range
    whole = mem.take(10 * page)
    assert whole.handle == 0 and whole.array[0] == 7 and mem.used == 10 * page
    mem.give(whole)
    # The cache makes room in the arena by evicting its least recently used entries.
    cache = HostPrefixCache(limit_bytes=10 * page, memory=mem)
    for i in range(4):
        assert cache.put(f"m{i}", np.arange(100 + i, dtype=np.int32), 3 * page, lambda arr: len(arr))
    assert len(cache) == 3 and cache.evictions == 1 and mem.used == 9 * page
    assert cache.put("big", np.arange(50, dtype=np.int32), 6 * page, lambda arr: len(arr))
    assert len(cache) == 2 and mem.used == 9 * page
    # No free range that large (fragments of 1 page): pageable memory, not an eviction.
    small = HostPrefixCache(limit_bytes=10 * page, memory=mem)
    assert small.put("x", np.arange(10, dtype=np.int32), page, lambda arr: len(arr))
    assert small.unpinned == 0 and mem.used == 10 * page
    evictions = cache.evictions
    assert cache.put("y", np.arange(20, dtype=np.int32), page, lambda arr: len(arr))
    assert cache.unpinned == 1 and cache.evictions == evictions and len(cache) == 3
    small.close()
    cache.close()
    assert mem.used == 0 and not mem.pinned
