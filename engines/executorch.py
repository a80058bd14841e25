"""The ExecuTorch engine: a `.pte` program from `gateway convert --to executorch`, on XNNPACK (CPU)
or on the Vulkan delegate (`--delegate vulkan`, a GPU or lavapipe).

Serves the folder the conversion writes: `model.pte` (method `forward(tokens (1, q), input_pos (1,))
-> logits (1, q, vocab)`, its KV cache in mutable buffers that ExecuTorch plans with the rest of
the program's memory), the Hugging Face tokenizer and chat template, `executorch_config.json` and
`partition.json` (what the delegate took).

One sequence per loaded method: a method owns one KV cache, so `parallel` methods are loaded (each
its own planned memory, KV included) and each of the pool's `parallel` threads uses its own; more
requests wait in the pool's bounded queue, as with ORT GenAI. A method remembers the tokens its
cache holds, so a request that begins with the last one's tokens (a conversation's next turn)
prefills only the rest. Prompts are fed in chunks of the program's `max_seq` tokens. Sampling,
stop strings, resume after a failover and logits are those of every stateful KV-cache program
(engines/stateful.py, the CoreML engine's too), over this runtime's `_predict`.

XNNPACK programs run through the wheel's Python bindings (torch tensors in and out, the llama::
kernels of the exported KV cache registered by the wheel's custom-ops library). Vulkan programs run
through `libgateway_et_runner.so`, a small C runner over the wheel's `libexecutorch.so` built with
the Vulkan backend by scripts/install-executorch.sh: no torch in the worker (the bindings need the
exact torch the wheel was built with), and ctypes releases the GIL during a step, so the worker's
heartbeat goes on while a slow device computes. `ETVK_DEVICE_INDEX` picks the loader's device.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines import runtimes
from engines.base import Capabilities, EngineConfig, EngineInfo, ModelLoadError
from engines.bridge import WorkerPool
from engines.envconfig import knob
from engines.host import HostCapabilities, PlatformRuntime
from engines.registry import register_runtime
from engines.runtimes import (
    CROSS_RUNTIME_QUANT,
    ConvertJob,
    Device,
    Found,
    Offer,
    Preference,
    Skip,
    register,
    run_step,
    vulkan_devices,
)
from engines.stateful import StatefulEngine, eos_ids, load_tokenizer
from engines.template_files import template_source
from engines.tuning import EngineTuning

log = logging.getLogger(__name__)

DELEGATES = {"cpu": "xnnpack", "vulkan": "vulkan"}  # engine backend -> the delegate its program needs


def executorch_available() -> tuple[bool, str, tuple[str, ...]]:
    """Whether ExecuTorch programs can run here, why not, and the backends its runtime registered."""
    try:
        with warnings.catch_warnings():  # its own imports use deprecated importlib.resources calls
            warnings.simplefilter("ignore", DeprecationWarning)
            from executorch.extension.pybindings import portable_lib
    except ImportError:
        return False, "executorch is not installed: pip install -e '.[executorch]'", ()
    except Exception as exc:  # noqa: BLE001 - a broken runtime library is a reason, not a crash
        return False, f"the executorch runtime does not load: {exc}", ()
    names = tuple(portable_lib._get_registered_backend_names())
    return True, "", names


VULKAN_LIB_ENV = knob(EngineTuning, "executorch_vulkan_lib").env
_vulkan_lock = threading.Lock()


def _executorch_version() -> str:
    try:
        return importlib.metadata.version("executorch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def vulkan_backend_library() -> tuple[Path | None, str]:
    """The Vulkan backend built for the installed executorch (scripts/install-executorch.sh vulkan),
    or None and why.  $GATEWAY_EXECUTORCH_VULKAN_LIB names one explicitly."""
    named = EngineTuning.read("executorch_vulkan_lib")
    if named:
        p = Path(named)
        return (p, "") if p.is_file() else (None, f"{VULKAN_LIB_ENV}={named} does not exist")
    version = _executorch_version()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-gateway" / "executorch-vulkan"
    builds = []
    for meta in cache.glob("*/build.json"):
        try:
            built_for = json.loads(meta.read_text()).get("executorch_version")
        except (OSError, ValueError):
            continue
        lib = meta.parent / "libexecutorch_backend_vulkan.so"
        if built_for == version and lib.is_file() and (meta.parent / "libgateway_et_runner.so").is_file():
            builds.append((meta.stat().st_mtime, lib))
    if builds:
        return max(builds)[1], ""
    return None, (f"the executorch {version} wheel has no Vulkan backend and none is built for it: "
                  "scripts/install-executorch.sh vulkan builds it from the pinned ExecuTorch, volk and VMA "
                  "sources (fetched from GitHub, or local copies named by EXECUTORCH_GIT, VOLK_GIT and VMA_GIT; "
                  "docs/conversion.md)")


def _executorch_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


class _Native:
    """libgateway_et_runner.so through ctypes (scripts/executorch-vulkan/runner.cpp): the wheel's
    runtime without its pybindings, which need the exact torch the wheel was built with."""

    lib: Any = None

    @classmethod
    def load(cls, plugin: Path, device_index: int | None) -> Any:
        """The runner, with the Vulkan backend registered (once per process)."""
        if cls.lib is not None:
            return cls.lib
        runtime = _executorch_lib_dir()
        if runtime is None or not (runtime / "libexecutorch.so").is_file():
            raise ModelLoadError("executorch is not installed (or ships no libexecutorch.so): pip install -e '.[executorch]'")
        runner = plugin.parent / "libgateway_et_runner.so"
        if not runner.is_file():
            raise ModelLoadError(f"{runner} is missing: rebuild with scripts/install-executorch.sh vulkan")
        if device_index is not None:  # read by the backend when it first opens a device
            os.environ["ETVK_DEVICE_INDEX"] = str(device_index)
        try:
            # The wheel's runtime first, by path: the two libraries link it by name.
            ctypes.CDLL(str(runtime / "libexecutorch.so"), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(str(runner), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(plugin), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise ModelLoadError(f"the ExecuTorch Vulkan backend {plugin} does not load: {exc}") from exc
        lib.gw_et_load.restype = ctypes.c_void_p
        lib.gw_et_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.gw_et_forward.restype = ctypes.c_long
        lib.gw_et_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_long, ctypes.c_int64,
                                      ctypes.POINTER(ctypes.c_float), ctypes.c_long, ctypes.c_char_p, ctypes.c_size_t]
        lib.gw_et_free.argtypes = [ctypes.c_void_p]
        lib.gw_et_has_backend.argtypes = [ctypes.c_char_p]
        if not lib.gw_et_has_backend(b"VulkanBackend"):
            raise ModelLoadError(f"{plugin} loaded but registered no VulkanBackend (built for another executorch?)")
        cls.lib = lib
        return lib


def load_vulkan_backend(device_index: int | None = None) -> Any:
    """The torch-free runner with the Vulkan backend registered, on the Vulkan device of that
    loader index.  Raises ModelLoadError with the reason."""
    with _vulkan_lock:
        plugin, why = vulkan_backend_library()
        if plugin is None:
            raise ModelLoadError(why)
        return _Native.load(plugin, device_index)


class _NativeMethod:
    """One loaded method of a program, through the runner."""

    def __init__(self, lib: Any, path: str, method: str, vocab: int, max_seq: int) -> None:
        self._lib = lib
        self._err = ctypes.create_string_buffer(1024)
        self._handle = lib.gw_et_load(path.encode(), method.encode(), self._err, len(self._err))
        if not self._handle:
            raise RuntimeError(self._err.value.decode(errors="replace"))
        self._out = np.empty(max_seq * vocab, dtype=np.float32)
        self._vocab = vocab

    def forward(self, ids: list[int], pos: int) -> npt.NDArray[np.float32]:
        tokens = np.asarray(ids, dtype=np.int64)
        n = self._lib.gw_et_forward(self._handle, tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(ids), pos,
                                    self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), self._out.size,
                                    self._err, len(self._err))
        if n < 0:
            raise RuntimeError(f"ExecuTorch: {self._err.value.decode(errors='replace')}")
        return self._out[:n].reshape(len(ids), self._vocab).copy()

    def close(self) -> None:
        if self._handle:
            self._lib.gw_et_free(self._handle)
            self._handle = None


class _NativeProgram:
    def __init__(self, lib: Any, path: str, vocab: int, max_seq: int) -> None:
        self._args = (lib, path)
        self._vocab, self._max_seq = vocab, max_seq

    def load_method(self, name: str) -> _NativeMethod:
        return _NativeMethod(*self._args, name, self._vocab, self._max_seq)


class _PybindMethod:
    """A method loaded through the wheel's pybindings (torch tensors in and out)."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def forward(self, ids: list[int], pos: int) -> npt.NDArray[np.float32]:
        import torch

        out = self._method.execute([torch.tensor([ids], dtype=torch.int64), torch.tensor([pos], dtype=torch.int64)])
        return out[0][0].float().numpy()  # type: ignore[no-any-return]

    def close(self) -> None:
        self._method = None


