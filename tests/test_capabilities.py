"""`gateway check`: the capability probe on the real default model, through the running gateway;
its report in /v1/checks, /v1/models and `gateway ls`. The verdicts the grammar guarantees are
asserted ok; those that depend on what a 135M model chooses to do are asserted present with a
reason, not a value."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread

GUARANTEED = ("streamed tool calls", "tool_choice required", "tool_choice named", "JSON schema output", "stop strings")
CHOSEN = ("tools", "parallel tool calls")  # the model decides under tool_choice auto


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("check")
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    data["models"] = [m for m in data["models"] if m["id"] == MODEL]
    data["cache_dir"] = str(tmp / "cache")  # its own reports, not the user's
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    registry = load_registry(cfg)
    server = ServerThread(create_app(Settings.from_env(env=NO_CHECKS, config=str(cfg), parallel=2, engine="cpu"),
                                     registry)).start()
    yield server.url, cfg
    server.stop()


def test_a_model_not_checked_yet_says_so(gateway: tuple[str, Path]) -> None:
    url, _ = gateway
    r = httpx.get(f"{url}/v1/checks/{MODEL}", timeout=30)
    assert r.status_code == 404 and "POST" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models/{MODEL}", timeout=30).json()["checks"] is None
    assert httpx.post(f"{url}/v1/checks/no-such-model", timeout=30).status_code == 404


@pytest.mark.timeout(900)  # a first load with its functional check, then nine short requests
def test_the_check_probes_the_real_model(gateway: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from gateway import check_cli

    url, cfg = gateway
    assert check_cli.run(argparse.Namespace(model=MODEL, url=url, config=None)) == 0
    printed = capsys.readouterr().out
    report = httpx.get(f"{url}/v1/checks/{MODEL}", timeout=30).json()
    found = {f["name"]: f for f in report["findings"]}
    assert report["format"] == "json"  # SmolLM2's template renders no tools: the gateway's rewrite
    for name in GUARANTEED:
        assert found[name]["ok"] is True, found[name]
    for name in CHOSEN:
        assert isinstance(found[name]["ok"], bool) and found[name]["detail"], found[name]
    assert found["reasoning on"]["ok"] is None and found["reasoning off"]["ok"] is None  # SmolLM2 does not reason
    assert report["summary"] in printed and "tool_choice named" in printed
    card = httpx.get(f"{url}/v1/models/{MODEL}", timeout=30).json()
    assert card["checks"] == report["findings"]
    # The web page's status: the format, the summary and what was not ok, with why.
    row = next(m for m in httpx.get(f"{url}/api/status", timeout=30).json()["models"] if m["id"] == MODEL)
    assert (row["tool_format"], row["check"]) == ("json", report["summary"])
    assert row["check_failed"] == [f"{f['name']}: {f['detail']}" for f in report["findings"] if f["ok"] is False]
    # `gateway ls` reads the kept report from the model cache.
    from gateway.cli import main

    assert main(["ls", "--config", str(cfg), "--url", url]) == 0
    assert report["summary"] in capsys.readouterr().out


@pytest.mark.timeout(900)
def test_check_models_checks_a_model_on_its_first_load(tmp_path: Path) -> None:
    """With `check_models`, the first load starts the check in the background; the kept report
    names the model's format, and the model answered meanwhile."""
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    data["models"] = [m for m in data["models"] if m["id"] == MODEL]
    data["cache_dir"] = str(tmp_path / "cache")
    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    settings = Settings.from_env(env={}, config=str(cfg), parallel=2, engine="cpu")  # on by default
    server = ServerThread(create_app(settings, load_registry(cfg))).start()
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200
        deadline = time.monotonic() + 600
        while (c := httpx.get(f"{server.url}/v1/checks/{MODEL}", timeout=30)).status_code == 404:
            assert time.monotonic() < deadline, "no check after the first load"
            time.sleep(2)
        report = c.json()
        assert report["format"] == "json" and len(report["findings"]) == 9
    finally:
        server.stop()


def test_a_background_check_waits_until_the_models_requests_are_done() -> None:
    """On a first load the check yields to users: each probe starts once no request of the model
    runs or waits in admission."""
    import asyncio
    from types import SimpleNamespace

    from gateway.api.admission import Admission
    from gateway.api.capabilities import _idle

    async def scenario() -> None:
        admission = Admission(max_queue=8, max_wait=30)
        service = SimpleNamespace(admission=admission)
        ticket = await admission.admit(MODEL, 2, 1)  # a user's request runs
        waiting = asyncio.ensure_future(_idle(service, MODEL))  # type: ignore[arg-type]
        await asyncio.sleep(0.6)
        assert not waiting.done()
        ticket.release()
        await asyncio.wait_for(waiting, 2)
        await asyncio.wait_for(_idle(service, "never-loaded"), 1)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_model_that_serves_only_embeddings_is_not_checked_on_load(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from gateway.api.capabilities import ReportCache, check_on_load

    hook = check_on_load(SimpleNamespace(), ReportCache(tmp_path / "reports.json"))  # type: ignore[arg-type]
    hook(SimpleNamespace(spec=SimpleNamespace(embedding_only=True, id="e")))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no running event loop"):  # a chat model's check starts a task
        hook(SimpleNamespace(spec=SimpleNamespace(embedding_only=False, id="c", tool_format=None, chat_template=None),
                             engine=SimpleNamespace(info=SimpleNamespace(template=None)), check_key="k"))
