"""Fallback with the real engine: a GPU candidate that fails its functional check hands over
to the next one, and the reason reaches the log, the response headers and /health."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from engines.base import ModelLoadError
from engines.llamacpp.runtime import found as llamacpp_found
from gateway.app import create_app
from gateway.host.hardware import HostCapabilities, VulkanInfo, probe_host
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests import hosts
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread


def _broken_gpu_host() -> HostCapabilities:
    """This host, plus a discrete Vulkan GPU that the probe lists but llama.cpp cannot open."""
    real = probe_host()
    ghost = dataclasses.replace(hosts.vk(7, "Ghost GPU 9000", "discrete"), index=7)
    llama = llamacpp_found(real)
    build = dataclasses.replace(llama.package, backends=tuple({*llama.package.backends, "Vulkan"}),
                                devices=(*llama.package.devices, ("Vulkan7", "Ghost GPU 9000", "gpu")))
    return dataclasses.replace(real, vulkan=VulkanInfo("libvulkan.so.1", "1.3", (ghost,))).with_found(
        "llamacpp", dataclasses.replace(llama, package=build))


@pytest.fixture(scope="module")
def fallback_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    cache = tmp_path_factory.mktemp("cache")
    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), parallel=1)
    app = create_app(settings, load_registry(ROOT / "models.yaml", cache_dir=cache), host=_broken_gpu_host())
    server = ServerThread(app).start(timeout=300)
    yield server.url, app
    server.stop()


def test_failed_gpu_falls_back_to_cpu_with_the_reason(fallback_gateway: tuple[str, object]) -> None:
    url, _ = fallback_gateway
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200
    assert r.headers["x-engine"] == "llamacpp/cpu"
    reason = r.headers["x-fallback-reason"]
    assert "llamacpp/vulkan on Ghost GPU 9000" in reason and "no device Vulkan7" in reason
    health = httpx.get(f"{url}/health").json()["models"][MODEL]
    assert health["engine"] == "llamacpp/cpu" and "Vulkan7" in health["fallback_reason"]
    assert health["failed_candidates"][0]["candidate"].startswith("llamacpp/vulkan")


def test_failed_check_is_cached(fallback_gateway: tuple[str, object]) -> None:
    _, app = fallback_gateway
    entries = app.state.manager.checks.read()  # type: ignore[attr-defined]
    outcomes = sorted((e["what"].split(" on ")[1].split()[0], e["ok"]) for e in entries.values())
    assert outcomes == [("llamacpp/cpu", True), ("llamacpp/vulkan", False)]


def test_fallback_counter_is_exported(fallback_gateway: tuple[str, object]) -> None:
    url, _ = fallback_gateway
    text = httpx.get(f"{url}/metrics").text
    assert 'gateway_fallbacks_total{engine="llamacpp/vulkan",model="smollm2-135m-instruct",reason="check_failed"} 1.0' in text


def test_explicit_engine_that_fails_its_check_stops_the_start(tmp_path: Path) -> None:
    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), engine="vulkan", parallel=1)
    app = create_app(settings, load_registry(ROOT / "models.yaml", cache_dir=tmp_path), host=_broken_gpu_host())
    with pytest.raises(ModelLoadError, match="no device Vulkan7"), TestClient(app):
        pass  # the start itself fails: no request is ever served on the CPU
    assert "no device Vulkan7" in app.state.startup_error  # type: ignore[attr-defined]
