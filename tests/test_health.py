"""The probes on a real gateway serving the real model: /health (and /health/ready) is 200 while the
default model can serve (loaded, or loadable on demand) whatever other models do, 503 only when it
cannot; /health/live only says the process answers; loading a model that is not installed is the
client's 409, with the install hint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread, wait_for

# A model whose Python package is not installed (as gemma-3-270m is, unless asked for).
ABSENT = "absent-model"
ABSENT_PACKAGE = "llm-gateway-absent-model"


def _registry(tmp: Path, default: str = MODEL) -> Path:
    """The real model (from models.yaml, with the real model cache) and the absent one."""
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    smol = next(m for m in cfg["models"] if m["id"] == MODEL)
    absent = {"id": ABSENT, "description": "a model whose package is not installed",
              "formats": {"gguf": {"pypi": {"module": "llm_gateway_absent_model", "package": ABSENT_PACKAGE,
                                            "files": ["absent.gguf"]}}}}
    path = tmp / "models.yaml"
    path.write_text(yaml.safe_dump({"default": default, "models": [smol, absent]}))
    return path


class Gateway:
    def __init__(self, tmp: Path, default: str = MODEL, **settings: Any) -> None:
        path = _registry(tmp, default)
        # One resident model: a load must not unload the default to make room before it knows it can load.
        self.app = create_app(Settings.from_env(env=NO_CHECKS, config=str(path), parallel=2, max_resident=1, **settings),
                              load_registry(path))
        self.server = ServerThread(self.app).start(wait_ready=False, timeout=300)
        self.url = self.server.url

    def health(self, path: str = "/health") -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10)

    def settled(self) -> httpx.Response:
        """/health once the start-up load has ended."""
        assert wait_for(f"{self.url}/health", 300, ok=lambda r: r.json()["status"] != "loading"), self.health().text
        return self.health()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(tmp_path_factory.mktemp("health"))
    assert g.settled().status_code == 200, g.health().text
    yield g
    g.server.stop()


def _load(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/api/models/{model}/load", timeout=300)


def _chat(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=4, temperature=0)
    return answer.choices[0].message.content or ""


def test_loading_a_model_that_is_not_installed_is_a_client_error_with_the_hint(gw: Gateway) -> None:
    r = _load(gw.url, ABSENT)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "model_not_installed" and f"pip install {ABSENT_PACKAGE}" in err["message"]


def test_health_stays_200_after_a_failed_load_of_another_model(gw: Gateway) -> None:
    assert _load(gw.url, MODEL).status_code == 200
    assert not _load(gw.url, ABSENT).is_success
    for path in ("/health", "/health/ready"):
        h = gw.health(path)
        assert h.status_code == 200 and h.json()["status"] == "ok", h.text
        models = h.json()["models"]
        assert models[ABSENT]["status"] == "failed" and ABSENT_PACKAGE in models[ABSENT]["error"]
        # Room was not made for a model that could not load: the default still serves.
        assert models[MODEL]["ready"] and models[MODEL]["engine"].startswith("llamacpp/")


def test_health_stays_200_after_the_default_model_is_unloaded_and_a_chat_loads_it(gw: Gateway) -> None:
    assert _load(gw.url, MODEL).status_code == 200
    r = httpx.post(f"{gw.url}/api/models/{MODEL}/unload", timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "not_loaded", r.text
    for path in ("/health", "/health/ready"):
        h = gw.health(path)
        assert h.status_code == 200 and h.json()["status"] == "ok", h.text
        row = h.json()["models"][MODEL]
        assert row["status"] == "not_loaded" and not row["ready"] and "engine" not in row
        assert "not loaded" in h.json()["reason"]
    assert _chat(gw.url)
    h = gw.health()
    assert h.status_code == 200 and h.json()["models"][MODEL]["ready"] and "reason" not in h.json()


def test_live_and_ready(gw: Gateway) -> None:
    live = gw.health("/health/live")
    assert live.status_code == 200 and live.json()["status"] == "alive" and live.json()["uptime_s"] >= 0
    ready, health = gw.health("/health/ready"), gw.health()
    assert ready.status_code == health.status_code == 200
    r, h = ready.json(), health.json()
    assert (r["status"], r["default_model"], set(r["models"])) == (h["status"], h["default_model"], set(h["models"]))
    paths = httpx.get(f"{gw.url}/openapi.json").json()["paths"]
    assert {"/health", "/health/ready", "/health/live"} <= set(paths)


def test_draining_is_not_ready_but_live_until_the_drain_time_runs_out(gw: Gateway) -> None:
    drain = gw.app.state.drain
    try:
        drain.begin(retry_after=7)
        for path in ("/health", "/health/ready"):
            h = gw.health(path)
            assert h.status_code == 503 and h.json()["status"] == "draining" and h.headers["retry-after"] == "7"
        assert gw.health("/health/live").status_code == 200  # finishing its requests: do not restart it
        drain.expired = True
        live = gw.health("/health/live")
        assert live.status_code == 503 and live.json()["status"] == "stopping"
    finally:
        drain.draining = drain.expired = False
    assert gw.health("/health/ready").status_code == 200


@pytest.mark.parametrize("preload", [True, False], ids=["preload", "lazy"])
def test_503_when_the_default_model_cannot_load(tmp_path: Path, preload: bool) -> None:
    g = Gateway(tmp_path, default=ABSENT, preload=preload)
    try:
        h = g.settled()
        assert h.status_code == 503 and h.json()["status"] == "error", h.text
        assert ABSENT in h.json()["reason"]
        if preload:  # the load at start-up failed, and says why
            assert h.json()["models"][ABSENT]["status"] == "failed" and ABSENT_PACKAGE in h.json()["reason"]
        else:  # nothing tried to load it: its files are missing
            assert h.json()["models"][ABSENT]["status"] == "not_loaded" and "not on this machine" in h.json()["reason"]
        ready = g.health("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "error"
        assert g.health("/health/live").status_code == 200  # the process is fine: a restart would not help
    finally:
        g.server.stop()
