"""gpt-oss's harmony format, written and read with the official openai-harmony library: the prompt
against the real template and the model card, real outputs read at every split, the reasoning
level from every protocol, the call constraint compiled for llama.cpp, and the vocabulary derived
from a GGUF's tokens."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.api.errors import to_api_error
from gateway.api.notes import Notes
from gateway.chat import formats
from gateway.chat.formats import harmony_vocab
from gateway.chat.formats.base import ArgumentsDelta, CallStarted, ContentDelta, ReasoningDelta
from gateway.chat.formats.harmony import Harmony, HarmonyReader
from gateway.chat.formats.harmony_vocab import ENV, FILE, RANKS, FormatUnavailable
from gateway.conversation import Conversation, Turn
from tests.formats import calls_of, conversation, fed, render, same_at_every_split, template

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
FMT = Harmony()


def o200k_file() -> Path:
    """The o200k_base.tiktoken that litellm (a dev dependency) bundles, named by the sha1 of its URL."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.submodule_search_locations
    path = (Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
            / "fb374d419588a4632f3f557e76b4b70aebbca790")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256
    return path


@pytest.fixture(scope="module", autouse=True)
def vocabulary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The vocabulary where $TIKTOKEN_ENCODINGS_BASE points, loaded for the module's tests."""
    base = tmp_path_factory.mktemp("tiktoken")
    shutil.copy(o200k_file(), base / FILE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(base))
        harmony_vocab.forget()
        FMT.prepare(tmp_path_factory.mktemp("cache"), None)
        yield base
        harmony_vocab.forget()


TPL = "openai-gpt-oss-120b"


# --- the prompt -----------------------------------------------------------------------------------


def test_the_gpt_oss_template_is_harmony_and_reasons() -> None:
    tpl = template(TPL)
    assert formats.detect(tpl) is formats.FORMATS[0] and formats.detect(tpl).name == "harmony"
    assert tpl.traits.reasons and not tpl.traits.opens
    assert formats.named("harmony").levels and not formats.named("hermes").levels


def test_the_prompt_has_the_pieces_the_model_card_documents() -> None:
    text = render(FMT, template(TPL), conversation(), effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           "Knowledge cutoff: 2024-06\nCurrent date: ")
    assert "\n\nReasoning: high\n\n# Valid channels: analysis, commentary, final." in text
    assert "<|start|>developer<|message|># Instructions\n\nYou are a helpful assistant.\n\n# Tools\n\n" in text
    assert ("namespace functions {\n\n// Current weather in a city\ntype get_weather = (_: {\ncity: string,\n"
            'unit?: "c" | "f",\n}) => any;\n\n// The time now\ntype get_time = () => any;\n\n'
            "} // namespace functions<|end|>") in text
    # The past call (harmony writes the recipient in the role's part of the header) and its result.
    assert ('<|start|>user<|message|>What is the weather in Paris?<|end|>'
            '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp_c": 18}<|end|>') in text
    assert text.endswith("<|start|>user<|message|>And the time?<|end|><|start|>assistant")


def test_the_prompt_is_the_real_templates_but_for_its_two_known_quirks() -> None:
    """Harmony and the model's Jinja template write the same prompt (the same date), except that
    the template leaves out a past call's `<|constrain|>` and quotes a tool result as a JSON string."""
    from gateway.api import tools

    conv = conversation()
    ours = render(FMT, template(TPL), conv)
    theirs = template(TPL).render(FMT.turns(conv, calls_of(conv, FMT)), tools.template_tools(conv))
    assert theirs != ours
    theirs = theirs.replace("<|channel|>commentary json<|message|>", "<|channel|>commentary <|constrain|>json<|message|>")
    assert theirs.replace('<|message|>"{\\"temp_c\\": 18}"<|end|>', '<|message|>{"temp_c": 18}<|end|>') == ours


@pytest.mark.parametrize(("effort", "thinking", "level"), [
    ("low", None, "low"), ("medium", None, "medium"), ("high", None, "high"), (None, None, "medium"),
    (None, False, "low"), ("high", False, "high")])
