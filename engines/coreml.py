"""The CoreML engine (`coremltools`, macOS 15+): a stateful KV-cache ML program on ANE/GPU/CPU.

Serves the folder `gateway convert --to coreml` writes: `model.mlpackage` (inputs `input_ids`
and `causal_mask`, states `keyCache`/`valueCache`, output `logits`), the Hugging Face tokenizer
and chat template, and `coreml_config.json`.  Each request gets its own state: the prompt is
prefilled in one prediction, then one token per prediction.  Sampling is done here in numpy.
Prediction needs macOS, so on any other host `load()` raises ModelLoadError with the reason;
this path is unverified until run on a Mac.
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from engines.attention import causal_mask
from engines.base import (
    Capabilities,
    ContextLengthExceeded,
    EngineClosed,
    EngineConfig,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    InvalidGenerationRequest,
    ModelLoadError,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
    new_token_budget,
    resumed_tokens,
    token_prompt,
)
from engines.bridge import EventChannel, Job, WorkerPool, call_job, pool_health, stream_job
from engines.host import HostCapabilities, PlatformRuntime
from engines.registry import register_runtime
from engines.runtimes import Device, Found, Offer, Preference, Runtime, RuntimeOptions, Skip, register
from engines.template_files import template_source
from engines.text import StopMatcher, token_logprob, with_scored_prompt

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


def sample(logits: npt.NDArray[np.float32], sp: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token: greedy at temperature 0, else top-k / top-p / min-p sampling."""
    x = logits.astype(np.float64)
    for token, bias in sp.logit_bias:
        x[token] += bias
    if sp.temperature <= 0.0:
        return int(np.argmax(x))
    x = x / sp.temperature
    order = np.argsort(-x)
    if sp.top_k > 0:
        order = order[: sp.top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    keep = len(p)
    if sp.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), sp.top_p) + 1)
    if sp.min_p > 0.0:
        keep = min(keep, int((p >= sp.min_p * p[0]).sum()))
    p = p[:keep] / p[:keep].sum()
    return int(order[rng.choice(keep, p=p)])


