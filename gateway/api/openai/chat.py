"""OpenAI chat completions -> the conversation model."""

from __future__ import annotations

from gateway.api.protocol import ChatCompletionRequest
from gateway.conversation import Conversation, Output, ToolCall, ToolChoice, ToolSpec, Turn


def conversation(req: ChatCompletionRequest) -> Conversation:
    turns = tuple(
        Turn.of("system" if m.role == "developer" else m.role, m.text(),
                tool_calls=tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()),
                tool_call_id=m.tool_call_id)
        for m in req.messages
    )
    tools = None
    if req.tools is not None:
        tools = tuple(ToolSpec(t.function.name, t.function.description or "", t.function.parameters) for t in req.tools)
    choice = None
    if isinstance(req.tool_choice, str):
        choice = ToolChoice(req.tool_choice)
    elif req.tool_choice is not None:
        choice = ToolChoice("named", req.tool_choice.function.name)
    output = None
    fmt = req.response_format
    if fmt is not None:
        js = fmt.json_schema
        output = Output(fmt.type, js.schema_ if js is not None else None, js.name if js is not None else "response",
                        js.strict if js is not None else None)
    return Conversation(turns, tools, choice, req.parallel_tool_calls is not False, output,
                        params={"tool_choice.name": "tool_choice.function.name", "output.schema": "response_format.json_schema"})