def test_the_reasoning_level_is_in_the_system_message(effort: str | None, thinking: bool | None, level: str) -> None:
    text = render(FMT, template(TPL), conversation(), thinking=thinking, effort=effort)
    assert re.findall(r"Reasoning: (\w+)", text) == [level]


def test_the_prompt_keeps_its_special_tokens_as_tokens() -> None:
    """The engine tokenizes the text with special tokens parsed: the text gives back harmony's ids."""
    enc = harmony_vocab.required()
    text = render(FMT, template(TPL), conversation())
    ids = enc.encode(text, allowed_special="all")
    assert enc.decode_utf8(ids) == text
    assert ids.count(enc.encode("<|start|>", allowed_special="all")[0]) == text.count("<|start|>") == 7


def test_a_result_with_no_call_is_refused() -> None:
    from gateway.chat.template import ChatMessage, TemplateError

    with pytest.raises(TemplateError, match="answers no earlier call"):
        FMT.render(template(TPL), [ChatMessage("user", "hi"), ChatMessage("tool", "42", tool_call_id="x")], None, None)


# --- the output -----------------------------------------------------------------------------------

# From the harmony documentation and the model card; then as llama.cpp writes them (no text for
# <|end|>, <|return|>, <|call|>).
ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
          '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"San Francisco"}<|call|>')
PREAMBLE = ('<|channel|>analysis<|message|>We need to check the weather. Plan first.<|end|>'
            '<|start|>assistant<|channel|>commentary<|message|>**Action plan**: 1. Look up the weather 🌤 in 東京.<|end|>'
            '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "東京", "unit": "c"}<|call|>')


def bare(text: str) -> str:
    return re.sub(r"<\|(end|return|call)\|>", "", text)


@pytest.mark.parametrize("text", [ANSWER, bare(ANSWER)], ids=["tokens", "llama.cpp"])
def test_analysis_then_final(text: str) -> None:
    calls = calls_of(conversation(), FMT)
    assert same_at_every_split(lambda: FMT.reader(calls, True, False), text) == {
        "content": "2 + 2 = 4.", "reasoning": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
        "calls": []}
    no_tools = same_at_every_split(lambda: FMT.reader(None, True, False), text)
    assert no_tools["content"] == "2 + 2 = 4." and no_tools["reasoning"].startswith("User asks")


@pytest.mark.parametrize("text", [CALL, bare(CALL)], ids=["tokens", "llama.cpp"])
def test_analysis_then_a_call(text: str) -> None:
    calls = calls_of(conversation(), FMT)
    assert same_at_every_split(lambda: FMT.reader(calls, True, False), text) == {
        "content": "", "reasoning": "Need to use function get_weather.",
        "calls": [["get_weather", '{"city":"San Francisco"}']]}


@pytest.mark.parametrize("text", [PREAMBLE, bare(PREAMBLE)], ids=["tokens", "llama.cpp"])
def test_a_preamble_is_content_and_the_recipient_may_stand_in_the_role(text: str) -> None:
    calls = calls_of(conversation(), FMT)
    assert same_at_every_split(lambda: FMT.reader(calls, True, False), text) == {
        "content": "**Action plan**: 1. Look up the weather 🌤 in 東京.",
        "reasoning": "We need to check the weather. Plan first.",
        "calls": [["get_weather", '{"city": "東京", "unit": "c"}']]}


@pytest.mark.parametrize("text", [ANSWER, bare(CALL), PREAMBLE])
def test_without_the_split_the_analysis_is_dropped_never_content(text: str) -> None:
    reader = FMT.reader(None, False, False)
    assert isinstance(reader, HarmonyReader)  # gpt-oss output is always read by its format
    out = same_at_every_split(lambda: FMT.reader(None, False, False), text)
    assert out["reasoning"] == "" and "analysis" not in out["content"] and "Plan first" not in out["content"]
    assert "Need to use" not in out["content"] and "User asks" not in out["content"]


