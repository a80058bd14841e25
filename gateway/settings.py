"""Gateway settings: the one reader of environment variables.  CLI flags override them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ENGINE_CHOICES = ("auto", "cpu", "vulkan", "cuda", "metal", "directml", "coreml")


def _default_config() -> str:
    here = Path.cwd() / "models.yaml"
    if here.exists():
        return str(here)
    return str(Path(__file__).resolve().parent.parent / "models.yaml")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    config: str = ""
    model: str | None = None  # the default model; models.yaml's `default` when unset
    engine: str = "auto"
    runtime: str | None = None  # pin a runtime: llamacpp, ortgenai, coreml
    device: str | None = None  # GPU index or part of its name
    max_resident: int = 0  # models kept loaded at once (LRU); 0 = as many as the memory budgets allow
    # Memory-aware residency (gateway/models/memory.py): bytes models may take in RAM / on each GPU
    # (None: the device's memory less memory_reserve, or 10% of it, at least 1 GiB).
    memory_budget: int | None = None
    gpu_memory_budget: int | None = None
    memory_reserve: int | None = None
    # Seconds a model stays loaded after its last request (Ollama's keep_alive, default 5 minutes;
    # negative: until evicted); models.yaml `keep_alive` and Ollama requests override it. The default
    # model stays unless keep_default is off.
    keep_alive: float = 300.0
    keep_default: bool = True
    parallel: int | None = None  # sequences per model; models.yaml / runtime default when unset
    # llama.cpp: requests run at once per model in one KV cache shared by them (kv_unified) of
    # context x parallel tokens; None: models.yaml's layout.
    sequences: int | None = None
    threads: int = 0  # CPU threads per model; 0 = all cores
    max_queue: int = 64  # requests that may wait per model
    preload: bool = True  # load the default model at start-up (/health is 503 until done)
    max_queue_wait: float = 30.0  # seconds a request may wait for a slot; longer estimated waits get 429 at once
    # llama.cpp's host-memory prefix cache per model, in MiB (None: models.yaml's, else a quarter of
    # the available memory up to 8 GiB; 0 = off), and prompt tokens per step beside running streams.
    prefix_cache: int | None = None
    # GATEWAY_PINNED_HOST_CACHE: the host prefix cache in page-locked memory: auto (CUDA/ROCm), on, off.
    pinned_host_cache: str = "auto"
    prefill_budget: int | None = None
    drain_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM/SIGINT
    max_body: int = 4 * 1024 * 1024  # request body limit in bytes (413 beyond)
    max_messages: int = 2048  # chat messages per request
    max_prompt_chars: int = 1_000_000  # characters of prompt text per request, checked before tokenizing
    log_level: str = "info"
    # When set, /v1 needs "Authorization: Bearer <key>": one key, a comma-separated list, or a file of
    # one key per line. Never printed (repr=False).
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    metrics_api_key: str | None = field(default=None, repr=False)  # when set, /metrics needs it too
    allowed_origins: tuple[str, ...] = ()  # browser origins beyond loopback ones; "*" allows any
    allowed_hosts: tuple[str, ...] = ()  # Host header names beyond loopback ones (DNS-rebinding guard)
    functional_check: bool = True  # load + one token before an engine is trusted
    isolate_check: bool = True  # run that check in a child process first (survives driver crashes)
    check_timeout: float = 300.0  # seconds; Vulkan on a software device compiles pipelines slowly
    # Rank candidates that share a device by a measured decode speed (32 tokens each, cached with the
    # functional check): off by default, since the first start loads every such candidate once.
    rank_by_speed: bool = False
    # Engines in supervised worker processes (one per loaded model); off = inside the gateway process.
    workers: bool = True
    worker_heartbeat_timeout: float = 3.0  # seconds without a heartbeat answer before a worker is killed
    worker_step_timeout: float = 120.0  # seconds one engine step may run before the worker is killed
    worker_max_crashes: int = 3  # crashes within worker_crash_window before the engine falls back
    worker_crash_window: float = 300.0
    worker_plugins: tuple[str, ...] = ()  # modules a worker imports first (they register runtimes)
    # Shadow parity: re-score a sample of finished requests on a reference engine (off when None).
    parity_reference: str | None = None  # engine choice, e.g. "cpu"
    parity_sample: float = 0.05  # share of finished requests re-scored
    parity_window: int = 20  # samples per (model, engine) judged together for drift
    parity_queue: int = 16  # samples waiting to be scored; more are dropped (and counted)
    parity_enforce: bool = False  # take a drifting engine out of selection (fall back)
    # llama.cpp: sample on the device (auto, on, off); overrides models.yaml's `device_sampling`.
    device_sampling: str | None = None
    # llama.cpp builds with loadable CPU variants: pin one ("haswell", "icelake", "sapphirerapids" for
    # AMX …); None = auto, the fastest supported non-AMX variant (engines/llamacpp/ggml_backends.py).
    cpu_variant: str | None = None
    # A serving engine that kept crashing is recorded like a failed check, but only this long
    # (seconds): then it is tried again (its rung of the ladder is retried first).
    crash_verdict_ttl: float = 1800.0
    worker_max_backoff: float = 30.0  # the longest wait between restarts of an only engine
    # A stream whose engine died continues on the restarted (or next) engine from the tokens already
    # sent: at most this many times per request, each waiting at most failover_wait seconds for
    # the engine to be back. 0 = off (the stream ends with engine_failed).
    failover_budget: int = 2
    failover_wait: float = 120.0
    # exact: the tokens already sent are fed one per step, as they were generated (greedy output as
    # uninterrupted; the gap grows with them); fast: in one prefill batch.
    failover_replay: str = "exact"
    # The Responses API's stored responses: an SQLite file in the model cache folder (or this path),
    # at most this many, kept this many days; off: `store` is ignored and nothing is kept.
    responses_store: bool = True
    responses_db: str | None = None
    responses_max: int = 10_000
    responses_max_age_days: float = 30.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        e = os.environ if env is None else env
        s = cls(
            host=e.get("GATEWAY_HOST", cls.host),
            port=int(e.get("GATEWAY_PORT", cls.port)),
            config=e.get("GATEWAY_CONFIG", "") or _default_config(),
            model=e.get("GATEWAY_MODEL") or None,
            engine=e.get("GATEWAY_ENGINE", cls.engine),
            runtime=e.get("GATEWAY_RUNTIME") or None,
            device=e.get("GATEWAY_DEVICE") or None,
            max_resident=int(e.get("GATEWAY_MAX_MODELS", cls.max_resident)),
            memory_budget=parse_size(e["GATEWAY_MEMORY_BUDGET"]) if e.get("GATEWAY_MEMORY_BUDGET") else None,
            gpu_memory_budget=parse_size(e["GATEWAY_GPU_MEMORY_BUDGET"]) if e.get("GATEWAY_GPU_MEMORY_BUDGET") else None,
            memory_reserve=parse_size(e["GATEWAY_MEMORY_RESERVE"]) if e.get("GATEWAY_MEMORY_RESERVE") else None,
            keep_alive=parse_duration(e.get("GATEWAY_KEEP_ALIVE", str(cls.keep_alive))),
            keep_default=e.get("GATEWAY_KEEP_DEFAULT", "1") not in ("0", "false", "no"),
            parallel=int(e["GATEWAY_PARALLEL"]) if e.get("GATEWAY_PARALLEL") else None,
            sequences=int(e["GATEWAY_SEQUENCES"]) if e.get("GATEWAY_SEQUENCES") else None,
            threads=int(e.get("GATEWAY_THREADS", cls.threads)),
            max_queue=int(e.get("GATEWAY_MAX_QUEUE", cls.max_queue)),
            preload=e.get("GATEWAY_PRELOAD", "1") not in ("0", "false", "no"),
            max_queue_wait=float(e.get("GATEWAY_MAX_QUEUE_WAIT", cls.max_queue_wait)),
            prefix_cache=parse_mib(e["GATEWAY_PREFIX_CACHE"]) if e.get("GATEWAY_PREFIX_CACHE") else None,
            pinned_host_cache=_on_off(e.get("GATEWAY_PINNED_HOST_CACHE", "auto")),
            prefill_budget=int(e["GATEWAY_PREFILL_BUDGET"]) if e.get("GATEWAY_PREFILL_BUDGET") else None,
            drain_timeout=float(e.get("GATEWAY_DRAIN_TIMEOUT", cls.drain_timeout)),
            max_body=parse_size(e.get("GATEWAY_MAX_BODY", str(cls.max_body))),
            max_messages=int(e.get("GATEWAY_MAX_MESSAGES", cls.max_messages)),
            max_prompt_chars=int(e.get("GATEWAY_MAX_PROMPT_CHARS", cls.max_prompt_chars)),
            log_level=e.get("GATEWAY_LOG_LEVEL", cls.log_level),
            api_key=e.get("GATEWAY_API_KEY") or None,
            api_key_file=e.get("GATEWAY_API_KEY_FILE") or None,
            metrics_api_key=e.get("GATEWAY_METRICS_API_KEY") or None,
            allowed_origins=split_list(e.get("GATEWAY_ALLOWED_ORIGINS", "")),
            allowed_hosts=split_list(e.get("GATEWAY_ALLOWED_HOSTS", "")),
            functional_check=e.get("GATEWAY_FUNCTIONAL_CHECK", "1") not in ("0", "false", "no"),
            isolate_check=e.get("GATEWAY_ISOLATE_CHECK", "1") not in ("0", "false", "no"),
            check_timeout=float(e.get("GATEWAY_CHECK_TIMEOUT", cls.check_timeout)),
            rank_by_speed=e.get("GATEWAY_RANK_BY_SPEED", "0") in ("1", "true", "yes"),
            workers=e.get("GATEWAY_WORKERS", "1") not in ("0", "false", "no"),
            worker_heartbeat_timeout=float(e.get("GATEWAY_WORKER_HEARTBEAT_TIMEOUT", cls.worker_heartbeat_timeout)),
            worker_step_timeout=float(e.get("GATEWAY_WORKER_STEP_TIMEOUT", cls.worker_step_timeout)),
            worker_max_crashes=int(e.get("GATEWAY_WORKER_MAX_CRASHES", cls.worker_max_crashes)),
            worker_crash_window=float(e.get("GATEWAY_WORKER_CRASH_WINDOW", cls.worker_crash_window)),
            worker_plugins=split_list(e.get("GATEWAY_WORKER_PLUGINS", "")),
            parity_reference=e.get("GATEWAY_PARITY_REFERENCE") or None,
            parity_sample=float(e.get("GATEWAY_PARITY_SAMPLE", cls.parity_sample)),
            parity_window=int(e.get("GATEWAY_PARITY_WINDOW", cls.parity_window)),
            parity_queue=int(e.get("GATEWAY_PARITY_QUEUE", cls.parity_queue)),
            parity_enforce=e.get("GATEWAY_PARITY_ENFORCE", "0") in ("1", "true", "yes"),
            device_sampling=e.get("GATEWAY_DEVICE_SAMPLING") or None,
            cpu_variant=e.get("GATEWAY_CPU_VARIANT") or None,
            crash_verdict_ttl=float(e.get("GATEWAY_CRASH_VERDICT_TTL", cls.crash_verdict_ttl)),
            worker_max_backoff=float(e.get("GATEWAY_WORKER_MAX_BACKOFF", cls.worker_max_backoff)),
            failover_budget=int(e.get("GATEWAY_FAILOVER_BUDGET", cls.failover_budget)),
            failover_wait=float(e.get("GATEWAY_FAILOVER_WAIT", cls.failover_wait)),
            failover_replay=e.get("GATEWAY_FAILOVER_REPLAY", cls.failover_replay),
            responses_store=e.get("GATEWAY_RESPONSES_STORE", "1") not in ("0", "false", "no"),
            responses_db=e.get("GATEWAY_RESPONSES_DB") or None,
            responses_max=int(e.get("GATEWAY_RESPONSES_MAX", cls.responses_max)),
            responses_max_age_days=float(e.get("GATEWAY_RESPONSES_MAX_AGE_DAYS", cls.responses_max_age_days)),
        )
        s = replace(s, **{k: v for k, v in overrides.items() if v is not None})
        if s.failover_replay not in ("exact", "fast"):
            raise ValueError(f"GATEWAY_FAILOVER_REPLAY must be exact or fast, not {s.failover_replay!r}")
        if s.device_sampling not in (None, "auto", "on", "off"):
            raise ValueError(f"GATEWAY_DEVICE_SAMPLING must be auto, on or off, not {s.device_sampling!r}")
        if s.sequences is not None and not 1 <= s.sequences <= 256:
            raise ValueError(f"--sequences (GATEWAY_SEQUENCES) must be 1-256, not {s.sequences}")
        if s.pinned_host_cache not in ("auto", "on", "off"):
            raise ValueError(f"GATEWAY_PINNED_HOST_CACHE must be auto, on or off, not {s.pinned_host_cache!r}")
        return s

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key: --api-key / GATEWAY_API_KEY (comma-separated) and the key file."""
        keys = list(split_list(self.api_key or ""))
        if self.api_key_file:
            text = Path(self.api_key_file).read_text()
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        return tuple(dict.fromkeys(keys))


