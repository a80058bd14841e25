"""Image parts at the protocol boundary, the same for every protocol: an adapter turns what its
client sent into a checked `Part` (a 400 `invalid_image` naming the part when it is not an image
the gateway takes), and serving refuses images a model cannot take (400 `model_not_multimodal`)
and images over the size limit, before any engine sees them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engines.base import IMAGE_MARKER, Capabilities
from gateway.api.errors import invalid
from gateway.chat.images import Image, ImageError, check_size
from gateway.conversation import Conversation, Part


def image_part(load: Callable[[], Image], param: str) -> Part:
    """The image `load` decodes, as a part the client put at `param`."""
    try:
        return Part("image", image=load(), param=param)
    except ImageError as exc:  # the part in the message too: Ollama's envelope has no field for it
        raise invalid(f"{param}: {exc}", param=param, code="invalid_image") from None


def check_images(conv: Conversation, max_bytes: int) -> None:
    """Every image within the size limit."""
    for p in conv.images:
        assert p.image is not None
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
    turns = [replace(t, parts=tuple(Part("text", IMAGE_MARKER) if p.type == "image" else p for p in t.parts))
             for t in conv.turns]
    return replace(conv, turns=tuple(turns)), images
