"""Choosing where a model runs: a pure function from (model, host, preference) to a plan.

`plan()` reads nothing but its arguments, so every host case is a table row in the tests.
A plan is an ordered list of candidates to try, plus what was left out and why; the pool
tries the candidates in order (functional check, then load) and falls back on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gateway.host.hardware import HostCapabilities, LlamaCppBuild, VulkanDevice, VulkanInfo
from gateway.models.registry import ModelSpec

# What each runtime consumes.
RUNTIME_FORMAT = {"llamacpp": "gguf", "ortgenai": "onnx", "coreml": "coreml", "executorch": "pte"}
RUNTIMES = tuple(RUNTIME_FORMAT)
# Runtimes whose converted artifact is bound to the engine: an ExecuTorch program is lowered for
# one delegate (XNNPACK on the CPU, Vulkan on a GPU), so the candidate names `pte:<delegate>`.
FORMAT_VARIANT = {("executorch", "cpu"): "xnnpack", ("executorch", "vulkan"): "vulkan"}
# The engines a user names (`--engine`), and the runtimes that provide each, preferred first.
ENGINE_RUNTIMES: dict[str, tuple[str, ...]] = {
    "cuda": ("llamacpp", "ortgenai"),
    "metal": ("llamacpp",),
    "vulkan": ("llamacpp", "executorch"),
    "directml": ("ortgenai",),
    "coreml": ("coreml",),
    "cpu": ("llamacpp", "ortgenai", "executorch"),
}
# `--engine auto`: fastest first. CoreML before CPU: the Neural Engine beats the CPU on a Mac.
AUTO_ORDER = ("cuda", "metal", "vulkan", "directml", "coreml", "cpu")
VULKAN_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}

INSTALL = {
    "llamacpp": "scripts/install-llama-cpp.sh {backend}",
    "ortgenai/cpu": "pip install onnxruntime-genai",
    "ortgenai/cuda": "pip install onnxruntime-genai-cuda",
    "ortgenai/directml": "pip install onnxruntime-genai-directml",
    "coreml": "pip install coremltools (on macOS)",
}


class SelectionError(ValueError):
    """No candidate can serve the request; the message says what is missing."""


@dataclass(frozen=True)
class Preference:
    engine: str = "auto"  # auto or one of ENGINE_RUNTIMES
    runtime: str | None = None  # pin a runtime (llamacpp, ortgenai, coreml)
    device: str | None = None  # index or part of the device name


@dataclass(frozen=True)
class Candidate:
    runtime: str
    backend: str  # the engine: cpu, vulkan, cuda, metal, directml, coreml
    device: str  # human-readable device name
    device_key: str  # the runtime's own id: ggml "Vulkan0"/"CUDA0", ORT device id; "" for CPU
    format: str
    device_index: int | None = None
    rank: int = 0  # position of its engine in the preference order
    lib_path: str = ""  # llama.cpp: the folder of the build that serves it; "" = the installed package's

    @property
    def label(self) -> str:
        return f"{self.runtime}/{self.backend}"


@dataclass(frozen=True)
class Skip:
    what: str  # e.g. "llamacpp/vulkan" or "llamacpp/vulkan llvmpipe"
    why: str
    # "absent": nothing of the kind on this host (not a fallback); "unusable": it is there
    # but cannot serve (driver fails, build lacks the backend) — a fallback the user must hear of.
    kind: str = "absent"
    rank: int = 0  # position of its engine in the preference order


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skip, ...] = ()

    def unusable(self, before: Candidate | None = None) -> list[Skip]:
        """Engines that are present but cannot serve; with `before`, only those preferred to it."""
        return [s for s in self.skipped if s.kind == "unusable" and (before is None or s.rank < before.rank)]


Found = tuple[list[tuple[str, str, int | None]], list[Skip]]  # ([(device, device_key, index)], skips)
Finder = Callable[[HostCapabilities, Preference], Found]


def _install_hint(runtime: str, backend: str) -> str:
    hint = INSTALL.get(f"{runtime}/{backend}") or INSTALL.get(runtime, "")
    return hint.format(backend=backend)


def _match(device: str | None, index: int, name: str) -> bool:
    if device is None:
        return True
    return device == str(index) or device.lower() in name.lower()


def _llama_built(host: HostCapabilities, backend: str, ggml_name: str) -> Skip | None:
    b = host.llamacpp
    if not b.installed:
        return Skip(f"llamacpp/{backend}", f"llama-cpp-python is not installed ({b.error}); "
                    f"install it with {_install_hint('llamacpp', backend)}", "unusable")
    if not b.has(ggml_name):
        return Skip(
            f"llamacpp/{backend}",
            f"the installed llama-cpp-python {b.version} was built without {ggml_name} "
            f"(it has: {', '.join(b.backends) or 'nothing'}); rebuild it with "
            f"{_install_hint('llamacpp', backend)}",
            "unusable",
        )
    return None


GGML_NAMES = {"cpu": "CPU", "vulkan": "Vulkan", "cuda": "CUDA", "metal": "Metal"}


def llama_build_for(host: HostCapabilities, backend: str) -> LlamaCppBuild:
    """The llama.cpp build that serves `backend`: of the installed builds that have it, the one with
    the fewest backends (a CPU-only build for the CPU, the Vulkan build for Vulkan), the installed
    package first on a tie; the package itself when none has it (its finder then says why)."""
    ggml = GGML_NAMES.get(backend, backend)
    builds = [b for b in (host.llamacpp, *host.llamacpp_builds) if b.installed and b.has(ggml)]
    return min(builds, key=lambda b: len(b.backends)) if builds else host.llamacpp


def _ggml_vulkan_name(host: HostCapabilities, dev: VulkanDevice) -> str | None:
    """ggml names Vulkan devices in the order the loader lists them (all made visible)."""
    name = f"Vulkan{dev.index}"
    return name if any(d[0] == name for d in host.llamacpp.devices) else None


def _llama_cpu(host: HostCapabilities, pref: Preference) -> Found:
    if not host.llamacpp.installed:
        return [], [Skip("llamacpp/cpu", f"llama-cpp-python is not installed ({host.llamacpp.error}); "
                         "install it with scripts/install-llama-cpp.sh cpu", "unusable")]
    return [("cpu", "", None)], []


def _vulkan_devices(vk: VulkanInfo, pref: Preference, what: str) -> tuple[list[VulkanDevice], list[Skip]]:
    """The Vulkan devices a runtime may use, best first: the requested one, and a software
    (CPU-type) device only when Vulkan was asked for."""
    eligible, skips = [], []
    for dev in sorted(vk.devices, key=lambda d: (VULKAN_RANK.get(d.type, 9), d.index)):
        if not _match(pref.device, dev.index, dev.name):
            skips.append(Skip(f"{what} {dev.name}", f"not the requested device {pref.device!r}"))
        elif dev.type == "cpu" and pref.engine == "auto" and pref.device is None:
            skips.append(Skip(f"{what} {dev.name}", "a software (CPU-type) Vulkan device is slower than "
                              "the CPU engine; use --engine vulkan to pick it anyway"))
        else:
            eligible.append(dev)
    return eligible, skips


def _llama_vulkan(host: HostCapabilities, pref: Preference) -> Found:
    vk = host.vulkan
    if not vk.devices:
        kind = "unusable" if vk.drivers else "absent"
        return [], [Skip("llamacpp/vulkan", vk.reason, kind)]
    eligible, skips = _vulkan_devices(vk, pref, "llamacpp/vulkan")
    if not eligible:
        return [], skips
    skip = _llama_built(host, "vulkan", "Vulkan")
    if skip:
        return [], [*skips, skip]
    out: list[tuple[str, str, int | None]] = []
    for dev in eligible:
        ggml = _ggml_vulkan_name(host, dev)
        if ggml is None:
            skips.append(Skip(f"llamacpp/vulkan {dev.name}", "ggml's Vulkan backend does not support this device", "unusable"))
            continue
        out.append((dev.name, ggml, dev.index))
    return out, skips


def _llama_cuda(host: HostCapabilities, pref: Preference) -> Found:
    cuda = host.cuda
    if not cuda.devices:
        present = host.llamacpp.has("CUDA") or cuda.driver_version is not None
        return [], [Skip("llamacpp/cuda", cuda.error or "no CUDA device", "unusable" if present else "absent")]
    skip = _llama_built(host, "cuda", "CUDA")
    if skip:
        return [], [skip]
    return [(d.name, f"CUDA{d.index}", d.index) for d in cuda.devices if _match(pref.device, d.index, d.name)], []


def _llama_metal(host: HostCapabilities, pref: Preference) -> Found:
    if not host.metal.available:
        return [], [Skip("llamacpp/metal", host.metal.reason)]
    skip = _llama_built(host, "metal", "Metal")
    if skip:
        return [], [skip]
    return [("Apple GPU", "MTL0", 0)], []


def _ort(backend: str) -> Finder:
    def find(host: HostCapabilities, pref: Preference) -> Found:
        what = f"ortgenai/{backend}"
        if not host.ort.genai:
            return [], [Skip(what, f"onnxruntime-genai is not installed ({_install_hint('ortgenai', backend)})")]
        if backend == "cpu":
            return [("cpu", "", None)], []
        if backend == "cuda":
            if not host.ort.has_package("onnxruntime-genai-cuda"):
                return [], [Skip(what, f"onnxruntime-genai-cuda is not installed ({_install_hint('ortgenai', 'cuda')})")]
            if not host.cuda.devices:
                return [], [Skip(what, host.cuda.error or "no CUDA device", "unusable")]
            return [(d.name, str(d.index), d.index) for d in host.cuda.devices if _match(pref.device, d.index, d.name)], []
        if not host.directml.available:
            return [], [Skip(what, host.directml.reason)]
        return [("DirectML adapter 0", "0", 0)], []

    return find


def _coreml(host: HostCapabilities, pref: Preference) -> Found:
    if not host.coreml.available:
        return [], [Skip("coreml/coreml", host.coreml.reason)]
    return [(host.coreml.detail or "Apple Neural Engine", "ALL", None)], []


def _executorch(host: HostCapabilities, pref: Preference) -> Found:
    if not host.executorch.available:
        return [], [Skip("executorch/cpu", host.executorch.reason)]
    return [("cpu", "", None)], []


def _executorch_vulkan(host: HostCapabilities, pref: Preference) -> Found:
    """Each Vulkan device, best first; the engine opens it by index (ETVK_DEVICE_INDEX)."""
    if not host.executorch.available:
        return [], [Skip("executorch/vulkan", host.executorch.reason)]
    if not host.executorch_vulkan.available:
        return [], [Skip("executorch/vulkan", host.executorch_vulkan.reason)]
    if not host.vulkan.devices:
        return [], [Skip("executorch/vulkan", host.vulkan.reason or "no Vulkan device", "absent")]
    eligible, skips = _vulkan_devices(host.vulkan, pref, "executorch/vulkan")
    found: list[tuple[str, str, int | None]] = [(dev.name, str(dev.index), dev.index) for dev in eligible]
    return found, skips


FINDERS: dict[tuple[str, str], Finder] = {
    ("llamacpp", "cpu"): _llama_cpu,
    ("llamacpp", "vulkan"): _llama_vulkan,
    ("llamacpp", "cuda"): _llama_cuda,
    ("llamacpp", "metal"): _llama_metal,
    ("ortgenai", "cpu"): _ort("cpu"),
    ("ortgenai", "cuda"): _ort("cuda"),
    ("ortgenai", "directml"): _ort("directml"),
    ("coreml", "coreml"): _coreml,
    ("executorch", "cpu"): _executorch,
    ("executorch", "vulkan"): _executorch_vulkan,
}


def plan(
    spec: ModelSpec,
    host: HostCapabilities,
    pref: Preference = Preference(),
    formats: Iterable[str] | None = None,
) -> Plan:
    """Ordered candidates for `spec` on `host` under `pref`.

    `formats` are the model formats available (the registry's sources plus converted
    artifacts); by default those listed in models.yaml. Raises SelectionError when nothing
    can serve, with every reason.
    """
    have = set(formats if formats is not None else spec.formats)
    if pref.engine != "auto" and pref.engine not in ENGINE_RUNTIMES:
        raise SelectionError(f"unknown engine {pref.engine!r}; expected auto or one of {', '.join(ENGINE_RUNTIMES)}")
    if pref.runtime is not None and pref.runtime not in RUNTIME_FORMAT:
        raise SelectionError(f"unknown runtime {pref.runtime!r}; expected one of {', '.join(RUNTIMES)}")
    engines = [pref.engine] if pref.engine != "auto" else list(spec.engines or AUTO_ORDER)
    runtimes = [r for r in (spec.runtimes or RUNTIMES) if pref.runtime in (None, r)]
    if pref.runtime and pref.runtime not in runtimes:
        raise SelectionError(f"model {spec.id!r} does not list runtime {pref.runtime!r} (it lists {spec.runtimes})")

    out: list[Candidate] = []
    skipped: list[Skip] = []
    for rank, engine in enumerate(engines):
        for runtime in sorted(ENGINE_RUNTIMES[engine], key=lambda r: runtimes.index(r) if r in runtimes else 99):
            if runtime not in runtimes:
                continue
            fmt = RUNTIME_FORMAT[runtime]
            present = fmt in have
            variant = FORMAT_VARIANT.get((runtime, engine))
            if variant is not None:
                # `pte` alone (formats given without variants) stands for any delegate.
                bound = any(h.startswith(f"{fmt}:") for h in have)
                fmt = f"{fmt}:{variant}"
                present = fmt in have or (present and not bound)
            if not present:
                hint = ""
                if fmt.startswith("pte"):
                    hint = f" (make it with `gateway convert --to executorch --delegate {variant}`)"
                elif fmt in ("onnx", "coreml"):
                    hint = " (make it with `gateway convert`)"
                skipped.append(Skip(f"{runtime}/{engine}", f"model {spec.id!r} has no {fmt} format{hint}", rank=rank))
                continue
            backend = "coreml" if runtime == "coreml" else engine
            on, lib = host, ""
            if runtime == "llamacpp":
                build = llama_build_for(host, backend)
                on, lib = replace(host, llamacpp=build), build.lib_path
            found, skips = FINDERS[(runtime, backend)](on, pref)
            skipped.extend(replace(s, rank=rank) for s in skips)
            for device, key, index in found:
                out.append(Candidate(runtime, engine, device, key, fmt, index, rank, lib))
    if not out:
        why = "; ".join(f"{s.what}: {s.why}" for s in skipped) or "no runtime is configured"
        wanted = f"--engine {pref.engine}" + (f" --runtime {pref.runtime}" if pref.runtime else "")
        if pref.device is not None:
            wanted += f" --device {pref.device}"
        raise SelectionError(f"{wanted} cannot serve model {spec.id!r} on this host: {why}")
    return Plan(tuple(out), tuple(skipped))
