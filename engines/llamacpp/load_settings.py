"""How the llama.cpp engine loads, by device class and settings: the prefill budget, the shared
layout's two passes, the trim's payback, the long prompts' context, the warm-up passes, llama.cpp's
own log lines routed to Python logging."""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any

from engines.base import ModelLoadError
from engines.tuning import engine_tuning

log = logging.getLogger("engines.llamacpp.engine")  # the engine's own log: a load's warm-up is part of it

# Prompt tokens per step while other sequences decode (chunked prefill), by backend: a chunk costs
# the running streams its compute in every step it shares with them (measured on a 2-core CPU and an
# H100, docs/benchmarks/history.md#a-host-memory-prefix-cache-and-a-prefill-budget);
# LlamaCppOptions.prefill_budget / models.yaml `prefill_budget` override. The CPU's 128 (was 64; measured
# on a 2-core AMD EPYC, docs/benchmarks/history.md#two-passes-on-the-cpu-and-a-prefill-budget-of-128):
# ggml's CPU attention takes a prompt chunk in tiles of 64
# query rows per head, 4 row ranges per thread, so on 2 threads a 64-token chunk of a 4-head model
# (Gemma-3-270M) fills its tiles by half and costs about what 128 tokens do (8 streams beside a
# 17.9k-token prompt: steps 424 vs 396 ms, the prompt through in 1.43x its time alone vs 2.28x).
PREFILL_BUDGET = {"cpu": 128, "vulkan": 256, "cuda": 512, "metal": 256, "rocm": 512}
# Passes of the budget a step may run beside running streams, by backend (1 elsewhere): a burst of
# prompts then costs each stream one gap instead of one per chunk. On an H200 with an 8B-shaped
# model, 8 / 16 / 32 streams: inter-token p99 18 / 18-19 / 36-49 ms against 24 / 76-78 / 95-97
# with one chunk a step, 0-5 % more tok/s, first tokens later at 16 and 32 streams (TTFT p50 171-183 /
# 293-312 ms against 164 / 201-204): docs/benchmarks/history.md#prompt-passes-by-default-on-cuda.
PREFILL_PASSES = {"cuda": 8}
# Sequences in use (their recent peak) up to which a step runs those passes, by backend (0: any
# number); with more, a step takes one chunk of 128 prompt tokens. In a closed loop of 32 streams the
# passes fed each burst of returning prompts in one step, so the streams stayed in lockstep and every
# first token waited for half a burst; 128-token chunks spread them out. H200, 8B-shaped model, 32
# streams: TTFT p50 96 ms against 301 (llama-server 631), ITL p99 47.5 against 54.9 (71.2), longest gap
# 111 ms against 497 (658), 0.81x the tok/s (1.78x llama-server's); 8 and 16 streams as with passes:
# docs/benchmarks/history.md#prompt-passes-up-to-16-streams-small-chunks-beyond.
PASSES_STREAMS = {"cuda": 16}


@dataclass(frozen=True)
class PrefillPlan:
    """How prompt tokens share a step with running streams (BatchScheduler._step)."""

    budget: int  # tokens a step takes beside running streams
    passes: int = 1  # passes of `budget` such a step may run, the streams waiting for them
    streams: int = 0  # passes only while at most this many sequences are in use (0: any number)
    many_budget: int = 0  # tokens a step takes when more are (0: `budget`), in one pass

    def for_step(self, load: int) -> tuple[int, int]:
        """(tokens a pass takes, passes) for a step while `load` sequences are in use."""
        if self.streams and load > self.streams:
            return self.many_budget or self.budget, 1
        return self.budget, self.passes


def prefill_plan(backend: str, budget: int, shared: bool = False) -> PrefillPlan:
    """The backend's plan (PREFILL_PASSES, PASSES_STREAMS) under GATEWAY_PREFILL_PASSES,
    _PASSES_STREAMS and _PREFILL_BUDGET_MANY (by default 128 tokens, or the budget if smaller).
    The shared layout (kv_unified) runs one pass a step, so by default its budget stays whole."""
    t = engine_tuning()
    default = 0 if shared else PASSES_STREAMS.get(backend, 0)
    streams = default if t.passes_streams is None else t.passes_streams
    return PrefillPlan(budget, t.prefill_passes or PREFILL_PASSES.get(backend, 1), streams,
                       t.prefill_budget_many or min(budget, 128))


def prefill_budget(backend: str) -> int:
    return PREFILL_BUDGET.get(backend, 256)


def split_mixed(backend: str) -> bool:
    """Whether a step of the shared layout (kv_unified) runs its running streams' tokens and its
    prompt chunks as two passes (BatchScheduler._step says why): on the CPU, whose attention
    skips the masked tiles of a pass; GATEWAY_SPLIT_MIXED=on/off overrides it (for measuring)."""
    choice = engine_tuning().split_mixed
    return backend == "cpu" if choice == "auto" else choice == "on"


def overlap_outputs(backend: str) -> bool:
    """Whether a pass's outputs become text and events after the next pass is launched
    (outputs.Outputs): on CUDA, where llama_decode returns before the device has run the pass (an
    H200, 8B-shaped model: 3-6 % more tok/s at 1-32 streams, one stream at 97-98 % of llama-bench's
    tg128 against 93 %: docs/benchmarks/history.md#a-passs-outputs-beside-the-next-pass). On the CPU
    it returns when the pass is done, so the events would wait a pass; ROCm is not measured.
    GATEWAY_OVERLAP_OUTPUTS=on/off overrides it."""
    choice = engine_tuning().overlap_outputs
    return backend == "cuda" if choice == "auto" else choice == "on"


