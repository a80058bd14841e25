"""A request's tools: checked, and planned in the format of the serving model's family
(gateway/chat/formats/): its template renders them, its grammar holds the calls, its parser reads
them back; the generic format (the gateway's rewrite) for templates without tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.base import Constraint
from gateway.chat.formats import GENERIC
from gateway.chat.formats.base import Calls, Format, Parser, Tool, ToolChoice, call_cap, parameters_of
from gateway.conversation import Conversation


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: in `format`, held to its constraint, read back by its parser."""

    calls: Calls
    format: Format

    @property
    def tools(self) -> tuple[Tool, ...]:
        return self.calls.tools

    @property
    def choice(self) -> ToolChoice:
        return self.calls.choice

    @property
    def native(self) -> str:
        """The family format's name, when the template renders the tools itself ("" for the rewrite)."""
        return self.format.name if self.format.native else ""

    def parser(self) -> Parser:
        return self.format.parser(self.calls)

    def constraint(self, lazy: bool) -> Constraint | None:
        return self.format.constraint(self.calls, lazy)


def plan(conv: Conversation, fmt: Format = GENERIC) -> ToolPlan | None:
    """The tool plan of a request (None: answer in plain text), in the serving model's format
    `fmt`. Raises ToolRequestError."""
    if conv.tools is not None and not conv.tools:
        raise ToolRequestError("tools must not be empty; leave it out for no tools", conv.param("tools"))
    choice = conv.tool_choice
    if choice is not None and not conv.tools:
        raise ToolRequestError("tool_choice is only allowed when tools are given", conv.param("tool_choice"))
    if not conv.tools or (choice is not None and choice.mode == "none"):
        return None
    tools = tuple(Tool(t.name, t.description, parameters_of(t), t.kind) for t in conv.tools)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tool names must be unique", conv.param("tools"))
    tc = ToolChoice(choice.mode if choice is not None else "auto", choice.name if choice is not None else None)
    if tc.mode == "named" and tc.name not in names:
        raise ToolRequestError(f"tool_choice names {tc.name!r}, which is not in tools", conv.param("tool_choice.name"))
    parallel = conv.parallel_tool_calls
    out = conv.output
    if fmt.native and (out is None or out.type == "text"):
        # A family that writes one call per answer is never asked for more.
        one = parallel and fmt.parallel
        return ToolPlan(Calls(tools, tc, one, call_cap(tools, tc, one)), fmt)
    most = call_cap(tools, tc, parallel)
    # A JSON answer format: the generic format's one schema holds both the calls and the answer.
    response: dict[str, Any] | None = None
    if out is not None and out.type == "json_object":
        response = {"type": "object"}
    elif out is not None and out.type == "json_schema":
        response = out.schema
    return ToolPlan(Calls(tools, tc, parallel, most, response), GENERIC)


def template_tools(conv: Conversation) -> list[dict[str, Any]]:
    """The tools as OpenAI's chat format lists them, which chat templates expect."""
    out = []
    for t in conv.tools or ():
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.kind == "custom" or t.parameters is not None:
            fn["parameters"] = parameters_of(t)
        out.append({"type": "function", "function": fn})
    return out
