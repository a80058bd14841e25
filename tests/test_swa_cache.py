"""Sliding-window KV (Gemma-3-270M, window 512) kept at its window, as llama-server does: the next
turn of a conversation still reuses the sequence's KV and the host cache's, with a cold run's
output, and a prefix that the window has moved past is never reused (it would attend to
overwritten positions)."""

from __future__ import annotations

from typing import Any

from engines.base import Usage
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.runtime import LlamaCppOptions
from engines.llamacpp.slots import floor
from gateway.chat.template import ChatMessage
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.test_prefix_cache import _ask as ask

WORDS = ("harbour lantern copper meadow violin glacier orchard saddle pepper thunder marble "
         "falcon compass velvet canyon ribbon kettle walnut").split()


def _gemma() -> tuple[str, Any]:
    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models["gemma-3-270m"]
    return str(reg.resolve(spec, "gguf")), spec


async def _engine(parallel: int = 1, prefix_cache_mib: int = 0, **kw: Any) -> LlamaCppEngine:
    path, spec = _gemma()
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=4096, parallel=parallel,
                                                     chat_template=spec.chat_template, prefix_cache_mib=prefix_cache_mib, **kw))
    await e.load()
    return e


def _text(seed: int, words: int) -> str:
    return " ".join(f"{WORDS[(seed * 7 + i * 5) % len(WORDS)]}{(seed + i) % 13}" for i in range(words))


def _chat(system: str, *turns: str) -> tuple[ChatMessage, ...]:
    msgs = [ChatMessage("system", system)]
    for i, t in enumerate(turns):
        msgs.append(ChatMessage("user" if i % 2 == 0 else "assistant", t))
    return tuple(msgs)


async def _ask(e: LlamaCppEngine, msgs: tuple[ChatMessage, ...]) -> tuple[str, Usage]:
    return await ask(e, msgs, max_tokens=12)


async def _cold(msgs: tuple[ChatMessage, ...]) -> str:
    """The answer of a fresh engine without any cache (greedy). Logits are not compared: on this
    model a different batch split alone moves top logprobs by up to ~0.3 (swa_full or not)."""
    e = await _engine()
    try:
        text, usage = await _ask(e, msgs)
        assert usage.cached_tokens == 0
        return text
    finally:
        await e.close()


SYSTEM = "You keep an inventory. Items: " + _text(1, 700)  # ~1.7k tokens: past the window and the batch


async def test_the_window_cache_is_on_and_the_next_turn_reuses_the_sequence() -> None:
    e = await _engine()
    try:
        assert e.info.extra["swa_cache"] == "window 512"
        first = _chat(SYSTEM, "Which item comes first? Answer with one word.")
        reply, u1 = await _ask(e, first)
        assert u1.prompt_tokens > 1500
        # The window layers kept only their last positions: the oldest is far past 0.
        pos_min = floor(e._sched._mem, 512, e._sched._slots[0]) - 512  # type: ignore[union-attr]
        assert pos_min > 500, pos_min
        second = _chat(SYSTEM, "Which item comes first? Answer with one word.", reply, "And the second?")
        text, u2 = await _ask(e, second)
        assert u2.cached_tokens >= u1.prompt_tokens - 8, (u2.cached_tokens, u1.prompt_tokens)
        cold = await _cold(second)
    finally:
        await e.close()
    assert text == cold


async def test_a_prefix_the_window_has_moved_past_is_prefilled_again() -> None:
    e = await _engine()
    try:
        long = _chat(SYSTEM, "List three items. " + _text(2, 300))
        await _ask(e, long)
        # Shares the system prompt (~1.6k tokens) but not the ~900 tokens after it: the window
        # layers no longer hold the window before the branch point.
        branch = _chat(SYSTEM, "Name one item that starts with the letter m.")
        text, usage = await _ask(e, branch)
        assert usage.cached_tokens == 0, usage
        cold = await _cold(branch)
    finally:
        await e.close()
    assert text == cold


async def test_the_host_cache_restores_a_window_cache_and_skips_what_it_cannot_serve() -> None:
    e = await _engine(prefix_cache_mib=256)
    try:
        ask = "Which of these comes first? " + _text(2, 300)  # ~1k tokens after the system prompt
        a1 = _chat(SYSTEM, ask)
        reply, _ = await _ask(e, a1)
        await _ask(e, _chat("You are terse.", "Say hi."))  # takes the only slot: A's state goes to host memory
        host = e._sched.host_cache  # type: ignore[union-attr]
        assert host is not None and len(host) == 1
        entry = next(iter(host._entries.values()))
        assert entry.floor > 512, entry.floor
        a2 = _chat(SYSTEM, ask, reply, "And the second?")
        text, usage = await _ask(e, a2)
        assert usage.prefix_lookup == "hit" and usage.restored_tokens > 2000, usage
        # Another conversation with the same system prompt only: the entries' windows are ~1k
        # tokens past its end.
        await _ask(e, _chat("You are terse.", "Say bye."))
        other = _chat(SYSTEM, "Name one item that starts with the letter m.")
        other_text, other_usage = await _ask(e, other)
        # (the few tokens the chat template starts with come from the short chat in the slot)
        assert other_usage.prefix_lookup == "miss" and other_usage.restored_tokens == 0 and other_usage.cached_tokens < 16, other_usage
        assert other_text == await _cold(other)
        text2, _ = await _ask(e, a2)  # a2 again, its logits now the engine's last
        assert text2 == text == await _cold(a2)
    finally:
        await e.close()


async def test_swa_full_keeps_every_position_and_reuses_any_prefix() -> None:
    e = await _engine(swa_full=True)
    try:
        assert e.info.extra["swa_cache"] == "full"
        await _ask(e, _chat(SYSTEM, "List three items. " + _text(2, 300)))
        branch = _chat(SYSTEM, "Name one item that starts with the letter m.")
        _, usage = await _ask(e, branch)
        assert usage.cached_tokens > 1500, usage
    finally:
        await e.close()


async def test_sessions_sharing_a_system_prompt_reuse_it_through_a_checkpoint() -> None:
    e = await _engine(prefix_cache_mib=256)
    try:
        await _ask(e, _chat(SYSTEM, "List three items. " + _text(2, 300)))
        # A second session: the first one's KV holds the system prompt, but its window is ~900
        # tokens past it. Prefilled again, and saved to the host cache when the prefill passes
        # the shared prefix's end.
        _, ub = await _ask(e, _chat(SYSTEM, "Count the items. " + _text(3, 300)))
        host = e._sched.host_cache  # type: ignore[union-attr]
        assert host is not None and ub.cached_tokens < 16 and host.checkpoints == 1, (ub, host.checkpoints)
        stats = e.health().prefix_cache
        assert stats is not None and stats.checkpoints == 1
        # A third session restores the system prompt from that checkpoint (nothing else holds
        # it in a form that can serve it: the second session's own state ends ~900 tokens later).
        third = _chat(SYSTEM, "Name one item that starts with the letter m.")
        text, usage = await _ask(e, third)
        assert usage.prefix_lookup == "hit" and usage.restored_tokens > 1500, usage
    finally:
        await e.close()
    assert text == await _cold(third)
