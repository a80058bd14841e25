"""gpt-oss's vocabulary for the harmony library, without the network.

openai-harmony reads the `o200k_base.tiktoken` file (its byte-pair ranks: `base64(bytes) rank`
lines) from $TIKTOKEN_ENCODINGS_BASE, else downloads it; it checks the file's SHA-256 either way.
The gateway uses the file where it already is ($TIKTOKEN_ENCODINGS_BASE, or `harmony/` in the
model cache), else derives it from the served model's GGUF: a gpt-oss GGUF's
`tokenizer.ggml.tokens` are o200k's byte-level BPE tokens in GPT-2's byte-to-unicode spelling, and
their ids are the ranks, for the first 199998. A file that does not match the hash is not used:
the format is then unavailable, with the reason. The library reads the directory from the
environment only: the process's $TIKTOKEN_ENCODINGS_BASE is set to the directory used.
"""

from __future__ import annotations

import base64
import functools
import os
import threading
from pathlib import Path
from typing import Any

from engines.base import ModelNotAvailable
from gateway.models.gguf_info import GGUFError, read_strings

FILE = "o200k_base.tiktoken"
ENV = "TIKTOKEN_ENCODINGS_BASE"
RANKS = 199_998  # o200k's byte-pair tokens; the ids above are special tokens
SUBDIR = "harmony"  # in the model cache


class FormatUnavailable(ModelNotAvailable):
    """A format cannot be used with this model: what it needs is missing (the reason says what)."""


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character that spells each byte in a byte-level
    BPE token -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes. Raises KeyError for a character outside the table."""
    table = byte_of_char()
    return bytes(table[c] for c in token)


def tiktoken_text(tokens: list[str]) -> bytes:
    """The `.tiktoken` file of the first RANKS tokens (rank = id). Raises FormatUnavailable."""
    if len(tokens) < RANKS:
        raise FormatUnavailable(f"its vocabulary has {len(tokens)} tokens, fewer than o200k's {RANKS}")
    try:
        lines = [base64.b64encode(token_bytes(t)) + b" %d\n" % rank for rank, t in enumerate(tokens[:RANKS])]
    except KeyError as exc:
        raise FormatUnavailable(f"its vocabulary is not byte-level BPE (a token holds {exc})") from None
    return b"".join(lines)


def derive(gguf: str | Path, directory: Path) -> Path:
    """`directory`/o200k_base.tiktoken from the GGUF's vocabulary (written whole or not at all).
    Raises FormatUnavailable."""
    try:
        model, tokens = read_strings(gguf, "tokenizer.ggml.tokens")
    except GGUFError as exc:
        raise FormatUnavailable(str(exc)) from None
    if tokens is None or model != "gpt2":
        raise FormatUnavailable(f"{gguf} holds no byte-level BPE vocabulary (tokenizer {model!r})")
    data = tiktoken_text(tokens)
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / FILE
    tmp = out.with_name(f".{FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


_lock = threading.Lock()
_loaded: list[Any] = []  # the encoding, once loaded (one for every gpt-oss model)
_failed: dict[str, str] = {}  # GGUF path -> why its vocabulary cannot be used


def _load(directory: str) -> Any:
    """The harmony encoding from `directory`'s file (it checks the hash). Raises FormatUnavailable."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ[ENV] = directory
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # noqa: BLE001 - the library's own error (a hash mismatch, an unreadable file)
        raise FormatUnavailable(f"openai-harmony refused {Path(directory) / FILE}: {exc}") from None


def encoding(cache_dir: Path, gguf: str | None) -> Any:
    """The harmony encoding, loaded once: from the file where it is, else derived from `gguf`
    (and kept in the model cache). Raises FormatUnavailable, naming the reason."""
    with _lock:
        if not _loaded:
            _loaded.append(_find(cache_dir / SUBDIR, gguf))
        return _loaded[0]


def _find(ours: Path, gguf: str | None) -> Any:
    given = os.environ.get(ENV)
    if given and (Path(given) / FILE).is_file():
        return _load(given)
    if (ours / FILE).is_file():
        try:
            return _load(str(ours))
        except FormatUnavailable:
            if gguf is None:
                raise
            (ours / FILE).unlink(missing_ok=True)  # derived again below
    if gguf is None:
        raise FormatUnavailable(f"harmony needs {FILE} (in ${ENV} or {ours}), and the model has no GGUF "
                                "to derive it from")
    if gguf not in _failed:
        try:
            return _load(str(derive(gguf, ours).parent))
        except FormatUnavailable as exc:
            (ours / FILE).unlink(missing_ok=True)
            _failed[gguf] = f"harmony's vocabulary cannot be derived from {gguf}: {exc}"
    raise FormatUnavailable(_failed[gguf])


def loaded() -> Any | None:
    """The encoding, once loaded."""
    return _loaded[0] if _loaded else None


def required() -> Any:
    """The encoding. Raises FormatUnavailable before it was loaded for a model (`encoding`)."""
    enc = loaded()
    if enc is None:
        raise FormatUnavailable("harmony's vocabulary was not loaded for this model")
    return enc


def forget() -> None:
    """Drop the loaded encoding and the failures remembered (tests)."""
    with _lock:
        _loaded.clear()
        _failed.clear()
