"""llama.cpp as the gateway sees it: GGUF on the CPU, Vulkan, CUDA and Metal, through the installed
llama-cpp-python and any builds installed beside it (scripts/install-llama-cpp.sh). Imports no
native library: the probe runs in a child process (engines/llamacpp/ggml_devices.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from engines.base import EngineConfig
from engines.host import (
    HostCapabilities,
    VulkanDevice,
    VulkanInfo,
    run_child,
    vulkan_visible_env,
)
from engines.llamacpp.ggml_backends import AMX_VARIANTS, ensure_loaded, lower
from engines.runtimes import (
    Device,
    Found,
    Offer,
    Preference,
    Runtime,
    RuntimeOptions,
    Skip,
    match_device,
    register,
    vulkan_devices,
)

INSTALL = "scripts/install-llama-cpp.sh {engine}"
GGML_NAMES = {"cpu": "CPU", "vulkan": "Vulkan", "cuda": "CUDA", "metal": "Metal"}


class LlamaCppOptions(RuntimeOptions):
    """llama.cpp's own engine options (EngineConfig.options of its engines)."""

    # Run the sampler chain on the device (only token ids come back) for requests without a
    # grammar or logprobs. "auto" = on for CUDA.
    device_sampling: Literal["auto", "on", "off"] = "auto"
    # Speculative decoding from n-gram drafts (prompt lookup): the tokens after the latest earlier
    # occurrence of the text's last `draft_ngram` tokens, up to `draft_max`, are verified in the
    # same step. 0 = off.
    draft_ngram: int = Field(default=0, ge=0)
    draft_max: int = Field(default=0, ge=0)
    draft_streams: int = Field(default=1, ge=0)  # draft only while at most this many sequences are decoding
    # Repack the weights into the CPU's extra buffer types (AMX tiles, interleaved AVX blocks);
    # False = llama.cpp's --no-repack. A rung of the fallback ladder.
    repack: bool = True
    # Builds with loadable CPU variants: the variant to load ("" = auto, the fastest supported
    # non-AMX one; see engines/llamacpp/ggml_backends.py). Applies per process.
    cpu_variant: str = ""
    # The host-memory prefix cache (engines/llamacpp/prefix_cache.py), in MiB; -1 = a quarter of
    # the memory available at load, at most 8 GiB; 0 = off.
    prefix_cache_mib: int = Field(default=-1, ge=-1)
    # Keep that cache in the device's page-locked host memory, pinned at load (DMA copies;
    # engines/llamacpp/host_memory.py): "auto" = on CUDA/ROCm, "on" (any device with such memory,
    # e.g. Vulkan), "off" = pageable memory.
    pinned_host_cache: Literal["auto", "on", "off"] = "auto"
    # Prompt tokens prefilled per step while other sequences are decoding (chunked prefill); 0 =
    # the device class's default (engines/llamacpp/engine.py PREFILL_BUDGET).
    prefill_budget: int = Field(default=0, ge=0)
    # Keep every position in the KV of sliding-window layers (llama.cpp's --swa-full): more memory
    # and slower long prompts, but any prefix of a sequence can be reused.
    swa_full: bool = False
    # One KV stream shared by every sequence (llama-server's default) instead of one per sequence:
    # a step's tokens of several sequences then go through the model together, but a sequence's
    # context is no longer its own (the sequences share context_length x parallel).
    kv_unified: bool = False
    # One model across several GPUs, whole layers on each (llama.cpp's --split-mode layer): the ggml
    # devices after the engine's own (`device_key`), and each one's share of the layers
    # (tensor_split, in device order, the engine's first; empty = by each GPU's free memory). Row
    # split is not offered: llama.cpp refused it on the CUDA build ("device CUDA0 does not support
    # split buffers", two H100s).
    split_devices: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    # With kv_unified: requests decoded at once (0 = parallel). More than `parallel` share the KV
    # of context_length x parallel tokens; when it fills, idle sequences' KV goes to the host
    # prefix cache first, then the newest request is paused and resumes when there is room.
    sequences: int = Field(default=0, ge=0)
    # The vision projector GGUF that goes with the model (llama-server's --mmproj): the model then
    # takes images (engines/llamacpp/vision.py). "" = none.
    mmproj: str = ""

    @model_validator(mode="after")
    def _shares(self) -> Self:
        if self.tensor_split and len(self.tensor_split) != 1 + len(self.split_devices):
            raise ValueError(f"tensor_split has {len(self.tensor_split)} shares for {1 + len(self.split_devices)} devices")
        if any(s < 0 for s in self.tensor_split) or (self.tensor_split and not sum(self.tensor_split)):
            raise ValueError("tensor_split's shares are >= 0, and not all 0")
        return self


