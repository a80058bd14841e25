"""Images in requests: decoded and checked once (gateway/chat/images.py) from what each protocol
carries, and refused with a 400 in the client's own envelope when they are not images, too large,
not inline, or sent to a model that takes none (the default model reads text only)."""

from __future__ import annotations

import base64
import io
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from PIL import Image as PILImage

from gateway.api.errors import APIError
from gateway.api.images import check_images
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
    ("https://example.com/cat.png", "invalid_image", "not fetched"),
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
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
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
