"""Images in a prompt, through llama.cpp's multimodal library (`mtmd`, as llama-server serves them).

A vision projector (the `mmproj` GGUF beside the model) turns each image into embeddings that are
decoded into a sequence's KV in place of tokens. The prompt arrives rendered, with `IMAGE_MARKER`
where each image goes; `Vision.tokenize` splits it into text tokens and image chunks. In the
sequence's token list an image's positions hold stand-in ids (`image_ids`: negative, derived from
the image's hash), so the prefix matching that reuses KV (a slot's own, another sequence's, the
host cache's) reuses an image's KV exactly when the same image is at the same place, and a
different image differs from its first position. The scheduler feeds an image whole, on its own
decode, before the prompt's text after it (`Vision.feed`).
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import logging
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.base import (
    IMAGE_MARKER,
    EngineFailure,
    GenerationRequest,
    InvalidGenerationRequest,
    ModelLoadError,
)
from engines.llamacpp.load_settings import route_vision_logs

log = logging.getLogger(__name__)

# Stand-in ids span the negative int32 range (the host cache keeps token lists as int32).
SPAN = 2**31 - 2


@dataclass(eq=False)
class Media:
    """One image of a prompt: its chunk (owned; freed with the request) and its tokens' place."""

    chunk: Any
    start: int
    n_tokens: int

    def free(self) -> None:
        if self.chunk is not None:
            import llama_cpp.mtmd_cpp as mt

            mt.mtmd_input_chunk_free(self.chunk)
            self.chunk = None


def image_ids(digest: bytes, n: int) -> list[int]:
    """The stand-ins for an image's `n` tokens: the same for the same image; no vocabulary id."""
    base = int.from_bytes(digest[:8], "little") % SPAN
    return [-1 - ((base + i) % SPAN) for i in range(n)]


def media_at(media: Sequence[Media], pos: int) -> Media | None:
    return next((m for m in media if m.start == pos), None)


def floor_media(media: Sequence[Media], keep: int) -> int:
    """`keep` moved back to the start of an image it would cut (an image is fed whole)."""
    for m in media:
        if m.start < keep < m.start + m.n_tokens:
            return m.start
    return keep


def next_media(media: Sequence[Media], pos: int) -> int | None:
    """Where the next image at or after `pos` starts."""
    return min((m.start for m in media if m.start >= pos), default=None)


def rgb(data: bytes, index: int) -> tuple[int, int, bytes]:
    """An image's pixels (the first frame of an animation) as RGB: (width, height, bytes)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                im.seek(0)
                px = im.convert("RGB")
                return px.width, px.height, px.tobytes()
    except UnidentifiedImageError:
        why = "its data is damaged (no decoder reads it)"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        why = "it has too many pixels"
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        why = str(exc) or type(exc).__name__
    raise InvalidGenerationRequest(f"image {index + 1} could not be decoded: {why}")


def seeing(vision: Vision | None) -> Vision:
    """The engine's projector; a request with images to a model without one is refused."""
    if vision is None:
        raise InvalidGenerationRequest("this model takes no images (it has no vision projector)")
    return vision


def placed(vision: Vision | None, token_ids: Sequence[int], images: Sequence[bytes]) -> list[Media]:
    """The images of a token sequence to score, on an engine with the projector `vision`."""
    return seeing(vision).place(token_ids, images)


def with_images(vision: Vision | None, request: GenerationRequest, bos_text: str) -> tuple[list[int], list[Media]]:
    """A request's prompt with its images, on an engine with the projector `vision`."""
    return seeing(vision).prompt(request, bos_text)


