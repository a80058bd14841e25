"""What a host has, as the runtimes' finders read it: typed, frozen, built by one probe.

`gateway.host.hardware.probe_host()` fills a `HostCapabilities`: the devices (CPU, Vulkan, CUDA,
Metal) first, then each registered runtime's own probe (engines/runtimes.py) adds what it found.
Tests build their own. Native probes run in a child process with a time limit (`run_child`), so a
missing library is a reported absence and a driver that crashes is a reported crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

PROBE_TIMEOUT_S = 60.0

@dataclass(frozen=True)
class VulkanDevice:
    index: int  # the loader's enumeration order
    name: str
    type: str  # discrete, integrated, virtual, cpu, other
    api_version: str
    driver_name: str
    driver_info: str
    driver_version: int
    vendor: str
    vendor_id: int
    device_id: int
    device_local_bytes: int
    max_compute_workgroup_size: tuple[int, int, int]
    max_compute_workgroup_invocations: int
    max_compute_shared_memory_bytes: int
    subgroup_size: int = 0


@dataclass(frozen=True)
class VulkanDriver:
    manifest: str
    library: str = ""
    ok: bool = False
    error: str = ""
    remedy: str = ""  # what fixes it, when the probe could tell


@dataclass(frozen=True)
class VulkanInfo:
    loader: str | None = None
    loader_api_version: str = ""
    devices: tuple[VulkanDevice, ...] = ()
    drivers: tuple[VulkanDriver, ...] = ()
    error: str | None = None

    @property
    def reason(self) -> str:
        """Why there is no usable device, in the words a user needs."""
        if self.devices:
            return ""
        broken = [d for d in self.drivers if d.error]
        missing_loader = self.loader is None
        if broken:
            why = "; ".join(f"{d.library or d.manifest}: {d.error}" + (f" (fix: {d.remedy})" if d.remedy else "")
                            for d in broken)
            msg = f"Vulkan driver present but failed to initialise: {why}"
            if missing_loader:
                msg += " (and the Vulkan loader libvulkan.so.1 is not installed)"
            return msg
        if missing_loader:
            return "no Vulkan loader (libvulkan.so.1 / vulkan-1.dll) is installed"
        return self.error or "no Vulkan device"


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    memory_bytes: int
    compute_capability: str


@dataclass(frozen=True)
class CudaInfo:
    devices: tuple[CudaDevice, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    visible_devices: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CpuInfo:
    model: str = ""
    arch: str = ""
    logical_cores: int = 1
    physical_cores: int = 1
    simd: tuple[str, ...] = ()
    memory_bytes: int = 0


@dataclass(frozen=True)
class PlatformRuntime:
    """DirectML or CoreML: present or not, and why."""

    available: bool = False
    reason: str = ""
    detail: str = ""


@dataclass(frozen=True)
class LlamaCppBuild:
    installed: bool = False
    version: str | None = None
    backends: tuple[str, ...] = ()  # ggml registries: CPU, Vulkan, CUDA, Metal…
    devices: tuple[tuple[str, str, str], ...] = ()  # (ggml name, description, type)
    error: str | None = None
    build_id: str = ""  # changes with every rebuild of the native libraries
    lib_path: str = ""  # a side-by-side build's folder (LLAMA_CPP_LIB_PATH); "" = the installed package's
    # A build with loadable CPU variants: (name, score on this CPU; 0 = unsupported), fastest first,
    # and the one auto picks. Empty for a build with its CPU backend compiled in.
    cpu_variants: tuple[tuple[str, int], ...] = ()
    cpu_variant: str = ""

    def has(self, backend: str) -> bool:
        return any(b.lower() == backend.lower() for b in self.backends)


@dataclass(frozen=True)
class OrtBuild:
    packages: tuple[tuple[str, str], ...] = ()  # (distribution, version)
    providers: tuple[str, ...] = ()  # onnxruntime.get_available_providers()
    error: str | None = None

    def has_package(self, name: str) -> bool:
        return any(p == name for p, _ in self.packages)

    @property
    def genai(self) -> bool:
        return any(p.startswith("onnxruntime-genai") for p, _ in self.packages)


@dataclass(frozen=True)
class HostCapabilities:
    os: str
    cpu: CpuInfo
    vulkan: VulkanInfo = field(default_factory=VulkanInfo)
    cuda: CudaInfo = field(default_factory=CudaInfo)
    directml: PlatformRuntime = field(default_factory=PlatformRuntime)
    coreml: PlatformRuntime = field(default_factory=PlatformRuntime)
    executorch: PlatformRuntime = field(default_factory=PlatformRuntime)
    # ExecuTorch's Vulkan backend, a plug-in built for the installed wheel (scripts/install-executorch.sh).
    executorch_vulkan: PlatformRuntime = field(default_factory=PlatformRuntime)
    metal: PlatformRuntime = field(default_factory=PlatformRuntime)
    llamacpp: LlamaCppBuild = field(default_factory=LlamaCppBuild)
    # More llama.cpp builds installed side by side (scripts/install-llama-cpp.sh cpu,vulkan,...): each
    # runs in its own worker processes.
    llamacpp_builds: tuple[LlamaCppBuild, ...] = ()
    ort: OrtBuild = field(default_factory=OrtBuild)
    # What the probes of runtimes without a field of their own found, by runtime name (plug-ins).
    runtimes: Mapping[str, PlatformRuntime] = field(default_factory=dict)

    def runtime(self, name: str) -> PlatformRuntime:
        """A plug-in runtime's probe result (absent when it has not probed)."""
        return self.runtimes.get(name) or PlatformRuntime(False, f"runtime {name!r} was not probed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- child-process probes ----------------------------------------------------------------


def run_child(module: str, timeout: float = PROBE_TIMEOUT_S, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m module`, which prints one JSON object; failures become {"error": …}."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module], capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"probe {module} did not finish within {timeout:.0f}s"}
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        return {"error": f"probe {module} crashed ({sig}): {proc.stderr.strip()[-300:]}"}
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        return {"error": f"probe {module} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}
    return out if isinstance(out, dict) else {"error": f"probe {module} printed {out!r}"}


def vulkan_visible_env(vulkan: VulkanInfo) -> dict[str, str]:
    """Make every Vulkan device visible to ggml, so ggml's `VulkanN` is the loader's device N.

    ggml hides CPU-type devices (lavapipe) unless GGML_VK_VISIBLE_DEVICES names them; the
    gateway decides itself which device a model uses, by name. A user's own setting wins.
    """
    if "GGML_VK_VISIBLE_DEVICES" in os.environ or not vulkan.devices:
        return {}
    return {"GGML_VK_VISIBLE_DEVICES": ",".join(str(d.index) for d in vulkan.devices)}

