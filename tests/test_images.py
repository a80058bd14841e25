"""Images in requests: decoded and checked once (gateway/chat/images.py) from what each protocol
carries, and refused with a 400 in the client's own envelope when they are not images, too large,
not inline, or sent to a model that takes none (the default model reads text only)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from PIL import Image as PILImage

from gateway.api.errors import APIError
from gateway.api.images import check_images, fetch_images, image_part
from gateway.chat import images
from gateway.chat.images import ImageError
from gateway.conversation import Conversation, Part, Turn
from tests.conftest import MODEL


def encoded(fmt: str, size: tuple[int, int] = (37, 21), **save: Any) -> bytes:
    """A real image file of `size` written by Pillow's encoder."""
    buf = io.BytesIO()
    PILImage.new("RGB", size, (200, 30, 90)).save(buf, format=fmt, **save)
    return buf.getvalue()


PNG = encoded("PNG")
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"
BMP = base64.b64encode(encoded("BMP")).decode()


@pytest.mark.parametrize(("fmt", "mime", "save"), [
    ("PNG", "image/png", {}), ("JPEG", "image/jpeg", {}), ("JPEG", "image/jpeg", {"progressive": True}),
    ("GIF", "image/gif", {}), ("WEBP", "image/webp", {"lossless": False}), ("WEBP", "image/webp", {"lossless": True}),
])
def test_each_type_is_read_from_its_bytes_with_its_size(fmt: str, mime: str, save: dict[str, Any]) -> None:
    data = encoded(fmt, (37, 21), **save)
    img = images.from_base64(base64.b64encode(data).decode())
    assert (img.mime, img.width, img.height) == (mime, 37, 21)
    assert img.data == data and len(img.sha256) == 64
    assert images.from_url(f"data:{mime};base64,{base64.b64encode(data).decode()}") == img


def test_webp_with_an_alpha_channel_has_its_extended_header_read() -> None:
    buf = io.BytesIO()
    PILImage.new("RGBA", (300, 5), (1, 2, 3, 4)).save(buf, format="WEBP", lossless=False)
    img = images.from_bytes(buf.getvalue())
    assert (img.mime, img.width, img.height) == ("image/webp", 300, 5)


@pytest.mark.parametrize(("make", "why"), [
    (lambda: images.from_base64("not base64!"), "not valid base64"),
    (lambda: images.from_base64(BMP), "not PNG, JPEG, WebP or GIF"),
    (lambda: images.from_base64(""), "empty"),
    (lambda: images.from_bytes(PNG[:20]), "cut short"),
    (lambda: images.from_bytes(encoded("JPEG")[:40]), "JPEG image"),
    (lambda: images.from_base64(B64, "image/jpeg"), "is image/png, not image/jpeg"),
    (lambda: images.from_url("https://example.com/cat.png"), "not fetched"),
    (lambda: images.from_url("file:///etc/passwd"), "not a base64 data: URL"),
    (lambda: images.from_url("data:image/png,rawbytes"), "not a base64 data: URL"),
])
def test_what_is_not_an_image_says_why(make: Any, why: str) -> None:
    with pytest.raises(ImageError, match=why):
        make()


def test_an_image_over_the_limit_is_refused_naming_the_part() -> None:
    part = Part("image", image=images.from_bytes(PNG), param="messages[0].content[1].image_url.url")
    conv = Conversation((Turn("user", (Part("text", "what is it?"), part)),))
    check_images(conv, len(PNG))
    with pytest.raises(APIError) as err:
        check_images(conv, len(PNG) - 1)
    assert err.value.param == part.param and "GATEWAY_MAX_IMAGE_BYTES" in str(err.value)


# --- through the gateway, each protocol's client ------------------------------------------------


def test_openai_chat_image_to_a_text_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}]}])
    body = err.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_multimodal" and body["param"] == "messages[0].content[1].image_url.url"
    assert f"model {MODEL!r} does not take images" in body["message"]


