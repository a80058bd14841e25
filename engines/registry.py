"""The registry of runtime adapters: each adapter registers a factory under its runtime name."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engines.base import Engine, EngineConfig, ModelLoadError

EngineFactory = Callable[[EngineConfig], Engine]

_FACTORIES: dict[str, EngineFactory] = {}
# Adapters imported on first use, so a missing optional runtime never breaks the others.
_BUILTIN = {"llamacpp": "engines.llamacpp.engine", "ortgenai": "engines.ortgenai", "coreml": "engines.coreml",
            "executorch": "engines.executorch"}


def register_runtime(name: str) -> Callable[[EngineFactory], EngineFactory]:
    def deco(factory: EngineFactory) -> EngineFactory:
        _FACTORIES[name] = factory
        return factory

    return deco


def runtime_names() -> list[str]:
    return sorted(set(_FACTORIES) | set(_BUILTIN))


def create_engine(runtime: str, config: EngineConfig) -> Engine:
    if runtime not in _FACTORIES and runtime in _BUILTIN:
        importlib.import_module(_BUILTIN[runtime])
    factory = _FACTORIES.get(runtime)
    if factory is None:
        raise ModelLoadError(f"unknown runtime {runtime!r}; known: {', '.join(runtime_names())}")
    return factory(config)
