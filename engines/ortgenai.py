"""The ONNX Runtime GenAI engine (`onnxruntime-genai`): CPU, CUDA and DirectML providers.

Serves an ORT GenAI model folder (`genai_config.json` + ONNX + tokenizer, as written by
`gateway convert --to onnx`).  Each request runs its own `og.Generator` on a worker thread of a
bounded pool; the model (one ONNX Runtime session) is shared, since sessions are thread-safe.
Sampling is ORT GenAI's own search (greedy, or top-k/top-p/temperature with a seed); logprobs
come from the raw logits of each step.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import platform
import random
import re
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    Capabilities,
    Constraint,
    ContextLengthExceeded,
    EngineConfig,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    InvalidGenerationRequest,
    ModelLoadError,
    SamplingParams,
    TokenEvent,
    token_prompt,
)
from engines.bridge import EventChannel, Job, WorkerPool, call_job, pool_health
from engines.export.onnx import convert as export_onnx
from engines.host import HostCapabilities, PlatformRuntime, run_child
from engines.registry import register_runtime
from engines.runtimes import (
    CROSS_RUNTIME_QUANT,
    Converter,
    Device,
    Finder,
    Found,
    Offer,
    Preference,
    Runtime,
    Skip,
    match_device,
    register,
    text_table,
)
from engines.steps import StepPlan, run_steps, step_plan, stream_steps
from engines.template_files import template_source

log = logging.getLogger(__name__)

# backend -> (ORT GenAI provider name, the pip package that has it, availability probe name,
# the provider option that picks the device: CUDA's device id, DirectML's adapter index)
PROVIDERS: dict[str, tuple[str, str, str, str]] = {
    "cuda": ("cuda", "onnxruntime-genai-cuda", "is_cuda_available", "device_id"),
    "directml": ("dml", "onnxruntime-genai-directml", "is_dml_available", "device_index"),
}


def ortgenai_version() -> str:
    try:
        import onnxruntime_genai as og

        return str(og.__version__)
    except Exception:  # noqa: BLE001 - absence is reported, not raised
        return ""


def device_id(options: EngineConfig) -> int:
    """The GPU index: the selector's `device_key` ("1"), else a trailing number in `device`
    ("cuda:1"), else `main_gpu`."""
    if options.device_key.isdigit():
        return int(options.device_key)
    m = re.search(r":(\d+)$", options.device)
    return int(m.group(1)) if m else options.main_gpu


def configure_providers(config: Any, og: Any, options: EngineConfig) -> None:
    """Point an `og.Config` at the execution provider for `options.backend`.

    Raises ModelLoadError naming the package to install when the installed onnxruntime-genai
    was not built with that provider.
    """
    backend = options.backend
    config.clear_providers()  # the model's genai_config may name a provider; CPU is the default
    if backend == "cpu":
        return
    if backend not in PROVIDERS:
        raise ModelLoadError(
            f"onnxruntime-genai has no {backend!r} backend here; use one of: cpu, {', '.join(PROVIDERS)}"
        )
    name, package, probe, device_option = PROVIDERS[backend]
    if not getattr(og, probe)():
        raise ModelLoadError(_missing_provider(backend, package))
    config.append_provider(name)
    config.set_provider_option(name, device_option, str(device_id(options)))


def _missing_provider(backend: str, package: str) -> str:
    return (
        f"the installed onnxruntime-genai has no {backend} execution provider; "
        f"pip install {package} (in place of onnxruntime-genai, which has the same import name)"
    )


class OrtGenAIEngine:
    """An ORT GenAI model folder served on one execution provider."""

    def __init__(self, options: EngineConfig) -> None:
        self.options = options
        self.info = EngineInfo(
            runtime="ortgenai",
            backend=options.backend,
            device=options.device,
            version=ortgenai_version(),
            context_length=options.context_length,
            parallel=options.parallel,
        )
        self._og: Any = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._pool: WorkerPool | None = None
        self._eos: frozenset[int] = frozenset()
        self._n_ctx = options.context_length
        self._n_vocab = 0
        self._pieces: dict[int, bytes] = {}

    # --- lifecycle -----------------------------------------------------------------------

    async def load(self) -> None:
        await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> None:
        try:
            import onnxruntime_genai as og
        except ImportError as exc:
            raise ModelLoadError(
                f"onnxruntime-genai is not installed ({exc}); pip install onnxruntime-genai "
                "(or onnxruntime-genai-cuda / onnxruntime-genai-directml for a GPU)"
            ) from exc
        o = self.options
        cfg_path = os.path.join(o.model_path, "genai_config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(
                f"{o.model_path} is not an ORT GenAI model folder (no genai_config.json); "
                "create one with `gateway convert --to onnx`"
            )
        with open(cfg_path) as f:
            genai_cfg = json.load(f)
        config = og.Config(o.model_path)
        configure_providers(config, og, o)
        if o.n_threads > 0:
            config.overlay(json.dumps(
                {"model": {"decoder": {"session_options": {"intra_op_num_threads": o.n_threads}}}}
            ))
        try:
            self._model = og.Model(config)
        except Exception as exc:
            hint = f" ({_missing_provider(o.backend, PROVIDERS[o.backend][1])}?)" if o.backend in PROVIDERS else ""
            raise ModelLoadError(f"onnxruntime-genai could not load {o.model_path} on {o.device}: {exc}{hint}") from exc
        self._og = og
        self._tokenizer = og.Tokenizer(self._model)
        self._check_tokenizer()
        model_cfg = genai_cfg.get("model", {})
        self._n_vocab = int(model_cfg.get("vocab_size", 0))
        trained = int(model_cfg.get("context_length", 0))
        self._n_ctx = min(o.context_length, trained) if trained > 0 else o.context_length
        self._eos = frozenset(int(t) for t in self._tokenizer.eos_token_ids)
        self._pool = WorkerPool(o.parallel, o.max_queue, name="ortgenai")
        # Constraints through ORT GenAI's guidance (llguidance): JSON schemas, and tagged items as a
        # Lark grammar around them; not GBNF, and not lazily (no trigger words).
        self.info = replace(self.info, context_length=self._n_ctx,
                            template=template_source(o.model_path, o.chat_template),
                            capabilities=Capabilities(resume=True, constraints=frozenset({"json", "tagged"})))
        log.info(
            "ORT GenAI loaded %s: backend=%s device=%s ctx=%d parallel=%d vocab=%d",
            o.model_path, o.backend, o.device, self._n_ctx, o.parallel, self._n_vocab,
        )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.close)
        self._tokenizer = None
        self._model = None

    def health(self) -> EngineHealth:
        return pool_health(self._pool)

    # --- text ------------------------------------------------------------------------------

    def _check_tokenizer(self) -> None:
        """A tokenizer that cannot round-trip text would serve garbage that every other check
        passes (one token comes out, logits agree between providers): refuse it at load."""
        probe = "Hello, world!\nThe capital of France is Paris."
        back = self._tokenizer.decode(self._tokenizer.encode(probe))
        if back.strip() != probe:
            raise ModelLoadError(
                f"the tokenizer in {self.options.model_path} does not round-trip text ({probe!r} came back as "
                f"{back!r}); convert the model again with `gateway convert --force`"
            )

    async def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise ModelLoadError("model is not loaded")
        return [int(t) for t in self._tokenizer.encode(text)]

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._tokenizer.decode([token]).encode("utf-8")
        return cached

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (a BOS the chat template wrote is not doubled)."""
        if request.prompt_ids:
            return token_prompt(request.prompt_ids, self._n_vocab)
        ids = self.encode(request.prompt or "")
        bos = self._tokenizer.bos_token_id
        if request.templated and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    # --- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        _check_supported(request.sampling)
        plan = step_plan(request, self.prompt_tokens(request), self._n_ctx)
        async for item in stream_steps(pool, plan, self.logits, self.piece, self._generate_blocking):
            yield item

    def search_options(self, sp: SamplingParams, prompt_len: int, max_new: int) -> dict[str, Any]:
        """ORT GenAI search options for one request (greedy when temperature is 0)."""
        total = prompt_len + max_new
        opts: dict[str, Any] = {"max_length": total, "batch_size": 1}
        if sp.ignore_eos:
            opts["min_length"] = total  # ORT GenAI masks EOS until min_length
        if sp.repeat_penalty != 1.0:
            opts["repetition_penalty"] = sp.repeat_penalty
        if sp.temperature <= 0.0:
            opts["do_sample"] = False
            return opts
        opts.update(
            do_sample=True,
            temperature=sp.temperature,
            top_p=sp.top_p,
            # 0 means "no top-k" to OpenAI clients; ORT GenAI's config default is 50.
            top_k=sp.top_k if sp.top_k > 0 else self._n_vocab,
            random_seed=sp.seed if sp.seed is not None else random.randrange(1 << 31),
        )
        return opts

    def _generate_blocking(self, job: Job[None], channel: EventChannel, plan: StepPlan) -> None:
        og, sp = self._og, plan.sampling
        params = og.GeneratorParams(self._model)
        params.set_search_options(**self.search_options(sp, len(plan.prompt), plan.max_new))
        if sp.constraint is not None:
            params.set_guidance(*guidance(sp.constraint))
        steps = _GeneratorSteps(og.Generator(self._model, params), self._tokenizer.create_stream())
        run_steps(job, channel.emit, plan, steps, self._eos, self.piece)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        raise InvalidGenerationRequest(
            "embeddings are not supported by the ortgenai runtime; serve this model with llama.cpp", param="model"
        )

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        if images:
            raise InvalidGenerationRequest("this engine takes no images")
        if not token_ids:
            raise InvalidGenerationRequest("no tokens to score")
        if len(token_ids) > self._n_ctx:
            raise ContextLengthExceeded(len(token_ids), self._n_ctx)

        def compute() -> npt.NDArray[np.float32]:
            params = self._og.GeneratorParams(self._model)
            params.set_search_options(max_length=len(token_ids) + 1, batch_size=1)
            gen = self._og.Generator(self._model, params)
            # The prefill's logits output holds every position, not just the last.
            gen.append_tokens(np.asarray(token_ids, dtype=np.int32))
            return np.ascontiguousarray(gen.get_output("logits")[0], dtype=np.float32)

        return await call_job(pool, compute)


