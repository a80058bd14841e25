"""Choosing where a model runs: a pure function from (model, host, preference) to a plan.

`plan()` reads nothing but its arguments, so every host case is a table row in the tests.
A plan is an ordered list of candidates to try, plus what was left out and why; the pool
tries the candidates in order (functional check, then load) and falls back on failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from engines.host import HostCapabilities
from engines.runtimes import Preference, Runtime, Skip, engine_order, runtimes
from gateway.models.registry import ModelSpec

__all__ = ["Candidate", "Plan", "Preference", "SelectionError", "Skip", "plan"]


ANY = Preference()  # --engine auto, any runtime, any device


class SelectionError(ValueError):
    """No candidate can serve the request; the message says what is missing."""


@dataclass(frozen=True)
class Candidate:
    runtime: str
    backend: str  # the engine: cpu, vulkan, cuda, metal, directml, coreml
    device: str  # human-readable device name
    device_key: str  # the runtime's own id: ggml "Vulkan0"/"CUDA0", ORT device id; "" for CPU
    format: str
    device_index: int | None = None
    rank: int = 0  # position of its engine in the preference order
    lib_path: str = ""  # the folder of the runtime build that serves it; "" = the installed package's

    @property
    def label(self) -> str:
        return f"{self.runtime}/{self.backend}"


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skip, ...] = ()

    def unusable(self, before: Candidate | None = None) -> list[Skip]:
        """Engines that are present but cannot serve; with `before`, only those preferred to it."""
        return [s for s in self.skipped if s.kind == "unusable" and (before is None or s.rank < before.rank)]


def _format(rt: Runtime, variant: str | None, have: set[str]) -> tuple[str, bool]:
    """The format a candidate of `rt` needs, and whether the model has it. A format bound to the
    engine (`pte:vulkan`) is there when named, or when the bare format is given without variants."""
    fmt = rt.format
    if variant is None:
        return fmt, fmt in have
    bound = any(h.startswith(f"{fmt}:") for h in have)
    return f"{fmt}:{variant}", f"{fmt}:{variant}" in have or (fmt in have and not bound)


def plan(
    spec: ModelSpec,
    host: HostCapabilities,
    pref: Preference = ANY,
    formats: Iterable[str] | None = None,
    registered: Iterable[Runtime] | None = None,
) -> Plan:
    """Ordered candidates for `spec` on `host` under `pref`.

    `formats` are the model formats available (the registry's sources plus converted
    artifacts); by default those listed in models.yaml. `registered`: the runtimes to choose
    from (default: every registered one). Raises SelectionError when nothing can serve, with
    every reason.
    """
    have = set(formats if formats is not None else spec.formats)
    described = {r.name: r for r in (registered if registered is not None else runtimes())}
    offered = engine_order(described.values())
    if pref.engine != "auto" and pref.engine not in offered:
        raise SelectionError(f"unknown engine {pref.engine!r}; expected auto or one of {', '.join(offered)}")
    if pref.runtime is not None and pref.runtime not in described:
        raise SelectionError(f"unknown runtime {pref.runtime!r}; expected one of {', '.join(described)}")
    engines = [pref.engine] if pref.engine != "auto" else list(spec.engines or offered)
    runtimes_ = [r for r in (spec.runtimes or list(described)) if pref.runtime in (None, r)]
    if pref.runtime and pref.runtime not in runtimes_:
        raise SelectionError(f"model {spec.id!r} does not list runtime {pref.runtime!r} (it lists {spec.runtimes})")

    out: list[Candidate] = []
    skipped: list[Skip] = []
    for rank, engine in enumerate(engines):
        serving = [r for r in described.values() if r.offer(engine) is not None and r.name in runtimes_]
        for rt in sorted(serving, key=lambda r: runtimes_.index(r.name)):
            offer = rt.offer(engine)
            assert offer is not None
            fmt, present = _format(rt, offer.variant, have)
            if not present:
                why = f"model {spec.id!r} has no {fmt} format{rt.convert_hint(offer.variant)}"
                skipped.append(Skip(f"{rt.name}/{engine}", why, rank=rank))
                continue
            found, skips = offer.find(host, pref)
            skipped.extend(replace(s, rank=rank) for s in skips)
            for d in found:
                out.append(Candidate(rt.name, engine, d.name, d.key, fmt, d.index, rank, d.lib_path))
    if not out:
        why = "; ".join(f"{s.what}: {s.why}" for s in skipped) or "no runtime is configured"
        wanted = f"--engine {pref.engine}" + (f" --runtime {pref.runtime}" if pref.runtime else "")
        if pref.device is not None:
            wanted += f" --device {pref.device}"
        raise SelectionError(f"{wanted} cannot serve model {spec.id!r} on this host: {why}")
    return Plan(tuple(out), tuple(skipped))
