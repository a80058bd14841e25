"""The engine worker process: one engine (model, runtime, device, llama.cpp build) behind the wire protocol.

A local worker is started by the gateway with one end of a socketpair (`--fd`), is told what to
load, and exits when the gateway goes away (the socket closes, or the parent-death signal).
A remote worker (`gateway worker --listen`) loads its model first and then serves every gateway
that connects with the right token.

    python -m engines.worker --fd 3              # spawned by the gateway's model pool
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hmac
import importlib
import logging
import os
import signal
import socket
import ssl
import sys
from typing import Any

from engines import gcpause
from engines.base import Engine, EngineError, GenerationRequest
from engines.registry import create_engine
from engines.worker import wire

log = logging.getLogger("engines.worker")
PR_SET_PDEATHSIG = 1


class Session:
    """One gateway's connection: requests in, batched events and results out."""

    def __init__(self, engine: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.reader = reader
        self.writer = writer
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._events: list[tuple[int, Any]] = []
        self._flush_scheduled = False
        self._loop = asyncio.get_running_loop()

    async def serve(self) -> None:
        try:
            while True:
                try:
                    body = await wire.read_frame(self.reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self._dispatch(wire.decode_for_worker(body))
        finally:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _dispatch(self, msg: wire.ToWorker) -> None:
        if isinstance(msg, wire.Generate):
            self._spawn(msg.id, self._generate(msg.id, msg.request))
        elif isinstance(msg, wire.Cancel):
            task = self._tasks.get(msg.id)
            if task is not None:
                task.cancel()
        elif isinstance(msg, wire.Ping):
            h = self.engine.health()
            self.send(wire.Pong(msg.id, h.running, h.waiting, h.busy_seconds, h.prefix_cache, h.kv))
        elif isinstance(msg, wire.Tokenize):
            self._spawn(msg.id, self._call(msg.id, self._tokenize(msg.id, msg.text)))
        elif isinstance(msg, wire.Logits):
            self._spawn(msg.id, self._call(msg.id, self._array(msg.id, self.engine.logits(msg.token_ids, tuple(msg.images)))))
        elif isinstance(msg, wire.Embed):
            self._spawn(msg.id, self._call(msg.id, self._array(msg.id, self.engine.embed(msg.inputs))))
        elif isinstance(msg, wire.Shutdown):
            self.writer.close()
        else:
            raise wire.ProtocolError(f"unexpected {type(msg).__name__} frame")

    def _spawn(self, req_id: int, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks[req_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(req_id, None))

    def send(self, msg: wire._Msg) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.frame(msg))

    async def _generate(self, req_id: int, request: GenerationRequest) -> None:
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                self._events.append((req_id, event))
                if not self._flush_scheduled:
                    # Every sequence of a scheduler step is woken in the same loop iteration, so one
                    # flush scheduled now goes out after all of them have added their event.
                    self._flush_scheduled = True
                    self._loop.call_soon(self._flush)
        except EngineError as exc:
            self._flush()
            self.send(wire.error_message(req_id, exc))
        except asyncio.CancelledError:
            pass  # the gateway cancelled it (or went away): closing the stream below aborts it
        except Exception as exc:  # noqa: BLE001 - reported to the gateway as an engine failure
            log.exception("generation %d failed", req_id)
            self._flush()
            self.send(wire.error_message(req_id, exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._events:
            items, self._events = self._events, []
            self.send(wire.Events(items))

    async def _call(self, req_id: int, work: Any) -> None:
        try:
            self.send(await work)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            self.send(wire.error_message(req_id, exc))

    async def _tokenize(self, req_id: int, text: str) -> wire.Result:
        return wire.Result(req_id, ids=await self.engine.tokenize(text))

    @staticmethod
    async def _array(req_id: int, work: Any) -> wire.Result:
        return wire.Result(req_id, array=wire.pack_array(await work))


# --- process entry points ----------------------------------------------------------------------


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when the gateway that started it dies, however it dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above ran
        os._exit(1)


async def serve_local(sock: socket.socket) -> None:
    """Serve the gateway on the other end of `sock`: Hello, Load, then requests until it closes."""
    reader, writer = await asyncio.open_connection(sock=sock)
    first = wire.decode_for_worker(await wire.read_frame(reader))
    load = wire.decode_for_worker(await wire.read_frame(reader))
    if not isinstance(first, wire.Hello) or not isinstance(load, wire.Load):
        raise wire.ProtocolError("a local worker expects Hello, then Load")
    try:
        engine = create_engine(load.runtime, load.engine_config())
        await engine.load()
    except Exception as exc:  # noqa: BLE001 - a failed load is the gateway's to report
        writer.write(wire.frame(wire.error_message(0, exc)))
        await writer.drain()
        writer.close()
        return
    gcpause.settle()  # what loading made stays; later collections do not walk it
    writer.write(wire.frame(wire.Ready(engine.info, os.getpid())))
    try:
        await Session(engine, reader, writer).serve()
    finally:
        await engine.close()


def accepts(token: str, tokens: tuple[str, ...]) -> bool:
    """Constant-time comparison against every accepted token (no early exit on the first match)."""
    ok = False
    for t in tokens:
        ok |= hmac.compare_digest(token.encode(), t.encode())
    return ok and bool(token)


async def serve_tcp(engine: Engine, host: str, port: int, tokens: tuple[str, ...],
                    ssl_context: ssl.SSLContext | None = None, started: asyncio.Event | None = None) -> None:
    """Serve an already loaded engine to every gateway that connects with one of `tokens`."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            hello = wire.decode_for_worker(await asyncio.wait_for(wire.read_frame(reader, wire.MAX_HELLO), 10))
            if not isinstance(hello, wire.Hello) or not accepts(hello.token, tokens):
                log.warning("refused a connection from %s: wrong or missing token", peer)
                writer.write(wire.frame(wire.Error(0, "Unauthorized", "the worker refused the token")))
                return
            if hello.protocol != wire.PROTOCOL:
                writer.write(wire.frame(wire.Error(
                    0, "ModelLoadError", f"protocol {hello.protocol} is not this worker's {wire.PROTOCOL}")))
                return
            writer.write(wire.frame(wire.Ready(engine.info, os.getpid())))
            log.info("gateway %s connected", peer)
            await Session(engine, reader, writer).serve()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, wire.ProtocolError) as exc:
            log.warning("connection from %s ended: %s", peer, exc or type(exc).__name__)
        finally:
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()

    server = await asyncio.start_server(on_connect, host, port, ssl=ssl_context)
    log.info("serving %s/%s on %s", engine.info.runtime, engine.info.backend,
             ", ".join(str(s.getsockname()) for s in server.sockets))
    if started is not None:
        started.set()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engines.worker", description=__doc__)
    ap.add_argument("--fd", type=int, required=True, help="the inherited socket to the gateway")
    ap.add_argument("--plugin", action="append", default=[],
                    help="a module to import first (it registers more runtimes); repeatable")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker[{os.getpid()}] %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; the gateway drains first and then
    # closes our socket, which is what ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in args.plugin:
        importlib.import_module(module)
    sock = socket.socket(fileno=args.fd)
    asyncio.run(serve_local(sock))


if __name__ == "__main__":
    main()
