"""Memory-aware residency: estimates read from the GGUF, budgets per device, eviction of
the least recently used idle model to make room, refusal before loading of a model that cannot fit,
sizing down, and idle unload after keep_alive; on the real engine in a real `gateway serve`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from engines.llamacpp.runtime import LlamaCppOptions
from gateway.models.gguf_info import read_gguf
from gateway.models.memory import (
    GiB,
    MiB,
    auto_host_cache,
    estimate,
    fit,
    fit_config,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    swa_layers,
)
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.test_production import Gateway

pytestmark = pytest.mark.timeout(600)

SMOL, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"


def _path(model_id: str) -> Path:
    registry = load_registry(ROOT / "models.yaml")
    return registry.resolve(registry.get(model_id), "gguf")  # type: ignore[arg-type]


def test_estimate_reads_the_shapes_from_the_gguf() -> None:
    smol, gemma = read_gguf(_path(SMOL)), read_gguf(_path(GEMMA))
    # f16 K and V: layers x KV heads x (key + value length) x 2 bytes
    assert kv_bytes_per_token(smol) == 30 * 3 * (64 + 64) * 2
    assert kv_bytes_per_token(gemma) == 18 * 1 * (256 + 256) * 2
    # Gemma 3: every 6th layer sees the whole context, the other 15 a window of 512 (+ a batch of
    # 512 cells) unless swa_full.
    assert swa_layers(gemma) == (512, [i % 6 != 5 for i in range(18)]) and swa_layers(smol) == (0, [])
    assert kv_bytes_per_sequence(gemma, 32768) == (3 * 32768 + 15 * 1024) * 1024
    assert kv_bytes_per_sequence(gemma, 32768, swa_full=True) == kv_bytes_per_token(gemma) * 32768
    assert kv_bytes_per_sequence(gemma, 600) == 18 * 600 * 1024  # a context shorter than window + batch
    assert kv_bytes_per_sequence(smol, 2048) == kv_bytes_per_token(smol) * 2048
    n = estimate(smol, 2048, 4)
    assert n.parts["kv"] == 30 * 3 * 128 * 2 * 2048 * 4
    assert n.parts["weights"] == smol.weight_bytes and n.gpu == 0 and n.host == sum(n.parts.values())
    assert estimate(smol, 100_000, 1).context == 8192  # not beyond what it was trained for
    g = estimate(gemma, 2048, 1, device="cuda:0")
    embed = next(t.nbytes for t in gemma.tensors if t.name == "token_embd.weight")
    assert g.parts["embeddings"] == embed and g.parts["weights"] == gemma.weight_bytes - embed
    assert g.gpu == g.parts["weights"] + g.parts["kv"] + g.parts["compute"] + g.parts["gpu runtime"]


def test_fit_sizes_down_sequences_then_context() -> None:
    gemma = read_gguf(_path(GEMMA))
    whole = estimate(gemma, 8192, 4)
    one = estimate(gemma, 8192, 1)
    need, changed = fit(gemma, 8192, 4, "cpu", one.host + MiB, None)
    assert (need.parallel, need.context, changed) == (1, 8192, "parallel 4 -> 1")
    need, changed = fit(gemma, 32768, 1, "cpu", estimate(gemma, 8192, 1).host, None)
    assert (need.context, changed) == (8192, "parallel 1 -> 1, context 32768 -> 8192")
    need, changed = fit(gemma, 8192, 4, "cpu", whole.host, None)
    assert (need, changed) == (whole, "")
    need, changed = fit(gemma, 8192, 1, "cpu", 10 * MiB, None)
    assert changed == "" and need.host > 10 * MiB  # cannot fit: the caller refuses it


def test_the_host_cache_is_in_the_estimate_and_shrinks_first() -> None:
    gemma = read_gguf(_path(GEMMA))
    bare = estimate(gemma, 8192, 4)
    cached = estimate(gemma, 8192, 4, host_cache=500 * MiB)
    assert cached.parts["host cache"] == 500 * MiB and cached.host == bare.host + 500 * MiB
    assert estimate(gemma, 2048, 1, device="cuda:0", host_cache=64 * MiB).parts["host cache"] == 64 * MiB
    # Short of room: the cache gives way first (to the RAM left), sequences and context only after.
    need, changed = fit(gemma, 8192, 4, "cpu", bare.host + 100 * MiB, None, host_cache=500 * MiB)
    assert (need.parallel, need.context, need.parts["host cache"]) == (4, 8192, 100 * MiB)
    assert changed == "host cache 500 -> 100 MiB"
    need, changed = fit(gemma, 8192, 4, "cpu", bare.host - MiB, None, host_cache=500 * MiB)
    assert need.parts["host cache"] == 0 and need.parallel < 4 and changed.startswith("parallel 4 ->")


@pytest.mark.parametrize(("prefix_cache_mib", "used", "want"), [
    (-1, 0, "auto"),  # a quarter of the budget left beside the model
    (-1, 3 * GiB, "auto"),  # other models hold some: a quarter of what is left
    (-1, 4 * GiB, 0),  # nothing left: no cache (never memory another model holds)
    (256, 3 * GiB, 256 * MiB),  # set outright
    (0, 0, 0),  # off
])
def test_each_model_gets_its_share_of_the_ram_left(prefix_cache_mib: int, used: int, want: object) -> None:
    smol = read_gguf(_path(SMOL))
    config = LlamaCppOptions.engine_config(model_path=str(_path(SMOL)), context_length=2048, parallel=1,
                                          prefix_cache_mib=prefix_cache_mib)
    budgets = {"cpu": 4 * GiB}
    need, _changed, exceeded = fit_config(smol, config, "cpu", budgets, used)
    bare = estimate(smol, 2048, 1)
    expected = auto_host_cache(4 * GiB - used - bare.host) if want == "auto" else want
    assert not exceeded and need.parts["host cache"] == expected
    assert expected == 0 or need.host == bare.host + expected


@pytest.fixture
def two_models(tmp_path: Path) -> Path:
    """SmolLM2 (~330 MiB estimated at 2k x 1) and Gemma-3-270M (~577 MiB at 2k x 1, ~667 MiB at 32k)."""
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    models = {m["id"]: m for m in data["models"]}
    smol = {**models[SMOL], "context_length": 2048, "parallel": 1}
    gemma = {**models[GEMMA], "context_length": 2048, "parallel": 1}
    gemma_long = {**models[GEMMA], "id": "gemma-long", "context_length": 32768, "parallel": 1}
    out = tmp_path / "models.yaml"
    out.write_text(yaml.safe_dump({"default": SMOL, "models": [smol, gemma, gemma_long]}, sort_keys=False))
    return out


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _resident(url: str) -> dict[str, int]:
    """Loaded models -> their worker's measured resident memory (bytes)."""
    return {m: row["worker"]["rss_bytes"] for m, row in _health(url)["models"].items() if row.get("engine")}