def trim_payback() -> float:
    """What idle KV must have cost the running passes before it leaves a shared cache, in its
    copies' time: batch.TRIM_PAYBACK, or GATEWAY_TRIM_PAYBACK (a number >= 0; e.g. 0 or 1e9 for
    side-by-side runs). A malformed value stops the load with a message that names it."""
    from engines.llamacpp.batch import TRIM_PAYBACK

    value = engine_tuning().trim_payback
    return TRIM_PAYBACK if value is None else value


def long_prompt_settings() -> tuple[int, int]:
    """(GATEWAY_LONG_PROMPT_TOKENS, GATEWAY_LONG_PROMPT_SMS): a prompt with at least that many
    tokens no sequence or host-cache entry holds, arriving while other requests decode, is
    prefilled (and then decoded) in a second llama_context beside them instead of in chunks
    inside their steps (0: off, the default); on a CUDA build patched with
    benchmarks/patches/ggml-cuda-green-contexts.patch, that context's kernels keep to that many SMs
    (0: all) and the decoding streams have the rest. Opt-in and for measuring (on an H100 and an H200:
    docs/benchmarks/history.md#green-contexts)."""
    tuning = engine_tuning()
    return tuning.long_prompt_tokens, tuning.long_prompt_sms


def warm_up_wanted(backend: str) -> bool:
    """Whether the engine runs `warm_up` at load: on the CUDA build (CUDA, ROCm), whose first pass
    of each new shape is slow (measured on the H100); GATEWAY_WARMUP=on/off overrides it. Not on
    Vulkan: its first passes were not measured to stall on a GPU, and on a software device
    (lavapipe, which ggml reports as a GPU) the passes took 200-250 s of every load, on 2 cores."""
    choice = engine_tuning().warmup
    return backend in ("cuda", "rocm") if choice == "auto" else choice == "on"


def warm_up(ctx: Any, n_batch: int, n_seqs: int, budget: int, n_ctx_seq: int) -> tuple[int, float]:
    """Run one pass of each shape serving will use, then empty the KV cache: (passes, seconds).

    The CUDA build loads a kernel on its first launch, and its kernels are specialised by the
    number of tokens in a pass, so the first pass of each new shape stalls the step. Measured on
    the H100 (Llama-3-8B-shaped Q4_K_M, 32 streams, shared KV): the first step with 32 streams'
    tokens beside a 256-token prompt chunk took 416 ms (the next ones 50 ms), and being one step
    of every stream at once, it alone set their inter-token p99. Warmed here: 1-8 sequences
    decoding (the matrix-vector kernels come in 1-8 columns), 16, 32, 64 and every sequence
    decoding, a prompt chunk of the prefill budget beside the streams, and a full batch of
    prompt. Every sequence asks for logits, as a decoding one does."""
    import llama_cpp as lc
    mem = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(n_batch, 0, 1)
    decoding = sorted({k for k in (*range(1, 9), 16, 32, 64, n_seqs) if k <= min(n_seqs, n_batch)})
    shapes = [(k, 0) for k in decoding]
    beside = min(n_seqs - 1, 32)
    longest = min(n_batch, n_ctx_seq)
    if budget < longest:
        shapes.append((beside, min(budget, n_batch - beside)))
    shapes.append((0, longest))
    t0 = time.perf_counter()
    passes = 0
    try:
        for streams, chunk in shapes:
            n = 0
            rows = [(seq, 1) for seq in range(streams)] + ([(n_seqs - 1, chunk)] if chunk else [])
            for seq, count in rows:
                for i in range(count):
                    batch.token[n], batch.pos[n], batch.n_seq_id[n] = 0, i, 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = i == count - 1
                    n += 1
            batch.n_tokens = n
            rc = lc.llama_decode(ctx, batch)
            lc.llama_memory_clear(mem, True)
            if rc != 0:
                log.warning("warm-up pass of %d tokens failed (%d); serving without the rest", n, rc)
                break
            passes += 1
        lc.llama_synchronize(ctx)
    finally:
        lc.llama_memory_clear(mem, True)
        lc.llama_batch_free(batch)
    return passes, time.perf_counter() - t0


native_log = logging.getLogger("llama.cpp")
# ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (llama_cpp/_logger.py still has the old order).
_GGML_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_log_callback: Any = None


def _route_native_logs(lc: Any) -> None:
    """Send llama.cpp's own log lines to Python logging (INFO lines are debug noise for us)."""
    global _log_callback
    if _log_callback is not None:
        return
    last = [logging.DEBUG]

    @lc.llama_log_callback  # type: ignore[misc, untyped-decorator, unused-ignore]
    def callback(level: int, text: bytes, _user: Any) -> None:
        lvl = last[0] if level == 5 else _GGML_LEVELS.get(level, logging.DEBUG)
        last[0] = lvl
        lvl = logging.DEBUG if lvl == logging.INFO else lvl
        if native_log.isEnabledFor(lvl):
            native_log.log(lvl, "%s", text.decode("utf-8", errors="replace").rstrip())

    _log_callback = callback
    lc.llama_log_set(callback, ctypes.c_void_p(0))


def route_vision_logs() -> None:
    """The multimodal library's log lines (its own logger, and its helpers') the same way."""
    import llama_cpp.mtmd_cpp as mt

    if _log_callback is not None:
        mt.mtmd_log_set(_log_callback, ctypes.c_void_p(0))
        mt.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))


def llama_cpp_version() -> str:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except Exception:  # noqa: BLE001 - absence is reported, not raised
        return ""


def _llama_cpp() -> Any:
    try:
        import llama_cpp as lc
    except ImportError as exc:
        raise ModelLoadError(f"llama-cpp-python is not installed ({exc}); run scripts/install-llama-cpp.sh") from exc
    return lc
