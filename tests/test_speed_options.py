"""The speed options of models.yaml through the whole gateway: speculative decoding's
usage details and metrics, sampling on the device, and their validation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import ValidationError

from gateway.app import create_app
from gateway.models.registry import ModelSpec, load_registry
from gateway.settings import Settings
from tests.conftest import NO_CHECKS, ROOT, ServerThread
from tests.test_engine_llamacpp import CODE

MODEL = "smollm2-135m-instruct"


def _config(tmp: Path, **options: object) -> Path:
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec = next(m for m in data["models"] if m["id"] == MODEL)
    spec.update(options)
    data["models"] = [spec]
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


@pytest.fixture(scope="module")
def speculative(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = _config(tmp_path_factory.mktemp("spec"), speculative={"ngram": 3, "max_draft": 8})
    settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), parallel=2, engine="cpu")
    server = ServerThread(create_app(settings, load_registry(cfg))).start()
    yield server.url
    server.stop()


def test_speculative_decoding_reports_its_drafts(speculative: str) -> None:
    health = httpx.get(f"{speculative}/health").json()["models"][MODEL]
    assert health["speculative"] == "ngram 3, up to 8, at most 1 streams" and health["sampling"] == "host", health
    body = {"model": MODEL, "prompt": "# file a.py\n" + CODE + "\n\n# file b.py, a copy of a.py\n" + CODE[:30],
            "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{speculative}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage["completion_tokens_details"]
    assert usage["completion_tokens"] == 96
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0, usage
    # Streaming with include_usage carries the same details; the metrics count the drafts.
    with httpx.stream("POST", f"{speculative}/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        last = [line for line in s.iter_lines() if line.startswith("data: {")][-1]
    streamed = json.loads(last.removeprefix("data: "))["usage"]["completion_tokens_details"]
    assert streamed["accepted_prediction_tokens"] > 0
    metrics = httpx.get(f"{speculative}/metrics").text
    accepted = [line for line in metrics.splitlines()
                if line.startswith("gateway_speculative_draft_tokens_total{") and 'outcome="accepted"' in line]
    both = details["accepted_prediction_tokens"] + streamed["accepted_prediction_tokens"]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) == both, accepted


def test_plain_decoding_has_no_draft_details(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"].get("completion_tokens_details") is None, r.text
    assert httpx.get(f"{gateway_url}/health").json()["models"][MODEL]["speculative"] == "off"


def test_speed_options_are_validated() -> None:
    base = {"id": "m", "formats": {"gguf": {"path": "m.gguf"}}}
    assert ModelSpec(**base, device_sampling="on", speculative={"ngram": 2, "max_draft": 4}).speculative is not None
    for bad in ({"device_sampling": "gpu"}, {"speculative": {"ngram": 0}}, {"speculative": {"max_draft": 0}},
                {"speculative": {"type": "eagle"}}, {"speculative": {"ngram": 3, "draft": 4}}, {"speculative": {"max_streams": 0}}):
        with pytest.raises(ValidationError):
            ModelSpec(**base, **bad)  # type: ignore[arg-type]
    assert Settings.from_env(env={"GATEWAY_DEVICE_SAMPLING": "off"}).device_sampling == "off"
    with pytest.raises(ValueError, match="GATEWAY_DEVICE_SAMPLING"):
        Settings.from_env(env={"GATEWAY_DEVICE_SAMPLING": "maybe"})
