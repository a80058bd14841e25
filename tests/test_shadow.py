"""Shadow parity: a live gateway re-scores served requests; the queue drops under load; drift falls back."""

from __future__ import annotations

import logging
import re
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import openai
import pytest

from engines.base import EngineConfig, ModelLoadError
from gateway.app import create_app
from gateway.metrics import Metrics
from gateway.models.pool import ModelManager
from gateway.models.registry import load_registry
from gateway.parity.shadow import ShadowParity, ShadowSample
from gateway.settings import Settings
from tests import hosts
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread
from tests.fakes import FakeEngine


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_shadow_parity_scores_served_requests(registry_path: Path) -> None:
    settings = Settings.from_env(
        env=NO_CHECKS, config=str(registry_path), parallel=2, max_resident=2,
        parity_reference="cpu", parity_sample=1.0, parity_window=3,
    )
    server = ServerThread(create_app(settings, load_registry(registry_path))).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for q in ("Name a colour.", "What is 2 + 2?", "Say hello in French."):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0
            )
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{server.url}/metrics").text
            if _metric(text, "gateway_parity_samples_scored_total", model=MODEL) >= 3:
                break
            time.sleep(0.2)
        labels = {"model": MODEL, "engine": "llamacpp/cpu", "device": "cpu"}
        assert _metric(text, "gateway_parity_samples_scored_total", **labels) == 3
        assert _metric(text, "gateway_parity_kl_count", **labels) == 3
        mean_kl = _metric(text, "gateway_parity_kl_sum", **labels) / 3
        top1 = _metric(text, "gateway_parity_top1_agreement_sum", **labels) / 3
        logging.getLogger(__name__).warning("shadow parity, served CPU vs reference CPU: mean KL %.3g, top-1 %.3f", mean_kl, top1)
        assert mean_kl < 1e-6 and top1 == 1.0
        assert _metric(text, "gateway_parity_drifted", **labels) == 0
        health = httpx.get(f"{server.url}/health").json()
        (entry,) = health["parity"]["engines"]
        assert entry["scored"] == 3 and entry["window"] == 3 and entry["drifted"] is False
    finally:
        server.stop()


class _Perturbed(FakeEngine):
    """A fake whose next-token distribution differs from the reference fake's (uniform)."""

    async def logits(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        return np.tile(np.arange(8, dtype=np.float32), (len(token_ids), 1))


def _manager(factory: type[FakeEngine], **kw: object) -> tuple[ModelManager, ShadowParity, Metrics]:
    # A private cache: drift is recorded like a failed functional check, and must not leak.
    registry = load_registry(ROOT / "models.yaml", cache_dir=tempfile.mkdtemp(prefix="shadow-"))
    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), parity_reference="cpu", **kw)
    metrics = Metrics()
    # A host with llama.cpp only: the one candidate, whatever converted formats the cache holds.
    manager = ModelManager(registry, settings, lambda _r, cfg: factory(cfg), metrics, host=hosts.CPU_ONLY)
    return manager, ShadowParity(manager, settings, metrics), metrics


async def test_a_full_queue_drops_and_counts() -> None:
    manager, shadow, metrics = _manager(FakeEngine, parity_sample=1.0, parity_queue=2)
    loaded = await manager.get(manager.registry.models[MODEL])
    offered = [shadow.offer(loaded, (1, 2), (3, 4)) for _ in range(5)]  # the scorer is not running
    assert offered == [True, True, False, False, False]
    dropped = metrics.parity_dropped.labels(MODEL, "llamacpp/cpu", "cpu", "queue_full")._value.get()
    assert dropped == 3 and shadow.queue.qsize() == 2
    await manager.close()


async def test_sampling_rate_zero_offers_nothing() -> None:
    manager, shadow, _ = _manager(FakeEngine, parity_sample=0.0)
    loaded = await manager.get(manager.registry.models[MODEL])
    assert not any(shadow.offer(loaded, (1,), (2,)) for _ in range(50))
    await manager.close()


async def test_drift_over_the_window_is_reported_and_enforced() -> None:
    manager, shadow, metrics = _manager(_Perturbed, parity_sample=1.0, parity_window=2, parity_enforce=True)
    spec = manager.registry.models[MODEL]
    loaded = await manager.get(spec)
    reference = FakeEngine(EngineConfig(model_path="ref"))  # uniform logits
    shadow._refs[spec.id] = reference
    sample = ShadowSample(loaded, (1, 2, 3), (4, 5, 6))
    await shadow.score(sample)
    assert manager.is_loaded(spec.id), "one sample does not fill the window"
    await shadow.score(sample)
    status = shadow.status()
    (entry,) = status["engines"]
    assert entry["drifted"] is True and "mean KL" in entry["reason"]
    assert "llamacpp/cpu" in status["excluded"][spec.id]
    assert metrics.parity_drifted.labels(MODEL, "llamacpp/cpu", "cpu")._value.get() == 1
    assert metrics.fallbacks.labels(MODEL, "llamacpp/cpu", "parity_drift")._value.get() == 1
    assert not manager.is_loaded(spec.id)
    (check,) = manager.checks.read().values()  # what `gateway devices` shows, and the next start skips
    assert not check["ok"] and check["reason"].startswith("parity drift: ")
    with pytest.raises(ModelLoadError, match="excluded: llamacpp/cpu: parity drift"):
        await manager.get(spec)
    await manager.close()
    assert loaded.engine.closed  # type: ignore[attr-defined]


def test_parity_settings_from_env_and_flags() -> None:
    from gateway.cli import build_parser

    s = Settings.from_env(env={
        "GATEWAY_PARITY_REFERENCE": "cpu", "GATEWAY_PARITY_SAMPLE": "0.25", "GATEWAY_PARITY_WINDOW": "7",
        "GATEWAY_PARITY_QUEUE": "3", "GATEWAY_PARITY_ENFORCE": "1",
    })
    assert (s.parity_reference, s.parity_sample, s.parity_window, s.parity_queue, s.parity_enforce) == ("cpu", 0.25, 7, 3, True)
    assert Settings.from_env(env={}).parity_reference is None
    args = build_parser().parse_args(["serve", "--parity-reference", "cpu", "--parity-sample", "0.05", "--parity-enforce"])
    assert (args.parity_reference, args.parity_sample, args.parity_enforce) == ("cpu", 0.05, True)
