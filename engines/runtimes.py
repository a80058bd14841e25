"""Runtimes as plug-ins: one descriptor per runtime, registered from the runtime's own module.

A `Runtime` says everything the gateway needs to know of a runtime without importing it: the
model format it serves, the engines (and so devices) it offers with a finder for each, its host
probe and what `gateway devices` shows of it, its install hint, its options model, its build
fingerprint, its fallback ladder and its parity tolerances. The gateway reaches runtimes only
through `runtimes()` / `runtime()`; its selector iterates them. The engine itself (the factory of
engines/registry.py) is imported only when a model loads on it.

Adding a runtime is one module that calls `register(Runtime(...))` (and registers its engine
factory); the built-in ones are imported on first use, others are named by the `plugins` setting.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from engines.base import EngineConfig, ModelLoadError
from engines.host import HostCapabilities, VulkanDevice

# The built-in runtimes, preferred in this order where several offer an engine, and the modules
# that register them.
BUILTIN: Mapping[str, str] = {
    "llamacpp": "engines.llamacpp.runtime",
    "ortgenai": "engines.ortgenai",
    "coreml": "engines.coreml",
    "executorch": "engines.executorch",
}
# `--engine auto`: fastest first. CoreML before CPU: the Neural Engine beats the CPU on a Mac. An
# engine only a plug-in offers goes before the CPU.
ENGINE_ORDER = ("cuda", "metal", "vulkan", "directml", "coreml", "cpu")


@dataclass(frozen=True)
class Preference:
    engine: str = "auto"  # auto or an engine a runtime offers
    runtime: str | None = None  # pin a runtime (llamacpp, ortgenai, coreml, executorch, …)
    device: str | None = None  # index or part of the device name


@dataclass(frozen=True)
class Skip:
    what: str  # e.g. "llamacpp/vulkan" or "llamacpp/vulkan llvmpipe"
    why: str
    # "absent": nothing of the kind on this host (not a fallback); "unusable": it is there
    # but cannot serve (driver fails, build lacks the backend) — a fallback the user must hear of.
    kind: str = "absent"
    rank: int = 0  # position of its engine in the preference order


@dataclass(frozen=True)
class Device:
    """A device a runtime's finder found for one of its engines."""

    name: str  # human-readable
    key: str = ""  # the runtime's own id: ggml "Vulkan0"/"CUDA0", ORT device id; "" for the CPU
    index: int | None = None
    lib_path: str = ""  # the folder of the runtime build that serves it; "" = the installed package's


Found = tuple[list[Device], list[Skip]]
Finder = Callable[[HostCapabilities, Preference], Found]


@dataclass(frozen=True)
class Offer:
    """An engine a runtime offers, and how to find its devices on a host."""

    engine: str  # what a user names with --engine: cpu, vulkan, cuda, metal, directml, coreml, …
    find: Finder
    # The artifact is bound to this engine (an ExecuTorch program is lowered for one delegate): the
    # candidate's format is `<format>:<variant>`.
    variant: str | None = None


