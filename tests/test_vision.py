"""Images through the real engine: a tiny Gemma-3-shaped vision model (random weights, converted by
llama.cpp's own converter: scripts/tiny_vlm.py) served with its projector, through every protocol's
official client. Its words are noise; what is checked is what images do to the prompt and the logits:
an image adds its tokens, two different images give different logits and the same image the same,
a follow-up about the same image reuses its KV, and bad images get their 400s."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import yaml
from PIL import Image as PILImage

from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import NO_CHECKS, ROOT, ServerThread

sys.path.insert(0, str(ROOT / "scripts"))
import tiny_vlm  # noqa: E402

VISION, TEXT = "tiny-vision", "tiny-vision-text-only"
# Gemma 3's projector wraps an image's tokens in <start_of_image> ... <end_of_image>.
IMAGE_TOKENS = tiny_vlm.TOKENS_PER_IMAGE + 2


def picture(colour: tuple[int, int, int], fmt: str = "PNG", size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


RED, BLUE = picture((220, 20, 30)), picture((20, 40, 230))


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny vision model and its projector."""
    return tiny_vlm.write(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, vlm: tuple[Path, Path]) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("vision")
    model, mmproj = vlm
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump({"models": [
        {"id": VISION, "formats": {"gguf": {"path": str(model)}}, "mmproj": {"path": str(mmproj)},
         "parallel": 2, "context_length": 4096},
        {"id": TEXT, "formats": {"gguf": {"path": str(model)}}, "parallel": 1, "context_length": 4096}]}))
    # Image URLs fetched from any host: the tests serve them on loopback.
    settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), engine="cpu", max_resident=2, image_fetch="any")
    srv = ServerThread(create_app(settings, load_registry(cfg, cache_dir=tmp / "cache"))).start(timeout=300)
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, image: bytes | None, text: str = "What is in the picture?", mime: str = "image/png",
        **kw: Any) -> Any:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": url(image, mime)}})
    return client.chat.completions.create(model=kw.pop("model", VISION), messages=[{"role": "user", "content": content}],
                                          max_tokens=kw.pop("max_tokens", 3), temperature=0, **kw)


def first_logprobs(r: Any) -> dict[int, float]:
    """The first token's top log-probabilities, by token text."""
    assert r.choices[0].logprobs is not None
    return {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}


def test_an_image_adds_its_tokens_to_the_prompt(client: openai.OpenAI) -> None:
    plain, seen = ask(client, None), ask(client, RED)
    assert plain.usage is not None and seen.usage is not None
    assert seen.usage.prompt_tokens - plain.usage.prompt_tokens == IMAGE_TOKENS
    assert seen.choices[0].finish_reason in ("length", "stop")


def test_different_images_give_different_logits_and_the_same_image_the_same(client: openai.OpenAI) -> None:
    kw = {"logprobs": True, "top_logprobs": 5, "max_tokens": 1}
    red, blue, red_again = (first_logprobs(ask(client, img, **kw)) for img in (RED, BLUE, RED))

    def gap(a: dict[str, float], b: dict[str, float]) -> float:
        return max(abs(a.get(t, -100.0) - b.get(t, -100.0)) for t in {*a, *b})

    # The same image: equal up to the rounding of a differently composed batch (part of the second
    # prompt's KV comes from the cache); another image: far apart.
    assert red.keys() == red_again.keys() and gap(red, red_again) < 1e-3
    assert gap(red, blue) > 100 * max(gap(red, red_again), 1e-4)


def test_a_follow_up_about_the_same_image_reuses_its_kv(client: openai.OpenAI) -> None:
    text = "Describe the colours, please."
    first = ask(client, BLUE, text)
    again = ask(client, BLUE, text)
    other = ask(client, RED, text)
    assert first.usage is not None and again.usage is not None and other.usage is not None
    cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # All but the last prompt token (one is decoded for the first logits): the image's KV with it.
    assert cached == again.usage.prompt_tokens - 1
    # Another image differs from its first token: only the text before it can be reused.
    other_cached = other.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert other_cached < other.usage.prompt_tokens - IMAGE_TOKENS