class _GeneratorSteps:
    """An `og.Generator` as the per-token loop drives it: ORT GenAI's search chooses each token (the
    EOS mask of `ignore_eos` included), and its tokenizer stream decodes them one at a time."""

    def __init__(self, gen: Any, stream: Any) -> None:
        self._gen = gen
        self._stream = stream

    def feed(self, tokens: Sequence[int]) -> None:
        self._gen.append_tokens(np.asarray(tokens, dtype=np.int32))

    def next(self, logits: bool) -> tuple[int, npt.NDArray[np.float32] | None]:
        # The logits the search is about to choose from (those of the last token fed or chosen).
        raw: npt.NDArray[np.float32] | None = self._gen.get_logits().reshape(-1).copy() if logits else None
        self._gen.generate_next_token()
        return int(self._gen.get_next_tokens()[0]), raw

    def text(self, tokens: Sequence[int]) -> str:
        if len(tokens) == 1:
            return str(self._stream.decode(tokens[0]))
        return "".join(self._stream.decode(t) for t in tokens)


def _check_supported(sp: SamplingParams) -> None:
    """Reject, rather than ignore, what ORT GenAI's search cannot do."""
    c = sp.constraint
    if c is not None and (c.kind == "grammar" or c.lazy):
        what = "GBNF grammars" if c.kind == "grammar" else "constraints that start at a trigger"
        raise InvalidGenerationRequest(f"{what} are not supported by the ortgenai runtime", param=c.part or None)
    unsupported = {
        "logit_bias": bool(sp.logit_bias),
        "presence_penalty": sp.presence_penalty != 0.0,
        "frequency_penalty": sp.frequency_penalty != 0.0,
        "min_p": sp.min_p > 0.0,
    }
    for param, used in unsupported.items():
        if used:
            raise InvalidGenerationRequest(f"{param} is not supported by the ortgenai runtime", param=param)


