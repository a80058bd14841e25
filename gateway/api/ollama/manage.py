"""Ollama's routes that make and remove models: `/api/pull`, `/api/delete`, `/api/create`,
`/api/copy`, `/api/blobs/<digest>`. Errors on these paths are Ollama's `{"error": "..."}`."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from gateway.api.errors import APIError
from gateway.api.notes import Notes
from gateway.api.ollama import api as ol
from gateway.api.ollama.routes import ERRORS, NDJSON, OllamaError, named_spec
from gateway.api.sse import until_disconnect
from gateway.models.create import BlobUpload, CreateError, blob_path, check_name, copy, create
from gateway.models.hub import PullError, PullProgress, parse_name, remove
from gateway.models.pool import ModelManager

log = logging.getLogger(__name__)
router = APIRouter(tags=["ollama"])


# --- pull and delete ------------------------------------------------------------------------------


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    name: str = ""  # older clients send `name`
    insecure: bool = False
    stream: bool = True


@router.post("/api/pull", responses={200: {"description": "Progress as NDJSON lines (or one JSON object with "
                                                         "`stream: false`), ending with `{\"status\": \"success\"}` "
                                                         "or an `{\"error\"}` line",
                                           "content": NDJSON},
                                     **ERRORS})
async def pull(body: PullRequest, request: Request) -> Response:
    """Pull a GGUF from the Hugging Face Hub by name (`hf.co/<user>/<repo>[:<quant>]`), as `gateway pull`
    does; a model already in the registry is a success at once."""
    manager: ModelManager = request.app.state.manager
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required", param="model")
    if manager.registry.get(name) is not None or manager.registry.get(name.removesuffix(":latest")) is not None:
        done = [{"status": "success"}]
        return JSONResponse(done[0]) if not body.stream else StreamingResponse(
            iter([json.dumps(d).encode() + b"\n" for d in done]), media_type="application/x-ndjson")
    hub_name = parse_name(name)
    if hub_name is None:
        raise APIError(404, f"model {name!r} is not in the registry, and not a Hub name: pull "
                       "hf.co/<user>/<repo>[:<quant>] (a GGUF repository on the Hugging Face Hub)", param="model")
    progress, task = manager.pull_jobs.start(hub_name)
    if not body.stream:
        try:
            await until_disconnect(request, asyncio.shield(task))
        except PullError as exc:
            raise APIError(_pull_status(str(exc)), str(exc), param="model") from exc
        return JSONResponse({"status": "success"})

    async def lines() -> AsyncIterator[bytes]:
        async for line in _pull_lines(progress, task):
            yield line
        if task.exception() is None:
            yield json.dumps({"status": "success"}).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _pull_lines(progress: PullProgress, task: asyncio.Task[Any]) -> AsyncIterator[bytes]:
    """A pull's progress as Ollama's NDJSON lines, up to "writing manifest" (or an `{"error"}` line)."""
    yield json.dumps({"status": "pulling manifest"}).encode() + b"\n"
    last: tuple[Any, ...] = ()
    while not task.done():
        now = (progress.status, progress.file, progress.completed // (1 << 20))
        if now != last and progress.status in ("downloading", "verifying"):
            last = now
            line = ({"status": f"pulling {progress.file}", "digest": progress.file, "total": progress.total,
                     "completed": progress.completed} if progress.status == "downloading"
                    else {"status": "verifying sha256 digest"})
            yield json.dumps(line).encode() + b"\n"
        await asyncio.sleep(0.25)
    exc = task.exception()
    if exc is not None:
        yield json.dumps({"error": str(exc)}).encode() + b"\n"
        return
    yield json.dumps({"status": "pulling " + progress.file, "digest": progress.file, "total": progress.total,
                      "completed": progress.total}).encode() + b"\n"
    yield json.dumps({"status": "writing manifest"}).encode() + b"\n"


def _pull_status(message: str) -> int:
    if message.startswith("no repository") or " has no " in message:
        return 404
    if "is gated" in message:
        return 401
    return 500


@router.delete("/api/delete", response_class=Response, responses={200: {"description": "Removed"}, **ERRORS,
                                         409: {"model": OllamaError, "description": "The model is loaded"}})
async def delete(body: ol.ModelRequest, request: Request) -> Response:
    """Remove a pulled model and the files only it uses (`gateway rm`); refused while it is loaded."""
    manager: ModelManager = request.app.state.manager
    spec = named_spec(request, body.id)
    if spec.id not in manager.registry.user_files:
        raise APIError(400, f"model {spec.id!r} is defined in models.yaml, not pulled: edit that file to remove it",
                       param="model")
    if manager.is_loaded(spec.id) or spec.id in manager.loading:
        raise APIError(409, f"model {spec.id!r} is loaded; unload it first (keep_alive 0, or the web page)",
                       param="model")
    await asyncio.to_thread(remove, manager.registry, spec)
    return Response(status_code=200)


# --- create, copy and blobs -----------------------------------------------------------------------


def _create_error(exc: CreateError) -> APIError:
    return APIError(exc.status, str(exc), param=exc.param)


def _new_id(manager: ModelManager, name: str, param: str) -> str:
    """The id a created or copied model gets; 409 while a model of that name is loaded."""
    try:
        model_id = check_name(manager.registry, name, param)
    except CreateError as exc:
        raise _create_error(exc) from None
    if manager.is_loaded(model_id) or model_id in manager.loading:
        raise APIError(409, f"model {model_id!r} is loaded; unload it first (keep_alive 0, or the web page)",
                       param=param)
    return model_id


@router.post("/api/create", responses={200: {"description": "Progress as NDJSON lines (or one JSON object with "
                                                           "`stream: false`), ending with `{\"status\": \"success\"}`",
                                             "content": NDJSON},
                                       **ERRORS, 409: {"model": OllamaError, "description": "The model is loaded"}})
async def create_model(body: ol.CreateRequest, request: Request) -> Response:
    """A new model from one the gateway has (`from`: its own system prompt, preset messages, sampling
    defaults, context; a Hub name not pulled yet is pulled first, its progress streamed) or from uploaded
    GGUF blobs (`files`); registered beside pulled models."""
    manager: ModelManager = request.app.state.manager
    notes = Notes()
    recipe = ol.recipe(body, notes)
    _new_id(manager, recipe.name, "model")
    pulling: tuple[PullProgress, asyncio.Task[Any]] | None = None
    if body.from_:
        found = manager.registry.get(body.from_) or manager.registry.get(body.from_.removesuffix(":latest"))
        hub_name = parse_name(body.from_) if found is None else None
        if found is None and hub_name is None:
            raise APIError(404, f"model {body.from_!r} not found", param="from")
        if hub_name is not None:
            pulling = manager.pull_jobs.start(hub_name)  # as Ollama does: a Hub model not here yet is pulled
        recipe.parent = found

    async def make() -> None:
        if pulling is not None:
            pulled = await asyncio.shield(pulling[1])
            recipe.parent = manager.registry.get(pulled.model_id)
            if recipe.parent is None:
                raise APIError(500, f"pulled {pulled.model_id} but cannot find it in the registry")
        _new_id(manager, recipe.name, "model")
        try:
            _, steps = await asyncio.to_thread(create, manager.registry, recipe)
        except CreateError as exc:
            raise _create_error(exc) from None
        log.info("created model %s (%s)", recipe.name, "; ".join(steps))

    headers = notes.headers()
    if not body.stream:
        try:
            await until_disconnect(request, make())
        except PullError as exc:
            raise APIError(_pull_status(str(exc)), str(exc), param="from") from exc
        return JSONResponse({"status": "success"}, headers=headers)

    # Each step is streamed as it starts (a quantization may take minutes).
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()

    def progress(step: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, step)

    recipe.progress = progress
    return StreamingResponse(_create_lines(pulling, make, queue), media_type="application/x-ndjson", headers=headers)


async def _create_lines(pulling: tuple[PullProgress, asyncio.Task[Any]] | None,
                        make: Callable[[], Awaitable[None]], queue: asyncio.Queue[str]) -> AsyncIterator[bytes]:
    """/api/create's NDJSON: the pull's progress first (when `from` is a Hub model not here yet),
    then each step of making the model as it starts, then success or the error."""
    if pulling is not None:
        async for line in _pull_lines(*pulling):
            yield line
        if pulling[1].exception() is not None:
            return
    task = asyncio.ensure_future(make())
    while not task.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield json.dumps({"status": getter.result()}).encode() + b"\n"
        else:
            getter.cancel()
    exc = task.exception()
    if exc is not None:
        yield json.dumps({"error": exc.message if isinstance(exc, APIError) else str(exc)}).encode() + b"\n"
        return
    yield json.dumps({"status": "success"}).encode() + b"\n"


@router.post("/api/copy", response_class=Response, responses={200: {"description": "Copied (an empty body)"}, **ERRORS,
                                     409: {"model": OllamaError, "description": "The destination is loaded"}})
async def copy_model(body: ol.CopyRequest, request: Request) -> Response:
    """`destination` becomes a model with everything `source` has (replacing a pulled or created model of
    that name; a model of models.yaml is not replaced)."""
    manager: ModelManager = request.app.state.manager
    source = named_spec(request, body.source)
    _new_id(manager, body.destination, "destination")
    try:
        await asyncio.to_thread(copy, manager.registry, source, body.destination)
    except CreateError as exc:
        raise _create_error(exc) from None
    return Response(status_code=200)


@router.head("/api/blobs/{digest}", response_class=Response, responses={
    200: {"description": "The blob is here"}, 404: {"description": "It is not"},
    400: {"description": "Not a sha256:<hex> digest"}, 401: {"description": "Missing or wrong API key"}})
async def blob_exists(digest: str, request: Request) -> Response:
    try:
        path = blob_path(request.app.state.manager.registry, digest)
    except CreateError as exc:
        raise _create_error(exc) from None
    return Response(status_code=200 if await asyncio.to_thread(path.is_file) else 404)


# Disk kept free beside an upload.
_UPLOAD_MARGIN = 1 << 30


@router.post("/api/blobs/{digest}", status_code=201, response_class=Response, responses={
    201: {"description": "Stored"}, 200: {"description": "Already here (the body is not read)"},
    400: {"model": OllamaError, "description": "The body's sha256 is not the digest"},
    507: {"model": OllamaError, "description": "Not enough disk space"}})
async def upload_blob(digest: str, request: Request) -> Response:
    """A file for `/api/create`'s `files`, stored under its sha256 (checked as it arrives; nothing is kept
    when it does not match). Not bound by --max-body."""
    registry = request.app.state.manager.registry
    try:
        path = blob_path(registry, digest)
    except CreateError as exc:
        raise _create_error(exc) from None
    if await asyncio.to_thread(path.is_file):
        return Response(status_code=200)
    length = request.headers.get("content-length")
    path.parent.mkdir(parents=True, exist_ok=True)
    free = (await asyncio.to_thread(shutil.disk_usage, path.parent)).free
    if length is not None and length.isdigit() and int(length) + _UPLOAD_MARGIN > free:
        raise APIError(507, f"not enough disk space for {int(length)} bytes ({free} free, {_UPLOAD_MARGIN} kept)")
    upload = await asyncio.to_thread(BlobUpload, registry, digest)
    try:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) >= 4 << 20:
                await asyncio.to_thread(upload.write, bytes(buf))
                buf.clear()
                if upload.size + _UPLOAD_MARGIN > free:
                    raise APIError(507, f"not enough disk space: {upload.size} bytes written, {free} were free")
        if buf:
            await asyncio.to_thread(upload.write, bytes(buf))
        await asyncio.to_thread(upload.finish)
    except CreateError as exc:
        raise _create_error(exc) from None
    except BaseException:
        await asyncio.to_thread(upload.abort)
        raise
    log.info("stored blob %s (%d bytes)", path.name, upload.size)
    return Response(status_code=201)