# --- the host probe ------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppBuild:
    """One llama.cpp build: the installed llama-cpp-python package, or one beside it."""

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
class LlamaCppFound:
    """What the llama.cpp probe finds on a host (its entry in `HostCapabilities.runtimes`)."""

    package: LlamaCppBuild = field(default_factory=lambda: LlamaCppBuild(error="was not probed"))
    # More builds installed side by side (scripts/install-llama-cpp.sh cpu,vulkan,...): each runs in
    # its own worker processes.
    beside: tuple[LlamaCppBuild, ...] = ()


def found(host: HostCapabilities) -> LlamaCppFound:
    return host.found("llamacpp", LlamaCppFound)


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


def probe(host: HostCapabilities) -> HostCapabilities:
    primary = probe_llamacpp(host.vulkan)
    return host.with_found("llamacpp", LlamaCppFound(primary, probe_llamacpp_builds(host.vulkan, primary,
                                                                                  default_build_dirs())))


def cpu_variants_line(b: LlamaCppBuild) -> str:
    """The build's CPU variants: which runs by default, which this CPU cannot run."""
    parts = []
    for name, score in b.cpu_variants:
        if score <= 0:
            continue
        tag = " (loaded by default)" if name == b.cpu_variant else (" (AMX: only when asked for)" if name in AMX_VARIANTS else "")
        parts.append(name + tag)
    unsupported = [n for n, sc in b.cpu_variants if sc <= 0]
    return ("CPU variants: " + ", ".join(parts)
            + (f"; this CPU cannot run: {', '.join(unsupported)}" if unsupported else ""))


def report(host: HostCapabilities) -> list[str]:
    f = found(host)
    b, lines = f.package, []
    if b.installed:
        lines.append(f"llama.cpp llama-cpp-python {b.version}, backends: {', '.join(b.backends) or '-'}")
        lines += [f"  {name:<9} {desc} ({kind})" for name, desc, kind in b.devices]
        if b.cpu_variants:
            lines.append(f"  {cpu_variants_line(b)}")
        if b.error:
            lines.append(f"  {b.error}")
    else:
        lines.append(f"llama.cpp {b.error}")
    for sb in f.beside:
        state = f"backends: {', '.join(sb.backends) or '-'}" if sb.installed else (sb.error or "unusable")
        lines.append(f"  side-by-side build {sb.lib_path}: {state}")
        if sb.installed and sb.cpu_variants:
            lines.append(f"    {cpu_variants_line(sb)}")
    return lines


# --- finders -------------------------------------------------------------------------------


def build_for(host: HostCapabilities, engine: str) -> LlamaCppBuild:
    """The llama.cpp build that serves `engine`: of the installed builds that have it, the one with
    the fewest backends (a CPU-only build for the CPU, the Vulkan build for Vulkan), the installed
    package first on a tie; the package itself when none has it (its finder then says why)."""
    ggml = GGML_NAMES.get(engine, engine)
    f = found(host)
    builds = [b for b in (f.package, *f.beside) if b.installed and b.has(ggml)]
    return min(builds, key=lambda b: len(b.backends)) if builds else f.package


def build_of(host: HostCapabilities, lib_path: str) -> LlamaCppBuild:
    """The build in `lib_path` (a side-by-side one), or the installed package."""
    f = found(host)
    return next((x for x in f.beside if x.lib_path and x.lib_path == lib_path), f.package)


def _built(b: LlamaCppBuild, engine: str, ggml_name: str) -> Skip | None:
    hint = INSTALL.format(engine=engine)
    if not b.installed:
        return Skip(f"llamacpp/{engine}", f"llama-cpp-python is not installed ({b.error}); install it with {hint}",
                    "unusable")
    if not b.has(ggml_name):
        return Skip(
            f"llamacpp/{engine}",
            f"the installed llama-cpp-python {b.version} was built without {ggml_name} "
            f"(it has: {', '.join(b.backends) or 'nothing'}); rebuild it with {hint}",
            "unusable",
        )
    return None


def _ggml_vulkan_name(b: LlamaCppBuild, dev: VulkanDevice) -> str | None:
    """ggml names Vulkan devices in the order the loader lists them (all made visible)."""
    name = f"Vulkan{dev.index}"
    return name if any(d[0] == name for d in b.devices) else None


def _cpu(host: HostCapabilities, b: LlamaCppBuild, pref: Preference) -> Found:
    if not b.installed:
        return [], [Skip("llamacpp/cpu", f"llama-cpp-python is not installed ({b.error}); "
                         f"install it with {INSTALL.format(engine='cpu')}", "unusable")]
    return [Device("cpu")], []