class RuntimeOptions(BaseModel):
    """A runtime's own engine options (a descriptor's `options`): frozen, unknown keys refused.
    They travel in `EngineConfig.options`; an engine reads its own with `of`. (A plug-in may use
    any pydantic model with extra="forbid"; this base only adds `of`.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, config: EngineConfig) -> Self:
        """`config`'s options as this model: its defaults where the config carries none; options
        of another runtime are refused (ModelLoadError)."""
        o = config.options
        if o is None:
            return cls()
        if not isinstance(o, cls):
            raise ModelLoadError(f"this engine takes {cls.__name__}, but its configuration carries {type(o).__name__}")
        return o

    @classmethod
    def engine_config(cls, **values: Any) -> EngineConfig:
        """An EngineConfig from flat values: EngineConfig's own fields, the rest these options
        (validated: a key neither knows is refused). For tools, benchmarks and tests."""
        own = {f.name for f in dataclasses.fields(EngineConfig)} - {"options"}
        return EngineConfig(**{k: v for k, v in values.items() if k in own},
                            options=cls.model_validate({k: v for k, v in values.items() if k not in own}))


class NoOptions(RuntimeOptions):
    """A runtime without options of its own."""


# (reference label, candidate label, precision class) and the limits (ParityTolerance's fields).
Tolerance = tuple[tuple[str, str, str], Mapping[str, float]]

# A runtime against llama.cpp on the same weights, llama.cpp quantised (Q4_1) and the other
# dequantised to fp32: llama.cpp quantises activations to 8 bits in its dot products, the other
# computes in fp32. ORT GenAI on the CPU (6 prompts x 16 tokens): mean KL 0.005, max 0.084,
# top-1 0.948, perplexity 2.190 vs 2.195.
CROSS_RUNTIME_QUANT: Mapping[str, float] = {"max_mean_kl": 0.02, "max_kl": 0.5, "min_top1": 0.8, "max_ppl_ratio": 1.05}


# --- conversion: how `gateway convert` makes a runtime's format --------------------------------


class ConversionError(RuntimeError):
    """A conversion step failed or cannot run here; the message says why."""


@dataclass(frozen=True)
class ConvertJob:
    """One conversion: the model as a Hugging Face fp32 checkpoint (the gateway dequantises its
    GGUF) into an empty folder that becomes the artifact when `run` returns."""

    checkpoint: Path
    out: Path
    precision: str
    variant: str | None  # the one of `Converter.variants` it is built for (None: it has none)
    context_length: int
    show_output: bool  # let the child processes' own progress through to the terminal
    progress: Callable[[str], None]


@dataclass(frozen=True)
class Converter:
    """How `gateway convert --to <target>` makes the format a runtime serves."""

    target: str
    run: Callable[[ConvertJob], None]
    needs: tuple[str, ...] = ()  # Python modules it imports: a missing one is said before minutes of work
    install: str = ""  # what installs them
    precisions: tuple[str, ...] = ("fp32",)
    # Precisions it computes in instead of the one asked for: asked -> (used, why).
    substitutes: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # Artifacts built for one of these (ORT's execution providers, ExecuTorch's delegates; the first
    # is the default), chosen with `gateway convert --<variant_flag>`; () = one for every device.
    variants: tuple[str, ...] = ()
    variant_flag: str = ""
    variant_help: str = ""


def run_step(cmd: list[str], what: str, show_output: bool) -> None:
    """Run one conversion step in a child process, offline; ConversionError with its output's tail."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # everything is local; never reach for the hub
    if show_output:
        rc = subprocess.run(cmd, env=env, check=False).returncode
        tail = ""
    else:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        rc = proc.returncode
        tail = "\n" + "\n".join(proc.stdout.replace("\r", "\n").splitlines()[-15:])
    if rc != 0:
        raise ConversionError(f"{what} failed (exit {rc}){tail}")


def _unchanged(host: HostCapabilities) -> HostCapabilities:
    return host


def _one_way(config: EngineConfig, host: HostCapabilities, lib_path: str) -> list[EngineConfig]:
    return [config]