@pytest.mark.parametrize(("fmt", "mime"), [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_each_image_type_is_read(client: openai.OpenAI, fmt: str, mime: str) -> None:
    r = ask(client, picture((10, 200, 30), fmt), mime=mime)
    assert r.usage is not None and r.usage.prompt_tokens > IMAGE_TOKENS


def test_a_stream_with_an_image(client: openai.OpenAI) -> None:
    chunks = list(ask(client, RED, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_two_images_in_one_message(client: openai.OpenAI) -> None:
    one = ask(client, RED)
    two = client.chat.completions.create(model=VISION, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                     {"type": "image_url", "image_url": {"url": url(RED)}},
                                     {"type": "image_url", "image_url": {"url": url(BLUE)}}]}])
    assert one.usage is not None and two.usage is not None
    assert two.usage.prompt_tokens - one.usage.prompt_tokens == IMAGE_TOKENS


def test_a_corrupt_image_is_a_400_and_the_model_serves_on(client: openai.OpenAI) -> None:
    broken = RED[:40]  # its header (type and size) is read; its pixels are not there
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        ask(client, broken)
    assert ask(client, RED).usage is not None


def test_a_text_only_model_given_an_image_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, RED, model=TEXT)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_multimodal" and TEXT in body["message"]


def test_responses_input_image(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=VISION, max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"}]}])
    r = client.responses.create(model=VISION, max_output_tokens=3, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in the picture?"},
        {"type": "input_image", "image_url": url(RED), "detail": "auto"}]}])
    assert r.usage is not None and plain.usage is not None
    assert r.usage.input_tokens - plain.usage.input_tokens == IMAGE_TOKENS
    # The stored conversation keeps the image: a follow-up by previous_response_id reuses its KV.
    follow = client.responses.create(model=VISION, max_output_tokens=3, temperature=0, previous_response_id=r.id,
                                     input="And its colour?")
    assert follow.usage is not None and follow.usage.input_tokens > r.usage.input_tokens
    details = follow.usage.input_tokens_details
    assert details is not None and details.cached_tokens >= r.usage.input_tokens - 1


def test_anthropic_image_block(server: str) -> None:
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0) as c:
        def send(*blocks: dict[str, Any]) -> anthropic.types.Message:
            return c.messages.create(model=VISION, max_tokens=3, messages=[
                {"role": "user", "content": [*blocks, {"type": "text", "text": "What is this?"}]}])

        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(BLUE).decode()}}
        seen, plain = send(image), send()
        assert seen.usage.input_tokens - plain.usage.input_tokens == IMAGE_TOKENS
        assert seen.stop_reason in ("max_tokens", "end_turn")
        broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(BLUE[:40]).decode()}}
        with pytest.raises(anthropic.BadRequestError, match="could not be decoded"):
            send(broken)


def test_ollama_images(server: str) -> None:
    with ollama.Client(host=server) as c:
        seen = c.chat(model=VISION, messages=[{"role": "user", "content": "What is it?", "images": [RED]}],
                      options={"num_predict": 3, "temperature": 0})
        plain = c.chat(model=VISION, messages=[{"role": "user", "content": "What is it?"}],
                       options={"num_predict": 3, "temperature": 0})
        assert seen.prompt_eval_count is not None and plain.prompt_eval_count is not None
        assert seen.prompt_eval_count - plain.prompt_eval_count == IMAGE_TOKENS
        gen = c.generate(model=VISION, prompt="What is it?", images=[BLUE], options={"num_predict": 3})
        assert gen.done and gen.eval_count == 3
        with pytest.raises(ollama.ResponseError) as err:
            c.chat(model=VISION, messages=[{"role": "user", "content": "What is it?", "images": [RED[:40]]}])
        assert err.value.status_code == 400 and "could not be decoded" in err.value.error
        assert "vision" in c.show(VISION).capabilities  # type: ignore[operator]
        assert "vision" not in (c.show(TEXT).capabilities or [])


def test_the_memory_estimate_counts_the_projector(tmp_path: Path) -> None:
    from engines.base import EngineConfig
    from engines.llamacpp.runtime import LlamaCppOptions
    from gateway.models.gguf_info import read_gguf
    from gateway.models.memory import MiB, fit_config

    model, mmproj = tiny_vlm.write(tmp_path)
    info = read_gguf(model)
    budgets = {"cpu": 4096 * MiB}
    bare = EngineConfig(model_path=str(model), options=LlamaCppOptions(prefix_cache_mib=0))
    seeing = EngineConfig(model_path=str(model), options=LlamaCppOptions(prefix_cache_mib=0, mmproj=str(mmproj)))
    without, _, _ = fit_config(info, bare, "cpu", budgets)
    with_it, _, _ = fit_config(info, seeing, "cpu", budgets)
    assert with_it.parts["projector"] == mmproj.stat().st_size > 0
    assert with_it.host - without.host == mmproj.stat().st_size