class Vision:
    """The projector of one loaded model: prompts with images into token ids and image chunks, and
    those chunks into a sequence's KV."""

    def __init__(self, mctx: Any) -> None:
        self._mctx = mctx
        # One encoder, its output buffer shared: the main and the long prompts' schedulers take turns.
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str, model: Any, threads: int, on_gpu: bool) -> Vision:
        import llama_cpp.mtmd_cpp as mt

        route_vision_logs()
        p = mt.mtmd_context_params_default()
        p.use_gpu = on_gpu
        p.n_threads = threads
        p.print_timings = False
        p.media_marker = IMAGE_MARKER.encode()
        mctx = mt.mtmd_init_from_file(path.encode(), model, p)
        if not mctx:
            raise ModelLoadError(f"the vision projector {path} could not be loaded (llama.cpp's log says why)")
        if not mt.mtmd_support_vision(mctx):
            mt.mtmd_free(mctx)
            raise ModelLoadError(f"{path} is not a vision projector")
        if mt.mtmd_decode_use_mrope(mctx):
            # Their image positions are 2-D (n_pos < n_tokens); the scheduler places tokens by count.
            mt.mtmd_free(mctx)
            raise ModelLoadError(f"{path}: projectors with M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) "
                                 "are not served yet")
        return cls(mctx)

    def close(self) -> None:
        if self._mctx is not None:
            import llama_cpp.mtmd_cpp as mt

            mt.mtmd_free(self._mctx)
            self._mctx = None

    def prompt(self, request: GenerationRequest, bos_text: str) -> tuple[list[int], list[Media]]:
        """A request's prompt with its images (with BOS unless its template wrote it, as for text)."""
        if request.sampling.prompt_logprobs is not None or request.prompt_ids:
            raise InvalidGenerationRequest("a prompt with images is given as text, and is not scored")
        text = request.prompt or ""
        return self.tokenize(text, request.images, not (request.templated and bos_text and text.startswith(bos_text)))

    def tokenize(self, text: str, images: Sequence[bytes], add_special: bool) -> tuple[list[int], list[Media]]:
        """The prompt's token ids (images as their stand-ins) and its images' chunks."""
        import llama_cpp.mtmd_cpp as mt

        found = text.count(IMAGE_MARKER)
        if found != len(images):
            raise InvalidGenerationRequest(f"the prompt has {found} image places ({IMAGE_MARKER}) for "
                                           f"{len(images)} images")
        digests = [hashlib.sha256(data).digest() for data in images]
        bitmaps: list[Any] = []
        chunks = mt.mtmd_input_chunks_init()
        try:
            bitmaps.extend(self._bitmap(data, i, digests[i]) for i, data in enumerate(images))
            raw = text.encode()
            inp = mt.mtmd_input_text(raw, len(raw), add_special, True)
            arr = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            # On the request's thread, beside the scheduler's encodes, as llama-server does: the
            # preprocessing reads the projector's parameters only.
            rc = mt.mtmd_tokenize(self._mctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise InvalidGenerationRequest(f"the images could not be prepared for the model (mtmd_tokenize: {rc})")
            return self._split(chunks, digests)
        finally:
            mt.mtmd_input_chunks_free(chunks)
            for b in bitmaps:
                mt.mtmd_bitmap_free(b)

    def _bitmap(self, data: bytes, index: int, digest: bytes) -> Any:
        import llama_cpp.mtmd_cpp as mt

        w, h, px = rgb(data, index)
        buf = (ctypes.c_uint8 * len(px)).from_buffer_copy(px)
        bitmap = mt.mtmd_bitmap_init(w, h, buf)
        mt.mtmd_bitmap_set_id(bitmap, digest.hex().encode())
        return bitmap

    @staticmethod
    def _split(chunks: Any, digests: Sequence[bytes]) -> tuple[list[int], list[Media]]:
        import llama_cpp.mtmd_cpp as mt

        ids: list[int] = []
        media: list[Media] = []
        each = iter(digests)
        try:
            for i in range(mt.mtmd_input_chunks_size(chunks)):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                kind = mt.mtmd_input_chunk_get_type(chunk)
                if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    toks = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    ids.extend(toks[: n.value] if n.value else [])
                elif kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    n_tok = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
                    media.append(Media(mt.mtmd_input_chunk_copy(chunk), len(ids), n_tok))
                    ids.extend(image_ids(next(each), n_tok))
                else:
                    raise InvalidGenerationRequest("only images are taken beside the prompt")
        except BaseException:
            for m in media:
                m.free()
            raise
        if media and ids[-1] < 0:
            for m in media:
                m.free()
            raise InvalidGenerationRequest("the prompt ends with an image; text must follow it")
        return ids, media

    def place(self, token_ids: Sequence[int], images: Sequence[bytes]) -> list[Media]:
        """The chunks of `images` for a token sequence holding their stand-ins (a prompt with these
        images, tokenized here, and what followed it), each at the place of its stand-ins."""
        ids, media = self.tokenize(IMAGE_MARKER * len(images) + "\n", images, False)
        at = 0
        for m in media:
            run = ids[m.start : m.start + m.n_tokens]
            m.start = next((i for i in range(at, len(token_ids) - len(run) + 1)
                            if token_ids[i] == run[0] and list(token_ids[i : i + len(run)]) == run), -1)
            if m.start < 0:
                for x in media:
                    x.free()
                raise InvalidGenerationRequest("the tokens do not hold the places of these images")
            at = m.start + m.n_tokens
        return media

    def feed(self, ctx: Any, m: Media, n_past: int, seq_id: int, n_batch: int) -> None:
        """Encode the image and decode its embeddings into `seq_id` from position `n_past`."""
        import llama_cpp as lc
        import llama_cpp.mtmd_cpp as mt

        new_past = lc.llama_pos(0)
        with self._lock:
            rc = mt.mtmd_helper_eval_chunk_single(self._mctx, ctx, m.chunk, n_past, seq_id, n_batch, False,
                                                  ctypes.byref(new_past))
        if rc != 0:
            raise EngineFailure(f"the image's embeddings could not be decoded (mtmd: {rc})")
        if new_past.value != n_past + m.n_tokens:
            raise EngineFailure(f"an image took {new_past.value - n_past} positions for {m.n_tokens} tokens")
