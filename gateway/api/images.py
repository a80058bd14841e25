"""Image parts at the protocol boundary, the same for every protocol: an adapter turns what its
client sent into a checked `Part` (a 400 `invalid_image` naming the part when it is not an image
the gateway takes), and serving refuses images a model cannot take (400 `model_not_multimodal`),
fetches http(s) images where the operator allows it (`fetch_images`), and refuses images over the
size limit, before any engine sees them."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urljoin, urlsplit

import httpx

from engines.base import IMAGE_MARKER, Capabilities
from gateway.api.errors import invalid
from gateway.chat.images import Image, ImageError, RemoteImage, check_size, from_bytes
from gateway.conversation import Conversation, Part

MAX_REDIRECTS = 5


def image_part(load: Callable[[], Image], param: str) -> Part:
    """The image `load` decodes, as a part the client put at `param` (an http(s) URL: a part to fetch)."""
    try:
        return Part("image", image=load(), param=param)
    except RemoteImage as exc:
        return Part("image", url=exc.url, param=param)
    except ImageError as exc:  # the part in the message too: Ollama's envelope has no field for it
        raise invalid(f"{param}: {exc}", param=param, code="invalid_image") from None


def check_images(conv: Conversation, max_bytes: int) -> None:
    """Every image within the size limit."""
    for p in conv.images:
        if p.image is None:
            continue  # fetched later, within the limit
        try:
            check_size(p.image, max_bytes)
        except ImageError as exc:
            raise invalid(f"{p.param}: {exc}", param=p.param, code="invalid_image") from None


def refuse_images(conv: Conversation, model: str, capabilities: Capabilities) -> None:
    """A model that takes no images, given one: 400 naming the model and the part."""
    images = conv.images
    if images and not capabilities.images:
        raise invalid(f"model {model!r} does not take images (it has no vision projector); the request has "
                      f"{len(images)}, the first at {images[0].param}", param=images[0].param,
                      code="model_not_multimodal")


def placed(conv: Conversation) -> tuple[Conversation, tuple[bytes, ...]]:
    """The conversation with each image part as the engine's image marker in its text, and the
    images' bytes in the same order (the engine puts each where its marker is)."""
    images = tuple(p.image.data for p in conv.images if p.image is not None)
    if not images:
        return conv, ()
    return _each_part(conv, lambda p: Part("text", IMAGE_MARKER) if p.type == "image" else p), images


def _each_part(conv: Conversation, change: Callable[[Part], Part]) -> Conversation:
    """The conversation with `change` applied to every part of every turn."""
    return replace(conv, turns=tuple(replace(t, parts=tuple(change(p) for p in t.parts)) for t in conv.turns))


async def fetch_images(conv: Conversation, mode: str, max_bytes: int, timeout: float) -> Conversation:
    """The conversation with its http(s) images fetched (`mode` public: from hosts whose addresses are
    all public; any: from any host; off: refused), each within `max_bytes` and `timeout` seconds:
    what fails is a 400 `invalid_image` naming the part and why."""
    remote = [p for p in conv.images if p.image is None and p.url]
    if not remote:
        return conv
    if mode == "off":
        p = remote[0]
        raise invalid(f"{p.param}: {RemoteImage(p.url)}", param=p.param, code="invalid_image")
    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout) as client:
        got = await asyncio.gather(*(_fetch(client, p, mode, max_bytes, timeout) for p in remote))
    by_id = {id(p): img for p, img in zip(remote, got, strict=True)}
    return _each_part(conv, lambda p: Part("image", image=by_id[id(p)], param=p.param) if id(p) in by_id else p)


async def _fetch(client: httpx.AsyncClient, part: Part, mode: str, max_bytes: int, timeout: float) -> Image:
    try:
        async with asyncio.timeout(timeout):
            return await _download(client, part.url, mode, max_bytes)
    except TimeoutError:
        why = f"fetching the image took longer than {timeout:g} s (GATEWAY_IMAGE_FETCH_TIMEOUT)"
    except ImageError as exc:
        why = str(exc)
    except httpx.HTTPError as exc:
        why = f"fetching the image failed: {exc or type(exc).__name__}"
    raise invalid(f"{part.param}: {why}", param=part.param, code="invalid_image")


async def _download(client: httpx.AsyncClient, url: str, mode: str, max_bytes: int) -> Image:
    for _ in range(MAX_REDIRECTS + 1):
        if mode == "public":
            await _public_host(url)
        async with client.stream("GET", url) as r:
            if r.is_redirect and "location" in r.headers:
                url = urljoin(url, r.headers["location"])
                if urlsplit(url).scheme not in ("http", "https"):
                    raise ImageError(f"the image URL redirects to {url}, which is not http(s)")
                continue
            if r.status_code != 200:
                raise ImageError(f"fetching the image answered HTTP {r.status_code}")
            ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype and not ctype.startswith("image/") and ctype != "application/octet-stream":
                raise ImageError(f"the URL is {ctype}, not an image")
            if int(r.headers.get("content-length") or 0) > max_bytes:
                raise ImageError(f"the image is larger than {max_bytes} bytes (GATEWAY_MAX_IMAGE_BYTES)")
            data = bytearray()
            async for chunk in r.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise ImageError(f"the image is larger than {max_bytes} bytes (GATEWAY_MAX_IMAGE_BYTES)")
            return from_bytes(bytes(data), ctype if ctype.startswith("image/") else None)
    raise ImageError(f"the image URL redirects more than {MAX_REDIRECTS} times")


async def _public_host(url: str) -> None:
    """Refuses a host any of whose addresses is not public (loopback, private, link-local, ...)."""
    host = urlsplit(url).hostname or ""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ImageError(f"the image's host {host!r} could not be resolved: {exc}") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_global:
            raise ImageError(f"the image's host {host} is at a non-public address ({addr}); this gateway fetches "
                             "images from public hosts only (--image-fetch any allows the others)")
