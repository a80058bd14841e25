"""The generic format, for templates that render no tools: the gateway rewrites the tools, past
calls and results into plain turns, and the model answers with one JSON object, held to a schema:

  {"tool_calls": [{"name": <tool>, "arguments": {...}}, ...]}   (parallel_tool_calls, the default)
  {"tool_call": {"name": <tool>, "arguments": {...}}}            (parallel_tool_calls: false)
  {"response": "..."}                                           (tool_choice auto only)

The grammar makes every call well-formed: the name is one of the tools, the arguments follow that
tool's parameters schema. It is also how a native format answers in a JSON response format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engines.base import Constraint
from gateway.chat.formats.base import Calls, Format, Parser, Tool, ToolChoice, call_arguments, call_schema
from gateway.chat.formats.jsonscan import StreamParser
from gateway.chat.template import ChatMessage, arguments_value
from gateway.conversation import Conversation


class Generic(Format):
    name = "json"
    title = "JSON answer (the gateway's rewrite)"
    native = False

    def turns(self, conv: Conversation, calls: Calls | None) -> list[ChatMessage]:
        return rewrite(conv, calls)

    def parser(self, calls: Calls) -> Parser:
        return StreamParser()

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        schema = output_schema(list(calls.tools), calls.choice, calls.parallel, calls.max_calls, calls.response)
        return Constraint("json", schema=json.dumps(schema), part="tools")


def rewrite(conv: Conversation, tool_plan: Calls | None) -> list[ChatMessage]:
    """The conversation as plain turns: tool calls and results as JSON text, the tool list and the
    answer format in the system text, consecutive same-role turns merged."""
    names: dict[str, str] = {}
    turns: list[tuple[str, str]] = []
    parallel = tool_plan.parallel if tool_plan else True
    for m in conv.turns:
        if m.role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[c.id] = c.name
            text = call_text([(c.name, call_arguments(c.kind, c.arguments)) for c in m.tool_calls], parallel)
            turns.append(("assistant", (m.text + "\n" + text) if m.text else text))
        elif m.role == "tool":
            turns.append(("user", result_text(names.get(m.tool_call_id or ""), m.tool_call_id, m.text)))
        else:
            turns.append((m.role, m.text))
    if tool_plan is not None:
        extra = system_text(tool_plan.tools, tool_plan.choice, tool_plan.parallel)
        if turns and turns[0][0] == "system":
            turns[0] = ("system", f"{turns[0][1]}\n\n{extra}")
        else:
            turns.insert(0, ("system", extra))
    return [ChatMessage(role=r, content=t) for r, t in merge_turns(turns)]


def system_text(tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> str:
    lines = ["You can call these tools (JSON schemas of their arguments):"]
    for t in tools:
        lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                ensure_ascii=False))
    call = '{"name": <tool name>, "arguments": {<arguments>}}'
    form = f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'
    if choice.mode == "named":
        lines.append(f"Call the tool {choice.name}. Answer with only this JSON object: {form}")
    elif choice.mode == "required":
        lines.append(f"Call one or more tools. Answer with only this JSON object: {form}")
    else:
        lines.append(f"To call tools, answer with only this JSON object: {form}. "
                     'To answer the user directly, answer with only {"response": <your answer>}.')
    return "\n".join(lines)


def call_text(calls: list[tuple[str, str]], parallel: bool) -> str:
    """An assistant turn that called tools, as the JSON the model is asked to write."""
    items = [{"name": n, "arguments": arguments_value(a)} for n, a in calls]
    obj = {"tool_calls": items} if parallel or len(items) != 1 else {"tool_call": items[0]}
    return json.dumps(obj, ensure_ascii=False)


def result_text(name: str | None, call_id: str | None, content: str) -> str:
    who = f"{name} " if name else ""
    return f"Result of tool call {who}({call_id or 'no id'}): {content}"


def merge_turns(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive turns of one role joined, so strict templates (user/assistant alternation) accept them."""
    out: list[tuple[str, str]] = []
    for role, text in messages:
        if out and out[-1][0] == role:
            out[-1] = (role, f"{out[-1][1]}\n\n{text}")
        else:
            out.append((role, text))
    return out


def output_schema(tools: list[Tool], choice: ToolChoice, parallel: bool, most: int,
                  response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema every answer must match (compiled to a grammar by the engine)."""
    call = call_schema([t for t in tools if choice.mode != "named" or t.name == choice.name])
    if parallel:
        branch = {"type": "object",
                  "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": most}},
                  "required": ["tool_calls"], "additionalProperties": False}
    else:
        branch = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                  "additionalProperties": False}
    if choice.mode != "auto":
        return branch
    answer = {"type": "object", "properties": {"response": response or {"type": "string"}},
              "required": ["response"], "additionalProperties": False}
    return {"anyOf": [branch, answer]}
