"""Reasoning output on a scripted engine: the splitter, what templates do with thinking, and the
reasoning in each protocol's own form (OpenAI chat and Responses, Anthropic, Ollama)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.base import EngineConfig, TemplateSource
from gateway.app import create_app
from gateway.chat.template import ChatMessage, ChatTemplate, Traits
from gateway.chat.thinking import Splitter
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests import hosts
from tests.conftest import NO_CHECKS, ServerThread
from tests.fakes import FakeEngine

# --- the splitter ---------------------------------------------------------------------------------


def _split(chunks: list[str], opened: bool = False) -> tuple[str, str]:
    s = Splitter(opened)
    parts = [p for c in chunks for p in s.feed(c)] + s.flush()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "text"))


CASES = [
    # (output, prompt opened the block, reasoning, answer)
    ("<think>\nLet me see.\n</think>\n\nHello!", False, "Let me see.\n", "Hello!"),
    ("  <think>plan</think>answer", False, "plan", "answer"),
    ("Let me see.</think>\n\nHello!", True, "Let me see.", "Hello!"),
    ("\nstill thinking when max_tokens came", True, "still thinking when max_tokens came", ""),
    ("<think>never closed", False, "never closed", ""),
    ("Just an answer, no block.", False, "", "Just an answer, no block."),
    ("<b>bold</b> is not a think tag", False, "", "<b>bold</b> is not a think tag"),
    ("a < b and </thin is not the close", True, "a < b and </thin is not the close", ""),
    ("<think></think>Straight to it", False, "", "Straight to it"),
    ("x</think>after <think>again</think>", True, "x", "after <think>again</think>"),
]


@pytest.mark.parametrize(("output", "opened", "reasoning", "answer"), CASES)
def test_splitter_gives_the_same_split_however_the_text_is_chunked(output: str, opened: bool, reasoning: str,
                                                                    answer: str) -> None:
    assert _split([output], opened) == (reasoning, answer)
    assert _split(list(output), opened) == (reasoning, answer)  # one character at a time
    for cut in range(1, len(output)):
        assert _split([output[:cut], output[cut:]], opened) == (reasoning, answer), cut


# --- templates ------------------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's convention: enable_thinking false writes an empty block.
QWEN3 = CHATML.replace("assistant\n{% endif %}", "assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                       "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}") + "{# </think> #}"
# DeepSeek-R1's: the generation prompt opens the block.
R1 = CHATML.replace("assistant\n{% endif %}", "assistant\n{{ '<think>\\n' }}{% endif %}") + "{# </think> #}"
HI = [ChatMessage("user", "Hi")]


def _template(text: str) -> ChatTemplate:
    return ChatTemplate(TemplateSource(text))


def test_template_traits() -> None:
    assert _template(CHATML).traits == Traits()
    assert _template(QWEN3).traits == Traits(reasons=True, toggle=True)
    assert _template(R1).traits == Traits(reasons=True, opens=True)


def test_thinking_off_reaches_the_template_or_closes_the_block() -> None:
    qwen, r1 = _template(QWEN3), _template(R1)
    assert qwen.render(HI).endswith("assistant\n")
    assert qwen.render(HI, thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")  # the template's own
    assert r1.render(HI).endswith("assistant\n<think>\n")
    assert r1.render(HI, thinking=False).endswith("assistant\n<think>\n</think>\n\n")  # closed by the engine
    assert _template(CHATML).render(HI, thinking=True) == _template(CHATML).render(HI)


# --- every protocol, on a scripted engine -----------------------------------------------------------

YAML = """
default: thinker
models:
  - id: thinker
    formats: {gguf: {path: a.gguf}}
  - id: plain
    reasoning: off
    formats: {gguf: {path: a.gguf}}
