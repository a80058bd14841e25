"""The CoreML engine (`coremltools`, macOS 15+): a stateful KV-cache ML program on ANE/GPU/CPU.

Serves the folder `gateway convert --to coreml` writes: `model.mlpackage` (inputs `input_ids`
and `causal_mask`, states `keyCache`/`valueCache`, output `logits`), the Hugging Face tokenizer
and chat template, and `coreml_config.json`.  Each request gets its own state: the prompt is
prefilled in one prediction, then one token per prediction.  Sampling is done in numpy
(engines/stateful.py).
Prediction needs macOS, so on any other host `load()` raises ModelLoadError with the reason;
this path is unverified until run on a Mac.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from engines.attention import causal_mask
from engines.base import Capabilities, EngineConfig, EngineInfo, ModelLoadError
from engines.bridge import WorkerPool
from engines.host import HostCapabilities, PlatformRuntime
from engines.registry import register_runtime
from engines.runtimes import (
    Converter,
    ConvertJob,
    Device,
    Found,
    Offer,
    Preference,
    Runtime,
    RuntimeOptions,
    Skip,
    register,
    run_step,
)
from engines.stateful import StatefulEngine, eos_ids, load_tokenizer
from engines.template_files import template_source

log = logging.getLogger(__name__)

COMPUTE_UNITS = ("ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY")
# (path, compute_units) -> an object with MLModel's predict(inputs, state=...) and make_state().
ModelLoader = Callable[[str, str], Any]


def coreml_available() -> tuple[bool, str]:
    """Whether CoreML models can run here, and if not, why (for the host probe)."""
    if sys.platform != "darwin":
        return False, f"CoreML prediction needs macOS; this host is {platform.system()} (coremltools cannot run models here)"
    release = platform.mac_ver()[0]
    if release and int(release.split(".")[0]) < 15:
        return False, f"stateful CoreML models need macOS 15 or later; this is macOS {release}"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return False, "coremltools is not installed: pip install -e '.[coreml]'"
    return True, ""


def _load_mlmodel(path: str, compute_units: str) -> Any:
    import coremltools as ct

    return ct.models.MLModel(path, compute_units=getattr(ct.ComputeUnit, compute_units))


class CoreMLEngine(StatefulEngine):
    """A converted stateful CoreML model; `loader` is replaced in tests by a fake predictor."""

    def __init__(self, options: EngineConfig, loader: ModelLoader | None = None) -> None:
        self.options = options
        self.coreml_options = CoreMLOptions.of(options)
        self.info = EngineInfo(
            runtime="coreml", backend="coreml", device=options.device,
            context_length=options.context_length, parallel=options.parallel,
            extra={"compute_units": self.coreml_options.compute_units},
        )
        self._loader = loader
        self._model: Any = None
        self._tokenizer: Any = None
        self._pool: WorkerPool | None = None
        self._eos: frozenset[int] = frozenset()
        self._n_ctx = options.context_length

    # --- lifecycle -----------------------------------------------------------------------

    def _load_blocking(self) -> None:
        o = self.options
        co = self.coreml_options
        loader = self._loader
        if loader is None:
            ok, reason = coreml_available()
            if not ok:
                raise ModelLoadError(reason)
            loader = _load_mlmodel
        if co.compute_units not in COMPUTE_UNITS:
            raise ModelLoadError(f"unknown compute units {co.compute_units!r}; one of {', '.join(COMPUTE_UNITS)}")
        d = Path(o.model_path)
        if not (d / "coreml_config.json").is_file() or not (d / "tokenizer.json").is_file():
            raise ModelLoadError(f"{d} is not a converted CoreML model folder; create one with `gateway convert --to coreml`")
        self._tokenizer = load_tokenizer(d, "CoreML", "coreml")
        meta = json.loads((d / "coreml_config.json").read_text())
        self._eos = frozenset(eos_ids(d))
        self._n_ctx = min(o.context_length, int(meta.get("context_length", o.context_length)))
        try:
            self._model = loader(str(d / "model.mlpackage"), co.compute_units)
        except Exception as exc:
            raise ModelLoadError(f"CoreML could not load {d}: {exc}") from exc
        self._pool = WorkerPool(o.parallel, o.max_queue, name="coreml")
        self.info = replace(self.info, context_length=self._n_ctx, template=template_source(d, o.chat_template),
                            capabilities=Capabilities(resume=True))
        log.info("CoreML loaded %s: compute_units=%s ctx=%d", d, co.compute_units, self._n_ctx)

    def _release(self) -> None:
        self._model = None

    # --- generation ------------------------------------------------------------------------

    def _predict(self, ids: list[int], end: int, state: Any) -> npt.NDArray[np.float32]:
        """Feed `ids` (positions end-len(ids) .. end-1); logits for each, shape (len(ids), vocab)."""
        out = self._model.predict(
            {"input_ids": np.asarray([ids], dtype=np.int32), "causal_mask": causal_mask(len(ids), end)}, state=state
        )
        logits: npt.NDArray[np.float32] = np.asarray(out["logits"], dtype=np.float32)[0]
        return logits

    def _new_state(self) -> Any:
        """A request's model state (its KV cache)."""
        return self._model.make_state()

@register_runtime("coreml")
def create_coreml(options: EngineConfig) -> CoreMLEngine:
    return CoreMLEngine(options)


# --- the runtime descriptor ----------------------------------------------------------------


class CoreMLOptions(RuntimeOptions):
    """CoreML's own engine options (EngineConfig.options of its engines)."""

    compute_units: Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = "ALL"  # where the model may run


def probe_coreml() -> PlatformRuntime:
    ok, why = coreml_available()
    if not ok:
        return PlatformRuntime(False, why)
    silicon = platform.machine() == "arm64"
    return PlatformRuntime(True, "", "Apple silicon with Neural Engine" if silicon else "Intel Mac (no Neural Engine)")


def _find(host: HostCapabilities, pref: Preference) -> Found:
    rt = host.runtime("coreml")
    if not rt.available:
        return [], [Skip("coreml/coreml", rt.reason)]
    return [Device(rt.detail or "Apple Neural Engine", "ALL")], []


def _report(host: HostCapabilities) -> list[str]:
    rt = host.runtime("coreml")
    return [f"{'CoreML':<9} {'available: ' + rt.detail if rt.available else rt.reason}"]


def _to_coreml(job: ConvertJob) -> None:
    job.progress(f"[2/2] Hugging Face -> CoreML ML program ({job.precision}, stateful KV cache) ...")
    run_step([sys.executable, "-m", "engines.export.coreml", str(job.checkpoint), str(job.out), job.precision,
              str(job.context_length)], "CoreML conversion", job.show_output)


RUNTIME = register(Runtime(
    name="coreml",
    format="coreml",
    offers=(Offer("coreml", _find),),
    engine_module="engines.coreml",
    probe=lambda host: host.with_found("coreml", probe_coreml()),
    report=_report,
    install={"*": "pip install coremltools (on macOS)"},
    convert=Converter(
        "coreml", _to_coreml, needs=("coremltools",), install="pip install -e '.[convert]'",
        precisions=("fp32", "fp16", "int4"),
        substitutes={"fp32": ("fp16", "ML programs run fp16 on the GPU / Neural Engine")}),
    options=CoreMLOptions,
))