def test_a_stream_with_an_image_goes_on_through_a_worker_kill(server: str, client: openai.OpenAI) -> None:
    """The resumed request carries its image: the new worker feeds it again, and the answer is the
    uninterrupted one (greedy), its prompt counted once."""
    content = [{"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": url(RED)}}]
    body = {"model": VISION, "messages": [{"role": "user", "content": content}], "max_tokens": 1500, "temperature": 0}
    reference = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()
    pid = httpx.get(f"{server}/health", timeout=10).json()["models"][VISION]["worker"]["pid"]
    text, usage, frames = "", None, 0
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            frames += 1
            if frames == 5:
                os.kill(pid, signal.SIGKILL)
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    assert usage is not None and usage.get("failovers", 0) >= 1, (usage, frames)
    assert usage["completion_tokens"] == 1500 and usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert text == reference["choices"][0]["message"]["content"]


from tests.test_web import _page, browser  # noqa: E402, F401 - the Chromium fixture


async def test_the_page_chat_attaches_an_image(browser, server: str) -> None:  # noqa: F811
    page, console = await _page(browser, server)
    sent: list[dict[str, Any]] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions") else None)
    await page.wait_for_selector(f'#model option[value="{VISION}"]', state="attached")
    await page.select_option("#model", TEXT)
    assert await page.is_disabled("#image")  # a model without a projector takes none
    await page.select_option("#model", VISION)
    assert await page.is_enabled("#image")
    await page.set_input_files("#image", files=[{"name": "red.png", "mimeType": "image/png", "buffer": RED}])
    await page.fill("#max-tokens", "3")
    await page.fill("#prompt", "What is in the picture?")
    await page.press("#prompt", "Enter")
    await page.wait_for_selector(".stats[data-ending]", timeout=60_000)
    assert await page.get_attribute(".stats", "data-ending") in ("length", "stop")
    assert await page.locator(".msg.user img.attached").count() == 1
    parts = sent[0]["messages"][0]["content"]
    assert parts[1]["image_url"]["url"] == url(RED)
    # The follow-up's history carries the image: the conversation stays about it.
    await page.fill("#prompt", "And its colour?")
    await page.press("#prompt", "Enter")
    await page.wait_for_function("() => document.querySelectorAll('.stats[data-ending]').length === 2", timeout=60_000)
    assert sent[1]["messages"][0]["content"][1]["image_url"]["url"] == url(RED)
    assert isinstance(sent[1]["messages"][2]["content"], str)
    assert console.errors == []
    await page.close()


def test_an_image_url_is_fetched_where_the_operator_allows_it(client: openai.OpenAI, server: str,
                                                              tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(RED)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        where = f"http://127.0.0.1:{host.server_address[1]}/red.png"
        fetched = client.chat.completions.create(model=VISION, max_tokens=1, temperature=0, logprobs=True,
                                                 top_logprobs=5, messages=[{"role": "user", "content": [
                                                     {"type": "text", "text": "What is in the picture?"},
                                                     {"type": "image_url", "image_url": {"url": where}}]}])
        inline = ask(client, RED, max_tokens=1, logprobs=True, top_logprobs=5)
        assert fetched.usage is not None and inline.usage is not None
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
        assert first_logprobs(fetched).keys() == first_logprobs(inline).keys()
        with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0) as c:
            m = c.messages.create(model=VISION, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": where}}, {"type": "text", "text": "What is this?"}]}])
            assert m.usage.input_tokens > IMAGE_TOKENS
            with pytest.raises(anthropic.BadRequestError, match="source.url: fetching the image answered HTTP 404"):
                c.messages.create(model=VISION, max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "url", "url": where + ".gone"}}]}])
    finally:
        host.shutdown()
        host.server_close()


def _on_lavapipe() -> bool:
    from engines.llamacpp.runtime import found
    from gateway.host.hardware import probe_host
    from tests.conftest import VULKAN

    return found(probe_host()).package.has("Vulkan") and any(d.type == "cpu" for d in VULKAN.devices)


@pytest.mark.skipif(not os.environ.get("CI") and not _on_lavapipe(),
                    reason="needs the Vulkan build of llama-cpp-python and Mesa's lavapipe (scripts/test.sh installs both)")
