"""Two llama.cpp builds at once: the CPU-only build and the Vulkan build (on Mesa's lavapipe) serve
two models in one gateway, each in its own worker process with its own native libraries."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from engines.llamacpp.runtime import default_build_dirs, found
from gateway.host.hardware import probe_host
from tests.conftest import ROOT
from tests.test_production import Gateway

ON_CPU, ON_VULKAN = "smol-on-cpu-build", "smol-on-vulkan-build"


def _vulkan_host_or_skip() -> None:
    """This host's Vulkan build and a Vulkan device (lavapipe in CI), or a skip (a failure in CI)."""
    host = probe_host()
    if not found(host).package.has("Vulkan") or not host.vulkan.devices:
        why = f"needs the Vulkan build and a Vulkan device (lavapipe): {host.vulkan.reason or 'no Vulkan build'}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def _cpu_build() -> str:
    host = probe_host()
    llama = found(host)
    cpu_only = [b for b in llama.beside if b.installed and b.backends == ("CPU",)]
    if not cpu_only or not llama.package.has("Vulkan") or not host.vulkan.devices:
        why = (f"needs the Vulkan build installed, a Vulkan device and a CPU-only build side by side "
               f"(scripts/install-llama-cpp.sh vulkan,cpu); found builds {default_build_dirs()}")
        if os.environ.get("CI"):
            pytest.fail(why)  # scripts/test.sh installs all of it
        pytest.skip(why)
    return cpu_only[0].lib_path


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    lib = _cpu_build()
    tmp = tmp_path_factory.mktemp("builds")
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    smol = next(m for m in cfg["models"] if m["id"] == "smollm2-135m-instruct")
    cfg["models"] = [{**smol, "id": ON_CPU, "engines": ["cpu"]}, {**smol, "id": ON_VULKAN, "engines": ["vulkan"]}]
    cfg["default"] = ON_CPU
    path = tmp / "models.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # --engine auto with each model's own engine list; --device llvmpipe lets auto take the software
    # Vulkan device (it is skipped by default as slower than the CPU).
    g = Gateway(tmp, "--config", str(path), "--engine", "auto", "--device", "llvmpipe", "--parallel", "1")
    yield g, lib
    g.stop()


def _libs(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if ".so" in line.split()[-1]}


def test_the_cpu_and_vulkan_builds_serve_at_once(two_builds: tuple[Gateway, str]) -> None:
    g, cpu_lib = two_builds
    served = {}
    for model in (ON_CPU, ON_VULKAN):
        r = httpx.post(f"{g.url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        served[model] = r.headers["x-engine"]
    assert served == {ON_CPU: "llamacpp/cpu", ON_VULKAN: "llamacpp/vulkan"}
    health = httpx.get(f"{g.url}/health", timeout=10).json()["models"]
    cpu_pid, vk_pid = health[ON_CPU]["worker"]["pid"], health[ON_VULKAN]["worker"]["pid"]
    assert cpu_pid != vk_pid
    cpu_libs, vk_libs = _libs(cpu_pid), _libs(vk_pid)
    # The CPU model's worker runs the side-by-side CPU-only build, without any Vulkan code...
    assert any(p.startswith(cpu_lib) and p.endswith("libllama.so") for p in cpu_libs), cpu_libs
    assert not any("libggml-vulkan" in p for p in cpu_libs)
    # ...and the Vulkan model's worker the installed package's Vulkan build.
    assert any("libggml-vulkan" in p for p in vk_libs)
    assert not any(p.startswith(cpu_lib) for p in vk_libs)
