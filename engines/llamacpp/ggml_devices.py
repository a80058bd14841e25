"""ggml's backend registry, read through ctypes from the libraries llama-cpp-python loads.

llama-cpp-python binds llama.h but not ggml-backend.h, yet the devices a build can use
(`CPU`, `Vulkan0`, `CUDA0`, `MTL0` …) live there. We open the same `libggml` that
`libllama` already loaded (dlopen returns the loaded copy) and declare the few functions
we need.

`python -m engines.llamacpp.ggml_devices` prints the installed build as JSON; the host probe runs it
in a child process so a backend that crashes while initialising cannot take the gateway down.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from engines.base import ModelLoadError
from engines.llamacpp.ggml_backends import ensure_loaded, ggml_lib, lib_dir, variants

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True)
class GgmlDevice:
    name: str  # ggml's name, e.g. "Vulkan0"; what llama.cpp calls the device
    description: str  # the driver's device name, e.g. "NVIDIA H100 80GB HBM3"
    type: str
    backend: str  # the registry the device belongs to, e.g. "Vulkan"
    memory_free: int
    memory_total: int


def _ggml() -> ctypes.CDLL:
    """The loaded libggml (the copy libllama uses)."""
    ensure_loaded()  # a build with loadable backends registers them (and its CPU variant) first
    lib = ggml_lib()
    vp = ctypes.c_void_p
    sigs: dict[str, tuple[list[Any], Any]] = {
        "ggml_backend_reg_count": ([], ctypes.c_size_t),
        "ggml_backend_reg_get": ([ctypes.c_size_t], vp),
        "ggml_backend_reg_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_count": ([], ctypes.c_size_t),
        "ggml_backend_dev_get": ([ctypes.c_size_t], vp),
        "ggml_backend_dev_by_name": ([ctypes.c_char_p], vp),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_description": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_type": ([vp], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([vp], vp),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None),
    }
    for fname, (args, res) in sigs.items():
        fn = getattr(lib, fname)
        fn.argtypes = args
        fn.restype = res
    return lib


def backends() -> list[str]:
    """Names of the backends compiled into (or loaded by) this build: CPU, Vulkan, CUDA, Metal…"""
    lib = _ggml()
    return [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode() for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[GgmlDevice]:
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append(GgmlDevice(
            name=lib.ggml_backend_dev_name(dev).decode(),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
            type=DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other"),
            backend=lib.ggml_backend_reg_name(reg).decode() if reg else "",
            memory_free=free.value,
            memory_total=total.value,
        ))
    return out


def device_list(names: list[str]) -> tuple[Any, list[str]]:
    """A NULL-terminated `ggml_backend_dev_t[]` for llama_model_params.devices.

    An empty `names` gives an empty list: the model stays on the CPU even in a GPU build.
    Returns the array (keep it alive while the model loads) and the names not found.
    """
    lib = _ggml()
    handles: list[int] = []
    missing: list[str] = []
    for name in names:
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if dev:
            handles.append(dev)
        else:
            missing.append(name)
    arr = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    return arr, missing


def split_shares(lc: Any, n: int, shares: tuple[float, ...]) -> Any:
    """llama.cpp's tensor_split for `n` devices: each one's share (in the device list's order), or
    zeros (llama.cpp then splits by each device's free memory)."""
    if shares and len(shares) != n:
        raise ModelLoadError(f"tensor_split has {len(shares)} shares for {n} devices")
    if n > lc.llama_max_devices():
        raise ModelLoadError(f"this llama.cpp build splits a model over at most {lc.llama_max_devices()} devices")
    arr = (ctypes.c_float * lc.llama_max_devices())(*(shares or ()))
    return ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))


def build_report() -> dict[str, Any]:
    """What the installed llama-cpp-python can do, as JSON-ready data."""
    report: dict[str, Any] = {"installed": False, "version": None, "backends": [], "devices": [], "error": None}
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - a broken build is reported, not raised
        report["error"] = f"llama-cpp-python cannot be imported: {exc}"
        return report
    report["installed"] = True
    report["version"] = getattr(llama_cpp, "__version__", None)
    directory = lib_dir()
    report["lib_dir"] = str(directory)
    # Identifies the build itself: a rebuild or relink of the same version changes it.
    ids = []
    for lib in sorted(directory.glob("lib*.so*")) + sorted(directory.glob("*.dll")) + sorted(directory.glob("*.dylib")):
        if lib.is_file() and not lib.is_symlink():
            st = lib.stat()
            ids.append(f"{lib.name}:{st.st_size}:{int(st.st_mtime)}")
    report["build_id"] = hashlib.sha256("|".join(ids).encode()).hexdigest()[:16]
    try:
        # A build with loadable CPU variants: each with its score on this CPU (0 = unsupported).
        report["cpu_variants"] = [[v.name, v.score] for v in variants(directory)]
        report["cpu_variant"] = ensure_loaded()
    except OSError as exc:
        report["error"] = f"cannot load the build's backends: {exc}"
        return report
    try:
        report["backends"] = backends()
        report["devices"] = [asdict(d) for d in devices()]
        report["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except (OSError, AttributeError) as exc:
        report["error"] = f"cannot read the ggml backend registry: {exc}"
    return report


if __name__ == "__main__":
    json.dump(build_report(), sys.stdout)