# JSON as one line with single spaces after separators (llguidance's `x-guidance` options): its
# default lets a small model wander into runs of newlines between every token of the JSON.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def guidance(c: Constraint) -> tuple[str, str]:
    """`c` as ORT GenAI guidance: (kind, data). Raises InvalidGenerationRequest for an XML body."""
    if c.kind == "json":
        return "json_schema", _compact(c.schema)
    alts = []
    for item in c.items:
        if item.body != "json":
            raise InvalidGenerationRequest("XML-bodied tool calls are not supported by the ortgenai runtime",
                                           param=c.part or None)
        alts.append(_seq(_lit(item.begin), f"%json{_compact(item.schema)}", _lit(item.end)))
    more = f"({_seq(_lit(c.separator), 'item')}){{0,{c.max_items - 1}}}" if c.max_items > 1 else ""
    return "lark_grammar", f"start: {_seq(_lit(c.prefix), 'item', more, _lit(c.suffix))}\nitem: {' | '.join(alts)}\n"


def _lit(text: str) -> str:
    """A text as a Lark literal ("" for none: Lark has no empty literal)."""
    return json.dumps(text) if text else ""


def _seq(*terms: str) -> str:
    return " ".join(t for t in terms if t)


def _compact(schema: str | None) -> str:
    return json.dumps({**json.loads(schema or '{"type": "object"}'), "x-guidance": _COMPACT})