def split_list(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_size(value: str) -> int:
    """Bytes from "4194304", "4M", "512k", "2MiB"."""
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(v[-1:], 1)
    number = v[:-1] if scale != 1 else v
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{value!r} is not a size (e.g. 4M, 512k, 2GiB)") from None
    if size <= 0:
        raise ValueError(f"size must be positive: {value!r}")
    return size


def parse_mib(value: str) -> int:
    """MiB from "2048" (a bare number is MiB, as llama-server's --cache-ram), "2G", "512M"; "0" = 0."""
    v = value.strip()
    if v.isdigit():
        return int(v)
    return parse_size(v) >> 20


def parse_duration(value: str) -> float:
    """Seconds from a number ("300", "-1") or a Go duration ("5m", "1h30m", "45s", "500ms"): Ollama's
    keep_alive spelling, used by --keep-alive too. ValueError says what is wrong with `value`."""
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, number, sign = 0.0, "", 1.0
    i = 0
    if text.startswith("-"):
        sign, i = -1.0, 1
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = next((u for u in ("ns", "us", "µs", "ms", "h", "m", "s") if text.startswith(u, i)), None)
        if unit is None or not number:
            raise ValueError(f"{value!r} is not a duration (e.g. 300, \"5m\", \"1h\", 0, -1)")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number:
        raise ValueError(f"{value!r} is missing a unit (s, m, h)")
    return sign * total


def _on_off(value: str) -> str:
    """A switch's value with the usual spellings of on and off (1, true, yes / 0, false, no) as
    `on` / `off`; anything else as written (the caller checks it)."""
    v = value.strip().lower()
    return "off" if v in ("0", "false", "no", "off") else "on" if v in ("1", "true", "yes", "on") else v
