"""Where a call may start under tool_choice auto, as llama.cpp's lazy grammar sees it: each family's
constraint is compiled and fed a text the model might write, token by token, through the real
sampler (the default model's vocabulary); the grammar is either still waiting (the text is free)
or holding the output to a call. A trigger the grammar then rejects aborts the process, so the
feeding runs in a child process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines.base import Constraint
from engines.llamacpp.grammar import compile_constraint, lazy_patterns
from gateway.chat import formats
from gateway.conversation import Conversation, ToolChoice, ToolSpec, Turn
from gateway.models.registry import load_registry
from tests.conftest import MODEL, ROOT
from tests.formats import calls_of

TOOLS = (ToolSpec("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]}),
         ToolSpec("get_time", "The time now", {"type": "object", "properties": {}}))

CHILD = r"""
import ctypes, json, sys
from llama_cpp import llama_cpp as lc

path, cases = sys.argv[1], json.loads(sys.stdin.read())
params = lc.llama_model_default_params()
params.vocab_only = True
model = lc.llama_model_load_from_file(path.encode(), params)
vocab = lc.llama_model_get_vocab(model)
n_vocab = lc.llama_vocab_n_tokens(vocab)
out = []
for grammar, patterns, text in cases:
    pats = (ctypes.c_char_p * len(patterns))(*[p.encode() for p in patterns])
    s = lc.llama_sampler_init_grammar_lazy_patterns(vocab, grammar.encode(), b"root", pats, len(patterns), None, 0)
    data = text.encode()
    buf = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(vocab, data, len(data), buf, len(data) + 8, False, True)
    for t in buf[:n]:
        lc.llama_sampler_accept(s, t)
    arr = (lc.llama_token_data * n_vocab)(*[lc.llama_token_data(i, 0.0, 0.0) for i in range(n_vocab)])
    cur = lc.llama_token_data_array(data=arr, size=n_vocab, selected=-1, sorted=False)
    lc.llama_sampler_apply(s, ctypes.byref(cur))
    out.append(sum(1 for i in range(n_vocab) if arr[i].logit > -1e30) < n_vocab)
    lc.llama_sampler_free(s)
print(json.dumps(out))
"""


def _constraint(fmt: str) -> Constraint:
    f = formats.named(fmt)
    conv = Conversation((Turn.of("user", "Weather in Paris?"),), TOOLS, ToolChoice("auto"), True)
    c = f.constraint(calls_of(conv, f), lazy=True)
    assert c is not None and c.lazy
    return c


def _held(cases: list[tuple[str, str]]) -> list[bool]:
    """For each (format, text): whether llama.cpp's grammar holds the output to a call after it."""
    reg = load_registry(ROOT / "models.yaml")
    path = reg.resolve(reg.models[MODEL], "gguf")
    payload = []
    for fmt, text in cases:
        c = _constraint(fmt)
        payload.append((compile_constraint(c).decode(), [p.decode() for p in lazy_patterns(c)], text))
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [bool(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


CASES = [
    # (format, what the model wrote so far, the grammar holds it to a call from here)
    ("llama3", '{"name"', True),
    ("llama3", '  \n{"name": "get_', True),
    ("llama3", 'Send it as {"name"', False),  # a JSON object quoted in prose
    ("llama3", "Checking. <|python_tag|>", True),
    ("functionary-v3.2", "get_weather\n", True),  # the prompt ends with >>>: the answer's recipient
    ("functionary-v3.2", "all\nI will look it up>>>get_time\n", True),
    ("functionary-v3.2", "all\nI can call get_weather\n", False),  # a tool's name ending a line of text
    ("hermes", "Let me look. <tool_call>", True),  # a family tag counts anywhere
    ("hermes", "Let me look.", False),
]


def test_each_trigger_starts_a_call_where_the_family_starts_one() -> None:
    held = _held([(fmt, text) for fmt, text, _ in CASES])
    assert held == [want for *_, want in CASES], list(zip(CASES, held, strict=True))


@pytest.mark.parametrize("fmt", ["llama3", "functionary-v3.2"])
def test_patterns_are_regular_expressions_llama_cpp_takes(fmt: str) -> None:
    c = _constraint(fmt)
    assert c.patterns and all("(" in p for p in c.patterns)  # the constrained text starts at the group
