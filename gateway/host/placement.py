"""Where a model goes when the host has several GPUs: pure decisions over the plan's candidates and
the memory budgets (models.yaml `devices:` and `placement:`).

- `devices` keeps the GPU candidates a model may use (indexes, parts of names, or `all`); the CPU
  stays a fallback.
- A split puts one copy across several GPUs of one engine and build (llama.cpp's layer split),
  each GPU's share of the layers proportional to its memory budget; `auto` splits only when one GPU
  cannot hold the model, `split` always (with two or more GPUs).
- Replicas are more copies, one per GPU, served as one engine (requests routed by load and by
  where a conversation's prefix is cached): `replicas` on every GPU of the engine and build that
  the model may use, `auto` on those of the same name as the first (a copy on a slower card would
  take its share of the requests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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


def from_setting(device: str | None) -> tuple[str | None, Devices]:
    """`--device`: one GPU (the plan's preference, as before), or several (`0,1`, `all`: the GPUs
    every model may use, over models.yaml's `devices`). (preference's device, devices)."""
    if device is None:
        return None, None
    if device.strip().lower() == "all":
        return None, "all"
    if "," in device:
        return None, [d.strip() for d in device.split(",") if d.strip()]
    return device, None


def chosen(cand: Candidate, devices: Devices) -> bool:
    """Whether `devices` lets the model use `cand` (CPU candidates always: the fallback)."""
    if devices is None or devices == "all" or cand.device_index is None:
        return True
    wanted = [devices] if isinstance(devices, str | int) else list(devices)
    return any(int(d) == cand.device_index if isinstance(d, int) or d.isdigit() else d.lower() in cand.device.lower()
               for d in wanted)


def _mates(cand: Candidate, candidates: Sequence[Candidate], devices: Devices) -> list[Candidate]:
    """The other GPUs of `cand`'s engine, build and format that `devices` allows, by index."""
    return sorted((c for c in candidates if (c.runtime, c.backend, c.lib_path, c.format) ==
                   (cand.runtime, cand.backend, cand.lib_path, cand.format) and c.device_index is not None
                   and c != cand and chosen(c, devices)), key=lambda c: c.device_index or 0)


def replicas_of(cand: Candidate, candidates: Sequence[Candidate], devices: Devices, placement: str) -> list[Candidate]:
    """The GPUs that get a copy beside `cand`'s: none for `split`; for `auto` only GPUs of the same
    name (identical cards)."""
    if cand.device_index is None or placement == "split":
        return []
    mates = _mates(cand, candidates, devices)
    return mates if placement == "replicas" else [c for c in mates if c.device == cand.device]


def split_of(cand: Candidate, candidates: Sequence[Candidate], devices: Devices, budgets: Mapping[str, int],
             key_of: dict[Candidate, str]) -> Split | None:
    """`cand` with the other GPUs of its engine and build that `devices` allows, shares by their
    budgets; None where there is no second one (or a GPU of unknown memory)."""
    if cand.device_index is None:
        return None
    members = (cand, *_mates(cand, candidates, devices))
    keys = tuple(key_of[c] for c in members)
    if len(members) < 2 or len(set(keys)) < len(keys) or any(budgets.get(k, 0) <= 0 for k in keys):
        return None
    total = sum(budgets[k] for k in keys)
    return Split(members, keys, tuple(round(budgets[k] / total, 4) for k in keys))


@dataclass(frozen=True)
class Placement:
    """What a model gets: one device, a copy on each of several GPUs, or one copy split over them."""

    kind: Literal["one", "replicas", "split"]
    replicas: tuple[Candidate, ...] = ()  # the GPUs with a copy beside the candidate's
    split: Split | None = None

    def describe(self, key_of: Mapping[Candidate, str]) -> str:
        if self.split is not None:
            return "split over " + ", ".join(f"{k} ({s:g})" for k, s in zip(self.split.keys, self.split.shares,
                                                                             strict=True))
        if self.replicas:
            return "replicas on " + ", ".join(key_of[c] for c in self.replicas)
        return ""


def decide(cand: Candidate, candidates: Sequence[Candidate], devices: Devices, placement: str, fits_one: bool,
           budgets: Mapping[str, int], key_of: dict[Candidate, str]) -> Placement:
    """Where a model goes from `cand`: split when asked or when one GPU cannot hold it (and there
    are GPUs to split over), else `cand` with its replicas (none where it does not fit)."""
    split = split_of(cand, candidates, devices, budgets, key_of)
    if split is not None and (placement == "split" or not fits_one):
        return Placement("split", split=split)
    mates = replicas_of(cand, candidates, devices, placement) if fits_one else []
    return Placement("replicas", (cand, *mates)) if mates else Placement("one")