class _PybindProgram:
    def __init__(self, program: Any) -> None:
        self._program = program

    def load_method(self, name: str) -> _PybindMethod:
        return _PybindMethod(self._program.load_method(name))


class _Slot:
    """One loaded method (one KV cache) and the tokens its cache holds."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.tokens: list[int] = []


class ExecuTorchEngine(StatefulEngine):
    """An exported ExecuTorch LLM program; `loader` (path -> program with load_method) is for tests."""

    def __init__(self, options: EngineConfig, loader: Any = None) -> None:
        self.options = options
        self.info = EngineInfo(
            runtime="executorch", backend=options.backend, device=options.device,
            context_length=options.context_length, parallel=options.parallel,
            extra={"delegate": DELEGATES.get(options.backend, options.backend)},
        )
        self._program_loader: Callable[[str], Any] | None = loader
        self._tokenizer: Any = None
        self._pool: WorkerPool | None = None
        self._eos: frozenset[int] = frozenset()
        self._n_ctx = options.context_length
        self._program: Any = None
        self._local = threading.local()
        self._slots: list[_Slot] = []  # not yet taken by a pool thread
        self._methods: list[Any] = []  # every loaded method, to free on close
        self._slots_lock = threading.Lock()
        self._max_seq = 1

    def _load_blocking(self) -> None:
        o = self.options
        d = Path(o.model_path)
        if not (d / "executorch_config.json").is_file() or not (d / "model.pte").is_file():
            raise ModelLoadError(f"{d} is not a converted ExecuTorch model folder; create one with "
                                 "`gateway convert MODEL --to executorch`")
        meta = json.loads((d / "executorch_config.json").read_text())
        want = DELEGATES.get(o.backend, o.backend)
        if meta.get("delegate") != want:
            raise ModelLoadError(f"{d} holds a {meta.get('delegate')} program; the {o.backend} engine needs {want}")
        loader = self._program_loader
        if loader is None and want == "vulkan":
            # Vulkan programs run through the torch-free runner (a worker without torch).
            lib = load_vulkan_backend(int(o.device_key) if o.device_key.isdigit() else None)
            vocab, max_seq = int(meta["vocab_size"]), max(1, int(meta.get("max_seq", 1)))

            def loader(path: str) -> Any:
                return _NativeProgram(lib, path, vocab, max_seq)
        elif loader is None:
            ok, reason, backends = executorch_available()
            if not ok:
                raise ModelLoadError(reason)
            backend_name = {"xnnpack": "XnnpackBackend"}.get(want)
            if backend_name and backend_name not in backends:
                raise ModelLoadError(f"this executorch runtime has no {backend_name} (it has {', '.join(backends)})")
            loader = _load_program
        self._tokenizer = load_tokenizer(d, "ExecuTorch", "executorch")
        self._eos = frozenset(eos_ids(d))
        self._n_ctx = min(o.context_length, int(meta["context_length"]))
        self._max_seq = int(meta.get("max_seq", 1))
        try:
            self._program = loader(str(d / "model.pte"))
            self._methods = [self._program.load_method(meta.get("method", "forward")) for _ in range(max(1, o.parallel))]
            self._slots = [_Slot(m) for m in self._methods]
        except Exception as exc:
            raise ModelLoadError(f"ExecuTorch could not load {d}: {exc}") from exc
        self._pool = WorkerPool(o.parallel, o.max_queue, name="executorch")
        partition = d / "partition.json"
        report = json.loads(partition.read_text()) if partition.is_file() else {}
        version = _executorch_version()
        self.info = replace(self.info, context_length=self._n_ctx, version=version,
                            template=template_source(d, o.chat_template), capabilities=Capabilities(resume=True), extra={
                                **self.info.extra, "max_seq": str(self._max_seq),
                                "delegated_share": str(report.get("delegated_share", ""))})
        log.info("ExecuTorch loaded %s: delegate=%s ctx=%d methods=%d", d, want, self._n_ctx, o.parallel)

    def _release(self) -> None:
        for method in self._methods:  # the pool's threads have stopped: no step is running
            method.close()
        self._methods, self._slots = [], []
        self._program = None

    def _new_state(self) -> _Slot:
        """This thread's own method (the step loop and logits feed it from position 0)."""
        slot: _Slot | None = getattr(self._local, "slot", None)
        if slot is None:
            with self._slots_lock:
                slot = self._slots.pop()
            self._local.slot = slot
        return slot

    def _predict(self, ids: list[int], end: int, state: Any) -> npt.NDArray[np.float32]:
        """Feed `ids` (positions end-len(ids) .. end-1) into this thread's method; their logits.

        A method's cache keeps what it was fed: positions before `end - len(ids)` must be what the
        last calls put there (the step loop feeds a request's tokens in order from 0)."""
        slot: _Slot = state
        start = end - len(ids)
        rows: list[npt.NDArray[np.float32]] = []
        for i in range(0, len(ids), self._max_seq):
            rows.append(slot.method.forward(ids[i:i + self._max_seq], start + i))
        del slot.tokens[start:]
        slot.tokens.extend(ids)
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def _prefill(self, prompt: list[int], state: Any) -> npt.NDArray[np.float32]:
        """The prompt's last logits, reusing the longest prefix this method's cache already holds."""
        slot: _Slot = state
        keep = 0
        for a, b in zip(slot.tokens, prompt[:-1], strict=False):  # at least one token is fed: its logits
            if a != b:
                break
            keep += 1
        return self._predict(prompt[keep:], len(prompt), slot)


