"""Gateway settings: the one reader of environment variables.  CLI flags override them."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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
    max_resident: int = 2  # models kept loaded at once (LRU)
    parallel: int | None = None  # sequences per model; models.yaml / runtime default when unset
    threads: int = 0  # CPU threads per model; 0 = all cores
    max_queue: int = 64  # requests that may wait per model
    preload: bool = True  # load the default model at start-up (/health is 503 until done)
    log_level: str = "info"
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
    functional_check: bool = True  # load + one token before an engine is trusted
    isolate_check: bool = True  # run that check in a child process first (survives driver crashes)
    check_timeout: float = 300.0  # seconds; Vulkan on a software device compiles pipelines slowly
    # Shadow parity: re-score a sample of finished requests on a reference engine (off when None).
    parity_reference: str | None = None  # engine choice, e.g. "cpu"
    parity_sample: float = 0.05  # share of finished requests re-scored
    parity_window: int = 20  # samples per (model, engine) judged together for drift
    parity_queue: int = 16  # samples waiting to be scored; more are dropped (and counted)
    parity_enforce: bool = False  # take a drifting engine out of selection (fall back)

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
            parallel=int(e["GATEWAY_PARALLEL"]) if e.get("GATEWAY_PARALLEL") else None,
            threads=int(e.get("GATEWAY_THREADS", cls.threads)),
            max_queue=int(e.get("GATEWAY_MAX_QUEUE", cls.max_queue)),
            preload=e.get("GATEWAY_PRELOAD", "1") not in ("0", "false", "no"),
            log_level=e.get("GATEWAY_LOG_LEVEL", cls.log_level),
            api_key=e.get("GATEWAY_API_KEY") or None,
            functional_check=e.get("GATEWAY_FUNCTIONAL_CHECK", "1") not in ("0", "false", "no"),
            isolate_check=e.get("GATEWAY_ISOLATE_CHECK", "1") not in ("0", "false", "no"),
            check_timeout=float(e.get("GATEWAY_CHECK_TIMEOUT", cls.check_timeout)),
            parity_reference=e.get("GATEWAY_PARITY_REFERENCE") or None,
            parity_sample=float(e.get("GATEWAY_PARITY_SAMPLE", cls.parity_sample)),
            parity_window=int(e.get("GATEWAY_PARITY_WINDOW", cls.parity_window)),
            parity_queue=int(e.get("GATEWAY_PARITY_QUEUE", cls.parity_queue)),
            parity_enforce=e.get("GATEWAY_PARITY_ENFORCE", "0") in ("1", "true", "yes"),
        )
        return replace(s, **{k: v for k, v in overrides.items() if v is not None})
