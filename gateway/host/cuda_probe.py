"""NVIDIA GPUs through the CUDA driver API (libcuda), with NVML for the driver version.

The driver API honours `CUDA_VISIBLE_DEVICES`, so the indices here are the ones every
CUDA program on this host (llama.cpp's `CUDA0`, ORT's `device_id`) will use. Run it in a
child process (`python -m gateway.host.cuda_probe`): `cuInit` must not touch the gateway itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import sys
from typing import Any

ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76


def _load(names: list[str]) -> tuple[ctypes.CDLL | None, str]:
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), ""
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    return None, "; ".join(errors)


def _error_string(lib: ctypes.CDLL, code: int) -> str:
    msg = ctypes.c_char_p()
    try:
        lib.cuGetErrorName(code, ctypes.byref(msg))
    except AttributeError:
        return str(code)
    return f"{msg.value.decode() if msg.value else 'CUDA_ERROR'} ({code})"


def _nvml_driver_version() -> str | None:
    lib, _ = _load(["libnvidia-ml.so.1", "nvml.dll"])
    if lib is None or lib.nvmlInit_v2() != 0:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, 96) == 0:
            return buf.value.decode()
        return None
    finally:
        lib.nvmlShutdown()


def probe() -> dict[str, Any]:
    report: dict[str, Any] = {
        "devices": [], "error": None, "driver_version": None, "cuda_version": None,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    names = ["nvcuda.dll"] if platform.system() == "Windows" else ["libcuda.so.1", "libcuda.so"]
    lib, err = _load(names)
    if lib is None:
        report["error"] = f"no NVIDIA driver ({names[0]} not found)"
        return report
    report["driver_version"] = _nvml_driver_version()
    code = lib.cuInit(0)
    if code != 0:
        report["error"] = f"cuInit failed: {_error_string(lib, code)}"
        return report
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        report["cuda_version"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    count = ctypes.c_int()
    code = lib.cuDeviceGetCount(ctypes.byref(count))
    if code != 0:
        report["error"] = f"cuDeviceGetCount failed: {_error_string(lib, code)}"
        return report
    lib.cuDeviceTotalMem_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    for i in range(count.value):
        dev = ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(dev), i)
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, dev)
        total = ctypes.c_size_t()
        lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(major), ATTR_CC_MAJOR, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), ATTR_CC_MINOR, dev)
        report["devices"].append({
            "index": i, "name": name.value.decode(errors="replace"), "memory_bytes": total.value,
            "compute_capability": f"{major.value}.{minor.value}",
        })
    if not report["devices"]:
        hidden = report["visible_devices"]
        report["error"] = (
            f"no CUDA device visible (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None
            else "the NVIDIA driver reports no CUDA device"
        )
    return report


if __name__ == "__main__":
    json.dump(probe(), sys.stdout)