def test_images_on_the_vulkan_build(tmp_path: Path, client: openai.OpenAI) -> None:
    """The Vulkan build's multimodal library serves the same model: an image's tokens, and logits
    close to the CPU engine's (fp16 kernels on lavapipe against fp32)."""
    model, mmproj = tiny_vlm.write(tmp_path)
    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml.safe_dump({"models": [
        {"id": VISION, "formats": {"gguf": {"path": str(model)}}, "mmproj": {"path": str(mmproj)},
         "parallel": 1, "context_length": 4096}]}))
    settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), engine="vulkan")
    srv = ServerThread(create_app(settings, load_registry(cfg, cache_dir=tmp_path / "cache"))).start(timeout=600)
    try:
        vk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert "vulkan" in httpx.get(f"{srv.url}/health", timeout=30).json()["models"][VISION]["engine"]
        kw = {"logprobs": True, "top_logprobs": 5, "max_tokens": 1}
        plain, red = ask(vk, None), ask(vk, RED, **kw)
        assert red.usage.prompt_tokens - plain.usage.prompt_tokens == IMAGE_TOKENS
        blue = first_logprobs(ask(vk, BLUE, **kw))
        cpu_red = first_logprobs(ask(client, RED, **kw))
        on_vk = first_logprobs(red)
        shared = on_vk.keys() & cpu_red.keys()
        assert shared, (on_vk, cpu_red)
        close = max(abs(on_vk[t] - cpu_red[t]) for t in shared)
        apart = max(abs(on_vk.get(t, -100.0) - blue.get(t, -100.0)) for t in {*on_vk, *blue})
        assert close < 0.1 and apart > 3 * close, (close, apart, on_vk, cpu_red, blue)
    finally:
        srv.stop()


async def test_scoring_a_prompt_with_its_image(vlm: tuple[Path, Path]) -> None:
    """Engine.logits re-feeds a prompt's images where their stand-ins are: the rows after the image
    give back the greedy answer generated with it; the image's own rows are NaN; another image than
    the tokens hold is refused."""
    import numpy as np

    from engines.base import (
        IMAGE_MARKER,
        EngineConfig,
        GenerationRequest,
        InvalidGenerationRequest,
        SamplingParams,
    )
    from engines.llamacpp.engine import LlamaCppEngine
    from engines.llamacpp.runtime import LlamaCppOptions

    model, mmproj = vlm
    e = LlamaCppEngine(EngineConfig(model_path=str(model), context_length=1024, parallel=1,
                                    options=LlamaCppOptions(prefix_cache_mib=0, mmproj=str(mmproj))))
    await e.load()
    try:
        req = GenerationRequest("t", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                prompt=f"Look: {IMAGE_MARKER}\nWhat is it?", images=(RED,))
        events = [ev async for ev in e.generate(req)]
        usage = events[-1].usage
        assert usage is not None
        prompt, out = list(usage.prompt_ids), [t for ev in events for t in ev.token_ids]
        assert len(out) == 6 and sum(t < 0 for t in prompt) == tiny_vlm.TOKENS_PER_IMAGE
        rows = await e.logits(prompt + out, (RED,))
        assert rows.shape[0] == len(prompt) + len(out)
        image = [i for i, t in enumerate(prompt) if t < 0]
        assert np.isnan(rows[image]).all() and np.isfinite(np.delete(rows, image, axis=0)).all()
        assert [int(np.argmax(r)) for r in rows[len(prompt) - 1 : -1]] == out
        again = await e.logits(prompt + out, (RED,))
        np.testing.assert_array_equal(np.delete(rows, image, axis=0), np.delete(again, image, axis=0))
        with pytest.raises(InvalidGenerationRequest, match="do not hold the places of these images"):
            await e.logits(prompt + out, (BLUE,))
    finally:
        await e.close()


def test_shadow_parity_scores_prompts_with_images(tmp_path: Path, vlm: tuple[Path, Path]) -> None:
    """Served requests with images are re-scored with their images on the reference engine."""
    from tests.test_shadow import _metric

    model, mmproj = vlm
    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"id": VISION, "formats": {"gguf": {"path": str(model)}},
                                               "mmproj": {"path": str(mmproj)}, "context_length": 2048}]}))
    settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), engine="cpu", parallel=1, parity_reference="cpu",
                                 parity_sample=1.0, parity_window=2)
    srv = ServerThread(create_app(settings, load_registry(cfg, cache_dir=tmp_path / "cache"))).start(timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for image in (RED, BLUE):
            ask(client, image, max_tokens=4)
        labels = {"model": VISION, "engine": "llamacpp/cpu", "device": "cpu"}
        deadline, text = time.monotonic() + 120, ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{srv.url}/metrics").text
            if _metric(text, "gateway_parity_samples_scored_total", **labels) >= 2:
                break
            time.sleep(0.2)
        assert _metric(text, "gateway_parity_samples_scored_total", **labels) == 2, text
        assert _metric(text, "gateway_parity_kl_sum", **labels) / 2 < 1e-6
        assert _metric(text, "gateway_parity_top1_agreement_sum", **labels) / 2 == 1.0
    finally:
        srv.stop()