def test_touched_while_in_analysis() -> None:
    r = FMT.reader(None, True, False)
    assert r.feed("<|channel|>analysis<|message|>Thinking") == [ReasoningDelta("Thinking")] and r.touched
    assert r.feed(" more") == [ReasoningDelta(" more")] and r.touched
    assert r.feed("<|start|>assistant<|channel|>final<|message|>Hi") == [ContentDelta("Hi")] and not r.touched


def test_a_call_is_done_once_its_arguments_are_whole() -> None:
    r = FMT.reader(calls_of(conversation(), FMT), True, False)
    assert r.feed("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>") == [
        CallStarted(0, "get_weather")]
    assert not r.done
    assert r.feed('{"city": "Par') == [ArgumentsDelta(0, '{"city": "Par')] and not r.done
    r.feed('is"}')
    assert r.done and r.calls == [("get_weather", '{"city": "Paris"}')]


def test_a_call_cut_short_is_not_done() -> None:
    r = FMT.reader(calls_of(conversation(), FMT), True, False)
    r.feed('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par')
    r.flush()
    assert not r.done and r.answer == '{"city": "Par'


def test_text_without_a_header_is_the_answer() -> None:
    assert same_at_every_split(lambda: FMT.reader(None, True, False), "Just text, <|chan no header.") == {
        "content": "Just text, <|chan no header.", "reasoning": "", "calls": []}


def test_a_partial_special_token_is_held_back() -> None:
    r = FMT.reader(None, True, False)
    assert r.feed("<|channel|>final<|message|>Hi<|st") == [ContentDelta("Hi")]
    assert r.feed("art|>assistant<|channel|>final<|message|>!") == [ContentDelta("!")]
    assert fed(lambda: FMT.reader(None, True, False), ["<|channel|>final<|message|>a<", "b"])["content"] == "a<b"


# --- the constraint -------------------------------------------------------------------------------


def test_the_lazy_constraint_starts_at_either_header_form() -> None:
    c = FMT.constraint(calls_of(conversation(), FMT), lazy=True)
    assert c is not None and c.triggers == (" to=functions.",) and c.max_items == 1
    begins = [i.begin for i in c.items]
    assert " to=functions.get_weather <|constrain|>json<|message|>" in begins
    assert " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>" in begins
    assert all(i.end == "" for i in c.items)  # <|call|> ends the generation
    assert FMT.constraint(calls_of(conversation(), FMT), lazy=False) is None  # auto, and no lazy grammar


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_is_a_call_from_the_first_token(choice: str) -> None:
    conv = conversation(choice="required")
    if choice == "named":
        from dataclasses import replace

        from gateway.conversation import ToolChoice
        conv = replace(conv, tool_choice=ToolChoice("named", "get_time"))
    c = FMT.constraint(calls_of(conv, FMT), lazy=True)
    assert c is not None and c.triggers == () and c.max_items == 1
    names = ["get_weather", "get_time"] if choice == "required" else ["get_time"]
    assert [i.begin for i in c.items] == [f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                                          for n in names]


def _smollm_vocab() -> tuple[object, object, int, list[int]]:
    """A real model's vocabulary (the default model's GGUF, vocabulary only): llama.cpp parses
    grammars against one."""
    from llama_cpp import llama_cpp as lc

    from gateway.models.registry import load_registry
    from tests.conftest import MODEL, ROOT

    reg = load_registry(ROOT / "models.yaml")
    path = reg.resolve(reg.models[MODEL], "gguf")
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    assert model
    vocab = lc.llama_model_get_vocab(model)
    return model, vocab, lc.llama_vocab_n_tokens(vocab), []


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_constraint_compiles_and_llama_cpp_takes_it(choice: str) -> None:
    from llama_cpp import llama_cpp as lc

    from engines.base import SamplingParams
    from engines.llamacpp.grammar import compile_constraint, pattern
    from engines.llamacpp.sampling import build_sampler

    c = FMT.constraint(calls_of(conversation(choice=choice), FMT), lazy=True)
    assert c is not None
    grammar = compile_constraint(c)
    assert b'" to=functions.get_weather <|constrain|>json<|message|>"' in grammar or choice != "auto"
    model, vocab, n_vocab, eog = _smollm_vocab()
    try:
        lazy = [pattern(t) for t in c.triggers]
        sampler = build_sampler(vocab, n_vocab, SamplingParams(), grammar, eog, 64, lazy)
        assert sampler is not None
        lc.llama_sampler_free(sampler)
        assert build_sampler(vocab, n_vocab, SamplingParams(), b'root ::= "a" (', eog, 64, lazy) is None
    finally:
        lc.llama_model_free(model)


