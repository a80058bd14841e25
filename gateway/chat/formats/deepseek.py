"""DeepSeek: calls between special tokens, reasoning in `<think>`.

  R1 (and its Qwen and Llama distills):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  V3.1:
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The publishers' templates join a past call's arguments into the prompt as text; llama.cpp's copies
apply `tojson` to them; `render` gives each what it expects. V3.1's template reads `thinking`.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from engines.base import Constraint, Tagged
from gateway.chat.formats.base import (
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    JsonEnd,
    Parser,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.template import ChatMessage, ChatTemplate, template_message
from gateway.chat.thinking import render_thinking

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"
# A template that writes a past call's arguments with `tojson` (else it joins them as text).
_TOJSON = re.compile(r"arguments'?\]?\s*\|\s*tojson")


class DeepSeekR1(Format):
    name = "deepseek-r1"
    title = "DeepSeek-R1 <｜tool▁calls▁begin｜> with ```json arguments"
    tags = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    separator: ClassVar[str] = "\n"  # between two calls

    def detects(self, template: str) -> bool:
        return CALLS_BEGIN in template and FENCE in template

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        turns = [_turn(m, not _TOJSON.search(template.source.text)) for m in messages]
        return render_thinking(lambda kw: template.render_turns(turns, tools, True, self.kwargs(kw)), thinking)

    def kwargs(self, kw: dict[str, Any]) -> dict[str, Any]:
        """The template's variables for thinking as asked."""
        return kw

    def parser(self, calls: Calls) -> Parser:
        return DeepSeekParser(fenced=True)

    def begin(self, name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}\n"

    def end(self) -> str:
        return f"\n```{CALL_END}"

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        items = [Tagged(self.begin(t.name), json.dumps(t.parameters), self.end()) for t in calls.callable]
        return tagged(calls, items, prefix=CALLS_BEGIN, suffix=CALLS_END, separator=self.separator,
                      triggers=[CALLS_BEGIN], lazy=lazy)


class DeepSeekV31(DeepSeekR1):
    name = "deepseek-v3.1"
    title = "DeepSeek-V3.1 <｜tool▁calls▁begin｜> NAME<｜tool▁sep｜>{arguments}"
    separator: ClassVar[str] = ""

    def detects(self, template: str) -> bool:
        return CALLS_BEGIN in template and FENCE not in template

    def kwargs(self, kw: dict[str, Any]) -> dict[str, Any]:
        """V3.1's template reads `thinking` (enable_thinking only in llama.cpp's copy)."""
        return {**kw, "thinking": kw["enable_thinking"]} if "enable_thinking" in kw else kw

    def parser(self, calls: Calls) -> Parser:
        return DeepSeekParser(fenced=False)

    def begin(self, name: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}"

    def end(self) -> str:
        return CALL_END


def _turn(m: ChatMessage, text_arguments: bool) -> dict[str, Any]:
    """A message as DeepSeek's templates expect it: a call's turn without text has no content
    (None: the templates test for it), its arguments as text where the template joins them as text."""
    out = template_message(m)
    if m.tool_calls:
        if not m.content:
            out["content"] = None
        if text_arguments:
            for c, rec in zip(out["tool_calls"], m.tool_calls, strict=True):
                c["function"]["arguments"] = rec.arguments or "{}"
    return out


class DeepSeekParser:
    """Free text, then a block of calls: each call's name, then its arguments, one JSON object
    (in a ```json fence with `fenced`), copied as written up to its closing brace."""

    def __init__(self, fenced: bool) -> None:
        self.fenced = fenced
        self.calls: list[tuple[str, str]] = []
        self.content = ""
        self._buf = ""
        self._state = "text"  # text | block | head | args | tail
        self._end = JsonEnd()  # where the call's arguments object ends

    @property
    def done(self) -> bool:
        """No call is open (the block's end may still come)."""
        return self._state in ("text", "block")

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._step(out):
            pass
        return coalesce(out)

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text" and self._buf:
            self._text(self._buf, out)
        self._buf = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if self.calls and not text.strip():
            return  # whitespace after the calls is not content
        self.content += text
        if text:
            out.append(ContentDelta(text))

    def _step(self, out: list[Event]) -> bool:
        buf = self._buf
        if self._state == "text":
            i = buf.find(CALLS_BEGIN)
            if i < 0:
                keep = partial_suffix(buf, CALLS_BEGIN)
                if not (self.calls and not buf[: len(buf) - keep].strip()):
                    self._text(buf[: len(buf) - keep], out)
                    self._buf = buf[len(buf) - keep:]
                return False
            self._text(buf[:i], out)
            self._buf, self._state = buf[i + len(CALLS_BEGIN):], "block"
            return True
        if self._state == "block":  # between calls: the next call or the block's end
            body = buf.lstrip()
            for tag, state in ((CALL_BEGIN, "head"), (CALLS_END, "text")):
                if body.startswith(tag):
                    self._buf, self._state = body[len(tag):], state
                    return True
            if any(tag.startswith(body) for tag in (CALL_BEGIN, CALLS_END)):
                self._buf = body
                return False
            self._buf, self._state = body, "text"  # not a call: text again
            return True
        if self._state == "head":
            return self._head(buf, out)
        if self._state == "args":
            return self._args(buf, out)
        i = buf.find(CALL_END)  # tail: after the arguments (the fence's end) up to the call's end
        if i < 0:
            self._buf = buf[len(buf) - partial_suffix(buf, CALL_END):]
            return False
        self._buf, self._state = buf[i + len(CALL_END):], "block"
        return True

    def _head(self, buf: str, out: list[Event]) -> bool:
        """The call's name: after the separator (R1, up to the line's end), or before it (V3.1)."""
        i = buf.find(SEP)
        if i < 0:
            return False
        if self.fenced:
            end = buf.find("\n", i)
            if end < 0:
                return False
            name, rest = buf[i + len(SEP):end], buf[end + 1:]
        else:
            name, rest = buf[:i], buf[i + len(SEP):]
        name = name.strip()
        self.calls.append((name, ""))
        out.append(CallStarted(len(self.calls) - 1, name))
        self._buf, self._state, self._end = rest, "args", JsonEnd()
        return True

    def _args(self, buf: str, out: list[Event]) -> bool:
        """The arguments object, character by character up to its closing brace."""
        if self._end.depth == 0:
            body = buf.lstrip()
            if self.fenced and body.startswith(FENCE):
                body = body[len(FENCE):].lstrip()
            if not body or (self.fenced and FENCE.startswith(body)):
                self._buf = body
                return False
            if body[0] != "{":  # no object: the call has no arguments
                self._emit("{}", out)
                self._buf, self._state = body, "tail"
                return True
            buf = body
        n = 0
        for n, ch in enumerate(buf, 1):
            if self._end.step(ch):
                self._emit(buf[:n], out)
                self._buf, self._state = buf[n:], "tail"
                return True
        self._emit(buf[:n], out)
        self._buf = ""
        return False

    def _emit(self, text: str, out: list[Event]) -> None:
        idx = len(self.calls) - 1
        self.calls[idx] = (self.calls[idx][0], self.calls[idx][1] + text)
        if text:
            out.append(ArgumentsDelta(idx, text))
