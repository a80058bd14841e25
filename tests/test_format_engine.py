"""Each family's format through the real engine and every protocol, on tiny random-weight GGUFs
that carry the family's real chat template and special tokens (scripts/tiny_gguf.py). Their words
are noise, but with a tool call required the grammar makes the call well-formed: the name one of
the tools, the arguments valid for its schema, between the family's own tags (which are control
tokens here, as in the real models' vocabularies)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import yaml

from gateway.app import create_app
from gateway.chat.formats.harmony_vocab import ENV, FILE
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import NO_CHECKS, ROOT, ServerThread
from tests.formats import TEMPLATES
from tests.test_format_harmony import o200k_file

sys.path.insert(0, str(ROOT / "scripts"))
import tiny_gguf  # noqa: E402

# Arguments a random model finishes quickly, in text any decoder reads back: short ASCII words and
# enums (a random byte-level model otherwise writes broken UTF-8 inside strings).
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass(frozen=True)
class Family:
    format: str  # the format the gateway must detect
    template: str  # tests/templates/<template>.jinja
    specials: tuple[str, ...]  # the special tokens of the real vocabulary that the format uses
    eos: str
    bos: str | None = None
    eog: tuple[str, ...] = ()  # other end-of-generation tokens


LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>")
MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>")
FAMILIES = {
    "hermes": Family("hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
                     ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"), "<|im_end|>"),
    "llama3": Family("llama3", "meta-llama-Llama-3.2-3B-Instruct", LLAMA, "<|eot_id|>", "<|begin_of_text|>"),
    "functionary": Family("functionary-v3.2", "meetkai-functionary-medium-v3.2", LLAMA, "<|eot_id|>",
                          "<|begin_of_text|>"),
    "mistral": Family("mistral", "mistralai-Mistral-Nemo-Instruct-2407", MISTRAL, "</s>", "<s>"),
    "mistral-v11": Family("mistral-v11", "mistralai-Ministral-3-14B-Reasoning-2512",
                          (*MISTRAL, "[ARGS]", "[CALL_ID]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[THINK]",
                           "[/THINK]", "[TOOL_CONTENT]"), "</s>", "<s>"),
    "granite": Family("granite", "ibm-granite-granite-3.3-2B-Instruct",
                      ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"), "<|end_of_text|>"),
    "qwen3-coder": Family("qwen3-coder", "Qwen3-Coder",
                          ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"), "<|im_end|>"),
    "deepseek-r1": Family("deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", DEEPSEEK,
                          "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
    "deepseek-v3.1": Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1", DEEPSEEK, "<｜end▁of▁sentence｜>",
                            "<｜begin▁of▁sentence｜>"),
    "command-r7b": Family("command-r7b", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
                          ("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>",
                           "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_ACTION|>", "<|END_ACTION|>",
                           "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>",
                           "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"), "<|END_OF_TURN_TOKEN|>", "<BOS_TOKEN>"),
    "harmony": Family("harmony", "openai-gpt-oss-120b",
                      ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                       "<|return|>", "<|call|>"), "<|return|>", eog=("<|call|>",)),
}


WORDS = '[a-z]{2,6} " " [a-z]{2,6} " " [a-z]{2,6}'
THINKERS = {
    "harmony": f'root ::= "<|channel|>analysis<|message|>" {WORDS} "<|end|><|start|>assistant<|channel|>final<|message|>" {WORDS}',
    "mistral-v11": f'root ::= "[THINK]" {WORDS} "[/THINK]" {WORDS}',
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models and their models.yaml."""
    tmp = tmp_path_factory.mktemp("families")
    # gpt-oss's vocabulary for the harmony library (a real gpt-oss GGUF carries it; these do not).
    vocab = tmp / "o200k"
    vocab.mkdir()
    shutil.copy(o200k_file(), vocab / FILE)
    models = []
    for name, f in FAMILIES.items():
        path = tiny_gguf.write(tmp / f"{name}.gguf", (TEMPLATES / f"{f.template}.jinja").read_text(), f.specials,
                               f.eos, f.bos, f.eog)
        models.append({"id": f"tiny-{name}", "formats": {"gguf": {"path": str(path)}}, "parallel": 1,
                       "context_length": 16384})
    # Models that think: a grammar (models.yaml's) makes the random model write its family's
    # reasoning, then an answer, in short lowercase words.
    for name, grammar in THINKERS.items():
        f = FAMILIES[name]
        models.append({"id": f"tiny-{name}-thinks", "formats": {"gguf": {"path": str(tmp / f"{name}.gguf")}},
                       "parallel": 1, "context_length": 16384, "grammar": grammar})
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump({"models": models}))
    return cfg


@pytest.fixture(scope="module")
def server(config: Path) -> Iterator[str]:
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV, str(config.parent / "o200k"))
    settings = Settings.from_env(env=NO_CHECKS, config=str(config), parallel=1, engine="cpu")
    server = ServerThread(create_app(settings, load_registry(config, cache_dir=config.parent / "cache"))).start(timeout=300)
    yield server.url
    server.stop()
    mp.undo()