# --- the reasoning level from every protocol ------------------------------------------------------


def _level(conv: Conversation) -> str:
    text = FMT.render(template(TPL), FMT.turns(conv, None), None, conv.thinking, conv.effort)
    return re.findall(r"Reasoning: (\w+)", text)[0]


@pytest.mark.parametrize(("asked", "level"), [("minimal", "low"), ("low", "low"), ("medium", "medium"),
                                               ("high", "high"), (None, "medium"), ("none", "low")])
def test_openai_chat_reasoning_effort(asked: str | None, level: str) -> None:
    from gateway.api.openai import chat
    from gateway.api.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                **({"reasoning_effort": asked} if asked else {})})
    assert _level(chat.conversation(req)) == level


@pytest.mark.parametrize(("asked", "level"), [("minimal", "low"), ("low", "low"), ("high", "high"), (None, "medium")])
def test_responses_reasoning_effort(asked: str | None, level: str) -> None:
    from gateway.api.openai import responses
    from gateway.api.openai.responses_schema import ResponseCreateRequest

    req = ResponseCreateRequest.model_validate({"model": "m", "input": "Hi",
                                                **({"reasoning": {"effort": asked}} if asked else {})})
    conv, _, _ = responses.conversation(req, (), Notes())
    assert _level(conv) == level


@pytest.mark.parametrize(("budget", "level"), [(1024, "low"), (4095, "low"), (4096, "medium"), (16383, "medium"),
                                                (16384, "high"), (None, "medium")])
def test_anthropic_thinking_budget(budget: int | None, level: str) -> None:
    from gateway.api.anthropic import messages

    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
            **({"thinking": {"type": "enabled", "budget_tokens": budget}} if budget else {})}
    notes = Notes()
    conv = messages.conversation(messages.MessagesRequest.model_validate(body), notes)
    assert _level(conv) == level
    assert ("thinking.budget_tokens" in notes.ignored) == (budget is not None)
    messages.note_thinking(conv, True, FMT.levels, notes)
    assert "thinking.budget_tokens" not in notes.ignored  # a model with levels reads it
    if budget is not None:
        messages.note_thinking(conv, True, False, other := Notes())
        assert not other.ignored  # nothing was noted there to begin with
        messages.note_thinking(conv, True, False, notes := Notes(ignored={"thinking.budget_tokens"}))
        assert "thinking.budget_tokens" in notes.ignored  # a model without levels thinks as it does


@pytest.mark.parametrize(("think", "level"), [("low", "low"), ("medium", "medium"), ("high", "high"),
                                              (True, "medium"), (False, "low"), (None, "medium")])
def test_ollama_think_levels(think: object, level: str) -> None:
    from gateway.api.ollama import api

    chat = api.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                           **({"think": think} if think is not None else {})})
    assert _level(api.chat_conversation(chat, Notes())) == level
    gen = api.GenerateRequest.model_validate({"model": "m", "prompt": "Hi", **({"think": think} if think is not None else {})})
    assert _level(api.generate_conversation(gen, Notes())) == level


# --- the vocabulary -------------------------------------------------------------------------------


def gpt2_chars() -> dict[int, str]:
    """GPT-2's byte-to-unicode table (as its encoder.py writes it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def write_gguf(path: Path, tokens: list[str], model: str = "gpt2") -> Path:
    """A vocabulary-only GGUF, as a gpt-oss GGUF holds its tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def o200k_tokens() -> list[str]:
    """o200k's tokens in a GGUF's spelling, then special tokens past the ranks."""
    table = gpt2_chars()
    out = []
    for rank, line in enumerate(o200k_file().read_bytes().splitlines()):
        data, r = line.split()
        assert int(r) == rank
        out.append("".join(table[b] for b in base64.b64decode(data)))
    assert len(out) == RANKS
    return out + ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>"]


