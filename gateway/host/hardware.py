"""What this host really has: a typed, injectable probe.

`probe_host()` builds one frozen `HostCapabilities`; tests build their own. Each native
probe (Vulkan loader, CUDA driver, the installed llama.cpp build, ONNX Runtime) runs in a
child process with a time limit, so a missing library is a reported absence and a driver
that crashes is a reported crash — never the gateway's crash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0

# Seed 000 §2.6: ONNX Runtime execution providers, where they run and what provides them.
EP_MATRIX: tuple[tuple[str, str, str, str], ...] = (
    ("CPUExecutionProvider", "All", "N/A", "onnxruntime"),
    ("CUDAExecutionProvider", "Lin/Win", "NVIDIA", "onnxruntime-gpu"),
    ("DmlExecutionProvider", "Windows", "Any", "onnxruntime-directml"),
    ("ROCMExecutionProvider", "Linux", "AMD", "onnxruntime-rocm"),
    ("CoreMLExecutionProvider", "macOS/iOS", "Apple", "onnxruntime-silicon"),
    ("TensorrtExecutionProvider", "Lin/Win", "NVIDIA", "onnxruntime-gpu"),
    ("OpenVINOExecutionProvider", "All", "Intel", "onnxruntime-openvino"),
)
ORT_PACKAGES = (
    "onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml",
    "onnxruntime", "onnxruntime-gpu", "onnxruntime-directml",
)


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


def probe_llamacpp(vulkan: VulkanInfo, lib_path: str = "") -> LlamaCppBuild:
    env = vulkan_visible_env(vulkan)
    if lib_path:
        env["LLAMA_CPP_LIB_PATH"] = lib_path
    r = run_child("engines.llamacpp.ggml_devices", env=env)
    return LlamaCppBuild(
        installed=bool(r.get("installed")),
        version=r.get("version"),
        backends=tuple(r.get("backends", [])),
        devices=tuple((d["name"], d["description"], d["type"]) for d in r.get("devices", [])),
        error=r.get("error"),
        build_id=r.get("build_id", ""),
        lib_path=lib_path,
        cpu_variants=tuple((str(n), int(sc)) for n, sc in r.get("cpu_variants", [])),
        cpu_variant=r.get("cpu_variant", "") or "",
    )


def default_build_dirs() -> tuple[str, ...]:
    """Side-by-side llama.cpp builds in the folder scripts/install-llama-cpp.sh unpacks them into."""
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    root = data / "llm-gateway" / "llama-builds"
    if not root.is_dir():
        return ()
    return tuple(str(d) for d in sorted(root.iterdir()) if (d / "libllama.so").exists() or (d / "llama.dll").exists()
                 or (d / "libllama.dylib").exists())


def probe_llamacpp_builds(vulkan: VulkanInfo, primary: LlamaCppBuild, dirs: tuple[str, ...]) -> tuple[LlamaCppBuild, ...]:
    """The side-by-side builds in `dirs` that can serve next to the installed package (same version: the
    Python bindings are the package's), each probed in its own child process."""
    out = []
    for d in dirs:
        b = probe_llamacpp(vulkan, d)
        if b.installed and primary.version and b.version != primary.version:
            b = replace(b, installed=False, error=f"built from llama-cpp-python {b.version}, but {primary.version} "
                        "is installed; rebuild it with scripts/install-llama-cpp.sh")
        out.append(b)
    return tuple(out)


def _ort_child() -> dict[str, Any]:
    try:
        import onnxruntime
    except Exception as exc:  # noqa: BLE001 - absence is reported
        return {"providers": [], "error": f"onnxruntime cannot be imported: {exc}"}
    return {"providers": list(onnxruntime.get_available_providers())}


def probe_ort() -> OrtBuild:
    packages = []
    for name in ORT_PACKAGES:
        try:
            packages.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    if not packages:
        return OrtBuild(error="no ONNX Runtime package is installed")
    r = run_child("gateway.host.hardware")
    return OrtBuild(packages=tuple(packages), providers=tuple(r.get("providers", [])), error=r.get("error"))


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


def probe_directml(ort: OrtBuild) -> PlatformRuntime:
    if platform.system() != "Windows":
        return PlatformRuntime(False, "DirectML needs Windows with a DirectX 12 adapter")
    if not ort.has_package("onnxruntime-genai-directml"):
        return PlatformRuntime(False, "onnxruntime-genai-directml is not installed (pip install onnxruntime-genai-directml)")
    if ort.providers and "DmlExecutionProvider" not in ort.providers:
        return PlatformRuntime(False, "ONNX Runtime here has no DmlExecutionProvider")
    return PlatformRuntime(True, "", "onnxruntime-genai-directml")


def probe_executorch() -> PlatformRuntime:
    """Whether the executorch package is installed (its runtime, with torch, loads in the worker;
    a runtime without the program's delegate fails the load there, with the reason)."""
    if importlib.util.find_spec("executorch") is None:
        return PlatformRuntime(False, "executorch is not installed: pip install -e '.[executorch]'")
    return PlatformRuntime(True, "", "ExecuTorch runtime (XNNPACK)")


def probe_executorch_vulkan(executorch: PlatformRuntime) -> PlatformRuntime:
    """Whether ExecuTorch's Vulkan backend is built for the installed wheel (the library loads, and
    finds its device, in the worker: a failure there falls back with the reason)."""
    if not executorch.available:
        return PlatformRuntime(False, executorch.reason)
    from engines.executorch import vulkan_backend_library

    lib, why = vulkan_backend_library()
    if lib is None:
        return PlatformRuntime(False, why)
    return PlatformRuntime(True, "", f"ExecuTorch Vulkan backend ({lib})")


def probe_coreml() -> PlatformRuntime:
    from engines.coreml import coreml_available  # the engine's own test: macOS 15+, coremltools

    ok, why = coreml_available()
    if not ok:
        return PlatformRuntime(False, why)
    silicon = platform.machine() == "arm64"
    return PlatformRuntime(True, "", "Apple silicon with Neural Engine" if silicon else "Intel Mac (no Neural Engine)")


def probe_metal() -> PlatformRuntime:
    if platform.system() != "Darwin":
        return PlatformRuntime(False, "Metal needs macOS")
    return PlatformRuntime(True, "", "Apple GPU")


def probe_host(llama_builds: tuple[str, ...] | None = None) -> HostCapabilities:
    """Probe everything; the native parts in parallel child processes.  `llama_builds`: folders of
    side-by-side llama.cpp builds (default: those scripts/install-llama-cpp.sh unpacked)."""
    with ThreadPoolExecutor(3) as pool:
        vulkan_f = pool.submit(probe_vulkan)
        cuda_f = pool.submit(probe_cuda)
        ort_f = pool.submit(probe_ort)
        vulkan = vulkan_f.result()
        llamacpp = probe_llamacpp(vulkan)
        builds = probe_llamacpp_builds(vulkan, llamacpp, default_build_dirs() if llama_builds is None else llama_builds)
        cuda, ort = cuda_f.result(), ort_f.result()
    executorch = probe_executorch()
    return HostCapabilities(
        os=f"{platform.system()} {platform.release()}",
        cpu=probe_cpu(),
        vulkan=vulkan,
        cuda=cuda,
        directml=probe_directml(ort),
        coreml=probe_coreml(),
        executorch=executorch,
        executorch_vulkan=probe_executorch_vulkan(executorch),
        metal=probe_metal(),
        llamacpp=llamacpp,
        llamacpp_builds=builds,
        ort=ort,
    )


if __name__ == "__main__":
    json.dump(_ort_child(), sys.stdout)