def _valid(name: str, arguments: str | dict[str, Any]) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather"
    jsonschema.validate(args, PARAMS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_required_call_is_well_formed(server: str, family: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)
    kw: dict[str, Any] = dict(model=f"tiny-{family}", messages=ASK, tools=[WEATHER, TIME], max_tokens=600,
                              tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            _valid(call.function.name, call.function.arguments)
        return
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or ():
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    args[d.index] = args.get(d.index, "") + d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and names
    for i, n in names.items():
        _valid(n, args[i])


@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_required_call_is_well_formed(server: str, family: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}
    r = client.messages.create(model=f"tiny-{family}", max_tokens=600, messages=ASK,  # type: ignore[arg-type]
                               tools=[tool], tool_choice={"type": "any"})  # type: ignore[list-item]
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses
    for b in uses:
        _valid(b.name, b.input)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_responses_required_call_is_well_formed(server: str, family: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)
    r = client.responses.create(model=f"tiny-{family}", input="Weather in Paris?", max_output_tokens=600,
                                tools=[{"type": "function", **WEATHER["function"]}],  # type: ignore[list-item]
                                tool_choice="required", temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for c in calls:
        _valid(c.name, c.arguments)


@pytest.mark.parametrize("family", FAMILIES)
def test_ollama_auto_answers_text_or_a_well_formed_call(server: str, family: str) -> None:
    """Ollama's API has no tool_choice: under auto the random model writes what it writes, and the
    answer is either text or well-formed calls, never a raw tag or an error."""
    r = httpx.post(f"{server}/api/chat", json={"model": f"tiny-{family}", "messages": ASK, "stream": False,
                                                "tools": [WEATHER], "options": {"num_predict": 60, "temperature": 0}},
                   timeout=300)
    assert r.status_code == 200, r.text
    msg = r.json()["message"]
    for call in msg.get("tool_calls") or ():
        _valid(call["function"]["name"], call["function"]["arguments"])


@pytest.mark.parametrize("family", FAMILIES)
def test_langchain_binds_tools_and_gets_well_formed_calls(server: str, family: str) -> None:
    """LangChain's OpenAI and Anthropic chat models, unchanged: a bound tool the model must call,
    whole and streamed (LangChain joins the streamed argument fragments itself)."""
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    with httpx.Client(timeout=300) as http:
        openai_llm = ChatOpenAI(model=f"tiny-{family}", base_url=f"{server}/v1", api_key="x",  # type: ignore[arg-type]
                                temperature=0, max_tokens=600, max_retries=0, http_client=http)
        bound = openai_llm.bind_tools([WEATHER, TIME], tool_choice="get_weather")
        msg = bound.invoke("What is the weather in Paris?")
        assert msg.tool_calls, msg  # type: ignore[attr-defined]
        total: Any = None
        for chunk in bound.stream("What is the weather in Paris?"):
            total = chunk if total is None else total + chunk
        assert total.tool_calls, total
        claude = ChatAnthropic(model_name=f"tiny-{family}", base_url=server, api_key="x",  # type: ignore[arg-type]
                               temperature=0, max_tokens_to_sample=600, max_retries=0, timeout=300)
        used = claude.bind_tools([WEATHER], tool_choice="any").invoke("What is the weather in Paris?")
        assert used.tool_calls, used  # type: ignore[attr-defined]
    for call in [*msg.tool_calls, *total.tool_calls, *used.tool_calls]:  # type: ignore[attr-defined]
        _valid(call["name"], call["args"])


# The reasoning each family's template shows (the others' do not reason).
REASONS = {"mistral-v11": "mistral", "granite": "think", "deepseek-r1": "think", "deepseek-v3.1": "think",
           "command-r7b": "command-r7b", "harmony": "harmony"}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_format_is_detected_and_listed(server: str, family: str) -> None:
    """After the requests above loaded the model, /v1/models names the format its template speaks."""
    models = httpx.get(f"{server}/v1/models", timeout=60).json()["data"]
    entry = next(m for m in models if m["id"] == f"tiny-{family}")
    assert entry["tool_format"] == FAMILIES[family].format
    assert entry["reasoning_format"] == REASONS.get(family, "none")


def _words(text: str) -> None:
    """Three lowercase words, as the grammar wrote them: no tag of the format left in."""
    assert text.count(" ") == 2 and text.replace(" ", "").isalpha() and text.islower(), text


@pytest.mark.parametrize("family", THINKERS)
def test_reasoning_comes_apart_from_the_answer_in_every_protocol(server: str, family: str) -> None:
    model = f"tiny-{family}-thinks"
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=200, temperature=0)  # type: ignore[arg-type]
    msg = r.choices[0].message
    _words((msg.model_extra or {})["reasoning_content"])
    _words(msg.content or "")
    thought, said = "", ""
    for chunk in client.chat.completions.create(model=model, messages=ASK, max_tokens=200, temperature=0,  # type: ignore[arg-type]
                                                stream=True):
        for ch in chunk.choices:
            thought += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            said += ch.delta.content or ""
    assert (thought, said) == ((msg.model_extra or {})["reasoning_content"], msg.content)
    a = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=300)
    m = a.messages.create(model=model, max_tokens=200, messages=ASK)  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["thinking", "text"]
    _words(m.content[0].thinking)  # type: ignore[union-attr]
    _words(m.content[1].text)  # type: ignore[union-attr]
    resp = client.responses.create(model=model, input="Weather in Paris?", max_output_tokens=200)
    kinds = [o.type for o in resp.output]
    assert kinds == ["reasoning", "message"], kinds
    _words(resp.output_text)
    o = httpx.post(f"{server}/api/chat", json={"model": model, "messages": ASK, "stream": False,
                                                "options": {"num_predict": 200}}, timeout=300).json()
    _words(o["message"]["thinking"])
    _words(o["message"]["content"])


def test_gateway_ls_names_each_models_format_before_it_loads(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway ls` reads the format from the GGUF's own template, without loading the model."""
    from gateway.cli import main

    assert main(["ls", "--config", str(config), "--url", "http://127.0.0.1:9"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.startswith("tiny-")}
    for name, f in FAMILIES.items():
        assert f.format in rows[f"tiny-{name}"], rows[f"tiny-{name}"]