class CoreMLEngine:
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

    async def load(self) -> None:
        await asyncio.to_thread(self._load_blocking)

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
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ModelLoadError("the CoreML engine needs tokenizers: pip install -e '.[coreml]'") from exc
        meta = json.loads((d / "coreml_config.json").read_text())
        self._tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self._eos = frozenset(_eos_ids(d))
        self._n_ctx = min(o.context_length, int(meta.get("context_length", o.context_length)))
        try:
            self._model = loader(str(d / "model.mlpackage"), co.compute_units)
        except Exception as exc:
            raise ModelLoadError(f"CoreML could not load {d}: {exc}") from exc
        self._pool = WorkerPool(o.parallel, o.max_queue, name="coreml")
        self.info = replace(self.info, context_length=self._n_ctx, template=template_source(d, o.chat_template),
                            capabilities=Capabilities(resume=True))
        log.info("CoreML loaded %s: compute_units=%s ctx=%d", d, co.compute_units, self._n_ctx)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.close)
        self._model = None

    def health(self) -> EngineHealth:
        return pool_health(self._pool)

    # --- text ------------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def piece(self, token: int) -> bytes:
        return str(self._tokenizer.decode([token], skip_special_tokens=False)).encode("utf-8")

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (text tokenized without added special tokens: a chat
        template writes its own)."""
        if request.prompt_ids:
            return token_prompt(request.prompt_ids, self._tokenizer.get_vocab_size())
        return self.encode(request.prompt or "")

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

    def _prefill(self, prompt: list[int], state: Any) -> npt.NDArray[np.float32]:
        """Logits of the prompt's tokens (at least its last) fed into `state`."""
        return self._predict(prompt, len(prompt), state)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        sp = request.sampling
        if sp.constraint is not None:
            raise InvalidGenerationRequest(f"constrained output is not supported by the {self.info.runtime} runtime",
                                           param=sp.constraint.part)
        prompt = self.prompt_tokens(request)
        # max_tokens 0 (only the prompt scored) never runs the generation below.
        max_new = new_token_budget(prompt, self._n_ctx, sp.max_tokens if sp.prompt_logprobs is None else sp.max_tokens or 1)
        resumed = resumed_tokens(request, max_new)
        replay = request.resume_replay

        def run(job: Job[None], channel: EventChannel) -> None:
            self._generate_blocking(job, prompt, sp, max_new, channel, resumed, replay)

        async for item in with_scored_prompt(prompt, sp, self.logits, self.piece, lambda: stream_job(pool, run)):
            yield item

    def _generate_blocking(
        self, job: Job[None], prompt: list[int], sp: SamplingParams, max_new: int, channel: EventChannel,
        resumed: tuple[int, ...] = (), replay: bool = True,
    ) -> None:
        state = self._new_state()
        rng = np.random.default_rng(sp.seed)
        stopper = StopMatcher(sp.stop)
        generated: list[int] = list(resumed)
        sent = ""
        if resumed and not replay:
            row = self._predict([*prompt, *resumed], len(prompt) + len(resumed), state)[-1]
        else:
            row = self._prefill(prompt, state)[-1]
            # A failover: the tokens already sent, one per prediction as they were generated.
            for i, t in enumerate(resumed, start=1):
                if job.cancelled:
                    return
                row = self._predict([t], len(prompt) + i, state)[-1]
        if resumed:  # the stop matcher's state, without emitting
            full = self._tokenizer.decode(generated, skip_special_tokens=False)
            if not full.endswith("\ufffd"):
                stopper.push(full)
                sent = full
        while True:
            if job.cancelled:
                if job.closing:
                    channel.emit(EngineClosed("the model was unloaded"))
                return
            if sp.ignore_eos:
                row[list(self._eos)] = -np.inf
            token = sample(row, sp, rng)
            logprobs: tuple[TokenLogprob, ...] = ()
            if sp.logprobs:
                logprobs = (token_logprob(row, token, sp.top_logprobs, self.piece),)
            generated.append(token)
            finish: str | None = None
            text = ""
            if token in self._eos and not sp.ignore_eos:
                finish = "stop"
            else:
                # Decode everything so far: byte-level tokens may end inside a character.
                full = self._tokenizer.decode(generated, skip_special_tokens=False)
                if not full.endswith("\ufffd"):
                    text, sent = stopper.push(full[len(sent):]), full
                if stopper.stopped:
                    finish = "stop"
                elif len(generated) >= max_new:
                    finish = "length"
            if finish is None:
                channel.emit(TokenEvent(text=text, token_ids=(token,), logprobs=logprobs,
                                        prompt_tokens=len(prompt) if len(generated) == 1 else 0))
                row = self._predict([token], len(prompt) + len(generated), state)[-1]
                continue
            usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(generated), queue_seconds=job.queue_seconds)
            channel.emit(TokenEvent(text=text + stopper.flush(), token_ids=(token,), logprobs=logprobs,
                                    finish_reason=finish, usage=usage, stop_sequence=stopper.matched))
            return

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        raise InvalidGenerationRequest(
            f"embeddings are not supported by the {self.info.runtime} runtime; serve this model with llama.cpp", param="model"
        )

    async def logits(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        if not token_ids:
            raise InvalidGenerationRequest("no tokens to score")
        if len(token_ids) > self._n_ctx:
            raise ContextLengthExceeded(len(token_ids), self._n_ctx)
        return await call_job(pool, lambda: self._predict(list(token_ids), len(token_ids), self._new_state()))


def _eos_ids(d: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = d / name
        if p.is_file():
            value = json.loads(p.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return ids


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
    if not host.coreml.available:
        return [], [Skip("coreml/coreml", host.coreml.reason)]
    return [Device(host.coreml.detail or "Apple Neural Engine", "ALL")], []


def _report(host: HostCapabilities) -> list[str]:
    rt = host.coreml
    return [f"{'CoreML':<9} {'available: ' + rt.detail if rt.available else rt.reason}"]


RUNTIME = register(Runtime(
    name="coreml",
    format="coreml",
    offers=(Offer("coreml", _find),),
    engine_module="engines.coreml",
    probe=lambda host: replace(host, coreml=probe_coreml()),
    report=_report,
    install={"*": "pip install coremltools (on macOS)"},
    convert="coreml",
    options=CoreMLOptions,
))
