"""How much memory a model takes, before it is loaded, and how much each device has to give.

The estimate is read from the GGUF header (gguf_info): the weights (on the GPU when offloaded, but
for the input embeddings, which llama.cpp keeps in host memory), the KV cache of every sequence at
the model's context (f16 keys and values for each layer's KV heads; llama.cpp allocates it whole
when the context is created; sliding-window layers hold only their window and a batch), the compute buffers, and the worker process itself.

On the CPU the weights count once: the engine gives the file pages of the mapped GGUF back after
load (engines/llamacpp/mapped.py), as those of repacked tensors are copies nobody reads
(docs/benchmarks/history.md#weights-resident-twice-on-the-cpu).

The compute and runtime terms are calibrated on measurements (the worker's resident memory after
requests that fill every sequence, ask for logprobs and follow a grammar: benchmarks/bench_memory.py,
docs/benchmarks/history.md#memory-estimate): 56 MiB of llama.cpp buffers and threads, 40 MiB for the worker's
Python, and 900 bytes per vocabulary entry (logits, the output projection's work space and the
logprobs over the vocabulary all grow with it).

On a GPU the input embeddings stay in host memory with the runtime's host buffers; the device holds
the other weights, the KV cache, the compute buffers and the runtime's own context (720 MiB with
CUDA on the H100: -3..+2% against the 8B model's measured GPU memory over five configurations).

A budget per device is its memory less a reserve: RAM (MemTotal) for the CPU, each GPU's memory for
the GPU; `--memory-budget` / `--gpu-memory-budget` set them outright.

The host prefix cache (KV of conversations that lost their sequence, kept in RAM, pinned on a GPU
host) is part of each model's estimate and of the RAM budget: sized by the gateway (a quarter of
the RAM budget left, at most 8 GiB, unless --prefix-cache sets it), and the first thing to shrink
when a load would not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from engines.base import EngineConfig
from gateway.models.gguf_info import GGUFError, GGUFInfo, read_gguf

MiB = 1 << 20
GiB = 1 << 30
RUNTIME_BYTES = 56 * MiB  # ggml/llama.cpp buffers and threads of one context
PER_VOCAB_BYTES = 900  # logits, output work space and logprobs, per vocabulary entry
WORKER_BYTES = 40 * MiB  # a worker process's interpreter and imports
# On a GPU (measured on an H100 80GB with CUDA, docs/benchmarks/history.md#memory-estimate; Vulkan assumed alike):
GPU_CONTEXT_BYTES = 720 * MiB  # the runtime's context and library work spaces on the device
GPU_RUNTIME_HOST_BYTES = 500 * MiB  # the GPU runtime's host memory in the worker
PER_SEQ_VOCAB_HOST_BYTES = 96  # host buffers per sequence and vocabulary entry (logits, sampling)


# Architectures whose sliding-window layers llama.cpp lays out by a fixed pattern when the GGUF has
# no `attention.sliding_window_pattern` (src/models/*.cpp, load_swa_pattern): (n, dense_first);
# every n-th layer attends to the whole context, the others to the window.
SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False), "gemma-embedding": (6, False),
                "gpt-oss": (2, False), "cohere2": (4, False), "exaone4": (4, False), "olmo2": (4, False)}


def _layer_kv_bytes(info: GGUFInfo) -> list[int]:
    """Bytes of f16 K and V per token of context, for each layer."""
    layers = int(info.arch_key("block_count", 0) or 0)
    if not layers:
        return []
    heads = info.arch_key("attention.head_count", 0) or 0
    kv_heads = info.arch_key("attention.head_count_kv", heads) or heads
    embd = int(info.arch_key("embedding_length", 0) or 0)
    per_layer_kv = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    head = int(heads[0] if isinstance(heads, list) else heads) or 1
    k_len = int(info.arch_key("attention.key_length", 0) or (embd // head if head else 0))
    v_len = int(info.arch_key("attention.value_length", 0) or k_len)
    return [int(h) * (k_len + v_len) * 2 for h in per_layer_kv[:layers]]


def kv_bytes_per_token(info: GGUFInfo) -> int:
    """Bytes of f16 K and V per token of context, over every layer."""
    return sum(_layer_kv_bytes(info))


def swa_layers(info: GGUFInfo) -> tuple[int, list[bool]]:
    """(window, which layers use it); (0, []) for a model without sliding-window attention."""
    window = int(info.arch_key("attention.sliding_window", 0) or 0)
    layers = int(info.arch_key("block_count", 0) or 0)
    arch = str(info.metadata.get("general.architecture", ""))
    pattern = info.arch_key("attention.sliding_window_pattern", None)
    if not window or not layers:
        return 0, []
    if isinstance(pattern, list):
        return window, [bool(x) for x in pattern[:layers]]
    n, dense_first = (int(pattern), False) if pattern else SWA_PATTERNS.get(arch, (0, False))
    if not n:
        return 0, []  # a window but no known layout: count every layer whole (an over-estimate)
    return window, [(il % n != 0) if dense_first else (il % n < n - 1) for il in range(layers)]


def kv_bytes_per_sequence(info: GGUFInfo, ctx: int, n_batch: int = 512, swa_full: bool = False) -> int:
    """The KV of one sequence of `ctx` tokens: sliding-window layers hold their window and a batch
    (llama.cpp's default, and the engine's unless `swa_full`), rounded up to 256 cells."""
    return kv_bytes_shared(info, ctx, 1, 1, n_batch, swa_full)


def kv_bytes_shared(info: GGUFInfo, ctx: int, parallel: int, sequences: int, n_batch: int = 512,
                    swa_full: bool = False) -> int:
    """The KV of one cache of ctx x parallel cells shared by `sequences` (kv_unified): its
    sliding-window layers hold a window per sequence and one batch (llama.cpp's unified layout),
    rounded up to 256 cells, at most the whole cache. One sequence's own cache is the case 1, 1."""
    per_layer = _layer_kv_bytes(info)
    cells = ctx * parallel
    window, is_swa = (0, []) if swa_full else swa_layers(info)
    swa_cells = min(cells, -(-(window * sequences + n_batch) // 256) * 256) if window else cells
    return sum(b * (swa_cells if i < len(is_swa) and is_swa[i] else cells) for i, b in enumerate(per_layer))


@functools.lru_cache(maxsize=64)
def _info(path: str, size: int, mtime: int) -> GGUFInfo:
    return read_gguf(path)


def gguf_info(path: str | Path) -> GGUFInfo | None:
    """The header of `path`, read once per file version; None when it is not a GGUF."""
    p = Path(path)
    try:
        st = p.stat()
        return _info(str(p), st.st_size, st.st_mtime_ns)
    except (OSError, GGUFError):
        return None


@dataclass(frozen=True)
class Need:
    """Bytes a model takes: `host` in RAM and `device` on its GPU (0 when it runs on the CPU)."""

    device: str  # "cpu", or the GPU's key ("cuda:0", "vulkan:1"), or a split's ("cuda:0+cuda:1")
    host: int
    gpu: int
    parts: dict[str, int] = field(default_factory=dict)
    context: int = 0
    parallel: int = 0
    shares: dict[str, float] = field(default_factory=dict)  # a split: each GPU's share of `gpu`
    copies: tuple[str, ...] = ()  # replicas: the GPUs holding a whole copy each (`host` is per copy)

    def on(self, device: str) -> int:
        if device == "cpu":
            return self.host * max(1, len(self.copies))
        if self.shares:
            return int(self.gpu * self.shares.get(device, 0.0))
        if self.copies:
            return self.gpu if device in self.copies else 0
        return self.gpu if device == self.device else 0

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in self.parts.items() if v)
        where = f"{self.host / MiB:.0f} MiB RAM" + (f" + {self.gpu / MiB:.0f} MiB on {self.device}" if self.gpu else "")
        return f"{where} ({parts}; context {self.context} x {self.parallel} sequences)"


def estimate(info: GGUFInfo, context: int, parallel: int, device: str = "cpu", worker: bool = True,
             swa_full: bool = False, shared: int = 0, host_cache: int = 0) -> Need:
    """The memory of `info` served with `context` tokens per sequence and `parallel` sequences on
    `device` ("cpu" or a GPU key), with the engine's batch of 512 tokens; `shared` > 0: one KV cache
    of context x parallel cells shared by that many sequences (kv_unified), whose per-sequence
    buffers and sliding windows count for each; `host_cache`: the bytes of its host prefix cache
    (in RAM, pinned or not), counted whole as it may fill."""
    ctx = min(context, info.context_length) if info.context_length else context
    seqs = max(shared, parallel)
    if shared:
        kv = kv_bytes_shared(info, ctx, parallel, seqs, swa_full=swa_full)
    else:
        kv = kv_bytes_per_sequence(info, ctx, swa_full=swa_full) * parallel
    compute = RUNTIME_BYTES + PER_VOCAB_BYTES * info.n_vocab
    weights = info.weight_bytes
    embed = next((t.nbytes for t in info.tensors if t.name == "token_embd.weight"), 0)
    process = WORKER_BYTES if worker else 0
    if device == "cpu":
        parts = {"weights": weights, "projector": info.projector_bytes, "kv": kv, "compute": compute,
                 "host cache": host_cache, "worker": process}
        return Need("cpu", sum(parts.values()), 0, parts, ctx, parallel)
    gpu_parts = {"weights": weights - embed, "projector": info.projector_bytes, "kv": kv, "compute": compute,
                 "gpu runtime": GPU_CONTEXT_BYTES}
    host_parts = {"embeddings": embed, "runtime": GPU_RUNTIME_HOST_BYTES + PER_SEQ_VOCAB_HOST_BYTES * info.n_vocab * seqs,
                  "host cache": host_cache, "worker": process}
    return Need(device, sum(host_parts.values()), sum(gpu_parts.values()), {**gpu_parts, **host_parts}, ctx, parallel)


@runtime_checkable
class KvOptions(Protocol):
    """What the estimate reads of a runtime's options (EngineConfig.options; llama.cpp's have
    them): its KV layout and host prefix cache."""

    @property
    def kv_unified(self) -> bool: ...
    @property
    def sequences(self) -> int: ...
    @property
    def swa_full(self) -> bool: ...
    @property
    def prefix_cache_mib(self) -> int: ...


@dataclass(frozen=True)
class _DefaultKv:
    kv_unified: bool = False
    sequences: int = 0
    swa_full: bool = False
    prefix_cache_mib: int = -1


def kv_options(config: EngineConfig) -> KvOptions:
    """`config`'s KV options; llama.cpp's defaults where its runtime's options have none."""
    o = config.options
    return o if isinstance(o, KvOptions) else _DefaultKv()


def shared_sequences(config: EngineConfig) -> int:
    """The sequences sharing one KV cache in an EngineConfig (`kv_unified`), else 0."""
    kv = kv_options(config)
    return max(kv.sequences, config.parallel) if kv.kv_unified else 0


def fit(info: GGUFInfo, context: int, parallel: int, device: str, room_host: int, room_gpu: int | None,
        min_context: int = 2048, swa_full: bool = False, shared: int = 0, host_cache: int = 0) -> tuple[Need, str]:
    """The largest way to serve `info` within the room given: first a smaller host prefix cache
    (the RAM left, down to none), then fewer sequences (down to one), then a shorter context
    (halved, not below `min_context` or the asked one). (need, what was changed, "" when nothing);
    the need returned may still not fit (the caller refuses it)."""

    def need(c: int, p: int, cache: int = 0) -> Need:
        return estimate(info, c, p, device, swa_full=swa_full, shared=shared, host_cache=cache)

    def fits(n: Need) -> bool:
        return n.host <= room_host and (room_gpu is None or n.gpu <= room_gpu)

    first = need(context, parallel, host_cache)
    if fits(first):
        return first, ""
    bare = need(context, parallel)
    cache = min(host_cache, max(0, room_host - bare.host)) // MiB * MiB
    if fits(n := need(context, parallel, cache)):
        return n, f"host cache {host_cache // MiB} -> {cache // MiB} MiB"
    p, c = parallel, first.context
    while p > 1:
        p -= 1
        if fits(n := need(c, p)):
            return n, f"parallel {parallel} -> {p}"
    floor = min(min_context, c)
    while c > floor:
        c = max(floor, c // 2)
        if fits(n := need(c, 1)):
            return n, f"parallel {parallel} -> 1, context {first.context} -> {c}"
    return need(c, 1), ""


def fit_budgets(info: GGUFInfo, context: int, parallel: int, device: str,
                budgets: dict[str, int], swa_full: bool = False, shared: int = 0,
                host_cache: int = 0) -> tuple[Need, str, str]:
    """`fit` within `budgets` (which has "cpu"): (need, what was sized down, "" when it fits or else
    the budget it exceeds, e.g. "450 MiB RAM" or "2048 MiB RAM, 7000 MiB on cuda:0")."""
    room_host = budgets["cpu"]
    room_gpu = budgets.get(device) if device != "cpu" else None  # unknown GPU memory: RAM only
    need, changed = fit(info, context, parallel, device, room_host, room_gpu, min_context=min(2048, context),
                        swa_full=swa_full, shared=shared, host_cache=host_cache)
    if need.host > room_host or (room_gpu is not None and need.gpu > room_gpu):
        return need, "", f"{room_host / MiB:.0f} MiB RAM" + (f", {room_gpu / MiB:.0f} MiB on {device}" if room_gpu else "")
    return need, changed, ""


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; (0, 0) where /proc/meminfo is not there."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, avail


def default_reserve(total: int) -> int:
    """What a budget leaves to the system and other programs: 10% of the memory, at least 1 GiB
    (half of it on a machine of 2 GiB or less)."""
    return min(max(GiB, total // 10), total // 2)


# The most a model's host prefix cache takes when it is sized automatically (llama-server's --cache-ram default).
HOST_CACHE_MAX = 8 * GiB


def auto_host_cache(room: int) -> int:
    """The host prefix cache a model gets by default: a quarter of the RAM budget still free, at most
    HOST_CACHE_MAX, in whole MiB."""
    return min(HOST_CACHE_MAX, max(0, room) // 4) // MiB * MiB


def fit_config(info: GGUFInfo, config: EngineConfig, device: str, budgets: dict[str, int], ram_used: int = 0
               ) -> tuple[Need, str, str]:
    """`fit_budgets` for an EngineConfig, with its host prefix cache: the size it sets
    (`prefix_cache_mib` 0: none), or by default a quarter of the RAM budget left beside this model
    and the `ram_used` by others (auto_host_cache)."""
    kv = kv_options(config)
    shared = shared_sequences(config)
    mmproj = str(getattr(config.options, "mmproj", "") or "")
    if mmproj and os.path.isfile(mmproj):  # its weights beside the model's (an image's KV is in the context's)
        info = dataclasses.replace(info, projector_bytes=os.path.getsize(mmproj))
    if kv.prefix_cache_mib >= 0:
        cache = kv.prefix_cache_mib * MiB
    else:
        bare = estimate(info, config.context_length, config.parallel, device, swa_full=kv.swa_full, shared=shared)
        cache = auto_host_cache(budgets["cpu"] - ram_used - bare.host)
    return fit_budgets(info, config.context_length, config.parallel, device, budgets, swa_full=kv.swa_full,
                       shared=shared, host_cache=cache)