@pytest.mark.parametrize(("url", "code", "why"), [
    ("data:image/png;base64,@@@", "invalid_image", "not valid base64"),
    (f"data:image/bmp;base64,{BMP}", "invalid_image", "not PNG, JPEG, WebP or GIF"),
    # (an image URL to a text model: refused before it would be fetched)
    ("https://example.com/cat.png", "model_not_multimodal", "does not take images"),
])
def test_openai_chat_bad_images(client: openai.OpenAI, url: str, code: str, why: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}])
    body = err.value.body
    assert isinstance(body, dict)
    assert body["code"] == code and why in body["message"] and body["param"] == "messages[0].content[0].image_url.url"


def test_responses_input_image(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": DATA_URL,
                                                              "detail": "auto"}]}])
    body = err.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_multimodal" and body["param"] == "input[0].content[1].image_url"
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,%%", "detail": "auto"}]}])


def test_anthropic_image_block(gateway_url: str) -> None:
    with anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0) as c:
        _anthropic_images(c)


def _anthropic_images(c: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
            {"type": "text", "text": "What is this?"}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert f"model {MODEL!r} does not take images" in err.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="is image/png, not image/gif"):
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": B64}}]}])
    with pytest.raises(anthropic.BadRequestError, match="does not take images.*source.url"):
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_ollama_images(gateway_url: str) -> None:
    with ollama.Client(host=gateway_url) as c:
        _ollama_images(c)
    r = httpx.post(f"{gateway_url}/api/generate", json={"model": MODEL, "prompt": "x", "images": [B64], "raw": True},
                   timeout=60)
    assert r.status_code == 400 and "not with raw true" in r.json()["error"]
    # An empty list is no image: the request is served.
    ok = httpx.post(f"{gateway_url}/api/chat", timeout=120, json={
        "model": MODEL, "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": "Hi", "images": []}]})
    assert ok.status_code == 200, ok.text


def _ollama_images(c: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model=MODEL, messages=[{"role": "user", "content": "What is it?", "images": [PNG]}])
    assert err.value.status_code == 400 and f"model {MODEL!r} does not take images" in err.value.error
    with pytest.raises(ollama.ResponseError, match="not PNG, JPEG, WebP or GIF"):
        c.generate(model=MODEL, prompt="What is it?", images=[base64.b64decode(BMP)])


# --- http(s) images, fetched where the operator allows it ----------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, str, bytes, float]] = {}  # path -> (status, content type, body, delay)

    def do_GET(self) -> None:  # noqa: N802 - the handler's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/red.png")
            self.end_headers()
            return
        status, ctype, body, delay = self.routes.get(self.path, (404, "text/plain", b"no", 0.0))
        time.sleep(delay)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    _Images.routes = {"/red.png": (200, "image/png", PNG, 0.0), "/page.html": (200, "text/html", b"<html>", 0.0),
                      "/big.png": (200, "image/png", PNG + b"\0" * 5000, 0.0), "/slow.png": (200, "image/png", PNG, 3.0)}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _asking(url: str) -> Conversation:
    return Conversation(turns=(Turn("user", (Part("text", "What is it?"),
                                             image_part(lambda: images.from_url(url), "messages[0].content[1]"))),))


@pytest.mark.parametrize(("path", "mode", "why"), [
    ("/red.png", "off", "not fetched by this gateway"),
    ("/red.png", "public", "non-public address (127.0.0.1)"),
    ("/page.html", "any", "the URL is text/html, not an image"),
    ("/big.png", "any", "larger than 4096 bytes"),
    ("/slow.png", "any", "longer than 1 s"),
    ("/gone.png", "any", "answered HTTP 404"),
])
async def test_an_image_url_that_is_not_fetched_says_why(image_host: str, path: str, mode: str, why: str) -> None:
    with pytest.raises(APIError) as err:
        await fetch_images(_asking(image_host + path), mode, max_bytes=4096, timeout=1.0)
    assert why in str(err.value) and err.value.param == "messages[0].content[1]" and err.value.code == "invalid_image"


async def test_an_image_url_is_fetched_through_redirects_when_allowed(image_host: str) -> None:
    conv = await fetch_images(_asking(f"{image_host}/moved"), "any", max_bytes=4096, timeout=5.0)
    (img,) = [p.image for p in conv.images]
    assert img is not None and img.data == PNG and img.mime == "image/png"
    assert conv.images[0].param == "messages[0].content[1]"
