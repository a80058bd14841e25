"""Hand-built hosts for selection and fallback tests: one per kind of machine users have."""

from __future__ import annotations

from dataclasses import replace

from engines.executorch import ExecuTorchFound
from engines.llamacpp.runtime import LlamaCppBuild, LlamaCppFound
from engines.ortgenai import OrtBuild
from gateway.host.hardware import (
    CpuInfo,
    CudaDevice,
    CudaInfo,
    HostCapabilities,
    PlatformRuntime,
    VulkanDevice,
    VulkanDriver,
    VulkanInfo,
)

CPU = CpuInfo(model="Test CPU", arch="x86_64", logical_cores=8, physical_cores=4, simd=("avx2",), memory_bytes=32 << 30)
NO_CUDA = CudaInfo(error="no NVIDIA driver (libcuda.so.1 not found)")
NO_VULKAN = VulkanInfo(error="Vulkan loader not found")


def vk(index: int, name: str, type_: str, vendor: str = "NVIDIA", vram: int = 8 << 30) -> VulkanDevice:
    return VulkanDevice(
        index=index, name=name, type=type_, api_version="1.3.280", driver_name="drv", driver_info="1.0",
        driver_version=1, vendor=vendor, vendor_id=0x10DE, device_id=index, device_local_bytes=vram,
        max_compute_workgroup_size=(1024, 1024, 64), max_compute_workgroup_invocations=1024,
        max_compute_shared_memory_bytes=49152, subgroup_size=32,
    )


def llama(*backends: str, vulkan: int = 0, cuda: int = 0, metal: bool = False) -> LlamaCppBuild:
    devices = [("CPU", "Test CPU", "cpu")]
    devices += [(f"Vulkan{i}", f"vk{i}", "gpu") for i in range(vulkan)]
    devices += [(f"CUDA{i}", f"cuda{i}", "gpu") for i in range(cuda)]
    if metal:
        devices.append(("MTL0", "Apple M3", "gpu"))
    return LlamaCppBuild(True, "0.3.36", ("CPU", *backends), tuple(devices))


NO_METAL = PlatformRuntime(False, "Metal needs macOS")
NO_ORT = OrtBuild(error="no ONNX Runtime package is installed")
NO_DIRECTML = PlatformRuntime(False, "DirectML needs Windows")
NO_COREML = PlatformRuntime(False, "CoreML prediction needs macOS")
NO_EXECUTORCH = PlatformRuntime(False, "executorch is not installed")


def host(*, os: str = "Linux 6.1", cpu: CpuInfo = CPU, vulkan: VulkanInfo = NO_VULKAN, cuda: CudaInfo = NO_CUDA,
         metal: PlatformRuntime = NO_METAL, llamacpp: LlamaCppBuild | None = None,
         llamacpp_builds: tuple[LlamaCppBuild, ...] = (), ort: OrtBuild = NO_ORT, directml: PlatformRuntime = NO_DIRECTML,
         coreml: PlatformRuntime = NO_COREML, executorch: PlatformRuntime = NO_EXECUTORCH,
         executorch_vulkan: PlatformRuntime = NO_EXECUTORCH) -> HostCapabilities:
    """A host: its devices, and what each built-in runtime's probe would find on it."""
    found = {
        "llamacpp": LlamaCppFound(llamacpp or llama(), llamacpp_builds),
        "ortgenai": replace(ort, directml=directml),
        "coreml": coreml,
        "executorch": ExecuTorchFound(executorch, executorch_vulkan),
    }
    return HostCapabilities(os=os, cpu=cpu, vulkan=vulkan, cuda=cuda, metal=metal, runtimes=found)


H100 = CudaInfo(devices=(CudaDevice(0, "NVIDIA H100 80GB HBM3", 80 << 30, "9.0"),), driver_version="580.1", cuda_version="13.0")

CPU_ONLY = host()
LAVAPIPE = host(vulkan=VulkanInfo("libvulkan.so.1", "1.3.239", (vk(0, "llvmpipe", "cpu", "Mesa", 2 << 30),)),
                llamacpp=llama("Vulkan", vulkan=1))
NVIDIA = host(
    cuda=H100,
    vulkan=VulkanInfo("libvulkan.so.1", "1.4", (vk(0, "NVIDIA H100", "discrete"),)),
    llamacpp=llama("CUDA", "Vulkan", vulkan=1, cuda=1),
)
# An H100 host as measured: CUDA works, the NVIDIA Vulkan ICD refuses to initialise, no loader.
H100_HOST = host(
    cuda=H100,
    vulkan=VulkanInfo(None, "", (), (VulkanDriver(
        "/etc/vulkan/icd.d/nvidia_icd.json", "libGLX_nvidia.so.0", False,
        "vk_icdNegotiateLoaderICDInterfaceVersion returned VK_ERROR_INITIALIZATION_FAILED (-3)"),),
        "Vulkan loader not found"),
    llamacpp=llama("CUDA", cuda=1),
)
AMD_VULKAN = host(
    vulkan=VulkanInfo("libvulkan.so.1", "1.3", (vk(0, "AMD Radeon RX 7900 XTX", "discrete", "AMD", 24 << 30),)),
    llamacpp=llama("Vulkan", vulkan=1),
)
IGPU_DGPU = host(
    cuda=H100,
    vulkan=VulkanInfo("libvulkan.so.1", "1.3", (
        vk(0, "Intel(R) UHD Graphics 770", "integrated", "Intel", 0), vk(1, "NVIDIA GeForce RTX 4090", "discrete"),
    )),
    llamacpp=llama("Vulkan", vulkan=2),  # a Vulkan-only build: CUDA present but not built
)
APPLE = host(
    os="Darwin 24.0", metal=PlatformRuntime(True, "", "Apple GPU"),
    coreml=PlatformRuntime(True, "", "Apple silicon with Neural Engine"),
    llamacpp=llama("Metal", metal=True),
)
WINDOWS_DML = host(
    os="Windows 11", directml=PlatformRuntime(True, "", "onnxruntime-genai-directml"),
    vulkan=VulkanInfo("vulkan-1.dll", "1.3", (vk(0, "AMD Radeon 780M", "integrated", "AMD", 0),)),
    llamacpp=llama(),
    ort=OrtBuild((("onnxruntime-genai-directml", "0.14.1"),), ("DmlExecutionProvider", "CPUExecutionProvider")),
)
