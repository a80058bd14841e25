"""Images in a request, as every protocol brings them: decoded and checked once, here.

OpenAI's `image_url` and Responses' `input_image` carry a `data:` URL; Anthropic's `image` block
and Ollama's `images` carry base64. Each becomes an `Image`: its bytes, its type (read from the
bytes, not taken from the client's word), its size in pixels and its SHA-256. What is not an image
the gateway takes — not base64, not PNG, JPEG, WebP or GIF, larger than the limit, its header cut
short, larger than the `max_image_bytes` setting — is an `ImageError` whose message says which,
answered 400 with the part that carried it. An http(s) URL is a `RemoteImage`: fetched later where
the operator allows it (`--image-fetch`, gateway/api/images.py), else refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass

# Types the vision models' image loaders read (llama.cpp's mtmd: stb_image), GIF's first frame.
TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
DEFAULT_MAX_BYTES = 20 << 20  # OpenAI's limit per image
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)


class ImageError(ValueError):
    """Not an image this gateway takes; the message says why."""


class RemoteImage(ImageError):
    """An http(s) image URL: fetched only where the operator allows it."""

    def __init__(self, url: str) -> None:
        super().__init__("image URLs are not fetched by this gateway: send the image in the request, as a data: "
                         "URL (data:image/png;base64,...), or ask its operator to allow fetching (--image-fetch)")
        self.url = url


@dataclass(frozen=True)
class Image:
    data: bytes
    mime: str  # one of TYPES, from the bytes
    width: int
    height: int
    sha256: str  # the prefix cache keys an image's KV by it

    def __repr__(self) -> str:  # never the bytes in logs
        return f"Image({self.mime}, {self.width}x{self.height}, {len(self.data)} bytes, {self.sha256[:12]})"


def from_base64(text: str, declared: str | None = None) -> Image:
    """An image from base64 text (whitespace allowed); `declared` is the type the client named,
    which must agree with the bytes when given."""
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image is not valid base64") from None
    return from_bytes(data, declared)


def from_url(url: str) -> Image:
    """An image from an OpenAI-style URL: a `data:` URL with base64 data."""
    if url.startswith(("http://", "https://")):
        raise RemoteImage(url)
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise ImageError("the image URL is not a base64 data: URL (data:image/png;base64,...)")
    return from_base64(m["data"], m["mime"])


def from_bytes(data: bytes, declared: str | None = None) -> Image:
    if not data:
        raise ImageError("the image is empty")
    mime = sniff(data)
    if mime is None:
        raise ImageError(f"the image is not PNG, JPEG, WebP or GIF{f' (it says {declared})' if declared else ''}")
    if declared and declared.lower() != mime and not (declared.lower() == "image/jpg" and mime == "image/jpeg"):
        raise ImageError(f"the image is {mime}, not {declared} as the request says")
    width, height = dimensions(data, mime)
    if width <= 0 or height <= 0:
        raise ImageError(f"the {mime} image has no size ({width}x{height})")
    return Image(data, mime, width, height, hashlib.sha256(data).hexdigest())


def check_size(image: Image, max_bytes: int) -> None:
    """ImageError when `image` is larger than the gateway takes (the `max_image_bytes` setting)."""
    if len(image.data) > max_bytes:
        raise ImageError(f"the image is {_size(len(image.data))}, larger than the {_size(max_bytes)} this gateway "
                         "takes (GATEWAY_MAX_IMAGE_BYTES)")


def sniff(data: bytes) -> str | None:
    """The image type its first bytes say, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


def dimensions(data: bytes, mime: str) -> tuple[int, int]:
    """(width, height) from the image's header; ImageError when the header is cut short or broken."""
    try:
        if mime == "image/png":
            if data[12:16] != b"IHDR":
                raise ImageError("the PNG image has no IHDR header")
            w, h = struct.unpack(">II", data[16:24])
            return w, h
        if mime == "image/gif":
            w, h = struct.unpack("<HH", data[6:10])
            return w, h
        if mime == "image/webp":
            return _webp(data)
        return _jpeg(data)
    except struct.error:
        raise ImageError(f"the {mime} image is cut short") from None


def _webp(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        if len(data) < 30:
            raise struct.error
        return w, h
    if chunk == b"VP8L":
        if len(data) < 25 or data[20] != 0x2F:
            raise ImageError("the WebP image's lossless header is broken")
        b = int.from_bytes(data[21:25], "little")
        return (b & 0x3FFF) + 1, ((b >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise ImageError("the WebP image's frame header is broken")
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    raise ImageError("the WebP image has no VP8, VP8L or VP8X chunk")


def _jpeg(data: bytes) -> tuple[int, int]:
    """The size from the first start-of-frame marker."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            raise ImageError("the JPEG image's markers are broken")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            return w, h
        i += 2 + length
    raise ImageError("the JPEG image has no frame header (cut short?)")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"
