"""The llama.cpp engine (llama-cpp-python): CPU, Vulkan, CUDA and Metal builds alike.

Loads a GGUF with the low-level API, reports the GGUF's chat template (the gateway renders it),
compiles output constraints to GBNF grammars, and runs every request through the
continuous-batching scheduler in `engines.llamacpp.batch`; images through a vision projector
(`engines.llamacpp.vision`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    Capabilities,
    ContextLengthExceeded,
    EngineConfig,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    InvalidGenerationRequest,
    ModelLoadError,
    TemplateSource,
    TokenEvent,
    new_token_budget,
    resumed_tokens,
    token_prompt,
)
from engines.bridge import EventChannel, settle_from_thread
from engines.llamacpp.ggml_backends import load_variant
from engines.llamacpp.grammar import compile_constraint, lazy_patterns
from engines.llamacpp.host_memory import HostMemory, PinnedHostMemory
from engines.llamacpp.load_settings import (
    _llama_cpp,
    _route_native_logs,
    llama_cpp_version,
    long_prompt_settings,
    overlap_outputs,
    prefill_budget,
    prefill_plan,
    split_mixed,
    trim_payback,
    warm_up,
    warm_up_wanted,
)
from engines.llamacpp.prefix_cache import HostPrefixCache, default_limit_bytes
from engines.llamacpp.runtime import LlamaCppOptions
from engines.llamacpp.vision import Media, Vision, placed, with_images
from engines.registry import register_runtime
from engines.steptrace import open_trace
from engines.text import with_scored_prompt
from engines.tuning import engine_tuning

log = logging.getLogger(__name__)

# Prompts longer than this (characters of text) are tokenized off the event loop.
LONG_RENDER_CHARS = 16_384


class LlamaCppEngine:
    """A GGUF model served by llama.cpp."""

    def __init__(self, options: EngineConfig) -> None:
        self.options = options
        self.llama_options = LlamaCppOptions.of(options)
        self.info = EngineInfo(
            runtime="llamacpp",
            backend=options.backend,
            device=options.device,
            version=llama_cpp_version(),
            context_length=options.context_length,
            parallel=_sequences(options, self.llama_options),
        )
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._sched: Any = None
        # The second context for long prompts (GATEWAY_LONG_PROMPT_TOKENS), its scheduler, the
        # prompt size that goes there, and how many went.
        self._side_ctx: Any = None
        self._side: Any = None
        self._long_min = 0
        self._route_lock = threading.Lock()
        self.long_prompts_beside = 0
        self._n_vocab = 0
        self._n_ctx_seq = options.context_length
        self._n_swa = 0
        self._pieces: dict[int, bytes] = {}
        self._shown_ids: dict[str, list[int]] = {}
        self._eog: list[int] = []
        self._bos_text = ""
        self._embedder: Any = None
        self._vision: Vision | None = None  # the vision projector (LlamaCppOptions.mmproj)

    # --- lifecycle -----------------------------------------------------------------------

    async def load(self) -> None:
        await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> None:
        try:
            self._load_parts()
        except BaseException:
            # A load that fails part-way (the long prompts' context, say) frees what it had made
            # (the weights, the first context) now, not when the engine is closed.
            self._close_blocking()
            raise

    def _load_parts(self) -> None:
        """The load, step by step: the library and its settings, the CPU variant, the weights,
        the context, the template, the scheduler (and the long prompts' one), what it is."""
        lc = _llama_cpp()
        o = self.options
        if not os.path.isfile(o.model_path):
            raise ModelLoadError(f"model file not found: {o.model_path}")
        try:
            tuning = engine_tuning()  # a malformed knob stops the load, said as such
            payback = trim_payback()
            long_min, long_sms = long_prompt_settings()
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        _route_native_logs(lc)
        variant = load_variant(self.llama_options.cpu_variant)  # before llama_backend_init
        lc.llama_backend_init()
        on_gpu = bool(o.device_key)
        model = self._load_model(lc, on_gpu)
        cparams, on_device = self._context_params(lc, model, on_gpu)
        ctx = self._new_context(lc, model, cparams)
        if self.llama_options.mmproj:
            self._vision = Vision.load(self.llama_options.mmproj, model, o.n_threads or os.cpu_count() or 1, on_gpu)
        template = self._load_template(lc)
        identity = self._identity(lc, variant)
        shared = self._start(lc, ctx, identity, on_device, tuning, payback)
        if long_min:
            self._open_side(lc, model, cparams, o, long_min, long_sms, identity, shared)
        self.info = replace(self.info, context_length=self._n_ctx_seq, template=template,
                            capabilities=Capabilities(resume=True, embeddings=True, lazy_constraints=True,
                                                      constraints=frozenset({"json", "grammar", "tagged"}),
                                                      images=self._vision is not None),
                            extra=self._facts(lc, variant, on_device, long_min, long_sms))
        log.info(
            "llama.cpp loaded %s: backend=%s device=%s ctx/seq=%d parallel=%d vocab=%d",
            o.model_path, o.backend, o.device, self._n_ctx_seq, o.parallel, self._n_vocab,
        )

    def _load_model(self, lc: Any, on_gpu: bool) -> Any:
        """The weights, on the engine's device only; on the CPU, the file pages repacking copied released."""
        from engines.llamacpp.ggml_devices import backends, device_list, split_shares

        o, lo = self.options, self.llama_options
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = lo.repack
        # An explicit device list, even an empty one: llama.cpp would otherwise spread the
        # model over every GPU the build sees, and a "CPU" engine would not be on the CPU.
        names = [o.device_key, *lo.split_devices] if on_gpu else []
        devices, missing = device_list(names)
        if missing:
            raise ModelLoadError(
                f"this llama-cpp-python build has no device {', '.join(missing)} "
                f"(its backends: {', '.join(backends())})"
            )
        mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
        mparams.n_gpu_layers = (o.n_gpu_layers or -1) if on_gpu else 0
        mparams.main_gpu = 0
        if len(names) > 1:  # one model over several devices (the shares kept alive through the load)
            mparams.split_mode = lc.LLAMA_SPLIT_MODE_LAYER
            mparams.tensor_split = self._split = split_shares(lc, len(names), lo.tensor_split)
        model = lc.llama_model_load_from_file(o.model_path.encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {o.model_path} on {o.device} ({o.device_key or 'CPU'})")
        self._model = model
        if not on_gpu:  # weights in RAM: the file pages of repacked tensors are copies no one reads
            from engines.llamacpp.mapped import release

            log.debug("model file pages released after load: %.0f MiB", release(o.model_path) / 2**20)
        self._vocab = lc.llama_model_get_vocab(model)
        self._n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        n_ctx_train = lc.llama_model_n_ctx_train(model)
        self._n_ctx_seq = min(o.context_length, n_ctx_train) if n_ctx_train > 0 else o.context_length
        if self._n_ctx_seq < o.context_length:
            log.warning("context_length %d is above the %d tokens the model was trained on: serving %d",
                        o.context_length, n_ctx_train, self._n_ctx_seq)
        return model

    @property
    def _pass_tokens(self) -> int:
        """Tokens a pass may take (n_batch = n_ubatch): the config's, or a larger prefill budget."""
        return max(self.options.n_batch, self.llama_options.prefill_budget)

    def _context_params(self, lc: Any, model: Any, on_gpu: bool) -> tuple[Any, bool]:
        """The context's parameters, and whether sampling runs on the device."""
        o, lo = self.options, self.llama_options
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self._n_ctx_seq * o.parallel
        cparams.n_batch = cparams.n_ubatch = self._pass_tokens
        # With one KV cache shared by all (kv_unified), `sequences` may exceed `parallel`: the cache
        # still holds context_length x parallel tokens, and the scheduler runs as many requests as fit.
        cparams.n_seq_max = _sequences(o, lo)
        # One KV stream per sequence: each request gets its full context, whatever the others do.
        # (llama.cpp then splits a step into ubatches of equal tokens per sequence: the running
        # streams' tokens and a prompt's chunk go through the model one after the other.)
        # kv_unified: one stream for all, as llama-server; opt-in.
        cparams.kv_unified = lo.kv_unified
        threads = o.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        # Sliding-window layers (Gemma 2/3, gpt-oss, ...) keep only their window plus a batch, as
        # llama-server does by default: their KV is a fraction of the context's, and a long prompt
        # prefills faster (13% at 7k tokens on Gemma-3-270M, 2 cores). The cost: a sequence's KV
        # serves only prefixes that end within the window of its end (the scheduler checks).
        self._n_swa = 0 if lo.swa_full else max(0, lc.llama_model_n_swa(model))
        cparams.swa_full = lo.swa_full
        # auto: CUDA only. On Vulkan it is 1.07-1.12x faster on the H100, but on lavapipe llama.cpp's
        # (experimental) backend sampling corrupted the heap ("double free", 2 starts of 3): opt in.
        on_device = lo.device_sampling == "on" or (lo.device_sampling == "auto" and on_gpu and o.backend == "cuda")
        on_device = on_device and not (lo.draft_ngram and lo.draft_max)  # drafts are verified on the host
        if on_device:
            # One output per sequence and step: lets the device samplers size their buffers.
            cparams.n_outputs_max_per_seq = 1
        return cparams, on_device

    def _new_context(self, lc: Any, model: Any, cparams: Any) -> Any:
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            lc.llama_model_free(model)
            self._model = None
            raise ModelLoadError(
                f"llama.cpp could not create a context of {cparams.n_ctx} tokens on {self.options.device}"
            )
        self._ctx = ctx
        self._eog = [t for t in range(self._n_vocab) if lc.llama_vocab_is_eog(self._vocab, t)]
        return ctx

    def _start(self, lc: Any, ctx: Any, identity: str, on_device: bool, tuning: Any,
               payback: float) -> dict[str, Any]:
        """Warm the device up, then start the scheduler and the embedder; returns what every
        scheduler of this engine shares (the long prompts' one too: `_open_side`)."""
        from engines.llamacpp.batch import BatchScheduler
        from engines.llamacpp.embed import Embedder

        o, lo = self.options, self.llama_options
        budget = lo.prefill_budget or prefill_budget(o.backend)
        if warm_up_wanted(o.backend):
            passes, took = warm_up(ctx, self._pass_tokens, _sequences(o, lo), budget, self._n_ctx_seq)
            log.info("llama.cpp warm-up: %d passes in %.0f ms", passes, took * 1000)
        shared: dict[str, Any] = dict(
            n_vocab=self._n_vocab,
            n_batch=self._pass_tokens,
            max_queue=o.max_queue,
            piece=self.piece,
            is_eog=lambda t: lc.llama_vocab_is_eog(self._vocab, t),
            device_sampling=on_device,
            draft_ngram=lo.draft_ngram,
            draft_max=lo.draft_max,
            draft_streams=lo.draft_streams,
            prefill=prefill_plan(o.backend, budget, shared=lo.kv_unified),
            overlap=overlap_outputs(o.backend),
            n_swa=self._n_swa,
            # Requests sharing a prefix being prefilled wait and copy it (off: each prefills its own).
            follow=tuning.prefix_follow,
            # Off: a device sampler chain is attached before the request's first pass, its graph
            # re-reserve in the time to the first token (for A/B runs: benchmarks' --gateway-variant).
            attach_defer=tuning.attach_defer,
            # What idle KV must have cost before it leaves a shared cache, in its copies' time.
            trim_payback=payback,
            trace=open_trace(tuning.step_trace, f"llama.cpp {o.backend} {os.path.basename(o.model_path)}"),
            vision=self._vision,
        )
        self._sched = BatchScheduler(
            ctx=ctx,
            n_parallel=_sequences(o, lo),
            host_cache=self._host_cache(o, lo),
            identity=identity,
            kv_pool=lc.llama_n_ctx(ctx) if lo.kv_unified else 0,
            n_cells=lc.llama_n_ctx(ctx),
            split_mixed=lo.kv_unified and split_mixed(o.backend),
            **shared,
        )
        threads = o.n_threads or os.cpu_count() or 1
        self._embedder = Embedder(self._model, self._n_ctx_seq, self._n_vocab, threads, o.pooling,
                                  o.normalize_embeddings)
        self._sched.embedder = self._embedder
        return shared

    def _facts(self, lc: Any, variant: str | None, on_device: bool, long_min: int, long_sms: int) -> dict[str, str]:
        """What this engine is, for people (health, `gateway devices`)."""
        o, lo = self.options, self.llama_options
        facts = {"precision": self._precision(lc), "embedding_width": str(self._embedder.width),
                 "sampling": "device" if on_device else "host",
                 "speculative": (f"ngram {lo.draft_ngram}, up to {lo.draft_max}, at most {lo.draft_streams} streams"
                                 if lo.draft_ngram and lo.draft_max else "off"),
                 "repack": "on" if lo.repack else "off",
                 "swa_cache": f"window {self._n_swa}" if self._n_swa else "full",
                 "kv_layout": (f"shared by {_sequences(o, lo)} sequences ({self._n_ctx_seq} x {o.parallel} tokens)"
                               if lo.kv_unified else f"one per sequence ({o.parallel} x {self._n_ctx_seq} tokens)")}
        if long_min:
            facts["long_prompt_context"] = f"from {long_min} uncached tokens" + (f", {long_sms} SMs" if long_sms else "")
        if variant:
            facts["cpu_variant"] = variant
        return facts

    def _precision(self, lc: Any) -> str:
        """The weights' type as llama.cpp names it ("f16", "q4_1", ...), last word of the model desc."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_desc(self._model, buf, len(buf))
        desc = buf.raw[: max(n, 0)].decode(errors="replace").split()
        return desc[-1].lower() if desc else "unknown"

    def _load_template(self, lc: Any) -> TemplateSource | None:
        """The chat template (models.yaml's, else the GGUF's) with the BOS and EOS texts it uses."""
        raw = (self.options.chat_template or "").encode() or lc.llama_model_chat_template(self._model, None)
        bos = lc.llama_vocab_bos(self._vocab)
        eos = lc.llama_vocab_eos(self._vocab)
        self._bos_text = self.piece(bos, special=True).decode(errors="replace") if bos >= 0 else ""
        if not raw:
            return None
        eos_text = self.piece(eos, special=True).decode(errors="replace") if eos >= 0 else ""
        return TemplateSource(raw.decode("utf-8"), bos_token=self._bos_text, eos_token=eos_text)

    def _open_side(self, lc: Any, model: Any, cparams: Any, o: EngineConfig, long_min: int, long_sms: int,
                   identity: str, shared: dict[str, Any]) -> None:
        """The second context and scheduler for long prompts (`long_prompt_settings`): the first
        context's parameters (`cparams`) but one sequence of the model's context length, its own KV
        (what it costs in memory), the same model weights; a scheduler with what the first one's
        shares. Its CUDA streams are made while GGML_CUDA_GREEN_SMS is set, so a patched build puts
        them in a green context of that many SMs (an unpatched one ignores it)."""
        from engines.llamacpp.batch import BatchScheduler

        side = type(cparams).from_buffer_copy(cparams)
        side.n_ctx = self._n_ctx_seq
        side.n_seq_max = 1
        side.kv_unified = False
        if long_sms:
            os.environ["GGML_CUDA_GREEN_SMS"] = str(long_sms)
        try:
            ctx = lc.llama_init_from_model(model, side)
            if not ctx:
                raise ModelLoadError(f"llama.cpp could not create the long prompts' context of {side.n_ctx} tokens "
                                     f"on {o.device}")
            if warm_up_wanted(o.backend):  # its first passes make its streams (while the setting holds)
                warm_up(ctx, self._pass_tokens, 1, shared["prefill_budget"], self._n_ctx_seq)
        finally:
            os.environ.pop("GGML_CUDA_GREEN_SMS", None)
        self._side_ctx = ctx
        self._long_min = long_min
        self._side = BatchScheduler(ctx=ctx, n_parallel=1, identity=identity + "|long-prompt-context",
                                    n_cells=self._n_ctx_seq, **shared)
        log.info("llama.cpp: prompts of %d uncached tokens or more beside running requests go to a second "
                 "context%s", long_min, f" of {long_sms} SMs" if long_sms else "")

    def _submit_gen(self, job: Any) -> Any:
        """Submit a generation to the scheduler that should run it, and return that scheduler.
        With a long prompts' context: a prompt whose uncached part is long goes there while other
        requests decode here and it is free (its chunks would otherwise share their steps), and a
        prompt whose prefix it holds better than this context does goes back to it."""
        side = self._side
        if side is None or len(job.prompt_ids) < self._long_min:
            self._sched.submit(job)
            return self._sched
        with self._route_lock:  # two long prompts at once: the second sees the first's submit
            here = self._sched.held_prefix(job.prompt_ids)
            there = side.held_prefix(job.prompt_ids)
            side_free = side.counts() == (0, 0)
            busy_here = self._sched.counts()[0] > 0
            long_here = len(job.prompt_ids) - here >= self._long_min
            target = side if side_free and (there > here or (busy_here and long_here)) else self._sched
            target.submit(job)
            if target is side:
                self.long_prompts_beside += 1
        return target

    async def close(self) -> None:
        await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        import llama_cpp as lc

        if self._sched is not None:
            self._sched.close()
            self._sched = None
        if self._side is not None:
            self._side.close()
            self._side = None
        if self._vision is not None:
            self._vision.close()
            self._vision = None
        if self._side_ctx is not None:
            lc.llama_free(self._side_ctx)
            self._side_ctx = None
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            lc.llama_model_free(self._model)
            self._model = None

    def health(self) -> EngineHealth:
        if self._sched is None:
            return EngineHealth(ready=False, detail="not loaded")
        running, waiting = self._sched.counts()
        if self._side is not None:
            side_running, side_waiting = self._side.counts()
            running, waiting = running + side_running, waiting + side_waiting
        started = self._sched.step_started
        busy = time.perf_counter() - started if started else 0.0
        host = self._sched.host_cache
        return EngineHealth(ready=True, running=running, waiting=waiting, busy_seconds=busy,
                            prefix_cache=host.stats() if host is not None else None,
                            kv=replace(self._sched.kv_stats(), long_prompts_beside=self.long_prompts_beside))

    @staticmethod
    def _host_cache(o: EngineConfig, lo: LlamaCppOptions) -> HostPrefixCache | None:
        if lo.prefix_cache_mib == 0:
            return None
        limit = lo.prefix_cache_mib << 20 if lo.prefix_cache_mib > 0 else default_limit_bytes()
        want = lo.pinned_host_cache == "on" or (lo.pinned_host_cache == "auto" and o.backend in ("cuda", "rocm", "hip"))
        pinned = PinnedHostMemory.for_device(o.device_key, limit) if want else None
        return HostPrefixCache(limit, pinned if pinned is not None and pinned.pin() else HostMemory())

    def _identity(self, lc: Any, variant: str | None) -> str:
        """What a saved sequence state depends on: the model file, the build and device, the KV
        layout. Entries of another identity are never restored (engines/llamacpp/prefix_cache.py)."""
        o = self.options
        lo = self.llama_options
        st = os.stat(o.model_path)
        return (f"{os.path.realpath(o.model_path)}:{st.st_size}:{st.st_mtime_ns}|llama-cpp-python "
                f"{lc.__version__} {o.backend} {o.device_key or 'CPU'} {variant or ''} repack={lo.repack}"
                f"|ctx/seq={self._n_ctx_seq} parallel={o.parallel} sequences={_sequences(o, lo)} type_k/v=f16 swa={self._n_swa or 'full'}"
                f"{' unified' if lo.kv_unified else ''}")

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            cached = self._pieces.get(token)
            if cached is not None:
                return cached
        import llama_cpp as lc

        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        if not special:
            self._pieces[token] = out
        return out

    def _shown(self, texts: tuple[str, ...]) -> dict[int, bytes]:
        """The tokens of `texts` that the vocabulary holds as single special tokens, with their text."""
        out: dict[int, bytes] = {}
        for text in texts:
            ids = self._shown_ids.get(text)
            if ids is None:
                ids = self._shown_ids[text] = self.encode(text, add_special=False)
            if len(ids) == 1 and not self.piece(ids[0]):
                out[ids[0]] = self.piece(ids[0], special=True)
        return out

    async def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        import llama_cpp as lc

        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        if n < 0:
            cap = -n
            arr = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        return list(arr[:n])

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids: given ones checked, text tokenized (with BOS unless
        a chat template already wrote it)."""
        if request.prompt_ids:
            return token_prompt(request.prompt_ids, self._n_vocab)
        text = request.prompt or ""
        return self.encode(text, add_special=not (request.templated and self._bos_text and text.startswith(self._bos_text)))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self._sched is None:
            raise ModelLoadError("model is not loaded")
        # A long prompt (or images) is prepared on another thread: on this loop it would hold back every
        # running stream's next token (tens of ms for a 10k-token prompt: a gap in 32 streams' ITL p99, H200).
        media: list[Media] = []
        if request.images:
            prompt, media = await asyncio.to_thread(with_images, self._vision, request, self._bos_text)
        elif len(request.prompt or "") > LONG_RENDER_CHARS:
            prompt = await asyncio.to_thread(self.prompt_tokens, request)
        else:
            prompt = self.prompt_tokens(request)
        async for item in with_scored_prompt(prompt, request.sampling, self.logits, self.piece,
                                             lambda: self._generate(request, prompt, media)):
            yield item

    async def _generate(self, request: GenerationRequest, prompt: list[int],
                        media: list[Media]) -> AsyncIterator[TokenEvent]:
        import llama_cpp as lc

        from engines.llamacpp.batch import GenJob, build_sampler, sampler_key

        assert self._sched is not None
        sp, sampler = request.sampling, None
        try:  # until the scheduler has it, the job's sampler and images are freed here
            max_new = new_token_budget(prompt, self._n_ctx_seq, sp.max_tokens)
            resumed = list(resumed_tokens(request, max_new))
            c = sp.constraint
            grammar = compile_constraint(c) if c is not None else None
            lazy = lazy_patterns(c) if c is not None else []
            sampler = build_sampler(self._vocab, self._n_vocab, sp, grammar, self._eog, max_new, lazy)
            if sampler is None:
                assert c is not None
                what = c.part or "the output constraint"
                raise InvalidGenerationRequest(f"llama.cpp could not compile the grammar for {what}",
                                               param=c.part or None)
            channel = EventChannel()
            # A resumed job samples on the host: a device chain starts from a fresh state.
            on_host = grammar is not None or sp.logprobs or bool(resumed)
            job = GenJob(prompt_ids=prompt, sampling=sp, max_new_tokens=max_new, sampler=sampler, emit=channel.emit,
                         device_key=None if on_host else sampler_key(sp, max_new), shown=self._shown(request.shown),
                         media=media)
            if resumed and request.resume_replay:
                job.forced.extend(resumed)
            elif resumed:
                for t in resumed:  # penalties' history and the grammar's position, as if just generated
                    lc.llama_sampler_accept(sampler, t)
                job.prompt_ids, job.resumed = prompt + resumed, len(resumed)
            sched = self._submit_gen(job)
        except BaseException:
            if sampler is not None:
                lc.llama_sampler_free(sampler)
            for m in media:
                m.free()
            raise
        try:
            async for item in channel.events():
                yield item
        finally:
            sched.cancel(job)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        from engines.llamacpp.batch import EmbedJob

        if self._sched is None:
            raise ModelLoadError("model is not loaded")
        self._embedder.check(inputs)
        fut: asyncio.Future[npt.NDArray[np.float32]] = asyncio.get_running_loop().create_future()
        job = EmbedJob(inputs=[list(x) for x in inputs], done=settle_from_thread(fut))
        self._sched.submit_embed(job)
        try:
            return await fut
        finally:
            self._sched.cancel(job)

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        from engines.llamacpp.batch import ScoreJob
        from engines.llamacpp.slots import free_job

        if self._sched is None:
            raise ModelLoadError("model is not loaded")
        if not token_ids:
            raise InvalidGenerationRequest("no tokens to score")
        if len(token_ids) > self._n_ctx_seq:
            raise ContextLengthExceeded(len(token_ids), self._n_ctx_seq)
        media = await asyncio.to_thread(placed, self._vision, token_ids, images) if images else []
        fut: asyncio.Future[npt.NDArray[np.float32]] = asyncio.get_running_loop().create_future()
        job = ScoreJob(token_ids=list(token_ids), done=settle_from_thread(fut), media=media)
        try:
            self._sched.submit(job)
        except BaseException:
            free_job(job)  # its images' chunks, which the scheduler never took
            raise
        try:
            return await fut
        finally:
            self._sched.cancel(job)


@register_runtime("llamacpp")
def create_llamacpp(options: EngineConfig) -> LlamaCppEngine:
    return LlamaCppEngine(options)


def _sequences(o: EngineConfig, lo: LlamaCppOptions) -> int:
    """Requests decoded at once: `sequences` where the KV is shared (kv_unified), else `parallel`."""
    return max(lo.sequences, o.parallel) if lo.kv_unified else o.parallel