def _vulkan(host: HostCapabilities, b: LlamaCppBuild, pref: Preference) -> Found:
    vk = host.vulkan
    if not vk.devices:
        kind = "unusable" if vk.drivers else "absent"
        return [], [Skip("llamacpp/vulkan", vk.reason, kind)]
    eligible, skips = vulkan_devices(host, pref, "llamacpp/vulkan")
    if not eligible:
        return [], skips
    skip = _built(b, "vulkan", "Vulkan")
    if skip:
        return [], [*skips, skip]
    out: list[Device] = []
    for dev in eligible:
        ggml = _ggml_vulkan_name(b, dev)
        if ggml is None:
            skips.append(Skip(f"llamacpp/vulkan {dev.name}", "ggml's Vulkan backend does not support this device", "unusable"))
            continue
        out.append(Device(dev.name, ggml, dev.index))
    return out, skips


def _cuda(host: HostCapabilities, b: LlamaCppBuild, pref: Preference) -> Found:
    cuda = host.cuda
    if not cuda.devices:
        present = b.has("CUDA") or cuda.driver_version is not None
        return [], [Skip("llamacpp/cuda", cuda.error or "no CUDA device", "unusable" if present else "absent")]
    skip = _built(b, "cuda", "CUDA")
    if skip:
        return [], [skip]
    return [Device(d.name, f"CUDA{d.index}", d.index) for d in cuda.devices if match_device(pref.device, d.index, d.name)], []


def _metal(host: HostCapabilities, b: LlamaCppBuild, pref: Preference) -> Found:
    if not host.metal.available:
        return [], [Skip("llamacpp/metal", host.metal.reason)]
    skip = _built(b, "metal", "Metal")
    if skip:
        return [], [skip]
    return [Device("Apple GPU", "MTL0", 0)], []


def _offer(engine: str) -> Offer:
    find = {"cpu": _cpu, "vulkan": _vulkan, "cuda": _cuda, "metal": _metal}[engine]

    def finder(host: HostCapabilities, pref: Preference) -> Found:
        # Each engine on the build that serves it; the devices name that build.
        b = build_for(host, engine)
        found, skips = find(host, b, pref)
        return [replace(d, lib_path=b.lib_path) for d in found], skips

    return Offer(engine, finder)


# --- trusting a build: fingerprint and fallback ladder ------------------------------------


def fingerprint(host: HostCapabilities, lib_path: str) -> str:
    b = build_of(host, lib_path)
    # The CPU too: which variants run, and how fast, is the CPU's to say.
    return (f"llama-cpp-python {b.version} [{','.join(b.backends)}] {b.build_id} "
            f"cpu {host.cpu.model} {','.join(host.cpu.simd)}")


def ladder(config: EngineConfig, host: HostCapabilities, lib_path: str) -> list[EngineConfig]:
    """As planned (weights repacked, the build's CPU variant unless one is pinned), then with
    repacking off (llama.cpp's --no-repack: no AMX or interleaved buffers), then also on a lower
    CPU variant (AVX2 class below AVX-512)."""
    build = build_of(host, lib_path)
    lo = LlamaCppOptions.of(config)
    variant = lo.cpu_variant or build.cpu_variant
    first = lo.model_copy(update={"cpu_variant": variant, "repack": True})
    out = [first, first.model_copy(update={"repack": False})]
    low = lower(list(build.cpu_variants), variant) if build.cpu_variants and variant else None
    if low:
        out.append(first.model_copy(update={"repack": False, "cpu_variant": low}))
    return [replace(config, options=o) for o in out]


def rung(config: EngineConfig) -> str:
    """A rung of the ladder: "CPU variant zen4, repack off"."""
    lo = LlamaCppOptions.of(config)
    how = [f"CPU variant {lo.cpu_variant}"] if lo.cpu_variant else []
    how.append(f"repack {'on' if lo.repack else 'off'}")
    if lo.split_devices:
        shares = "/".join(f"{s:g}" for s in lo.tensor_split)
        how.append(f"split with {', '.join(lo.split_devices)}" + (f", shares {shares}" if shares else ""))
    return ", ".join(how)


def build_env(lib_path: str) -> dict[str, str]:
    return {"LLAMA_CPP_LIB_PATH": lib_path} if lib_path else {}


def _prepare() -> None:
    ensure_loaded()


RUNTIME = register(Runtime(
    name="llamacpp",
    format="gguf",
    offers=tuple(_offer(e) for e in ("cpu", "vulkan", "cuda", "metal")),
    engine_module="engines.llamacpp.engine",
    probe=probe,
    in_process=lambda host: host.with_found("llamacpp", replace(found(host), beside=())),
    report=report,
    install={"*": INSTALL},
    options=LlamaCppOptions,
    fingerprint=fingerprint,
    ladder=ladder,
    rung=rung,
    build_env=build_env,
    prepare=_prepare,
    memory_estimate=True,
))
