"""Choosing where a model runs: pure functions from (model, preference) to an ordered plan."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.registry import ModelSpec

# Which file format each runtime consumes.
RUNTIME_FORMAT = {"llamacpp": "gguf", "ortgenai": "onnx"}
# Engines (backends) implemented so far, per runtime.
IMPLEMENTED = {"llamacpp": ("cpu",), "ortgenai": ("cpu",)}


class SelectionError(ValueError):
    """No candidate can serve the request; the message says what is missing."""


@dataclass(frozen=True)
class Candidate:
    runtime: str
    backend: str
    device: str
    format: str


def plan(spec: ModelSpec, engine: str = "auto") -> list[Candidate]:
    """Ordered candidates for `spec` under the user's `engine` preference."""
    out: list[Candidate] = []
    for runtime in spec.runtimes:
        fmt = RUNTIME_FORMAT.get(runtime)
        if fmt is None or fmt not in spec.formats:
            continue
        for backend in IMPLEMENTED.get(runtime, ()):
            if engine in ("auto", backend):
                out.append(Candidate(runtime, backend, "cpu" if backend == "cpu" else backend, fmt))
    if not out:
        if engine != "auto" and not any(engine in b for b in IMPLEMENTED.values()):
            raise SelectionError(
                f"--engine {engine} is not available in this build of the gateway yet; "
                "use --engine cpu (or auto)"
            )
        raise SelectionError(
            f"model {spec.id!r} has no format that runtimes {spec.runtimes} can serve "
            f"with engine {engine!r}"
        )
    return out
