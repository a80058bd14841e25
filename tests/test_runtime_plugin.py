"""A runtime is a plug-in: one module (tests/plugin_runtime.py) registers it, and `gateway devices`,
selection and serving pick it up without a change to the gateway. Gateway code reaches the
runtimes only through the registry."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import ValidationError

from engines import runtimes
from gateway.app import create_app
from gateway.host.selection import Preference, SelectionError, plan
from gateway.models.convert import MANIFEST
from gateway.models.registry import ModelSpec, Registry, load_registry
from gateway.settings import Settings
from tests import hosts
from tests.conftest import MODEL, NO_CHECKS, ServerThread, needs_convert
from tests.test_code_shape import imports_of

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "tests.plugin_runtime"
YAML = """
default: echo-model
models:
  - id: echo-model
    formats: {echo: {path: echo.bin}}
"""
SPEC = ModelSpec.model_validate({"id": "echo-model", "formats": {"echo": {"path": "echo.bin"}}})


@pytest.fixture
def plugin() -> Iterator[runtimes.Runtime]:
    module = importlib.import_module(PLUGIN)
    runtimes.register(module.RUNTIME)
    yield module.RUNTIME
    runtimes.unregister(module.NAME)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    (tmp_path / "echo.bin").write_bytes(b"echo")
    p = tmp_path / "models.yaml"
    p.write_text(YAML)
    return p


def test_the_registry_lists_the_plugin_after_the_builtin_runtimes(plugin: runtimes.Runtime) -> None:
    names = [r.name for r in runtimes.runtimes()]
    assert names[:4] == ["llamacpp", "ortgenai", "coreml", "executorch"] and names[-1] == "echo"
    assert runtimes.runtime("echo") is plugin
    # An engine only the plug-in offers goes before the CPU.
    assert runtimes.engine_order() == ("cuda", "metal", "vulkan", "directml", "coreml", "echo", "cpu")


def test_selection_plans_the_plugin_from_its_probe(plugin: runtimes.Runtime) -> None:
    host = plugin.probe(hosts.CPU_ONLY)
    p = plan(SPEC, host)
    # Its own engine first (an engine only a plug-in offers goes before the CPU), then the CPU.
    assert [(c.label, c.format) for c in p.candidates] == [("echo/echo", "echo"), ("echo/cpu", "echo")]
    # Without its probe's verdict it is out, with the reason; pinned, the other runtimes are not asked.
    with pytest.raises(SelectionError, match="echo/cpu: runtime 'echo' was not probed"):
        plan(SPEC, hosts.CPU_ONLY)
    assert [c.label for c in plan(SPEC, host, Preference(runtime="echo")).candidates] == ["echo/echo", "echo/cpu"]
    assert [c.label for c in plan(SPEC, host, Preference("cpu")).candidates] == ["echo/cpu"]
    # A GGUF model on the same host still goes to llama.cpp: the plug-in serves its own format only.
    gguf = ModelSpec.model_validate({"id": "m", "formats": {"gguf": {"path": "m.gguf"}}})
    assert [c.label for c in plan(gguf, host).candidates] == ["llamacpp/cpu"]


def test_selection_is_pure_over_the_runtimes_it_is_given(plugin: runtimes.Runtime) -> None:
    host = plugin.probe(hosts.CPU_ONLY)
    builtin = [r for r in runtimes.runtimes() if r.name != "echo"]
    with pytest.raises(SelectionError, match="llamacpp/cpu: model 'echo-model' has no gguf format") as e:
        plan(SPEC, host, registered=builtin)
    assert "echo/" not in str(e.value)


def test_options_refuse_unknown_keys(plugin: runtimes.Runtime) -> None:
    assert plugin.parse_options({"greeting": "hi"}).model_dump() == {"greeting": "hi"}
    with pytest.raises(ValidationError, match="greting"):
        plugin.parse_options({"greting": "hi"})
    llamacpp = runtimes.runtime("llamacpp")
    assert llamacpp is not None
    assert llamacpp.parse_options({"kv_unified": True}).model_dump()["kv_unified"] is True
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        llamacpp.parse_options({"kv_unifed": True})
    coreml = runtimes.runtime("coreml")
    assert coreml is not None
    with pytest.raises(ValidationError):
        coreml.parse_options({"compute_units": "GPU_ONLY"})


def test_each_runtime_gets_its_own_options_from_models_yaml_and_the_settings(plugin: runtimes.Runtime) -> None:
    from engines.llamacpp.runtime import LlamaCppOptions
    from gateway.host.selection import Candidate
    from gateway.models.pool import engine_config

    spec = ModelSpec.model_validate({"id": "m", "formats": {"gguf": {"path": "m.gguf"}}, "kv_unified": True,
                                     "swa_full": True, "speculative": {"ngram": 2}, "compute_units": "CPU_ONLY"})
    settings = Settings.from_env(env={"GATEWAY_SEQUENCES": "8", "GATEWAY_PREFILL_BUDGET": "96"})
    llama = engine_config(spec, Candidate("llamacpp", "cpu", "cpu", "", "gguf"), "m.gguf", settings)
    assert llama.options == LlamaCppOptions(kv_unified=True, sequences=8, swa_full=True, prefill_budget=96,
                                            draft_ngram=2, draft_max=16, draft_streams=1)
    coreml = engine_config(spec, Candidate("coreml", "coreml", "ane", "ALL", "coreml"), "m", settings)
    assert coreml.options is not None and coreml.options.model_dump() == {"compute_units": "CPU_ONLY"}
    echo = engine_config(spec, Candidate("echo", "cpu", "cpu", "", "echo"), "m", settings)
    assert echo.options == plugin.options()
    # Without a descriptor (an engine factory registered alone) a config carries none.
    assert engine_config(spec, Candidate("nameless", "cpu", "cpu", "", "x"), "m", settings).options is None


def test_options_cross_to_a_worker_and_are_validated_there(plugin: runtimes.Runtime) -> None:
    from dataclasses import replace

    from engines.base import EngineConfig, ModelLoadError
    from engines.coreml import CoreMLOptions
    from engines.llamacpp.runtime import LlamaCppOptions
    from engines.worker import wire

    def across(runtime: str, config: EngineConfig) -> EngineConfig:
        load = wire.decode_for_worker(wire.frame(wire.Load(runtime, config))[4:])
        assert isinstance(load, wire.Load) and load.config.options is None  # the options travel apart
        return load.engine_config()

    config = LlamaCppOptions.engine_config(model_path="m.gguf", parallel=2, kv_unified=True, sequences=8,
                                           cpu_variant="zen4", pinned_host_cache="off")
    back = across("llamacpp", config)
    assert back == config and isinstance(back.options, LlamaCppOptions)
    plain = EngineConfig("m.gguf")
    assert across("llamacpp", plain) == plain
    greeting = replace(plain, options=plugin.parse_options({"greeting": "hey"}))
    assert across("echo", greeting) == greeting
    # Through JSON too (the functional check's child), the same way.
    values = json.loads(json.dumps(runtimes.option_values(config)))
    assert runtimes.with_option_values("llamacpp", replace(config, options=None), values) == config
    # A key the worker's runtime does not know is refused by name, as are bad values.
    with pytest.raises(ModelLoadError, match=r"llamacpp: unknown option 'kv_unifed'.*its options: device_sampling"):
        wire.Load("llamacpp", plain, {"kv_unifed": True}).engine_config()
    with pytest.raises(ModelLoadError, match="option 'draft_max'"):
        wire.Load("llamacpp", plain, {"draft_max": -1}).engine_config()
    with pytest.raises(ModelLoadError, match="not registered"):
        wire.Load("nameless", plain, {"x": 1}).engine_config()
    # An engine reads its own typed options, its defaults where none, and refuses another runtime's.
    assert LlamaCppOptions.of(plain) == LlamaCppOptions()
    with pytest.raises(ModelLoadError, match="takes LlamaCppOptions, but its configuration carries CoreMLOptions"):
        LlamaCppOptions.of(replace(plain, options=CoreMLOptions()))
    with pytest.raises(ValidationError, match="kv_unifed"):
        LlamaCppOptions.engine_config(model_path="m.gguf", kv_unifed=True)


def test_gateway_devices_shows_the_plugin_and_plans_on_it(config: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--json", "--config", str(config)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "GATEWAY_PLUGINS": PLUGIN})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["host"]["runtimes"]["echo"]["available"] is True
    assert out["echo"] == {"available": True}
    assert [(c["runtime"], c["engine"]) for c in out["plans"]["echo-model"]["candidates"]] == [("echo", "echo"),
                                                                                               ("echo", "cpu")]
    table = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--config", str(config)],
                           capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env={**os.environ, "GATEWAY_PLUGINS": PLUGIN}).stdout
    assert "Echo      available: echo runtime" in table and "2. echo/cpu on cpu" in table
    # Its own engine is a value of --engine (the settings' choices come from the registered runtimes).
    own = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--json", "--engine", "echo", "--config",
                          str(config)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "GATEWAY_PLUGINS": PLUGIN})
    assert own.returncode == 0, own.stderr
    assert [(c["runtime"], c["engine"]) for c in json.loads(own.stdout)["plans"]["echo-model"]["candidates"]] == [
        ("echo", "echo")]
    without = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--engine", "echo", "--config",
                              str(config)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert without.returncode == 2 and "must be auto, cuda, metal, vulkan, directml, coreml or cpu, not 'echo'" in without.stderr


def test_gateway_convert_makes_the_plugins_format(plugin: runtimes.Runtime, default_registry: Registry) -> None:
    """`gateway convert --to echo` with the plug-in's own variant flag: its converter gets the
    checkpoint the gateway dequantised from the GGUF, and the artifact lands where the registry finds it."""
    needs_convert("echo")
    spec = default_registry.models[MODEL]
    out = default_registry.converted_dir(spec, "echo", "fp8", "loud")
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "GATEWAY_PLUGINS": PLUGIN}
    cmd = [sys.executable, "-m", "gateway.cli", "convert", "--model", MODEL, "--to", "echo", "--config", str(ROOT / "models.yaml")]
    r = subprocess.run([*cmd, "--precision", "fp8", "--voice", "loud"], capture_output=True, text=True, timeout=900,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "echoing llama in a loud voice" in r.stdout and r.stdout.strip().endswith(str(out))
    assert json.loads((out / "echo.json").read_text()) == {"model_type": "llama", "precision": "fp8", "voice": "loud"}
    assert json.loads((out / MANIFEST).read_text())["format"] == "echo"
    bad = subprocess.run([*cmd, "--voice", "shout"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "invalid choice: 'shout'" in bad.stderr
    assert "--voice" not in subprocess.run([sys.executable, "-m", "gateway.cli", "convert", "--help"],
                                           capture_output=True, text=True, timeout=240, cwd=ROOT).stdout


def test_a_gateway_serves_a_chat_through_the_plugin_in_a_worker(plugin: runtimes.Runtime, config: Path) -> None:
    settings = Settings.from_env(env=NO_CHECKS, config=str(config), plugins=(PLUGIN,), workers=True)
    app = create_app(settings, load_registry(config, cache_dir=config.parent / "cache"),
                     host=plugin.probe(hosts.CPU_ONLY))
    server = ServerThread(app).start(wait_ready=False)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model="echo-model", messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().choices[0].message.content == "hello from a plug-in runtime"
        assert "echo" in raw.headers["x-engine"], dict(raw.headers)
    finally:
        server.stop()


# --- the proof: gateway code imports no runtime adapter --------------------------------------

ADAPTERS = ("engines.llamacpp", "engines.coreml", "engines.executorch", "engines.ortgenai")


def adapter_imports(source: str) -> list[str]:
    """The runtime adapters a module's source imports, at any depth of its code."""
    return imports_of(source, ADAPTERS)


def test_no_gateway_module_imports_a_runtime_adapter() -> None:
    gateway = ROOT / "gateway"
    found = {str(p.relative_to(ROOT)): hit for p in sorted(gateway.rglob("*.py"))
             if (hit := adapter_imports(p.read_text()))}
    assert not found, f"gateway code reaches runtimes only through engines.runtimes: {found}"


def test_the_import_check_sees_every_form() -> None:
    for source in ("from engines.llamacpp.ggml_backends import lower\n", "import engines.coreml\n",
                   "from engines import executorch\n", "def f():\n    from engines.ortgenai import EP_MATRIX\n"):
        assert adapter_imports(source), source
    assert not adapter_imports("from engines.base import EngineConfig\nfrom engines.runtimes import runtime\n"
                               "from engines.registry import create_engine\nimport engines.host\n")
