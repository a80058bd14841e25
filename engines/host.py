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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

PROBE_TIMEOUT_S = 60.0
T = TypeVar("T")

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
    """A platform or runtime that is present or not (Metal, CoreML, DirectML), and why."""

    available: bool = False
    reason: str = ""
    detail: str = ""


@dataclass(frozen=True)
class HostCapabilities:
    """The host's devices, and what each registered runtime's probe found on it."""

    os: str
    cpu: CpuInfo
    vulkan: VulkanInfo = field(default_factory=VulkanInfo)
    cuda: CudaInfo = field(default_factory=CudaInfo)
    metal: PlatformRuntime = field(default_factory=PlatformRuntime)
    # By runtime name, what its probe found, in the runtime's own type (llama.cpp's builds, ONNX
    # Runtime's packages and providers, ...): only that runtime reads it, through `found`.
    runtimes: Mapping[str, Any] = field(default_factory=dict)

    def found(self, name: str, kind: type[T], absent: T | None = None) -> T:
        """What runtime `name`'s probe found, as its type `kind`; `absent` (else `kind()`) where it
        has not probed this host."""
        value = self.runtimes.get(name)
        if isinstance(value, kind):
            return value
        return absent if absent is not None else kind()

    def with_found(self, name: str, value: object) -> HostCapabilities:
        """This host with runtime `name`'s probe result (a runtime's `probe` returns this)."""
        return replace(self, runtimes={**self.runtimes, name: value})

    def runtime(self, name: str) -> PlatformRuntime:
        """A runtime whose probe finds only present-or-not (absent when it has not probed)."""
        return self.found(name, PlatformRuntime, PlatformRuntime(False, f"runtime {name!r} was not probed"))

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