@dataclass(frozen=True)
class Runtime:
    """One runtime, as the gateway sees it."""

    name: str
    format: str  # the model format it serves: gguf, onnx, coreml, pte, …
    offers: tuple[Offer, ...]
    engine_module: str  # the module that registers its engine factory, imported when a model loads on it
    # Adds what the runtime finds on the host to `host` (the devices are already probed).
    probe: Callable[[HostCapabilities], HostCapabilities] = _unchanged
    # What of the host one process can use, when engines run in the gateway's own process rather
    # than in workers (llama.cpp: one build per process, so no builds beside the package).
    in_process: Callable[[HostCapabilities], HostCapabilities] = _unchanged
    # Its lines in `gateway devices`, and its part of `gateway devices --json` beside the host.
    report: Callable[[HostCapabilities], list[str]] = lambda host: []
    report_json: Callable[[HostCapabilities], dict[str, Any]] = lambda host: {}
    install: Mapping[str, str] = field(default_factory=dict)  # engine ("*": any) -> what installs it
    convert: Converter | None = None  # how `gateway convert` makes its format; None = models.yaml names the files
    options: type[BaseModel] = NoOptions  # its own engine options (extra="forbid")
    # Identity of the build serving a candidate (host, the candidate's lib_path): a functional
    # check's cached verdict holds for this build only.
    fingerprint: Callable[[HostCapabilities, str], str] | None = None
    # The ways to run a candidate, tried in order before the next candidate (its fallback ladder),
    # and how one rung reads in reasons and logs ("" where there is one way).
    ladder: Callable[[EngineConfig, HostCapabilities, str], list[EngineConfig]] = _one_way
    rung: Callable[[EngineConfig], str] = lambda config: ""
    # Environment a worker serving one of its candidates needs (from the candidate's lib_path).
    build_env: Callable[[str], dict[str, str]] = lambda lib_path: {}
    # Makes its native library usable in this process (tools that call it directly).
    prepare: Callable[[], None] = lambda: None
    memory_estimate: bool = False  # the gateway's GGUF memory estimate applies to its loads
    tolerances: tuple[Tolerance, ...] = ()

    def offer(self, engine: str) -> Offer | None:
        return next((o for o in self.offers if o.engine == engine), None)

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(o.engine for o in self.offers)

    def install_hint(self, engine: str) -> str:
        return (self.install.get(engine) or self.install.get("*", "")).format(engine=engine)

    def convert_hint(self, variant: str | None) -> str:
        """How to make the format it serves, for a plan's skip reason ("" when it is not converted)."""
        c = self.convert
        if c is None:
            return ""
        return f" (make it with `gateway convert --to {c.target} --{c.variant_flag} {variant}`)" if variant else \
            f" (make it with `gateway convert --to {c.target}`)"

    def parse_options(self, values: Mapping[str, Any]) -> BaseModel:
        """Its options from plain values; unknown keys are refused (pydantic.ValidationError)."""
        return self.options.model_validate(dict(values))

    def load_options(self, values: Mapping[str, Any]) -> BaseModel:
        """`parse_options`, its refusal a ModelLoadError that names each key it refuses."""
        try:
            return self.parse_options(values)
        except ValidationError as exc:
            raise ModelLoadError(options_error(self.name, self.options, exc)) from exc


def options_error(name: str, model: type[BaseModel], exc: ValidationError) -> str:
    """A refusal of runtime `name`'s options, key by key: "llamacpp: unknown option 'kv_unifed'
    (its options: ...)"."""
    parts = []
    for e in exc.errors():
        key = ".".join(str(p) for p in e["loc"])
        parts.append(f"unknown option {key!r}" if e["type"] == "extra_forbidden" else f"option {key!r}: {e['msg']}")
    return f"{name}: {'; '.join(parts)} (its options: {', '.join(model.model_fields) or 'none'})"


# --- options across a process boundary ----------------------------------------------------
#
# An EngineConfig crosses to a worker process (engines/worker/wire.py, msgpack) and to a
# functional check's child (JSON). Its options are a pydantic model, which neither encoding
# knows: they travel beside the config as plain values (`option_values`), the config itself with
# none, and the receiver validates them again with the runtime's own model (`with_option_values`),
# looked up by the runtime's name, which travels with them. The receiver thus gets the same typed
# model, and a key its runtime does not know (a gateway and a worker of different versions) is
# refused by name.


def option_values(config: EngineConfig) -> dict[str, Any] | None:
    """`config`'s options as plain values (JSON and msgpack types); None where it carries none."""
    return None if config.options is None else config.options.model_dump(mode="json")


