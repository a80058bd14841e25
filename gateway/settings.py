"""Gateway settings: the one reader of the gateway's environment variables, and the one place a
setting is declared. Each field carries its type, default, help, variable (GATEWAY_<NAME> unless
`env` names another), its `gateway serve` flag where it has one, and its parser; the flags
(gateway/settings_flags.py) and the tables of docs/configuration.md (`gateway settings --markdown`)
are generated from them. A flag given on the command line wins over the variable."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from engines.envconfig import (
    EnvSettings,
    SettingError,
    parse_duration,
    parse_mib,
    parse_size,
    setting,
    split_list,
)
from engines.runtimes import engine_order

__all__ = ["engine_choices", "SettingError", "Settings", "parse_duration", "parse_mib", "parse_size", "split_list"]



def engine_choices() -> tuple[str, ...]:
    """`--engine`'s values: auto, and every engine a registered runtime offers (plug-ins' too)."""
    return ("auto", *engine_order())


def _default_config() -> str:
    here = Path.cwd() / "models.yaml"
    if here.exists():
        return str(here)
    return str(Path(__file__).resolve().parent.parent / "models.yaml")


class Settings(EnvSettings):
    """`gateway serve`'s settings (frozen; `model_copy(update=...)` for a changed copy)."""

    # --- what to serve, and where ---
    model: str | None = setting(
        None, "default model id; an `hf.co/…` name is pulled first", flag=True,
        shown="models.yaml's `default`", readme=True)
    engine: str = setting(
        "auto", "where to run (auto: the best engine that passes its functional check)", flag=True,
        choices=engine_choices, readme=True)
    runtime: str | None = setting(
        None, "pin a runtime: `llamacpp`, `ortgenai`, `coreml`, `executorch` or a plug-in's", flag=True, shown="any", readme=True)
    device: str | None = setting(
        None, "GPU by index or part of its name (see `gateway devices`); several (`0,1`, `all`): the GPUs every "
        "model may use, as models.yaml's `placement` says (replicas or a split)", flag=True, shown="the plan's first")
    rank_by_speed: bool = setting(
        False, "where several engines pass on one device, serve on the fastest (32-token decode, cached "
        "with the functional check; the first start loads each such candidate once)", flag=True)
    host: str = setting("127.0.0.1", "bind address", flag=True, readme=True)
    port: int = setting(8080, "port", flag=True, ge=0, le=65535, readme=True)
    config: str = setting(
        help="models.yaml path", flag=True, default_factory=_default_config,
        shown="`./models.yaml`, else the package's", readme=True)
    # --- residency: which models stay loaded (gateway/models/memory.py) ---
    max_resident: int = setting(
        0, "models kept loaded at most (LRU; 0: as many as the memory budgets allow)",
        env="GATEWAY_MAX_MODELS", flag="--max-models", ge=0)
    memory_budget: int | None = setting(
        None, "RAM the models may take, e.g. 12G", flag=True, parse="size",
        shown="RAM less `--memory-reserve`", readme=True)
    gpu_memory_budget: int | None = setting(
        None, "memory the models may take on each GPU", flag=True, parse="size",
        shown="each GPU's memory less 5 %, at least 512 MiB")
    memory_reserve: int | None = setting(
        None, "memory left to the system and other programs", flag=True, parse="size",
        shown="10 % of RAM, at least 1 GiB")
    # Ollama's keep_alive; models.yaml `keep_alive` and Ollama requests override it.
    keep_alive: float = setting(
        300.0, "how long an idle model stays loaded: 300, 5m, 1h (-1: until evicted)", flag=True,
        parse="duration", readme=True)
    keep_default: bool = setting(
        True, "let the default model unload after `--keep-alive` too (it stays loaded otherwise)",
        flag="--unload-default")
    # --- how a model runs ---
    parallel: int | None = setting(
        None, "sequences decoded together per model", flag=True, ge=1, shown="models.yaml's, else the runtime's",
        readme=True)
    # llama.cpp: requests at once per model in one KV cache shared by them (kv_unified).
    sequences: int | None = setting(
        None, "llama.cpp: run up to N requests at once per model in one KV cache shared by them "
        "(llama-server's layout) of context x `--parallel` tokens; more conversations keep their KV on the device",
        flag=True, ge=1, le=256, metavar="N", shown="models.yaml's layout, one KV per sequence")
    threads: int = setting(0, "CPU threads per model (0: all cores)", flag=True, ge=0)
    # --- admission and limits ---
    max_queue: int = setting(64, "requests that may wait per model", flag=True, ge=0)
    max_queue_wait: float = setting(
        30.0, "seconds a request may wait for a slot; longer estimated waits get 429 at once", flag=True, ge=0,
        readme=True)
    preload: bool = setting(True, "load the default model at start-up (`/health` is 503 until done)")
    drain_timeout: float = setting(
        30.0, "seconds running requests get to finish after SIGTERM/SIGINT", flag=True, ge=0, readme=True)
    serve_stream_interval: float = setting(
        0.02, "Ray Serve: seconds a stream's tokens may wait in their replica to travel on together (each "
        "message between Ray's processes costs more than a token does; 0: each token alone)", ge=0, le=1)
    max_body: int = setting(4 * 1024 * 1024, "request body limit (413 beyond)", flag=True, parse="size")
    max_messages: int = setting(2048, "chat messages per request", ge=1)
    max_prompt_chars: int = setting(
        1_000_000, "characters of prompt text per request, checked before tokenizing", ge=1)
    max_image_bytes: int = setting(
        20 * 1024 * 1024, "bytes of one image in a request, decoded (the body limit bounds them too)",
        parse="size", ge=1)
    image_fetch: Literal["off", "public", "any"] = setting(
        "off", "http(s) image URLs in requests: off (images travel in the request), public (fetched from "
        "hosts whose addresses are all public), any (private and loopback hosts too)", flag=True,
        choices=("off", "public", "any"))
    image_fetch_timeout: float = setting(10.0, "seconds a fetched image may take, its whole download", ge=0.1)
    # --- llama.cpp's KV memory ---
    prefix_cache: int | None = setting(
        None, "llama.cpp: host memory per model for the KV of conversations that lost their sequence, "
        "e.g. 2G; a bare number is MiB (0: off)", flag=True, parse="mib", ge=0,
        shown="models.yaml's, else a quarter of the available memory, at most 8G")
    pinned_host_cache: Literal["auto", "on", "off"] = setting(
        "auto", "the host prefix cache in page-locked memory (auto: on CUDA and ROCm)")
    prefill_budget: int | None = setting(
        None, "llama.cpp: prompt tokens prefilled per step beside running streams (above 512 the pass grows "
        "with it: on a GPU, 4096 keeps many streams' gaps between tokens short)", flag=True, ge=1,
        shown="CPU 128, Vulkan 256, CUDA 512")
    device_sampling: Literal["auto", "on", "off"] | None = setting(
        None, "llama.cpp: sampling inside the graph, for every model (overrides models.yaml's `device_sampling`)",
        shown="models.yaml's")
    # Builds with loadable CPU variants (engines/llamacpp/ggml_backends.py); also read by the engines.
    cpu_variant: str | None = setting(
        None, "pin llama.cpp's CPU variant: `haswell`, `zen4`, `sapphirerapids` (AMX), …",
        shown="auto (the fastest non-AMX)")
    # --- access ---
    # One key, a comma-separated list, or (api_key_file) a file of one key per line; never printed.
    api_key: str | None = setting(
        None, "bearer token(s) required on `/v1` and `/api/*`, comma-separated (`/health` stays open)",
        flag=True, secret=True, readme=True)
    api_key_file: str | None = setting(None, "file of accepted API keys, one per line", flag=True)
    metrics_api_key: str | None = setting(None, "bearer token required on `/metrics`", flag=True, secret=True)
    allowed_origins: tuple[str, ...] = setting(
        (), "browser origins allowed besides loopback ones (comma-separated; `*`: any)", flag=True,
        shown="loopback origins")
    allowed_hosts: tuple[str, ...] = setting(
        (), "Host names accepted besides loopback ones (the DNS-rebinding guard; `*`: any)", flag=True,
        shown="loopback names")
    log_level: str = setting("info", "log level (`debug` logs every engine pass and collections over 5 ms)")
    # --- trusting engines ---
    functional_check: bool = setting(True, "check an engine (load + one token) before trusting it")
    check_models: bool = setting(True, "skip `gateway check` on a model's first load (it runs when the kept report "
                                 "is for another file, engine or template, in the background: one probe at a "
                                 "time, each when no request of the model runs or waits)", flag="--no-check-models")
    isolate_check: bool = setting(True, "run that check in a child process first (survives driver crashes)")
    # Vulkan on a software device compiles pipelines slowly.
    check_timeout: float = setting(300.0, "seconds a functional check may take", ge=0)
    # --- worker processes ---
    workers: bool = setting(
        True, "engines in supervised worker processes (one per loaded model); off: inside the gateway process "
        "(one llama.cpp build only)")
    worker_heartbeat_timeout: float = setting(
        3.0, "seconds without a heartbeat answer before a worker is killed", ge=0)
    worker_step_timeout: float = setting(120.0, "seconds one engine step may run before the worker is killed", ge=0)
    worker_max_crashes: int = setting(
        3, "counted crashes within `GATEWAY_WORKER_CRASH_WINDOW` before the engine falls back", ge=1)
    worker_crash_window: float = setting(300.0, "that window, in seconds", ge=0)
    worker_max_backoff: float = setting(30.0, "the longest wait between restarts of an only engine", ge=0)
    # Then it is tried again (its rung of the ladder first).
    crash_verdict_ttl: float = setting(
        1800.0, "seconds an engine that kept crashing stays recorded as failed", ge=0)
    worker_plugins: tuple[str, ...] = setting((), "modules a worker imports first (they register runtimes)")
    plugins: tuple[str, ...] = setting(
        (), "modules the gateway and its workers import first: each registers a runtime (docs/architecture.md)")
    # A stream whose engine died continues on the restarted (or next) engine from the tokens sent.
    failover_budget: int = setting(
        2, "failovers per request (0: a dying engine ends the stream with `engine_failed`)", ge=0)
    failover_wait: float = setting(120.0, "seconds a failover waits for the engine to be back", ge=0)
    failover_replay: Literal["exact", "fast"] = setting(
        "exact", "`exact`: the tokens already sent are fed one per step, as generated (greedy text as "
        "uninterrupted); `fast`: in one prefill batch")
    # --- shadow parity: re-score a sample of finished requests on a reference engine ---
    parity_reference: str | None = setting(
        None, "shadow parity: re-score sampled requests on this reference engine", flag=True,
        choices=lambda: engine_choices()[1:], shown="off")
    parity_sample: float = setting(0.05, "share of finished requests re-scored", flag=True, ge=0, le=1)
    parity_window: int = setting(20, "samples per (model, engine) judged together for drift", flag=True, ge=1)
    parity_queue: int = setting(
        16, "samples waiting to be scored (more are dropped and counted)", flag=True, ge=1)
    parity_enforce: bool = setting(False, "take a drifting engine out of selection (fall back)", flag=True)
    # --- the Responses API's stored responses ---
    responses_store: bool = setting(True, "keep stored responses (off: `store` is ignored)")
    responses_db: str | None = setting(
        None, "the SQLite file of stored responses", shown="`responses.sqlite3` in the model cache")
    responses_max: int = setting(10_000, "stored responses at most", ge=1)
    responses_max_age_days: float = setting(30.0, "days a stored response is kept", ge=0)
    # --- files ---
    models_dir: str | None = setting(
        None, "the user registry of pulled and created models",
        shown="`$XDG_DATA_HOME/llm-gateway/models.d` (`~/.local/share/…`)")

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key: --api-key / GATEWAY_API_KEY (comma-separated) and the key file."""
        keys = list(split_list(self.api_key or ""))
        if self.api_key_file:
            text = Path(self.api_key_file).read_text()
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        return tuple(dict.fromkeys(keys))