"""
SCRIPT = "<think> I should greet them </think> Hello there friend"
# Qwen3's template, marking a request that turned thinking on.
THINKER = QWEN3 + "{% if enable_thinking is defined and enable_thinking %}[thinking on]{% endif %}"
THOUGHT, ANSWER = "I should greet them ", "Hello there friend"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[FakeEngine]]]:
    d = tmp_path_factory.mktemp("reasoning")
    (d / "a.gguf").write_bytes(b"GGUF")
    (d / "models.yaml").write_text(YAML)
    made: list[FakeEngine] = []

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        e = FakeEngine(config, script=SCRIPT, answer_at_once="Hi", template=THINKER)
        made.append(e)
        return e

    settings = Settings.from_env(env=NO_CHECKS, config=str(d / "models.yaml"), functional_check=False)
    app = create_app(settings, load_registry(d / "models.yaml", cache_dir=d / "cache"), engine_factory=factory,
                     host=hosts.CPU_ONLY)
    server = ServerThread(app).start()
    yield server.url, made
    server.stop()


def _post(url: str, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=10)


def _sse(r: httpx.Response) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _last_thinking(made: list[FakeEngine]) -> bool | None:
    """What the last prompt asked of the template: thinking off (the block closed), on, or its default."""
    prompt = max((e for e in made if e.requests), key=lambda e: len(e.requests)).requests[-1].prompt or ""
    if prompt.endswith("<think>\n\n</think>\n\n"):
        return False
    return True if "[thinking on]" in prompt else None


MSG = [{"role": "user", "content": "Hi"}]


def test_chat_completions_reasoning_content(served: tuple[str, list[FakeEngine]]) -> None:
    url, made = served
    whole = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG}).json()
    m = whole["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (THOUGHT, ANSWER)
    chunks = _sse(_post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning comes first
    # Off: the engine is asked to answer at once, and nothing is split.
    for body in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        off = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG, **body}).json()
        assert _last_thinking(made) is False
        assert off["choices"][0]["message"] == {"role": "assistant", "content": "Hi", "refusal": None,
                                                "tool_calls": None}
    on = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG,
                                             "chat_template_kwargs": {"enable_thinking": True}})
    assert on.status_code == 200 and _last_thinking(made) is True
    # The reasoning sent back in the history is accepted.
    back = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": [*MSG, m, *MSG]})
    assert back.status_code == 200
    bad = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG,
                                              "chat_template_kwargs": {"enable_thinking": "yes"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    bad = _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG,
                                              "chat_template_kwargs": {"tools_in_user_message": True}})
    assert bad.status_code == 400


def test_a_model_set_not_to_reason_returns_the_text_as_it_is(served: tuple[str, list[FakeEngine]]) -> None:
    url, _made = served
    m = _post(url, "/v1/chat/completions", {"model": "plain", "messages": MSG}).json()["choices"][0]["message"]
    assert "reasoning_content" not in m and m["content"] == SCRIPT


def test_a_json_format_renders_with_thinking_off(served: tuple[str, list[FakeEngine]]) -> None:
    url, made = served
    _post(url, "/v1/chat/completions", {"model": "thinker", "messages": MSG, "response_format": {"type": "json_object"}})
    assert _last_thinking(made) is False


def test_responses_reasoning_item(served: tuple[str, list[FakeEngine]]) -> None:
    url, made = served
    r = _post(url, "/v1/responses", {"model": "thinker", "input": "Hi"}).json()
    kinds = [it["type"] for it in r["output"]]
    assert kinds == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert r["output"][1]["content"][0]["text"] == ANSWER
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 6  # <think> and five words
    events = _sse(_post(url, "/v1/responses", {"model": "thinker", "input": "Hi", "stream": True}))
    names = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    # The reasoning item is done before the message is added.
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    off = _post(url, "/v1/responses", {"model": "thinker", "input": "Hi", "reasoning": {"effort": "none"}})
    assert [it["type"] for it in off.json()["output"]] == ["message"] and _last_thinking(made) is False
    # A reasoning item in the input (a client sending the output back) is accepted.
    again = _post(url, "/v1/responses", {"model": "thinker", "input": [*r["output"], {"role": "user", "content": "Hi"}]})
    assert again.status_code == 200


def test_anthropic_thinking_blocks(served: tuple[str, list[FakeEngine]]) -> None:
    url, made = served
    body = {"model": "thinker", "max_tokens": 64, "messages": MSG}
    m = _post(url, "/v1/messages", body).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    assert m["content"][1]["text"] == ANSWER
    r = httpx.post(f"{url}/v1/messages", json={**body, "stream": True}, timeout=10)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert [d["type"] for d in deltas if d["type"] == "signature_delta"] == ["signature_delta"]
    off = _post(url, "/v1/messages", {**body, "thinking": {"type": "disabled"}}).json()
    assert [b["type"] for b in off["content"]] == ["text"] and _last_thinking(made) is False
    on = _post(url, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert on.status_code == 200 and _last_thinking(made) is True
    assert "thinking.budget_tokens" in on.headers["x-ignored-fields"]
    # The thinking block sent back in the history is accepted.
    again = _post(url, "/v1/messages", {**body, "messages": [*MSG, {"role": "assistant", "content": m["content"]},
                                                              *MSG]})
    assert again.status_code == 200
    bad = _post(url, "/v1/messages", {**body, "thinking": {"type": "sometimes"}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_ollama_thinking(served: tuple[str, list[FakeEngine]]) -> None:
    url, made = served
    whole = _post(url, "/api/chat", {"model": "thinker", "messages": MSG, "stream": False}).json()
    assert (whole["message"]["thinking"], whole["message"]["content"]) == (THOUGHT, ANSWER)
    lines = [json.loads(x) for x in _post(url, "/api/chat", {"model": "thinker", "messages": MSG}).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == THOUGHT
    assert "".join(x["message"]["content"] for x in lines) == ANSWER
    gen = _post(url, "/api/generate", {"model": "thinker", "prompt": "Hi", "stream": False}).json()
    assert (gen["thinking"], gen["response"]) == (THOUGHT, ANSWER)
    off = _post(url, "/api/chat", {"model": "thinker", "messages": MSG, "stream": False, "think": False}).json()
    assert "thinking" not in off["message"] and off["message"]["content"] == "Hi" and _last_thinking(made) is False
    level = _post(url, "/api/chat", {"model": "thinker", "messages": MSG, "stream": False, "think": "high"})
    assert level.status_code == 200 and _last_thinking(made) is True
    no = _post(url, "/api/chat", {"model": "plain", "messages": MSG, "stream": False, "think": True})
    assert no.status_code == 400 and no.json() == {"error": '"plain" does not support thinking'}
    bad = _post(url, "/api/chat", {"model": "thinker", "messages": MSG, "think": "very"})
    assert bad.status_code == 400 and "think" in bad.json()["error"]


def test_registry_reasoning_and_grammar_keys(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    p = tmp_path / "models.yaml"
    p.write_text("models:\n  - id: a\n    reasoning: sometimes\n    formats: {gguf: {path: a.gguf}}\n")
    with pytest.raises(Exception, match="reasoning"):
        load_registry(p)
    p.write_text("models:\n  - id: a\n    reasoning: on\n    grammar: 'root ::= \"x\"'\n    formats: {gguf: {path: a.gguf}}\n")
    spec = load_registry(p).models["a"]
    assert spec.reasoning == "on" and spec.grammar == 'root ::= "x"'


# --- models.yaml reasoning_format -------------------------------------------------------------------

FORMATS_YAML = """
default: bracket
models:
  - id: bracket        # a template that names no tags; the model writes Magistral's
    reasoning_format: mistral
    formats: {gguf: {path: bracket.gguf}}
  - id: unparsed       # a <think> template, its reasoning left in the text
    reasoning_format: none
    formats: {gguf: {path: think.gguf}}
  - id: opened         # a template that names no tags and opens the block in the prompt itself
    reasoning_format: think
    formats: {gguf: {path: opened.gguf}}