def with_option_values(runtime_name: str, config: EngineConfig, values: Mapping[str, Any] | None) -> EngineConfig:
    """`config` carrying runtime `runtime_name`'s options validated from `values` (None: none);
    ModelLoadError when they do not validate, or the runtime has no descriptor to validate them."""
    if values is None:
        return replace(config, options=None)
    rt = runtime(runtime_name)
    if rt is None:
        raise ModelLoadError(f"options for runtime {runtime_name!r}, which is not registered here")
    return replace(config, options=rt.load_options(values))


_RUNTIMES: dict[str, Runtime] = {}
_SEQ = itertools.count()
_ORDER: dict[str, int] = {}


def register(rt: Runtime) -> Runtime:
    """Register `rt` (again: replaces the earlier one, keeping its place)."""
    _RUNTIMES[rt.name] = rt
    _ORDER.setdefault(rt.name, next(_SEQ))
    return rt


def unregister(name: str) -> None:
    _RUNTIMES.pop(name, None)
    _ORDER.pop(name, None)


def _load_builtins() -> None:
    for name, module in BUILTIN.items():
        if name not in _RUNTIMES:
            importlib.import_module(module)


def load_plugins(modules: Iterable[str]) -> None:
    """Import modules that register runtimes (the `plugins` setting)."""
    for module in modules:
        importlib.import_module(module)


def runtimes() -> tuple[Runtime, ...]:
    """Every registered runtime: the built-in ones in their order, then plug-ins as registered."""
    _load_builtins()
    builtin = list(BUILTIN)
    return tuple(sorted(_RUNTIMES.values(), key=lambda r: (builtin.index(r.name) if r.name in builtin else len(builtin),
                                                            _ORDER[r.name])))


def runtime(name: str) -> Runtime | None:
    if name not in _RUNTIMES:
        _load_builtins()
    return _RUNTIMES.get(name)


def in_one_process(host: HostCapabilities) -> HostCapabilities:
    """`host` as engines loaded in this one process can use it (settings.workers off)."""
    for rt in runtimes():
        host = rt.in_process(host)
    return host


def converters() -> dict[str, Converter]:
    """`gateway convert`'s targets, in the runtimes' order."""
    return {rt.convert.target: rt.convert for rt in runtimes() if rt.convert is not None}


def engine_order(rts: Iterable[Runtime] | None = None) -> tuple[str, ...]:
    """Every engine the runtimes offer, fastest first (`--engine auto`)."""
    offered = [e for r in (runtimes() if rts is None else rts) for e in r.engines]
    extra = [e for e in dict.fromkeys(offered) if e not in ENGINE_ORDER]
    known = [e for e in ENGINE_ORDER if e in offered or e == "cpu"]
    return tuple(known[:-1] + extra + known[-1:])


# --- helpers for finders -------------------------------------------------------------------

VULKAN_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}


def match_device(device: str | None, index: int, name: str) -> bool:
    """Whether the preference's device (an index or part of the name; None: any) names this one."""
    if device is None:
        return True
    if device.isdigit():  # an index, never a part of the name ("1" is in "H100")
        return int(device) == index
    return device.lower() in name.lower()


def vulkan_devices(host: HostCapabilities, pref: Preference, what: str) -> tuple[list[VulkanDevice], list[Skip]]:
    """The Vulkan devices a runtime may use, best first: the requested one, and a software
    (CPU-type) device only when Vulkan was asked for."""
    eligible, skips = [], []
    for dev in sorted(host.vulkan.devices, key=lambda d: (VULKAN_RANK.get(d.type, 9), d.index)):
        if not match_device(pref.device, dev.index, dev.name):
            skips.append(Skip(f"{what} {dev.name}", f"not the requested device {pref.device!r}"))
        elif dev.type == "cpu" and pref.engine == "auto" and pref.device is None:
            skips.append(Skip(f"{what} {dev.name}", "a software (CPU-type) Vulkan device is slower than "
                              "the CPU engine; use --engine vulkan to pick it anyway"))
        else:
            eligible.append(dev)
    return eligible, skips


def text_table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Rows as aligned columns, for `gateway devices`."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
