"""Output constraints (engines/base.py `Constraint`) as llama.cpp GBNF grammars: JSON schemas
through llama-cpp-python's converter, tagged items around them, trigger texts as the lazy
grammar's patterns."""

from __future__ import annotations

import functools
import json
import re

from engines.base import Constraint, InvalidGenerationRequest


def compile_constraint(c: Constraint) -> bytes:
    """`c` as a GBNF grammar. Raises InvalidGenerationRequest (naming `c.part`) for a schema that
    llama.cpp's converter does not take."""
    if c.kind == "grammar":
        return (c.grammar or "").encode()
    from llama_cpp.llama_grammar import JSON_GBNF

    try:
        body = _schema_grammar(c.schema) if c.schema else JSON_GBNF.encode()
    except Exception as exc:
        raise InvalidGenerationRequest(f"unsupported JSON schema: {exc}", param=c.part or None) from exc
    return body if c.kind == "json" else _tagged_grammar(body, c.begin, c.end, c.separator, c.max_items)


def _gbnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def _tagged_grammar(item: bytes, begin: str, end: str, separator: str, max_items: int) -> bytes:
    """One to `max_items` items joined by `separator`, each `begin` item `end`."""
    body = re.sub(rb"^root ::=", b"tagged-item ::=", item, count=1, flags=re.MULTILINE)
    more = f"({_gbnf_literal(separator)} tagged-one){{0,{max_items - 1}}}" if max_items > 1 else ""
    head = f"root ::= tagged-one {more}\ntagged-one ::= {_gbnf_literal(begin)} tagged-item {_gbnf_literal(end)}\n"
    return head.encode() + body


def pattern(trigger: str) -> bytes:
    """A trigger text as a lazy grammar's pattern (a regular expression matching it literally)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", trigger).encode()


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str) -> bytes:
    """GBNF for a JSON schema, cached: tool definitions repeat on every request of an agent."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return str(json_schema_to_gbnf(schema)).encode()
