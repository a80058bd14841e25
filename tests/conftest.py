"""Shared fixtures: a real gateway on loopback serving the real SmolLM2 model through llama.cpp."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.host.hardware import probe_vulkan, vulkan_visible_env
from gateway.host.ports import free_port
from gateway.models.registry import Registry, load_registry
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
# ggml reads GGML_VK_VISIBLE_DEVICES once, when its Vulkan backend first starts; tests load
# CPU and Vulkan engines in one process, so every Vulkan device (lavapipe too) is made visible
# before any engine loads, as `gateway serve` does.
VULKAN = probe_vulkan()
os.environ.update(vulkan_visible_env(VULKAN))
# Models a developer pulled (`gateway pull`) are not the tests' business: an empty user registry,
# which tests that pull fill in their own folders.
_USER_MODELS = Path(os.environ.get("TMPDIR", "/tmp")) / f"gateway-test-models-{os.getpid()}"
os.environ["GATEWAY_MODELS_DIR"] = str(_USER_MODELS)
# The capability check that runs on a model's first load (on by default) adds its probes to the
# requests and slots tests count: off in tests' gateways, in-process (NO_CHECKS as their
# environment) and started ones; tests/test_capabilities.py runs it.
NO_CHECKS = {"GATEWAY_CHECK_MODELS": "false"}
os.environ.update(NO_CHECKS)


def wait_for(url: str, timeout: float, ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
             alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll `url` until a response satisfies `ok`: False when `timeout` passes first or `alive()`
    (the server's process still running) turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if ok(httpx.get(url, timeout=2)):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


class ServerThread:
    """uvicorn in a background thread, on a free loopback port."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=3, loop="asyncio", http="h11")  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True, timeout: float = 120) -> ServerThread:
        self.thread.start()
        if wait_for(f"{self.url}/health", timeout, ok=lambda r: r.status_code == 200 or (not wait_ready and r.status_code == 503)):
            return self
        raise RuntimeError("gateway did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def registry_path() -> Path:
    return ROOT / "models.yaml"


@pytest.fixture(scope="session")
def gateway_url(registry_path: Path) -> Iterator[str]:
    settings = Settings.from_env(env=NO_CHECKS, config=str(registry_path), parallel=4, max_resident=2)
    app = create_app(settings, load_registry(registry_path))
    server = ServerThread(app).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


# --- converted artifacts (the `convert` extra) -------------------------------------------------


@pytest.fixture(scope="session")
def default_registry(registry_path: Path) -> Registry:
    """models.yaml with the real model cache, so a conversion is done once per machine."""
    return load_registry(registry_path)


def needs_convert(target: str) -> None:
    from gateway.models.convert import missing_modules

    missing = missing_modules(target)
    if missing:
        pytest.skip(f"the `convert` extra is not installed (missing {', '.join(missing)}); pip install -e '.[convert]'")


@pytest.fixture(scope="session")
def onnx_fp32(default_registry: Registry) -> Path:
    """SmolLM2 converted from its GGUF to ORT GenAI fp32 (cached in the model cache)."""
    needs_convert("onnx")
    from gateway.models.convert import convert

    return convert(default_registry, default_registry.models[MODEL], "onnx", "fp32", "cpu")


def converted_gateway(runtime: str, fmt: str, converted: dict[str, str], artifact: Path, tmp_path: Path,
                      default_registry: Registry, spec_fields: dict[str, Any] | None = None,
                      **settings: Any) -> ServerThread:
    """The gateway serving the default model only through `runtime`, from its converted `fmt`
    artifact (`converted`: the models.yaml pin, which must resolve to `artifact`); `spec_fields`
    are added to its models.yaml entry, `settings` override the gateway's (engine=..., parallel=...)."""
    import yaml

    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec = next(m for m in data["models"] if m["id"] == MODEL)
    spec["runtimes"] = [runtime]
    spec["formats"][fmt] = {"converted": converted}
    spec.update(spec_fields or {})
    data["models"] = [spec]
    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    registry = load_registry(cfg, cache_dir=default_registry.cache_dir)
    assert registry.resolve(registry.models[MODEL], fmt) == artifact
    return ServerThread(create_app(Settings.from_env(env=NO_CHECKS, config=str(cfg), **{"parallel": 2, **settings}),
                                   registry)).start()


def chat_answers_paris(server: ServerThread, engine: str, max_tokens: int = 24) -> None:
    """Through the openai SDK: the capital question at temperature 0 answers Paris from `engine`
    (the X-Engine header), and the stream's text equals the non-stream answer."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs: Any = [{"role": "user", "content": "What is the capital of France?"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=max_tokens,
                                                           temperature=0)
    assert raw.headers["x-engine"] == engine
    resp = raw.parse()
    assert "Paris" in (resp.choices[0].message.content or "")
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == resp.choices[0].message.content


def parity_against_llamacpp(runtime: str, tmp_path: Path, engine: str = "cpu") -> dict[str, Any]:
    """`gateway parity`: llama.cpp on the Q4_1 GGUF as reference, `runtime` as candidate, both on
    `engine` (cpu, or vulkan on lavapipe), two prompts x 12 tokens; asserts the verdict and returns
    the report."""
    import json

    from gateway.cli import main as cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n1, 1, 2, 3, 5, 8, 13,\n")
    out = tmp_path / "parity.json"
    rc = cli(["parity", "--model", MODEL, "--engine", engine, "--reference", engine, "--runtime", runtime,
              "--reference-runtime", "llamacpp", "--prompts", str(prompts), "--tokens", "12", "--json", str(out)])
    report: dict[str, Any] = json.loads(out.read_text())
    print(f"gateway parity llama.cpp vs {runtime}: {json.dumps(report['overall'])}")
    assert (report["reference"], report["candidate"]) == (f"llamacpp/{engine}", f"{runtime}/{engine}")
    assert rc == 0 and report["passed"], report["reasons"]
    return report


@pytest.fixture(scope="session")
def pte_xnnpack(default_registry: Registry) -> Path:
    """SmolLM2 converted from its GGUF to an XNNPACK-delegated ExecuTorch program (cached)."""
    needs_convert("executorch")
    from gateway.models.convert import convert

    return convert(default_registry, default_registry.models[MODEL], "executorch", "fp32", "xnnpack")


@pytest.fixture(scope="session")
def pte_vulkan(default_registry: Registry) -> Path:
    """SmolLM2 as a Vulkan-delegated ExecuTorch program (cached), where the Vulkan backend is built
    for the installed executorch (scripts/install-executorch.sh vulkan) and a Vulkan device exists."""
    needs_convert("executorch")
    from engines.executorch import vulkan_backend_library
    from gateway.host.hardware import probe_vulkan
    from gateway.models.convert import convert

    lib, why = vulkan_backend_library()
    if lib is None:
        pytest.skip(why)
    vk = probe_vulkan()
    if not vk.devices:
        pytest.skip(f"no Vulkan device: {vk.reason}")
    return convert(default_registry, default_registry.models[MODEL], "executorch", "fp32", "vulkan")


@pytest.fixture(scope="session")
def hf_reference(default_registry: Registry) -> tuple[Any, Any]:
    """(model, tokenizer): the transformers fp32 reference, from the cached HF checkpoint."""
    needs_convert("onnx")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.models.convert import hf_checkpoint

    path = hf_checkpoint(default_registry, default_registry.models[MODEL])
    torch.manual_seed(0)
    # One torch thread: torch's spinning OpenMP workers and ORT's pool starve each other on 2 cores.
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def coreml_fp16(default_registry: Registry) -> Path:
    """SmolLM2 converted from its GGUF to a stateful CoreML ML program (cached in the model cache)."""
    needs_convert("coreml")
    from gateway.models.convert import convert

    return convert(default_registry, default_registry.models[MODEL], "coreml", "fp16")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with the log tails of the `gateway serve` processes it used (those
    still running, or started during it): on CI that is the only record of what the server saw."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    import sys

    production = sys.modules.get("tests.test_production")
    for g in getattr(getattr(production, "Gateway", None), "started", []):
        if g.proc.poll() is None or g.started_at >= call.start:
            try:
                tail = g.log_path.read_text(errors="replace")[-4000:]
            except OSError as exc:
                tail = f"(unreadable: {exc})"
            report.sections.append((f"gateway on port {g.port}: the end of its log", tail))
