"""Where a model goes when the host has several GPUs: pure decisions over the plan's candidates and
the memory budgets (models.yaml `devices:` and `placement:`).

- `devices` keeps the GPU candidates a model may use (indexes, parts of names, or `all`); the CPU
  stays a fallback.
- A split puts one copy across several GPUs of one engine and build (llama.cpp's layer or row
  split), each GPU's share of the layers proportional to its memory budget; `auto` splits only when
  one GPU cannot hold the model, `split` always (with two or more GPUs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.host.selection import Candidate

Devices = Sequence[int | str] | str | None  # models.yaml `devices`: indexes, name parts, "all"


@dataclass(frozen=True)
class Split:
    """One copy over several GPUs: the members in order (the first is the engine's own device),
    their budget keys ("cuda:0"), and each one's share of the layers."""

    members: tuple[Candidate, ...]
    keys: tuple[str, ...]
    shares: tuple[float, ...]

    @property
    def key(self) -> str:
        """The budget the split draws on as one: "cuda:0+cuda:1"."""
        return "+".join(self.keys)

    def room(self, budgets: Mapping[str, int]) -> int:
        return sum(budgets.get(k, 0) for k in self.keys)


def chosen(cand: Candidate, devices: Devices) -> bool:
    """Whether `devices` lets the model use `cand` (CPU candidates always: the fallback)."""
    if devices is None or devices == "all" or cand.device_index is None:
        return True
    wanted = [devices] if isinstance(devices, str | int) else list(devices)
    return any(int(d) == cand.device_index if isinstance(d, int) or d.isdigit() else d.lower() in cand.device.lower()
               for d in wanted)


def split_of(cand: Candidate, candidates: Sequence[Candidate], devices: Devices, budgets: Mapping[str, int],
             key_of: dict[Candidate, str]) -> Split | None:
    """`cand` with the other GPUs of its engine and build that `devices` allows, shares by their
    budgets; None where there is no second one (or a GPU of unknown memory)."""
    if cand.device_index is None:
        return None
    mates = [c for c in candidates if (c.runtime, c.backend, c.lib_path, c.format) ==
             (cand.runtime, cand.backend, cand.lib_path, cand.format) and c.device_index is not None
             and c != cand and chosen(c, devices)]
    members = (cand, *sorted(mates, key=lambda c: c.device_index or 0))
    keys = tuple(key_of[c] for c in members)
    if len(members) < 2 or len(set(keys)) < len(keys) or any(budgets.get(k, 0) <= 0 for k in keys):
        return None
    total = sum(budgets[k] for k in keys)
    return Split(members, keys, tuple(round(budgets[k] / total, 4) for k in keys))