@register_runtime("ortgenai")
def create_ortgenai(options: EngineConfig) -> OrtGenAIEngine:
    return OrtGenAIEngine(options)


# --- the runtime descriptor ----------------------------------------------------------------

# ONNX Runtime execution providers, where they run and what provides them.
EP_MATRIX: tuple[tuple[str, str, str, str], ...] = (
    ("CPUExecutionProvider", "All", "N/A", "onnxruntime"),
    ("CUDAExecutionProvider", "Lin/Win", "NVIDIA", "onnxruntime-gpu"),
    ("DmlExecutionProvider", "Windows", "Any", "onnxruntime-directml"),
    ("ROCMExecutionProvider", "Linux", "AMD", "onnxruntime-rocm"),
    ("CoreMLExecutionProvider", "macOS/iOS", "Apple", "onnxruntime-silicon"),
    ("TensorrtExecutionProvider", "Lin/Win", "NVIDIA", "onnxruntime-gpu"),
    ("OpenVINOExecutionProvider", "All", "Intel", "onnxruntime-openvino"),
)
ORT_PACKAGES = (
    "onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml",
    "onnxruntime", "onnxruntime-gpu", "onnxruntime-directml",
)
INSTALL = {"cpu": "pip install onnxruntime-genai", "cuda": "pip install onnxruntime-genai-cuda",
           "directml": "pip install onnxruntime-genai-directml"}


def _providers_child() -> dict[str, Any]:
    try:
        import onnxruntime
    except Exception as exc:  # noqa: BLE001 - absence is reported
        return {"providers": [], "error": f"onnxruntime cannot be imported: {exc}"}
    return {"providers": list(onnxruntime.get_available_providers())}


@dataclass(frozen=True)
class OrtBuild:
    """What the ONNX Runtime probe finds on a host (its entry in `HostCapabilities.runtimes`)."""

    packages: tuple[tuple[str, str], ...] = ()  # (distribution, version)
    providers: tuple[str, ...] = ()  # onnxruntime.get_available_providers()
    error: str | None = None
    directml: PlatformRuntime = field(default_factory=lambda: PlatformRuntime(False, "DirectML was not probed"))

    def has_package(self, name: str) -> bool:
        return any(p == name for p, _ in self.packages)

    @property
    def genai(self) -> bool:
        return any(p.startswith("onnxruntime-genai") for p, _ in self.packages)


def found(host: HostCapabilities) -> OrtBuild:
    return host.found("ortgenai", OrtBuild, OrtBuild(error="ONNX Runtime was not probed"))


def probe_ort() -> OrtBuild:
    packages = []
    for name in ORT_PACKAGES:
        try:
            packages.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    if not packages:
        ort = OrtBuild(error="no ONNX Runtime package is installed")
    else:
        r = run_child("engines.ortgenai")
        ort = OrtBuild(packages=tuple(packages), providers=tuple(r.get("providers", [])), error=r.get("error"))
    return replace(ort, directml=probe_directml(ort))


