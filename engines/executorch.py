"""The ExecuTorch engine: a `.pte` program from `gateway convert --to executorch`, on XNNPACK (CPU).

Serves the folder the conversion writes: `model.pte` (method `forward(tokens (1, q), input_pos (1,))
-> logits (1, q, vocab)`, its KV cache in mutable buffers that ExecuTorch plans with the rest of
the program's memory), the Hugging Face tokenizer and chat template, `executorch_config.json` and
`partition.json` (what the delegate took).

One sequence per loaded method: a method owns one KV cache, so `parallel` methods are loaded (each
its own planned memory, KV included) and each of the pool's `parallel` threads uses its own; more
requests wait in the pool's bounded queue, as with ORT GenAI. A method remembers the tokens its
cache holds, so a request that begins with the last one's tokens (a conversation's next turn)
prefills only the rest. Prompts are fed in chunks of the program's `max_seq` tokens. Sampling,
stop strings, resume after a failover and logits are the CoreML engine's (the same step loop over
a different `_predict`).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import EngineConfig, ModelLoadError
from engines.bridge import WorkerPool
from engines.chat import ChatTemplate
from engines.coreml import CoreMLEngine, _eos_ids
from engines.registry import register_runtime

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


VULKAN_LIB_ENV = "GATEWAY_EXECUTORCH_VULKAN_LIB"
_vulkan_lock = threading.Lock()


def _executorch_version() -> str:
    try:
        return importlib.metadata.version("executorch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def vulkan_backend_library() -> tuple[Path | None, str]:
    """The Vulkan backend built for the installed executorch (scripts/install-executorch.sh vulkan),
    or None and why.  $GATEWAY_EXECUTORCH_VULKAN_LIB names one explicitly."""
    named = os.environ.get(VULKAN_LIB_ENV)
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
        if built_for == version and lib.is_file():
            builds.append((meta.stat().st_mtime, lib))
    if builds:
        return max(builds)[1], ""
    return None, (f"the executorch {version} wheel has no Vulkan backend and none is built for it: "
                  "scripts/install-executorch.sh vulkan")


def load_vulkan_backend(device_index: int | None = None) -> None:
    """Register the Vulkan backend with this process's executorch runtime (once), on the Vulkan
    device of that loader index.  Raises ModelLoadError with the reason."""
    with _vulkan_lock:
        ok, reason, backends = executorch_available()
        if not ok:
            raise ModelLoadError(reason)
        if "VulkanBackend" in backends:
            return
        lib, why = vulkan_backend_library()
        if lib is None:
            raise ModelLoadError(why)
        if device_index is not None:  # read by the backend when it first opens a device
            os.environ["ETVK_DEVICE_INDEX"] = str(device_index)
        try:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise ModelLoadError(f"the ExecuTorch Vulkan backend {lib} does not load: {exc}") from exc
        if "VulkanBackend" not in executorch_available()[2]:
            raise ModelLoadError(f"{lib} loaded but registered no VulkanBackend (built for another executorch?)")


class _Slot:
    """One loaded method (one KV cache) and the tokens its cache holds."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.tokens: list[int] = []


class ExecuTorchEngine(CoreMLEngine):
    """An exported ExecuTorch LLM program; `loader` (path -> program with load_method) is for tests."""

    def __init__(self, options: EngineConfig, loader: Any = None) -> None:
        super().__init__(options)
        self._program_loader: Callable[[str], Any] | None = loader
        delegate = DELEGATES.get(options.backend, options.backend)
        self.info = replace(self.info, runtime="executorch", backend=options.backend,
                            extra={"delegate": delegate})
        self._program: Any = None
        self._local = threading.local()
        self._slots: list[_Slot] = []
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
        if loader is None:
            ok, reason, backends = executorch_available()
            if not ok:
                raise ModelLoadError(reason)
            if want == "vulkan":
                load_vulkan_backend(int(o.device_key) if o.device_key.isdigit() else None)
                backends = executorch_available()[2]
            backend_name = {"xnnpack": "XnnpackBackend", "vulkan": "VulkanBackend"}.get(want)
            if backend_name and backend_name not in backends:
                raise ModelLoadError(f"this executorch runtime has no {backend_name} (it has {', '.join(backends)})")
            loader = _load_program
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ModelLoadError("the ExecuTorch engine needs tokenizers: pip install -e '.[executorch]'") from exc
        self._tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self._template = ChatTemplate.from_model_dir(d, o.chat_template)
        self._eos = frozenset(_eos_ids(d))
        self._n_ctx = min(o.context_length, int(meta["context_length"]))
        self._max_seq = int(meta.get("max_seq", 1))
        try:
            self._program = loader(str(d / "model.pte"))
            self._slots = [_Slot(self._program.load_method(meta.get("method", "forward"))) for _ in range(max(1, o.parallel))]
        except Exception as exc:
            raise ModelLoadError(f"ExecuTorch could not load {d}: {exc}") from exc
        self._pool = WorkerPool(o.parallel, o.max_queue, name="executorch")
        partition = d / "partition.json"
        report = json.loads(partition.read_text()) if partition.is_file() else {}
        version = _executorch_version()
        self.info = replace(self.info, context_length=self._n_ctx, version=version, extra={
            **self.info.extra, "resume": "1", "max_seq": str(self._max_seq),
            "delegated_share": str(report.get("delegated_share", "")),
            **(self._template.traits() if self._template else {})})
        log.info("ExecuTorch loaded %s: delegate=%s ctx=%d methods=%d", d, want, self._n_ctx, o.parallel)

    async def close(self) -> None:
        await super().close()
        self._slots = []
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
        import torch

        slot: _Slot = state
        start = end - len(ids)
        rows: list[npt.NDArray[np.float32]] = []
        for i in range(0, len(ids), self._max_seq):
            chunk = ids[i:i + self._max_seq]
            out = slot.method.execute([torch.tensor([chunk], dtype=torch.int64),
                                       torch.tensor([start + i], dtype=torch.int64)])
            rows.append(out[0][0].float().numpy())
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

    return Runtime.get().load_program(path)


@register_runtime("executorch")
def create_executorch(options: EngineConfig) -> ExecuTorchEngine:
    return ExecuTorchEngine(options)
