"""The wire protocol between the gateway and its engine workers: msgpack frames over a stream socket.

Every message is one frame: a 4-byte big-endian length, then a msgspec-encoded msgpack body whose
`t` tag names its type.  The same protocol runs over the socketpair of a local worker and over TCP
to a remote one (which first needs a `Hello` with its token).

Token events travel batched: the worker sends one `Events` frame per scheduler step, holding that
step's events of every running sequence, not one frame per token.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from engines.base import (
    ContextLengthExceeded,
    EngineClosed,
    EngineConfig,
    EngineError,
    EngineFailure,
    EngineInfo,
    EngineOverloaded,
    GenerationRequest,
    InvalidGenerationRequest,
    KvStats,
    ModelLoadError,
    ModelNotAvailable,
    PrefixCacheStats,
    TokenEvent,
)
from engines.runtimes import option_values, with_option_values

PROTOCOL = 1
# A frame may carry the logits of a whole parity sequence (positions x vocabulary x 4 bytes).
MAX_FRAME = 1 << 30
# Before a remote peer has proved its token, it may send only a small Hello.
MAX_HELLO = 4096
_HEADER = 4


class _Msg(msgspec.Struct, tag_field="t", array_like=True, omit_defaults=True):
    pass


# --- gateway -> worker ---------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    """The first frame on a connection: the protocol version and, for a remote worker, its token."""

    protocol: int
    token: str = ""


class Load(_Msg, tag="load"):
    """Load `runtime` with `config` (local workers; a remote worker has its model already).

    The config's options (a pydantic model, which msgpack does not know) travel apart, as plain
    values in `options`, the config itself with none (done on construction); the worker validates
    them again with the runtime's own options model (`engine_config`), so it reads the same typed
    options, and one its runtime does not know is refused by name."""

    runtime: str
    config: EngineConfig
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.config.options is not None:
            self.options = option_values(self.config)
            self.config = replace(self.config, options=None)

    def engine_config(self) -> EngineConfig:
        """The config with its options validated again (ModelLoadError when they do not validate)."""
        return with_option_values(self.runtime, self.config, self.options)


class Generate(_Msg, tag="gen"):
    id: int
    request: GenerationRequest


class Cancel(_Msg, tag="cancel"):
    id: int


class Tokenize(_Msg, tag="tok"):
    id: int
    text: str


class Logits(_Msg, tag="logits"):
    id: int
    token_ids: list[int]
    images: list[bytes] = []


class Embed(_Msg, tag="embed"):
    id: int
    inputs: list[list[int]]


class Ping(_Msg, tag="ping"):
    id: int


class Shutdown(_Msg, tag="bye"):
    pass


# --- worker -> gateway ---------------------------------------------------------------------


class Ready(_Msg, tag="ready"):
    """The engine is loaded (the answer to Hello on a remote worker, to Load on a local one)."""

    info: EngineInfo
    pid: int


class Events(_Msg, tag="ev"):
    """One scheduler step's token events: (request id, event) for every sequence that produced one."""

    items: list[tuple[int, TokenEvent]]


class Error(_Msg, tag="err"):
    """Request `id` failed (id 0: the connection itself, e.g. a refused token or a failed load)."""

    id: int
    kind: str
    message: str
    param: str | None = None
    prompt_tokens: int = 0
    context_length: int = 0


class Result(_Msg, tag="res"):
    id: int
    ids: list[int] | None = None  # Tokenize
    array: tuple[tuple[int, ...], bytes] | None = None  # Logits / Embed: (shape, float32 bytes)


class Pong(_Msg, tag="pong"):
    id: int
    running: int
    waiting: int
    busy_seconds: float  # how long the engine's current step has run (0 when idle)
    prefix_cache: PrefixCacheStats | None = None  # the engine's host-memory prefix cache
    kv: KvStats | None = None  # the engine's KV cache


ToWorker = Hello | Load | Generate | Cancel | Tokenize | Logits | Embed | Ping | Shutdown
ToGateway = Ready | Events | Error | Result | Pong

_encoder = msgspec.msgpack.Encoder()
worker_decoder: msgspec.msgpack.Decoder[ToWorker] = msgspec.msgpack.Decoder(ToWorker)
gateway_decoder: msgspec.msgpack.Decoder[ToGateway] = msgspec.msgpack.Decoder(ToGateway)


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol (or too large a one)."""


def frame(msg: _Msg) -> bytes:
    body = _encoder.encode(msg)
    return len(body).to_bytes(_HEADER, "big") + body


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """One frame's body; IncompleteReadError at a clean end of stream."""
    n = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {limit}")
    return await reader.readexactly(n)


def decode_for_worker(body: bytes) -> ToWorker:
    try:
        return worker_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(str(exc)) from exc


def decode_for_gateway(body: bytes) -> ToGateway:
    try:
        return gateway_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(str(exc)) from exc


def pack_array(a: npt.NDArray[Any]) -> tuple[tuple[int, ...], bytes]:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return tuple(int(d) for d in a.shape), a.tobytes()


def unpack_array(packed: tuple[tuple[int, ...], bytes]) -> npt.NDArray[np.float32]:
    shape, data = packed
    return np.frombuffer(data, dtype=np.float32).reshape(shape).copy()


# --- engine errors across the wire ------------------------------------------------------------

_ERRORS: dict[str, type[EngineError]] = {
    c.__name__: c
    for c in (ModelLoadError, ModelNotAvailable, InvalidGenerationRequest, EngineOverloaded, EngineClosed,
              EngineFailure, ContextLengthExceeded)
}


def error_message(req_id: int, exc: BaseException) -> Error:
    """`exc` as an Error frame; an exception that is not an engine error travels as EngineFailure."""
    if isinstance(exc, ContextLengthExceeded):
        return Error(req_id, "ContextLengthExceeded", str(exc), None, exc.prompt_tokens, exc.context_length)
    if isinstance(exc, InvalidGenerationRequest):
        return Error(req_id, "InvalidGenerationRequest", str(exc), exc.param)
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "EngineFailure"
    return Error(req_id, kind, str(exc) or type(exc).__name__)


def error_from(msg: Error) -> EngineError:
    """The engine error an Error frame describes."""
    if msg.kind == "ContextLengthExceeded":
        return ContextLengthExceeded(msg.prompt_tokens, msg.context_length)
    if msg.kind == "InvalidGenerationRequest":
        return InvalidGenerationRequest(msg.message, msg.param)
    return _ERRORS.get(msg.kind, EngineFailure)(msg.message)