def probe_directml(ort: OrtBuild) -> PlatformRuntime:
    if platform.system() != "Windows":
        return PlatformRuntime(False, "DirectML needs Windows with a DirectX 12 adapter")
    if not ort.has_package("onnxruntime-genai-directml"):
        return PlatformRuntime(False, "onnxruntime-genai-directml is not installed (pip install onnxruntime-genai-directml)")
    if ort.providers and "DmlExecutionProvider" not in ort.providers:
        return PlatformRuntime(False, "ONNX Runtime here has no DmlExecutionProvider")
    return PlatformRuntime(True, "", "onnxruntime-genai-directml")


def _report(host: HostCapabilities) -> list[str]:
    o = found(host)
    dml = o.directml
    lines = [f"{'DirectML':<9} {'available: ' + dml.detail if dml.available else dml.reason}"]
    pk = ", ".join(f"{p} {v}" for p, v in o.packages) or "none"
    lines.append(f"ONNX Runtime packages: {pk}" + (f" ({o.error})" if o.error and o.packages else ""))
    eps = [("", "EXECUTION PROVIDER", "OS", "GPU", "PACKAGE")]
    eps += [("[x]" if ep in o.providers else "[ ]", ep, os_, gpu, pkg) for ep, os_, gpu, pkg in EP_MATRIX]
    return lines + text_table(eps)


def ep_matrix(host: HostCapabilities) -> list[dict[str, Any]]:
    """The execution providers, and which this host's ONNX Runtime has."""
    providers = found(host).providers
    return [{"provider": ep, "os": os_, "gpu": gpu, "package": pkg, "available": ep in providers}
            for ep, os_, gpu, pkg in EP_MATRIX]


def _finder(engine: str) -> Finder:
    def find(host: HostCapabilities, pref: Preference) -> Found:
        what, ort = f"ortgenai/{engine}", found(host)
        if not ort.genai:
            return [], [Skip(what, f"onnxruntime-genai is not installed ({INSTALL[engine]})")]
        if engine == "cpu":
            return [Device("cpu")], []
        if engine == "cuda":
            if not ort.has_package("onnxruntime-genai-cuda"):
                return [], [Skip(what, f"onnxruntime-genai-cuda is not installed ({INSTALL['cuda']})")]
            if not host.cuda.devices:
                return [], [Skip(what, host.cuda.error or "no CUDA device", "unusable")]
            return [Device(d.name, str(d.index), d.index) for d in host.cuda.devices
                    if match_device(pref.device, d.index, d.name)], []
        if not ort.directml.available:
            return [], [Skip(what, ort.directml.reason)]
        return [Device("DirectML adapter 0", "0", 0)], []

    return find


def _fingerprint(host: HostCapabilities, lib_path: str) -> str:
    return ",".join(f"{p}={v}" for p, v in found(host).packages)


RUNTIME = register(Runtime(
    name="ortgenai",
    format="onnx",
    offers=tuple(Offer(e, _finder(e)) for e in ("cpu", "cuda", "directml")),
    engine_module="engines.ortgenai",
    probe=lambda host: host.with_found("ortgenai", probe_ort()),
    report=_report,
    report_json=lambda host: {"ep_matrix": ep_matrix(host)},
    install=INSTALL,
    convert=Converter(
        "onnx", export_onnx, needs=("onnx", "onnx_ir", "onnxruntime_genai"), install="pip install -e '.[convert]'",
        precisions=("fp32", "fp16", "int4"), variants=("cpu", "cuda", "dml"), variant_flag="provider",
        variant_help="ORT GenAI execution provider the ONNX graph is built for"),
    fingerprint=_fingerprint,
    tolerances=((("llamacpp/cpu", "ortgenai/cpu", "quant"), CROSS_RUNTIME_QUANT),
                (("ortgenai/cpu", "llamacpp/cpu", "quant"), CROSS_RUNTIME_QUANT)),
))


if __name__ == "__main__":  # the host probe's child: the providers of the installed onnxruntime
    json.dump(_providers_child(), sys.stdout)