def _load_program(path: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # The kernels of llama::update_cache and llama::custom_sdpa (the exported KV cache) are
        # registered by loading the package's custom-ops library.
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
        from executorch.runtime import Runtime

    return _PybindProgram(Runtime.get().load_program(path))


@register_runtime("executorch")
def create_executorch(options: EngineConfig) -> ExecuTorchEngine:
    return ExecuTorchEngine(options)


# --- the runtime descriptor ----------------------------------------------------------------


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
    lib, why = vulkan_backend_library()
    if lib is None:
        return PlatformRuntime(False, why)
    return PlatformRuntime(True, "", f"ExecuTorch Vulkan backend ({lib})")


@dataclass(frozen=True)
class ExecuTorchFound:
    """What the ExecuTorch probe finds on a host (its entry in `HostCapabilities.runtimes`)."""

    runtime: PlatformRuntime = field(default_factory=lambda: PlatformRuntime(False, "ExecuTorch was not probed"))
    # Its Vulkan backend, a plug-in built for the installed wheel (scripts/install-executorch.sh).
    vulkan: PlatformRuntime = field(default_factory=lambda: PlatformRuntime(False, "ExecuTorch was not probed"))


def found(host: HostCapabilities) -> ExecuTorchFound:
    return host.found("executorch", ExecuTorchFound)


def _probe(host: HostCapabilities) -> HostCapabilities:
    et = probe_executorch()
    return host.with_found("executorch", ExecuTorchFound(et, probe_executorch_vulkan(et)))


def _report(host: HostCapabilities) -> list[str]:
    f = found(host)
    et, et_vk = f.runtime, f.vulkan
    lines = [f"ExecuTorch {'available: ' + et.detail if et.available else et.reason}"]
    if et.available:
        lines.append(f"  Vulkan   {'available: ' + et_vk.detail if et_vk.available else et_vk.reason}")
    return lines


def _find_cpu(host: HostCapabilities, pref: Preference) -> Found:
    et = found(host).runtime
    if not et.available:
        return [], [Skip("executorch/cpu", et.reason)]
    return [Device("cpu")], []


def _find_vulkan(host: HostCapabilities, pref: Preference) -> Found:
    """Each Vulkan device, best first; the engine opens it by index (ETVK_DEVICE_INDEX)."""
    f = found(host)
    if not f.runtime.available:
        return [], [Skip("executorch/vulkan", f.runtime.reason)]
    if not f.vulkan.available:
        return [], [Skip("executorch/vulkan", f.vulkan.reason)]
    if not host.vulkan.devices:
        return [], [Skip("executorch/vulkan", host.vulkan.reason or "no Vulkan device", "absent")]
    eligible, skips = vulkan_devices(host, pref, "executorch/vulkan")
    return [Device(dev.name, str(dev.index), dev.index) for dev in eligible], skips


# ExecuTorch/XNNPACK on the fp32 export of the same weights as llama.cpp's Q4_1: built-in prompts x
# 16 tokens, mean KL 0.0043, max 0.040, top-1 0.948, perplexity 2.215 vs 2.213 (docs/parity.md) - as
# ORT. Its Vulkan delegate computes the fp32 export in fp32 (its logits within 1.3e-4 of
# transformers and of XNNPACK). Against llama.cpp's Vulkan build: on lavapipe (2 prompts x 12
# tokens) mean KL 0.0028, max 0.010, top-1 0.958 (one prompt 0.917); on the H100 (6 prompts x 32)
# mean KL 0.0011, max 0.011, top-1 0.979 (worst prompt 0.938), perplexity 2.082 vs 2.078 - inside
# the cross-runtime row with 4x room in KL. Against llama.cpp CPU (lavapipe, 2 prompts x 12): mean
# KL 0.0036, max 0.015, top-1 0.917.
def _to_pte(job: ConvertJob) -> None:
    delegate = job.variant or "xnnpack"
    job.progress(f"[2/2] Hugging Face -> ExecuTorch program (fp32, static KV cache, {delegate}) ...")
    run_step([sys.executable, "-m", "engines.export.executorch", str(job.checkpoint), str(job.out), delegate,
              str(job.context_length)], "ExecuTorch export", job.show_output)
    report = json.loads((job.out / "partition.json").read_text())
    job.progress(f"partition ({delegate}): {report['delegated_ops']} operators delegated in "
                 f"{report['delegate_calls']} call(s) ({report['delegated_share']:.0%}); on portable CPU "
                 f"kernels: {', '.join(f'{k} x{v}' for k, v in report['fallback'].items()) or 'none'}")


_PAIRS = (("llamacpp/cpu", "executorch/cpu"), ("llamacpp/vulkan", "executorch/vulkan"),
          ("llamacpp/cpu", "executorch/vulkan"))

RUNTIME = register(runtimes.Runtime(
    name="executorch",
    format="pte",
    offers=(Offer("cpu", _find_cpu, variant=DELEGATES["cpu"]), Offer("vulkan", _find_vulkan, variant=DELEGATES["vulkan"])),
    engine_module="engines.executorch",
    probe=_probe,
    report=_report,
    install={"*": "pip install -e '.[executorch]'", "vulkan": "scripts/install-executorch.sh vulkan"},
    convert=runtimes.Converter(
        "executorch", _to_pte, needs=("executorch",), install="pip install -e '.[convert,executorch]'",
        variants=tuple(DELEGATES.values()), variant_flag="delegate",
        variant_help="ExecuTorch: the backend the program is lowered to"),
    tolerances=tuple(((a, b, "quant"), CROSS_RUNTIME_QUANT) for pair in _PAIRS for a, b in (pair, pair[::-1])),
))
