"""The registry of engine factories: each runtime registers one under its name (its descriptor, in
engines/runtimes.py, names the module that does, imported when a model first loads on it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engines import runtimes
from engines.base import Engine, EngineConfig, ModelLoadError

EngineFactory = Callable[[EngineConfig], Engine]

_FACTORIES: dict[str, EngineFactory] = {}


def register_runtime(name: str) -> Callable[[EngineFactory], EngineFactory]:
    def deco(factory: EngineFactory) -> EngineFactory:
        _FACTORIES[name] = factory
        return factory

    return deco


def runtime_names() -> list[str]:
    return sorted(set(_FACTORIES) | {r.name for r in runtimes.runtimes()})


def create_engine(runtime: str, config: EngineConfig) -> Engine:
    described = runtimes.runtime(runtime) if runtime not in _FACTORIES else None
    if described is not None:
        # Adapters are imported on first use, so a missing optional runtime never breaks the others.
        importlib.import_module(described.engine_module)
    factory = _FACTORIES.get(runtime)
    if factory is None:
        raise ModelLoadError(f"unknown runtime {runtime!r}; known: {', '.join(runtime_names())}")
    return factory(config)
