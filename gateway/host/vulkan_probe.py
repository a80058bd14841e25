"""Vulkan devices as the Vulkan loader itself reports them, through ctypes.

No Vulkan SDK or Python binding is needed: we load the loader (`libvulkan.so.1`,
`vulkan-1.dll`, MoltenVK's loader on macOS), create an instance and read each physical
device's properties, limits and memory heaps. When the loader finds no device we look at
the installed ICD manifests and ask each driver why (`vk_icdNegotiateLoaderICDInterfaceVersion`),
so "driver present but failed to initialise" can be told apart from "no driver".

Run it in a child process (`python -m gateway.host.vulkan_probe`): a broken driver may crash,
and the gateway must survive that.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import platform
import re
import sys
from typing import Any

VK_SUCCESS = 0
VK_INCOMPLETE = 5
RESULTS = {
    -1: "VK_ERROR_OUT_OF_HOST_MEMORY", -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
    -3: "VK_ERROR_INITIALIZATION_FAILED", -4: "VK_ERROR_DEVICE_LOST",
    -6: "VK_ERROR_LAYER_NOT_PRESENT", -7: "VK_ERROR_EXTENSION_NOT_PRESENT",
    -9: "VK_ERROR_INCOMPATIBLE_DRIVER",
}
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
VENDORS = {0x1002: "AMD", 0x1010: "ImgTec", 0x10DE: "NVIDIA", 0x13B5: "ARM", 0x5143: "Qualcomm",
           0x8086: "Intel", 0x106B: "Apple", 0x10005: "Mesa"}

ST_APPLICATION_INFO = 0
ST_INSTANCE_CREATE_INFO = 1
ST_PROPERTIES_2 = 1000059001
ST_DRIVER_PROPERTIES = 1000196000
ST_SUBGROUP_PROPERTIES = 1000094000
PORTABILITY_ENUMERATION_BIT = 0x1
HEAP_DEVICE_LOCAL = 0x1

u32, i32, u64, f32, sz = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ctypes.c_size_t


def _limits_fields() -> list[tuple[str, Any]]:
    """VkPhysicalDeviceLimits, in header order (vulkan_core.h)."""
    spec = """u32 maxImageDimension1D maxImageDimension2D maxImageDimension3D maxImageDimensionCube
    maxImageArrayLayers maxTexelBufferElements maxUniformBufferRange maxStorageBufferRange
    maxPushConstantsSize maxMemoryAllocationCount maxSamplerAllocationCount
    u64 bufferImageGranularity sparseAddressSpaceSize
    u32 maxBoundDescriptorSets maxPerStageDescriptorSamplers maxPerStageDescriptorUniformBuffers
    maxPerStageDescriptorStorageBuffers maxPerStageDescriptorSampledImages maxPerStageDescriptorStorageImages
    maxPerStageDescriptorInputAttachments maxPerStageResources maxDescriptorSetSamplers
    maxDescriptorSetUniformBuffers maxDescriptorSetUniformBuffersDynamic maxDescriptorSetStorageBuffers
    maxDescriptorSetStorageBuffersDynamic maxDescriptorSetSampledImages maxDescriptorSetStorageImages
    maxDescriptorSetInputAttachments maxVertexInputAttributes maxVertexInputBindings
    maxVertexInputAttributeOffset maxVertexInputBindingStride maxVertexOutputComponents
    maxTessellationGenerationLevel maxTessellationPatchSize maxTessellationControlPerVertexInputComponents
    maxTessellationControlPerVertexOutputComponents maxTessellationControlPerPatchOutputComponents
    maxTessellationControlTotalOutputComponents maxTessellationEvaluationInputComponents
    maxTessellationEvaluationOutputComponents maxGeometryShaderInvocations maxGeometryInputComponents
    maxGeometryOutputComponents maxGeometryOutputVertices maxGeometryTotalOutputComponents
    maxFragmentInputComponents maxFragmentOutputAttachments maxFragmentDualSrcAttachments
    maxFragmentCombinedOutputResources maxComputeSharedMemorySize maxComputeWorkGroupCount[3]
    maxComputeWorkGroupInvocations maxComputeWorkGroupSize[3] subPixelPrecisionBits subTexelPrecisionBits
    mipmapPrecisionBits maxDrawIndexedIndexValue maxDrawIndirectCount
    f32 maxSamplerLodBias maxSamplerAnisotropy
    u32 maxViewports maxViewportDimensions[2]
    f32 viewportBoundsRange[2]
    u32 viewportSubPixelBits
    sz minMemoryMapAlignment
    u64 minTexelBufferOffsetAlignment minUniformBufferOffsetAlignment minStorageBufferOffsetAlignment
    i32 minTexelOffset u32 maxTexelOffset i32 minTexelGatherOffset u32 maxTexelGatherOffset
    f32 minInterpolationOffset maxInterpolationOffset
    u32 subPixelInterpolationOffsetBits maxFramebufferWidth maxFramebufferHeight maxFramebufferLayers
    framebufferColorSampleCounts framebufferDepthSampleCounts framebufferStencilSampleCounts
    framebufferNoAttachmentsSampleCounts maxColorAttachments sampledImageColorSampleCounts
    sampledImageIntegerSampleCounts sampledImageDepthSampleCounts sampledImageStencilSampleCounts
    storageImageSampleCounts maxSampleMaskWords timestampComputeAndGraphics
    f32 timestampPeriod
    u32 maxClipDistances maxCullDistances maxCombinedClipAndCullDistances discreteQueuePriorities
    f32 pointSizeRange[2] lineWidthRange[2] pointSizeGranularity lineWidthGranularity
    u32 strictLines standardSampleLocations
    u64 optimalBufferCopyOffsetAlignment optimalBufferCopyRowPitchAlignment nonCoherentAtomSize"""
    types = {"u32": u32, "i32": i32, "u64": u64, "f32": f32, "sz": sz}
    fields: list[tuple[str, Any]] = []
    current: Any = u32
    for word in spec.split():
        if word in types:
            current = types[word]
        elif word.endswith("]"):
            name, n = word[:-1].split("[")
            fields.append((name, current * int(n)))
        else:
            fields.append((word, current))
    return fields


class Limits(ctypes.Structure):
    _fields_ = _limits_fields()


class Properties(ctypes.Structure):
    _fields_ = [
        ("apiVersion", u32), ("driverVersion", u32), ("vendorID", u32), ("deviceID", u32),
        ("deviceType", u32), ("deviceName", ctypes.c_char * 256), ("pipelineCacheUUID", ctypes.c_uint8 * 16),
        ("limits", Limits), ("sparseProperties", u32 * 5),
    ]


class DriverProperties(ctypes.Structure):
    _fields_ = [
        ("sType", u32), ("pNext", ctypes.c_void_p), ("driverID", u32),
        ("driverName", ctypes.c_char * 256), ("driverInfo", ctypes.c_char * 256),
        ("conformanceVersion", ctypes.c_uint8 * 4),
    ]


class SubgroupProperties(ctypes.Structure):
    _fields_ = [
        ("sType", u32), ("pNext", ctypes.c_void_p), ("subgroupSize", u32),
        ("supportedStages", u32), ("supportedOperations", u32), ("quadOperationsInAllStages", u32),
    ]


class Properties2(ctypes.Structure):
    _fields_ = [("sType", u32), ("pNext", ctypes.c_void_p), ("properties", Properties)]


class MemoryHeap(ctypes.Structure):
    _fields_ = [("size", u64), ("flags", u32)]


class MemoryProperties(ctypes.Structure):
    _fields_ = [
        ("memoryTypeCount", u32), ("memoryTypes", (u32 * 2) * 32),
        ("memoryHeapCount", u32), ("memoryHeaps", MemoryHeap * 16),
    ]


class ApplicationInfo(ctypes.Structure):
    _fields_ = [
        ("sType", u32), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
        ("applicationVersion", u32), ("pEngineName", ctypes.c_char_p), ("engineVersion", u32),
        ("apiVersion", u32),
    ]


class InstanceCreateInfo(ctypes.Structure):
    _fields_ = [
        ("sType", u32), ("pNext", ctypes.c_void_p), ("flags", u32),
        ("pApplicationInfo", ctypes.POINTER(ApplicationInfo)),
        ("enabledLayerCount", u32), ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", u32), ("ppEnabledExtensionNames", ctypes.POINTER(ctypes.c_char_p)),
    ]


def version_string(v: int) -> str:
    return f"{(v >> 22) & 0x7F}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def make_version(major: int, minor: int) -> int:
    return (major << 22) | (minor << 12)


def result_name(code: int) -> str:
    return f"{RESULTS.get(code, 'VkResult')} ({code})"


def loader_names() -> list[str]:
    system = platform.system()
    if system == "Windows":
        return ["vulkan-1.dll"]
    if system == "Darwin":
        return ["libvulkan.1.dylib", "libvulkan.dylib", "libMoltenVK.dylib"]
    return ["libvulkan.so.1", "libvulkan.so"]


def load_loader() -> tuple[ctypes.CDLL | None, str | None, str]:
    errors = []
    for name in loader_names():
        try:
            return ctypes.CDLL(name), name, ""
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    return None, None, "; ".join(errors)


def icd_manifests() -> list[str]:
    """ICD manifest files the loader would consider (Linux/macOS search paths and overrides)."""
    for var in ("VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        if os.environ.get(var):
            return [p for p in os.environ[var].split(os.pathsep) if p]
    dirs = []
    xdg_config = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    xdg_data = os.environ.get("XDG_DATA_DIRS", "/usr/local/share:/usr/share").split(":")
    for base in [*xdg_config, "/etc", *xdg_data]:
        dirs.append(os.path.join(base, "vulkan", "icd.d"))
    found: list[str] = []
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "*.json"))):
            if p not in found:
                found.append(p)
    return found


# Shared libraries Vulkan drivers need, and the Debian/Ubuntu package that provides each.
SONAME_PACKAGES = {
    "libGLdispatch.so.0": "libglvnd0", "libGLX.so.0": "libglx0", "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1", "libOpenGL.so.0": "libopengl0", "libGLESv2.so.2": "libgles2",
    "libvulkan.so.1": "libvulkan1", "libX11.so.6": "libx11-6", "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb.so.1": "libxcb1", "libwayland-client.so.0": "libwayland-client0", "libdrm.so.2": "libdrm2",
    "libz.so.1": "zlib1g", "libexpat.so.1": "libexpat1", "libstdc++.so.6": "libstdc++6",
}
# Libraries a driver opens at run time rather than at link time: loading the driver works without
# them, and it fails later. NVIDIA's Vulkan ICD lives in its GLX library and needs libglvnd's
# dispatcher; without it the loader reports only "Could not get 'vkCreateInstance'".
RUNTIME_DEPS = {"libGLX_nvidia.so": ("libGLdispatch.so.0",)}
# Device nodes a vendor's driver opens; absent in a container started without the GPU.
DEVICE_NODES = {"libGLX_nvidia.so": ("nvidiactl", "nvidia0"), "libnvidia": ("nvidiactl", "nvidia0")}
# llama.cpp's Vulkan backend needs Vulkan 1.2.
MIN_API = (1, 2)


def soname_remedy(soname: str) -> str:
    pkg = SONAME_PACKAGES.get(soname)
    if pkg:
        return f"install {pkg} (Debian/Ubuntu), which provides {soname}"
    return f"install the package that provides {soname}"


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def runtime_problems(library: str, loadable: Any = _loadable, dev_root: str = "/dev") -> list[tuple[str, str]]:
    """(what is wrong, remedy) for a driver that loads but does not initialise."""
    base = os.path.basename(library)
    out: list[tuple[str, str]] = []
    for prefix, deps in RUNTIME_DEPS.items():
        if base.startswith(prefix):
            for dep in deps:
                if not loadable(dep):
                    out.append((f"it needs {dep}, which cannot be loaded", soname_remedy(dep)))
    for prefix, nodes in DEVICE_NODES.items():
        if base.startswith(prefix):
            gone = [n for n in nodes if not os.path.exists(os.path.join(dev_root, n))]
            if gone:
                out.append((f"{', '.join(os.path.join(dev_root, n) for n in gone)} missing",
                            "give this container or VM the GPU's device nodes (docker --gpus all, or --device)"))
    return out


def _api_tuple(text: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def diagnose_icd(manifest: str) -> dict[str, Any]:
    """Load one driver the way the loader would and report whether it initialises, and if not,
    why and what fixes it (`remedy`)."""
    out: dict[str, Any] = {"manifest": manifest}
    try:
        with open(manifest) as f:
            icd = json.load(f)["ICD"]
        library = icd["library_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        out["error"] = f"unreadable manifest: {exc}"
        out["remedy"] = f"reinstall the driver package that owns {manifest}, or remove that file"
        return out
    if not os.path.isabs(library) and os.sep in library:
        library = os.path.join(os.path.dirname(manifest), library)
    out["library"] = library
    api = _api_tuple(str(icd.get("api_version", "")))
    if api is not None and api < MIN_API:
        out["error"] = f"the driver supports Vulkan {api[0]}.{api[1]}; llama.cpp needs {MIN_API[0]}.{MIN_API[1]} or newer"
        out["remedy"] = "update the GPU driver (or Mesa)"
        return out
    if os.sep in library and not os.path.exists(library):
        out["error"] = f"the manifest names {library}, which does not exist"
        out["remedy"] = f"reinstall the driver package that owns {manifest}, or remove that stale file"
        return out
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        out["error"] = f"driver library cannot be loaded: {exc}"
        missing = re.search(r"([\w.+-]+\.so[\w.]*): cannot open shared object file", str(exc))
        if missing and os.path.basename(library) != missing.group(1):
            out["remedy"] = soname_remedy(missing.group(1))
        return out
    negotiate = getattr(lib, "vk_icdNegotiateLoaderICDInterfaceVersion", None)
    if negotiate is not None:
        version = u32(7)
        negotiate.restype = i32
        code = negotiate(ctypes.byref(version))
        if code != VK_SUCCESS:
            out["error"] = f"vk_icdNegotiateLoaderICDInterfaceVersion returned {result_name(code)}"
        else:
            out["interface_version"] = version.value
    if "error" not in out:
        gipa = getattr(lib, "vk_icdGetInstanceProcAddr", None)
        if gipa is not None:
            gipa.restype = ctypes.c_void_p
            gipa.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            if not gipa(None, b"vkCreateInstance"):
                out["error"] = "the driver returns no vkCreateInstance (vk_icdGetInstanceProcAddr)"
    if "error" in out:
        problems = runtime_problems(library)
        if problems:
            out["error"] += "; " + "; ".join(w for w, _ in problems)
            out["remedy"] = "; ".join(r for _, r in problems)
        return out
    out["ok"] = True  # (a driver without the negotiate entry point is a very old one the loader copes with)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    """Prototypes: without them ctypes passes 64-bit handles as C ints."""
    vp, ptr = ctypes.c_void_p, ctypes.POINTER
    lib.vkCreateInstance.argtypes = [ptr(InstanceCreateInfo), vp, ptr(vp)]
    lib.vkCreateInstance.restype = i32
    lib.vkDestroyInstance.argtypes = [vp, vp]
    lib.vkDestroyInstance.restype = None
    lib.vkEnumeratePhysicalDevices.argtypes = [vp, ptr(u32), vp]
    lib.vkEnumeratePhysicalDevices.restype = i32
    lib.vkGetPhysicalDeviceProperties.argtypes = [vp, ptr(Properties)]
    lib.vkGetPhysicalDeviceProperties.restype = None
    lib.vkGetPhysicalDeviceMemoryProperties.argtypes = [vp, ptr(MemoryProperties)]
    lib.vkGetPhysicalDeviceMemoryProperties.restype = None
    if hasattr(lib, "vkGetPhysicalDeviceProperties2"):
        lib.vkGetPhysicalDeviceProperties2.argtypes = [vp, ptr(Properties2)]
        lib.vkGetPhysicalDeviceProperties2.restype = None


def probe() -> dict[str, Any]:
    """Everything the loader reports, as JSON-ready data."""
    report: dict[str, Any] = {"loader": None, "devices": [], "drivers": [], "error": None}
    lib, name, err = load_loader()
    if lib is None:
        report["error"] = f"Vulkan loader not found ({err})"
        report["drivers"] = [diagnose_icd(m) for m in icd_manifests()]
        return report
    report["loader"] = name
    _declare(lib)
    try:
        enumerate_version = lib.vkEnumerateInstanceVersion
        enumerate_version.restype = i32
        v = u32(0)
        if enumerate_version(ctypes.byref(v)) == VK_SUCCESS:
            report["loader_api_version"] = version_string(v.value)
    except AttributeError:
        report["loader_api_version"] = "1.0"

    app = ApplicationInfo(ST_APPLICATION_INFO, None, b"llm-gateway", 1, b"llm-gateway", 1, make_version(1, 2))
    info = InstanceCreateInfo(ST_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
    if platform.system() == "Darwin":  # MoltenVK is a portability driver
        exts = (ctypes.c_char_p * 1)(b"VK_KHR_portability_enumeration")
        info.flags = PORTABILITY_ENUMERATION_BIT
        info.enabledExtensionCount = 1
        info.ppEnabledExtensionNames = exts
    instance = ctypes.c_void_p()
    code = lib.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance))
    if code != VK_SUCCESS:
        report["error"] = f"vkCreateInstance failed: {result_name(code)}"
        report["drivers"] = [diagnose_icd(m) for m in icd_manifests()]
        return report
    try:
        count = u32(0)
        code = lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        if code not in (VK_SUCCESS, VK_INCOMPLETE):
            report["error"] = f"vkEnumeratePhysicalDevices failed: {result_name(code)}"
        handles = (ctypes.c_void_p * max(1, count.value))()
        if count.value:
            lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        get_props2 = getattr(lib, "vkGetPhysicalDeviceProperties2", None)
        for index in range(count.value):
            report["devices"].append(_device(lib, get_props2, handles[index], index))
    finally:
        lib.vkDestroyInstance(instance, None)
    if not report["devices"]:
        report["drivers"] = [diagnose_icd(m) for m in icd_manifests()]
        if not report["error"]:
            report["error"] = "the Vulkan loader found no physical device"
    return report


def _device(lib: ctypes.CDLL, get_props2: Any, handle: Any, index: int) -> dict[str, Any]:
    props = Properties()
    lib.vkGetPhysicalDeviceProperties(handle, ctypes.byref(props))
    driver = DriverProperties(ST_DRIVER_PROPERTIES, None)
    subgroup = SubgroupProperties(ST_SUBGROUP_PROPERTIES, None)
    have_ext = False
    if get_props2 is not None and props.apiVersion >= make_version(1, 1):
        chain = ctypes.cast(ctypes.pointer(subgroup), ctypes.c_void_p)
        if props.apiVersion >= make_version(1, 2):
            driver.pNext = chain
            chain = ctypes.cast(ctypes.pointer(driver), ctypes.c_void_p)
        p2 = Properties2(ST_PROPERTIES_2, chain)
        get_props2(handle, ctypes.byref(p2))
        have_ext = True
    mem = MemoryProperties()
    lib.vkGetPhysicalDeviceMemoryProperties(handle, ctypes.byref(mem))
    heaps = [mem.memoryHeaps[i] for i in range(mem.memoryHeapCount)]
    limits = props.limits
    return {
        "index": index,
        "name": props.deviceName.decode(errors="replace"),
        "type": DEVICE_TYPES.get(props.deviceType, "other"),
        "api_version": version_string(props.apiVersion),
        "driver_version": props.driverVersion,
        "driver_name": driver.driverName.decode(errors="replace") if have_ext else "",
        "driver_info": driver.driverInfo.decode(errors="replace") if have_ext else "",
        "vendor_id": props.vendorID,
        "vendor": VENDORS.get(props.vendorID, hex(props.vendorID)),
        "device_id": props.deviceID,
        "device_local_bytes": sum(h.size for h in heaps if h.flags & HEAP_DEVICE_LOCAL),
        "heaps_bytes": [h.size for h in heaps],
        "max_compute_workgroup_size": list(limits.maxComputeWorkGroupSize),
        "max_compute_workgroup_invocations": limits.maxComputeWorkGroupInvocations,
        "max_compute_shared_memory_bytes": limits.maxComputeSharedMemorySize,
        "subgroup_size": subgroup.subgroupSize if have_ext else 0,
    }


if __name__ == "__main__":
    json.dump(probe(), sys.stdout)