@pytest.fixture
def gateway(tmp_path: Path, two_models: Path) -> Iterator[callable]:
    started: list[Gateway] = []

    def start(*args: str) -> Gateway:
        g = Gateway(tmp_path, "--config", str(two_models), *args)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


def test_alternating_models_evict_each_other_within_the_budget(gateway: callable) -> None:
    budget = 700 * MiB
    g = gateway("--memory-budget", "700M", "--keep-alive", "-1")
    peaks = []
    for model in (GEMMA, SMOL, GEMMA, SMOL):
        r = _chat(g.url, model)
        assert r.status_code == 200, r.text
        resident = _resident(g.url)
        assert list(resident) == [model], resident  # the other one made room
        peaks.append(sum(resident.values()))
        held = _health(g.url)["memory"]["cpu"]
        assert held["budget_bytes"] == budget and held["used_bytes"] <= budget, held
    assert max(peaks) <= budget, [p // MiB for p in peaks]
    log = g.log()
    assert log.count(f"unloading {SMOL} (to make room for {GEMMA} on cpu)") == 2, log
    assert log.count(f"unloading {GEMMA} (to make room for {SMOL} on cpu)") == 2


def test_a_model_too_large_is_refused_before_loading(gateway: callable) -> None:
    g = gateway("--memory-budget", "450M")
    r = _chat(g.url, GEMMA)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory"
    assert f"model '{GEMMA}' needs" in err["message"] and "the budget is 450 MiB RAM" in err["message"]
    assert "MiB" in err["message"] and "weights" in err["message"] and "kv" in err["message"]
    h = _health(g.url)
    assert not h["models"][GEMMA].get("engine") and h["models"][SMOL].get("engine"), h  # nothing evicted
    # The Anthropic and Ollama routes say it in their own envelopes (Anthropic's 503 is its 529).
    a = httpx.post(f"{g.url}/v1/messages", timeout=60, json={
        "model": GEMMA, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert a.status_code == 529 and a.json()["type"] == "error" and "needs" in a.json()["error"]["message"]
    o = httpx.post(f"{g.url}/api/chat", timeout=60, json={
        "model": GEMMA, "stream": False, "messages": [{"role": "user", "content": "Hi"}]})
    assert o.status_code == 503 and "needs" in o.json()["error"]


def test_a_long_context_is_sized_down_to_fit(gateway: callable) -> None:
    # Gemma's window layers keep 1024 cells whatever the context: ~667 MiB at 32k, ~619 at 16k
    g = gateway("--memory-budget", "640M")
    r = _chat(g.url, "gemma-long")
    assert r.status_code == 200, r.text
    row = _health(g.url)["models"]["gemma-long"]
    assert row["memory"]["sized_down"] == "parallel 1 -> 1, context 32768 -> 16384", row
    assert row["memory"]["estimate"]["context"] == 16384
    assert "gemma-long sized down to fit the memory budget of cpu" in g.log()
    show = httpx.post(f"{g.url}/api/show", json={"model": "gemma-long"}, timeout=30).json()
    assert show["model_info"]["general.context_length"] == 16384


def test_two_models_share_the_ram_budget_with_their_caches(gateway: callable) -> None:
    """Each model's host prefix cache is part of its estimate: the second model's cache is what the
    budget has left, so both stay resident and their estimates never promise more than the budget."""
    budget = 1400 * MiB
    g = gateway("--memory-budget", "1400M", "--keep-alive", "-1")
    assert _chat(g.url, GEMMA).status_code == 200
    models = _health(g.url)["models"]
    assert {m for m, row in models.items() if row.get("engine")} == {SMOL, GEMMA}
    smol, gemma = (models[m]["memory"]["estimate"] for m in (SMOL, GEMMA))
    assert smol["parts_bytes"]["host cache"] > gemma["parts_bytes"]["host cache"] > 0, (smol, gemma)
    assert smol["ram_bytes"] + gemma["ram_bytes"] <= budget
    held = _health(g.url)["memory"]["cpu"]
    assert held["used_bytes"] <= budget, held


def test_idle_models_unload_after_keep_alive(gateway: callable) -> None:
    g = gateway("--keep-alive", "2s")
    assert _chat(g.url, GEMMA).status_code == 200
    ps = httpx.get(f"{g.url}/api/ps", timeout=30).json()["models"]
    assert {m["name"] for m in ps} == {SMOL, GEMMA}
    gemma = next(m for m in ps if m["name"] == GEMMA)
    assert gemma["size"] > 300 * MiB and gemma["expires_at"] < "2318"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and GEMMA in _resident(g.url):
        time.sleep(0.5)
    assert GEMMA not in _resident(g.url), "idle past keep_alive: unloaded"
    assert SMOL in _resident(g.url), "the default model stays loaded"
    while time.monotonic() < deadline and "unloaded gemma-3-270m: idle for" not in g.log():
        time.sleep(0.2)  # logged once its worker has exited
    assert "unloaded gemma-3-270m: idle for" in g.log()
    # A request's own keep_alive (Ollama's) wins over the default, either way.
    r = httpx.post(f"{g.url}/api/generate", timeout=120, json={
        "model": GEMMA, "prompt": "Hi", "stream": False, "keep_alive": "-1", "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    time.sleep(4)
    assert GEMMA in _resident(g.url)
    r = httpx.post(f"{g.url}/api/generate", timeout=120, json={
        "model": SMOL, "prompt": "Hi", "stream": False, "keep_alive": "1s", "options": {"num_predict": 2}})
    assert r.status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and SMOL in _resident(g.url):
        time.sleep(0.5)
    assert SMOL not in _resident(g.url)


def test_devices_says_what_fits_before_anything_loads() -> None:
    import subprocess
    import sys

    def devices(budget: str) -> str:
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--model", GEMMA, "--engine", "cpu",
                            "--memory-budget", budget], cwd=ROOT, capture_output=True, text=True, timeout=300)
        return r.stdout

    gemma = read_gguf(_path(GEMMA))
    bare = estimate(gemma, 32768, 1)
    need = estimate(gemma, 32768, 1, host_cache=auto_host_cache(8 * GiB - bare.host))  # its host cache included
    out = devices("8G")
    assert "Memory    budgets for models: RAM 8.0 GiB" in out
    assert f"memory: needs {need.host / MiB:.0f} MiB RAM" in out
    out = devices("500M")
    assert "memory: DOES NOT FIT: needs" in out and "budget 500 MiB RAM" in out
    out = devices("640M")
    assert "sized down to fit: parallel 1 -> 1, context 32768 -> 16384" in out