@pytest.fixture
def no_vocabulary(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No file where harmony looks: only what is derived; the module's encoding restored after."""
    saved = harmony_vocab.loaded()
    monkeypatch.delenv(ENV)
    harmony_vocab.forget()
    yield
    harmony_vocab.forget()
    if saved is not None:
        harmony_vocab._loaded.append(saved)


@pytest.mark.usefixtures("no_vocabulary")
def test_the_vocabulary_derived_from_a_gguf_loads_in_harmony(tmp_path: Path, o200k_tokens: list[str]) -> None:
    gguf_path = write_gguf(tmp_path / "gpt-oss-vocab.gguf", o200k_tokens)
    cache = tmp_path / "cache"
    enc = harmony_vocab.encoding(cache, str(gguf_path))
    derived = cache / "harmony" / FILE
    assert hashlib.sha256(derived.read_bytes()).hexdigest() == O200K_SHA256
    assert enc.decode_utf8(enc.encode("Hello, 東京 🌤")) == "Hello, 東京 🌤"
    harmony_vocab.forget()  # the next start finds it in the cache, with no GGUF
    assert harmony_vocab.encoding(cache, None).encode("Hello") == enc.encode("Hello")


@pytest.mark.usefixtures("no_vocabulary")
def test_a_vocabulary_that_is_not_o200k_is_refused_with_the_reason(tmp_path: Path, o200k_tokens: list[str]) -> None:
    swapped = list(o200k_tokens)
    swapped[1000], swapped[1001] = swapped[1001], swapped[1000]
    cache = tmp_path / "cache"
    with pytest.raises(FormatUnavailable, match="hash mismatch"):
        harmony_vocab.encoding(cache, str(write_gguf(tmp_path / "other.gguf", swapped)))
    assert not (cache / "harmony" / FILE).exists()
    with pytest.raises(FormatUnavailable, match="tokenizer 'llama'"):
        harmony_vocab.encoding(cache, str(write_gguf(tmp_path / "spm.gguf", o200k_tokens[:10], model="llama")))
    with pytest.raises(FormatUnavailable, match="fewer than o200k"):
        harmony_vocab.encoding(cache, str(write_gguf(tmp_path / "small.gguf", o200k_tokens[:10])))
    with pytest.raises(FormatUnavailable, match="no GGUF to derive it from"):
        harmony_vocab.encoding(cache, None)
    err = to_api_error(FormatUnavailable("why"))
    assert err.status == 503 and err.code == "model_not_available"


@pytest.mark.usefixtures("no_vocabulary")
async def test_the_served_format_is_prepared_once_or_unavailable(tmp_path: Path) -> None:
    tpl = template(TPL)
    with pytest.raises(FormatUnavailable, match="no GGUF"):
        await formats.prepared(None, tpl, None, tmp_path)
    with pytest.raises(FormatUnavailable):
        FMT.reader(None, True, False)
    (tmp_path / "harmony").mkdir()
    shutil.copy(o200k_file(), tmp_path / "harmony" / FILE)
    assert isinstance(await formats.prepared(None, tpl, None, tmp_path), Harmony) and FMT.ready
    assert isinstance(FMT.reader(None, True, False), HarmonyReader)


def test_turns_are_plain_messages() -> None:
    conv = Conversation((Turn.of("system", "A"), Turn.of("user", "B"), Turn.of("system", "C"), Turn.of("assistant", "D"),
                         Turn.of("user", "E")))
    text = FMT.render(template(TPL), FMT.turns(conv, None), None, None)
    assert "<|start|>developer<|message|># Instructions\n\nA<|end|><|start|>user<|message|>B<|end|>" in text
    assert "<|start|>developer<|message|># Instructions\n\nC<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>D<|end|><|start|>user<|message|>E<|end|>" in text
