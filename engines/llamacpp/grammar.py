"""Output constraints (engines/base.py `Constraint`) as llama.cpp GBNF grammars: JSON schemas
through llama-cpp-python's converter, tagged items around them, trigger texts as the lazy
grammar's patterns."""

from __future__ import annotations

import functools
import json
import re

from engines.base import Constraint, InvalidGenerationRequest, Tagged, literal


def compile_constraint(c: Constraint) -> bytes:
    """`c` as a GBNF grammar. Raises InvalidGenerationRequest (naming `c.part`) for a schema that
    llama.cpp's converter does not take."""
    if c.kind == "grammar":
        return (c.grammar or "").encode()
    from llama_cpp.llama_grammar import JSON_GBNF

    try:
        if c.kind == "json":
            return _schema_grammar(c.schema) if c.schema else JSON_GBNF.encode()
        return _tagged_grammar(c.items, c.prefix, c.suffix, c.separator, c.max_items)
    except InvalidGenerationRequest:
        raise
    except Exception as exc:
        raise InvalidGenerationRequest(f"unsupported JSON schema: {exc}", param=c.part or None) from exc


def _gbnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


_RULE = re.compile(rb"^([a-zA-Z0-9-]+)\s*::=", re.MULTILINE)
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[a-zA-Z0-9-]+|.', re.DOTALL)


def _namespaced(grammar: bytes, prefix: str) -> bytes:
    """A grammar's rules renamed `prefix-NAME` (its `root` becomes `prefix`), so that several
    grammars can be joined into one: names are renamed outside string literals and classes."""
    names = set(_RULE.findall(grammar))
    ns = prefix.encode()

    def rename(m: re.Match[bytes]) -> bytes:
        tok = m.group(0)
        if tok not in names:
            return tok
        return ns if tok == b"root" else ns + b"-" + tok

    return _TOKEN.sub(rename, grammar)


def _item_body(item: Tagged, name: str) -> bytes:
    """The rules of one item's body, its start rule named `name`."""
    from llama_cpp.llama_grammar import JSON_GBNF

    if item.body == "xml":
        return _xml_body(item.schema, name)
    body = _schema_grammar(item.schema) if item.schema else JSON_GBNF.encode()
    return _namespaced(body, name)


def _xml_body(schema: str | None, name: str) -> bytes:
    """The rules of an XML body, its start rule named `name`: the schema's properties as
    `<parameter=NAME>`, newline, VALUE, newline, `</parameter>`, newline blocks in the schema's order, the required ones
    always, the others optionally. A string's value is text without `</` (an approximation of
    "without `</parameter>`": a string value cannot hold a closing tag), any other value the
    property's JSON schema; a string's listed values (enum, const) are the only ones."""
    parsed = json.loads(schema) if schema else {}
    props = parsed.get("properties") or {}
    required = set(parsed.get("required") or ())
    text = f"{name}-text"
    rules = [f'{text} ::= ( [^<] | "<"+ [^/<] )*'.encode()]
    blocks: list[str] = []
    for k, (key, prop) in enumerate(props.items()):
        block = f"{name}-p{k}"
        choices = _string_choices(prop)
        if choices:
            value = f"{name}-v{k}"
            rules.append(f"{value} ::= {' | '.join(_gbnf_literal(c) for c in choices)}".encode())
        elif _is_string(prop) and _shaped(prop):
            value = f"{name}-v{k}"
            rules.append(_namespaced(_unquoted(_schema_grammar(json.dumps(prop))), value))
        elif _is_string(prop):
            value = text
        else:
            value = f"{name}-v{k}"
            rules.append(_namespaced(_schema_grammar(json.dumps(prop if isinstance(prop, dict) else {})), value))
        open_tag = _gbnf_literal(f"<parameter={key}>\n")
        rules.append(f'{block} ::= {open_tag} {value} "\\n</parameter>\\n"'.encode())
        blocks.append(block if key in required else f"{block}?")
    seq = " ".join(blocks) or '""'
    rules.insert(0, f"{name} ::= {seq}".encode())
    return b"\n".join(rules)


def _shaped(prop: dict[str, object]) -> bool:
    """A string schema that limits its text (a pattern, a length, a format)."""
    return any(k in prop for k in ("pattern", "minLength", "maxLength", "format"))


_QUOTED_ROOT = re.compile(rb'^root ::= "\\"" (.*) "\\"" space$', re.MULTILINE)


def _unquoted(grammar: bytes) -> bytes:
    """A JSON string's grammar as the raw text between its quotes (XML bodies write strings bare)."""
    out, n = _QUOTED_ROOT.subn(rb"root ::= \1", grammar)
    if n != 1:
        raise InvalidGenerationRequest("a string parameter's schema could not be written as raw text")
    return out


def _string_choices(prop: object) -> list[str]:
    """A string property's allowed values, when its schema lists them (enum or const)."""
    if not isinstance(prop, dict) or not _is_string(prop):
        return []
    values = prop.get("enum", [prop["const"]] if "const" in prop else [])
    return values if values and all(isinstance(v, str) for v in values) else []


def _is_string(prop: object) -> bool:
    """A property written as raw text: its type is string (or string or null)."""
    if not isinstance(prop, dict):
        return False
    kind = prop.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return bool(kinds) and all(k == "string" for k in kinds)
    return kind == "string"


@functools.lru_cache(maxsize=256)
def _tagged_grammar(items: tuple[Tagged, ...], prefix: str, suffix: str, separator: str, max_items: int) -> bytes:
    """`prefix`, one to `max_items` items joined by `separator`, `suffix`; each item one of `items`."""
    rules: list[bytes] = []
    alts: list[str] = []
    for k, item in enumerate(items):
        body = f"tagged-body{k}"
        alts.append(f"{_gbnf_literal(item.begin)} {body} {_gbnf_literal(item.end)}")
        rules.append(_item_body(item, body))
    more = f" ({_gbnf_literal(separator)} tagged-one){{0,{max_items - 1}}}" if max_items > 1 else ""
    head = (f"root ::= {_gbnf_literal(prefix)} tagged-one{more} {_gbnf_literal(suffix)}\n"
            f"tagged-one ::= {' | '.join(f'( {a} )' for a in alts)}\n")
    return head.encode() + b"\n".join(rules)


def pattern(trigger: str) -> bytes:
    """A trigger text as a lazy grammar's pattern (a regular expression matching it literally)."""
    return literal(trigger).encode()


def lazy_patterns(c: Constraint) -> list[bytes]:
    """The patterns a lazy grammar waits for: its trigger texts anywhere, its patterns as they are
    (llama.cpp searches each in the output so far; the grammar starts at a pattern's first group)."""
    return [pattern(t) for t in c.triggers] + [p.encode() for p in c.patterns]


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str) -> bytes:
    """GBNF for a JSON schema, cached: tool definitions repeat on every request of an agent."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    # llama-cpp-python's converter lets a string hold raw control characters, which JSON forbids
    # (a model that writes one would answer with arguments no JSON parser reads): excluded, as
    # llama.cpp's own converter does.
    return str(json_schema_to_gbnf(schema)).replace(_LOOSE_CHAR, _JSON_CHAR).encode()


_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
