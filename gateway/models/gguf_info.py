"""What a GGUF file says about itself: its metadata and the size of its tensors, read from the
header only (a few MB at most, however large the weights are).

The gateway needs this before it loads anything: to register a pulled model (context length, chat
template, parameter count, quantisation) and to estimate the memory a model will take (weights, KV
cache, compute buffers) so that residency can be decided by memory instead of by count.

The format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF", version,
tensor count, metadata count, the metadata as typed key/value pairs, then one info record per
tensor (name, dims, type, offset into the data section), then the aligned data. Split models
(`-00001-of-00003.gguf`) keep the metadata in the first file and tensors in all of them.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
# Value types of the metadata.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays longer than this (token lists, merges) are skipped, not kept: only their length is.
_KEEP_ARRAY = 64
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """Not a GGUF file, or one cut short."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int = 0  # filled from the offsets of the data section


@dataclass
class GGUFInfo:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[Tensor] = field(default_factory=list)
    array_lengths: dict[str, int] = field(default_factory=dict)  # skipped arrays: key -> length
    files: list[Path] = field(default_factory=list)  # every file of a split model, in order
    projector_bytes: int = 0  # a vision projector loaded beside it (models.yaml mmproj): its file's size

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture", "llama"))

    def arch_key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    @property
    def context_length(self) -> int | None:
        v = self.arch_key("context_length")
        return int(v) if v else None

    @property
    def chat_template(self) -> str | None:
        v = self.get("tokenizer.chat_template")
        return str(v) if v else None

    @property
    def parameters(self) -> int:
        n = 0
        for t in self.tensors:
            count = 1
            for d in t.shape:
                count *= d
            n += count
        return n

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_vocab(self) -> int:
        return self.array_lengths.get("tokenizer.ggml.tokens") or int(self.arch_key("vocab_size", 0) or 0)

    @property
    def quantization(self) -> str:
        """The file type llama.cpp wrote (general.file_type), as llama-quantize names it."""
        ft = self.get("general.file_type")
        return FILE_TYPES.get(int(ft), f"type {ft}") if ft is not None else ""


def parameter_size(n: int) -> str:
    """A parameter count as model names write it: "135M", "8.0B" ("" when unknown)."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n else ""


# llama_ftype names (llama.h), the ones quantised GGUFs carry.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


class _Reader:
    def __init__(self, f: BinaryIO, where: Path) -> None:
        self.f = f
        self.where = where

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFError(f"{self.where}: cut short in its header")
        return b

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 26:
            raise GGUFError(f"{self.where}: a string of {n} bytes in the header")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        raise GGUFError(f"{self.where}: unknown metadata type {vtype}")

    def skip(self, vtype: int, count: int) -> None:
        if vtype in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[vtype]) * count, 1)
        elif vtype == _STRING:
            for _ in range(count):
                self.f.seek(self.unpack("<Q"), 1)
        else:
            raise GGUFError(f"{self.where}: unknown array type {vtype}")


def _read_one(path: Path) -> tuple[GGUFInfo, int, int]:
    """(info, data offset, file size) of one file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        r = _Reader(f, path)
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise GGUFError(f"{path}: implausible header ({n_tensors} tensors, {n_kv} keys)")
        meta: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            if vtype == _ARRAY:
                atype, count = r.unpack("<I"), r.unpack("<Q")
                if count <= _KEEP_ARRAY and atype != _ARRAY:
                    meta[key] = [r.value(atype) for _ in range(count)]
                else:
                    lengths[key] = count
                    r.skip(atype, count)
            else:
                meta[key] = r.value(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            ttype, offset = r.unpack("<I"), r.unpack("<Q")
            tensors.append(Tensor(name, shape, ttype, offset))
        align = int(meta.get("general.alignment", 32)) or 32
        data = (f.tell() + align - 1) // align * align
    # Each tensor's size: up to the next tensor's start (alignment padding included), the last up
    # to the end of the file.
    ordered = sorted(tensors, key=lambda t: t.offset)
    sized = []
    for i, t in enumerate(ordered):
        end = ordered[i + 1].offset if i + 1 < len(ordered) else size - data
        sized.append(Tensor(t.name, t.shape, t.type, t.offset, max(0, end - t.offset)))
    return GGUFInfo(path, version, meta, sized, lengths, [path]), data, size


def split_files(path: Path) -> list[Path]:
    """Every file of the split model `path` belongs to (just [path] when it is not split)."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_gguf(path: str | Path) -> GGUFInfo:
    """The metadata of `path` and the tensors of all its files (a split model's too)."""
    path = Path(path)
    try:
        info, _, _ = _read_one(path)
        files = split_files(path)
        if len(files) > 1:
            for other in files:
                if other == path:
                    continue
                more, _, _ = _read_one(other)
                info.tensors.extend(more.tensors)
            info.files = files
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc}") from exc
    return info


def read_strings(path: str | Path, key: str) -> tuple[Any, list[str] | None]:
    """(the value of `tokenizer.ggml.model`, the string array `key`) of a GGUF's metadata, read
    whole (a vocabulary's tokens, which `read_gguf` skips); None where it has no such array."""
    path = Path(path)
    model: Any = None
    found: list[str] | None = None
    try:
        with path.open("rb") as f:
            r = _Reader(f, path)
            if f.read(4) != MAGIC:
                raise GGUFError(f"{path} is not a GGUF file")
            if r.unpack("<I") not in (2, 3):
                raise GGUFError(f"{path}: its GGUF version is not supported")
            r.unpack("<Q")
            for _ in range(r.unpack("<Q")):
                name, vtype = r.string(), r.unpack("<I")
                if vtype != _ARRAY:
                    value = r.value(vtype)
                    model = value if name == "tokenizer.ggml.model" else model
                    continue
                atype, count = r.unpack("<I"), r.unpack("<Q")
                if name == key and atype == _STRING:
                    found = [r.string() for _ in range(count)]
                else:
                    r.skip(atype, count)
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc}") from exc
    return model, found
