"""Stop-string matching and UTF-8 safe detokenization."""

from __future__ import annotations

import json

from engines.text import Detokenizer, StopMatcher


def _run(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        out += m.push(p)
        if m.stopped:
            break
    return out + m.flush(), m.stopped


def test_stop_across_pieces() -> None:
    assert _run(("END",), ["hello E", "N", "D more"]) == ("hello ", True)


def test_partial_stop_released_when_it_diverges() -> None:
    m = StopMatcher(("END",))
    assert m.push("abc EN") == "abc "
    assert m.push("X") == "ENX"


def test_earliest_stop_wins() -> None:
    assert _run(("b", "a"), ["xxab"]) == ("xx", True)
    m = StopMatcher(("b", "a"))
    m.push("xxab")
    assert m.matched == "a"  # which one ended it (Anthropic's stop_sequence)
    assert StopMatcher(("b",)).matched is None


def test_no_stop_flushes_everything() -> None:
    assert _run(("zz",), ["a z", "b z"]) == ("a zb z", False)


def test_detokenizer_holds_partial_utf8() -> None:
    d = Detokenizer()
    euro = "€".encode()
    assert d.push(euro[:1]) == ""
    assert d.push(euro[1:]) == "€"
    assert d.push(b"\xe2") == ""
    assert d.flush() == "\ufffd"


def test_text_chunk_template_equals_full_serialisation() -> None:
    from gateway.api.openai.common import TextChunk
    from gateway.api.openai.protocol import ChatCompletionChunk, ChunkChoice, Delta

    def render(text: str) -> str:
        c = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[ChunkChoice(index=2, delta=Delta(content=text))])
        return c.model_dump_json(exclude={"usage"})

    fast = TextChunk(render)
    for text in ["plain", ' "quoted" ', "line\nbreak\ttab", "back\\slash", "ünïcødé 中文 🙂", "\x00\x1f", "@@gateway-text@@"]:
        assert json.loads(fast(text)) == json.loads(render(text))