"""
SCRIPTS = {"bracket": ("[THINK] I should greet them [/THINK] Hello there friend", CHATML),
           "think": (SCRIPT, QWEN3),
           "opened": ("I should greet them </think> Hello there friend",
                      CHATML.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}"))}


@pytest.fixture(scope="module")
def formats_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("reasoning-formats")
    for name in SCRIPTS:
        (d / f"{name}.gguf").write_bytes(b"GGUF")
    (d / "models.yaml").write_text(FORMATS_YAML)

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        script, template = SCRIPTS[Path(config.model_path).stem]
        return FakeEngine(config, script=script, template=template)

    settings = Settings.from_env(env=NO_CHECKS, config=str(d / "models.yaml"), functional_check=False)
    app = create_app(settings, load_registry(d / "models.yaml", cache_dir=d / "cache"), engine_factory=factory,
                     host=hosts.CPU_ONLY)
    server = ServerThread(app).start()
    yield server.url
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("model", "reasoning", "answer"), [
    ("bracket", THOUGHT, ANSWER),
    ("unparsed", "", SCRIPT),
    ("opened", "I should greet them ", ANSWER),
])
def test_reasoning_format_names_the_tags_a_model_reasons_in(formats_served: str, model: str, reasoning: str,
                                                            answer: str, stream: bool) -> None:
    r = _post(formats_served, "/v1/chat/completions", {"model": model, "messages": MSG, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        deltas = [c["choices"][0]["delta"] for c in _sse(r) if c.get("choices")]  # type: ignore[index]
        got = ("".join(d.get("reasoning_content") or "" for d in deltas),  # type: ignore[union-attr]
               "".join(d.get("content") or "" for d in deltas))  # type: ignore[union-attr]
    else:
        msg = r.json()["choices"][0]["message"]
        got = (msg.get("reasoning_content") or "", msg["content"])
    assert (got[0].strip(), got[1].strip()) == (reasoning.strip(), answer.strip())


def test_reasoning_format_is_validated(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text("models:\n  - id: m\n    reasoning_format: bogus\n"
                                          "    formats: {gguf: {path: a.gguf}}\n")
    with pytest.raises(Exception, match="reasoning_format"):
        load_registry(tmp_path / "models.yaml")


def test_models_say_the_reasoning_format_they_are_served_with(formats_served: str) -> None:
    for model in ("bracket", "unparsed"):  # loaded by the test above
        _post(formats_served, "/v1/chat/completions", {"model": model, "messages": MSG, "max_tokens": 1})
    cards = {m["id"]: m for m in httpx.get(f"{formats_served}/v1/models", timeout=10).json()["data"]}
    assert cards["bracket"]["reasoning_format"] == "mistral"
    assert cards["unparsed"]["reasoning_format"] == "none"
    assert cards["opened"]["reasoning_format"] == "think"
