"""What this host really has: a typed, injectable probe.

`probe_host()` builds one frozen `HostCapabilities` (engines/host.py); tests build their own. It
probes the devices (CPU, Vulkan loader, CUDA driver, Metal), then lets each registered runtime
probe itself (engines/runtimes.py). Each native probe runs in a child process with a time limit,
so a missing library is a reported absence and a driver that crashes is a reported crash —
never the gateway's crash.
"""

from __future__ import annotations

import logging
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from engines.host import (
    CpuInfo,
    CudaDevice,
    CudaInfo,
    HostCapabilities,
    PlatformRuntime,
    VulkanDevice,
    VulkanDriver,
    VulkanInfo,
    run_child,
    vulkan_visible_env,
)
from engines.runtimes import runtimes

__all__ = ["CpuInfo", "CudaDevice", "CudaInfo", "HostCapabilities", "PlatformRuntime", "VulkanDevice", "VulkanDriver",
           "VulkanInfo", "probe_host", "run_child", "vulkan_visible_env"]

log = logging.getLogger(__name__)


def _vulkan_device(d: dict[str, Any]) -> VulkanDevice:
    known = {f.name for f in fields(VulkanDevice)}
    kw = {k: v for k, v in d.items() if k in known}
    kw["max_compute_workgroup_size"] = tuple(kw["max_compute_workgroup_size"])
    return VulkanDevice(**kw)


def probe_vulkan() -> VulkanInfo:
    r = run_child("gateway.host.vulkan_probe")
    return VulkanInfo(
        loader=r.get("loader"),
        loader_api_version=r.get("loader_api_version", ""),
        devices=tuple(_vulkan_device(d) for d in r.get("devices", [])),
        drivers=tuple(
            VulkanDriver(d.get("manifest", ""), d.get("library", ""), bool(d.get("ok")), d.get("error", ""),
                         d.get("remedy", ""))
            for d in r.get("drivers", [])
        ),
        error=r.get("error"),
    )


def probe_cuda() -> CudaInfo:
    r = run_child("gateway.host.cuda_probe")
    return CudaInfo(
        devices=tuple(CudaDevice(**d) for d in r.get("devices", [])),
        driver_version=r.get("driver_version"),
        cuda_version=r.get("cuda_version"),
        visible_devices=r.get("visible_devices"),
        error=r.get("error"),
    )


def probe_cpu() -> CpuInfo:
    model, flags, cores = "", set[str](), set[tuple[str, str]]()
    try:
        with open("/proc/cpuinfo") as f:
            phys = core = ""
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key in ("model name", "Processor") and not model:
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                    cores.add((phys, core))
    except OSError:
        model = platform.processor()
    wanted = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16", "neon", "asimd", "asimddp", "sve", "i8mm")
    simd = tuple(f for f in wanted if f in flags)
    if platform.machine() == "arm64" and platform.system() == "Darwin":
        simd = ("neon",)
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 0
    logical = os.cpu_count() or 1
    return CpuInfo(model=model, arch=platform.machine(), logical_cores=logical,
                   physical_cores=len(cores) or logical, simd=simd, memory_bytes=mem)


def probe_metal() -> PlatformRuntime:
    if platform.system() != "Darwin":
        return PlatformRuntime(False, "Metal needs macOS")
    return PlatformRuntime(True, "", "Apple GPU")

def probe_host() -> HostCapabilities:
    """Probe the devices (the native ones in parallel child processes), then every registered
    runtime, each adding what it finds."""
    with ThreadPoolExecutor(2) as pool:
        vulkan_f = pool.submit(probe_vulkan)
        cuda_f = pool.submit(probe_cuda)
        vulkan, cuda = vulkan_f.result(), cuda_f.result()
    host = HostCapabilities(
        os=f"{platform.system()} {platform.release()}",
        cpu=probe_cpu(),
        vulkan=vulkan,
        cuda=cuda,
        metal=probe_metal(),
    )
    for rt in runtimes():
        host = rt.probe(host)
    return host
