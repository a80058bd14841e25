"""The CoreML engine: host probe, the traced KV-cache decoder against transformers, and the
adapter's generation loop against predictors with MLModel's interface (CoreML cannot run here)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import (
    ContextLengthExceeded,
    EngineConfig,
    GenerationRequest,
    ModelLoadError,
    SamplingParams,
)
from engines.coreml import CoreMLEngine, causal_mask, coreml_available
from engines.registry import create_engine
from engines.stateful import sample
from gateway.chat.template import ChatMessage
from tests.chat import chat_request

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # torch.jit.trace's TracerWarnings (python bools of traced shapes) are expected here.
    pytest.mark.filterwarnings("ignore:.*trace"),
]

WORDS = ["<|im_end|>", "<|im_start|>", "user", "assistant", "hello", "world", "foo", "bar", "baz"]
EOS = 0
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


class ScriptedMLModel:
    """MLModel's interface: the token at position p is script[p % len]; checks every call's shapes."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.calls: list[tuple[int, int]] = []  # (query length, end)
        self.states = 0

    def make_state(self) -> dict[str, int]:
        self.states += 1
        return {"pos": 0}

    def predict(self, inputs: dict[str, np.ndarray], state: dict[str, int] | None = None) -> dict[str, np.ndarray]:
        ids, mask = inputs["input_ids"], inputs["causal_mask"]
        assert state is not None and ids.dtype == np.int32 and ids.shape[0] == 1
        q, end = ids.shape[1], mask.shape[-1]
        assert state["pos"] == end - q, "positions must continue the state's cache"
        assert mask.shape == (1, 1, q, end) and np.array_equal(mask, causal_mask(q, end))
        state["pos"] = end
        self.calls.append((q, end))
        logits = np.full((1, q, len(WORDS)), -10.0, dtype=np.float16)
        for i in range(q):
            logits[0, i, self.script[(end - q + i) % len(self.script)]] = 10.0
        return {"logits": logits}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (the coreml extra)")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="baz"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(WORDS[:2])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    (tmp_path / "config.json").write_text('{"eos_token_id": 0}')
    (tmp_path / "coreml_config.json").write_text('{"context_length": 64}')
    return tmp_path


async def _engine(path: Path, fake: Any, **kw: Any) -> CoreMLEngine:
    e = CoreMLEngine(EngineConfig(model_path=str(path), context_length=kw.pop("ctx", 512), **kw),
                     loader=lambda p, cu: fake)
    await e.load()
    return e


def _chat(e: CoreMLEngine, text: str, **sp: Any) -> GenerationRequest:
    sp.setdefault("temperature", 0.0)
    return chat_request(e, (ChatMessage("user", text),), SamplingParams(**sp))


async def _run(e: CoreMLEngine, req: GenerationRequest) -> tuple[list[int], str, str | None]:
    toks: list[int] = []
    text, finish = "", None
    async for ev in e.generate(req):
        toks += ev.token_ids
        text += ev.text
        finish = ev.finish_reason
    return toks, text, finish


@pytest.mark.skipif(sys.platform == "darwin", reason="the probe reports unavailability off macOS")
async def test_unavailable_off_macos_with_reason(tmp_path: Path) -> None:
    ok, reason = coreml_available()
    assert not ok and "macOS" in reason
    e = create_engine("coreml", EngineConfig(model_path=str(tmp_path), backend="coreml"))
    with pytest.raises(ModelLoadError, match="needs macOS"):
        await e.load()


async def test_loop_prefills_once_then_one_token_per_step(model_dir: Path) -> None:
    fake = ScriptedMLModel([4, 5, 6, 7])
    e = await _engine(model_dir, fake, ctx=64)
    try:
        prompt = e.prompt_tokens(_chat(e, "hello"))
        assert prompt == [1, 2, 4, 0, 1, 3]
        toks, text, finish = await _run(e, _chat(e, "hello", max_tokens=5))
        n = len(prompt)
        want = [[4, 5, 6, 7][(n - 1 + i) % 4] for i in range(5)]
        assert (toks, finish) == (want, "length")
        assert text == " ".join(WORDS[t] for t in want)
        # One prefill of the whole prompt, then one token per step; the last token is not fed.
        assert fake.calls == [(n, n)] + [(1, n + i) for i in range(1, 5)]
        assert fake.states == 1
        _, text, finish = await _run(e, _chat(e, "hello", max_tokens=8, stop=("foo",)))
        assert finish == "stop" and "foo" not in text
    finally:
        await e.close()


async def test_a_resumed_request_replays_its_tokens_then_continues(model_dir: Path) -> None:
    """Failover on CoreML: the tokens already sent are fed one per prediction (as they were generated)
    or with the prompt in one (fast); only what follows is emitted; usage counts every token once."""
    fake = ScriptedMLModel([4, 5, 6, 7])
    e = await _engine(model_dir, fake, ctx=64)
    try:
        assert e.info.capabilities.resume
        n = len(e.prompt_tokens(_chat(e, "hello")))
        whole = [ev async for ev in e.generate(_chat(e, "hello", max_tokens=6))]
        toks = [t for ev in whole for t in ev.token_ids]
        for replay in (True, False):
            fake.calls.clear()
            req = replace(_chat(e, "hello", max_tokens=6), request_id="r", resume_ids=tuple(toks[:2]),
                          resume_replay=replay)
            rest = [ev async for ev in e.generate(req)]
            assert [t for ev in rest for t in ev.token_ids] == toks[2:]
            assert "".join(ev.text for ev in whole[:2]) + "".join(ev.text for ev in rest) == \
                "".join(ev.text for ev in whole)
            assert (rest[-1].usage.completion_tokens, rest[-1].usage.prompt_tokens) == (6, n)
            feed = [(n, n), (1, n + 1), (1, n + 2)] if replay else [(n + 2, n + 2)]
            assert fake.calls[:len(feed)] == feed
        # A stop string the resumed tokens began is still matched after the failover.
        stop = WORDS[toks[3]]
        req = replace(_chat(e, "hello", max_tokens=6, stop=(" " + stop,)), request_id="r", resume_ids=tuple(toks[:3]))
        rest = [ev async for ev in e.generate(req)]
        assert rest[-1].finish_reason == "stop" and "".join(ev.text for ev in rest) == ""
    finally:
        await e.close()


async def test_eos_logprobs_logits_and_limits(model_dir: Path) -> None:
    fake = ScriptedMLModel([4, 5, EOS])
    e = await _engine(model_dir, fake, ctx=64, parallel=1)
    try:
        toks, _, finish = await _run(e, GenerationRequest("t", SamplingParams(temperature=0, max_tokens=10), prompt="hello"))
        assert (toks, finish) == ([4, 5, EOS], "stop")  # the token at position p is script[p]
        toks, _, finish = await _run(e, GenerationRequest(
            "t", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), prompt="hello"))
        assert EOS not in toks and (len(toks), finish) == (6, "length")
        events = [ev async for ev in e.generate(GenerationRequest(
            "t", SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=2), prompt="hello"))]
        lp = events[0].logprobs[0]
        assert lp.token_id == 4 and lp.top[0].token_id == 4 and lp.logprob > -1e-3
        rows = await e.logits([4, 5, 6])
        assert rows.shape == (3, len(WORDS)) and rows.dtype == np.float32
        assert list(rows.argmax(axis=1)) == [4, 5, EOS]
        with pytest.raises(ContextLengthExceeded):  # over the model's 64-token context
            await _run(e, GenerationRequest("t", SamplingParams(temperature=0), prompt="hello " * 70))
    finally:
        await e.close()


def test_sampling_is_seeded_and_respects_filters() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    draw = [sample(logits, SamplingParams(temperature=1.0, seed=3), np.random.default_rng(3)) for _ in range(2)]
    assert draw[0] == draw[1]
    rng = np.random.default_rng(0)
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=2), rng) for _ in range(200)} == {0, 1}
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), rng) for _ in range(200)} == {0, 1}
    assert {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), rng) for _ in range(200)} == {0, 1}
    assert sample(logits, SamplingParams(temperature=0.0, logit_bias=((3, 10.0),)), rng) == 3


# --- the traced decoder (what becomes the ML program) against transformers ---------------------


@pytest.fixture(scope="module")
def decoder(hf_reference: tuple[Any, Any]) -> Any:
    import torch

    from engines.export.coreml import KVCacheDecoder

    return KVCacheDecoder(hf_reference[0], context_length=128, cache_dtype=torch.float32).eval()


def test_traced_decoder_matches_transformers_logits(decoder: Any, hf_reference: tuple[Any, Any]) -> None:
    import torch

    model, tok = hf_reference
    ids = tok("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    n = ids.shape[1]
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    decoder.reset()
    traced = torch.jit.trace(decoder, (ids[:, :2].int(), torch.from_numpy(causal_mask(2, 2).astype(np.float32))),
                             check_trace=False)
    decoder.reset()
    # Prefill most of the prompt, then feed the rest one token at a time through the cache.
    with torch.no_grad():
        rows = [traced(ids[:, : n - 3].int(), torch.from_numpy(causal_mask(n - 3, n - 3).astype(np.float32)))[0]]
        for i in range(n - 3, n):
            rows.append(traced(ids[:, i : i + 1].int(), torch.from_numpy(causal_mask(1, i + 1).astype(np.float32)))[0])
    got = torch.cat(rows).numpy()
    # Both sides are float32 (eps 1.2e-7), but they sum in different orders: one batched forward
    # against a prefill plus three single-token steps through the KV cache, through 30 layers.
    # Logits span about ±30 here; the largest difference measured is 1.04e-4 (transformers 5.23,
    # torch 2.13: 5 of 442,368 logits above 1e-4), the mean 9.9e-6. A wrong mask, position or
    # cache offset moves logits by 0.1 or more, so 5e-4 (1.7e-5 of the logit range; the mean within
    # 5e-5) still catches every such bug while leaving float32 rounding room.
    diff = np.abs(got - want)
    print(f"traced vs transformers: max |d| {diff.max():.3g}, mean {diff.mean():.3g}")
    assert diff.max() < 5e-4
    assert diff.mean() < 5e-5


class DecoderMLModel:
    """MLModel's interface over the PyTorch decoder: each state is its own pair of cache tensors."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def make_state(self) -> dict[str, Any]:
        return {"k": self.decoder.keyCache.clone().zero_(), "v": self.decoder.valueCache.clone().zero_()}

    def predict(self, inputs: dict[str, np.ndarray], state: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        import torch

        assert state is not None
        self.decoder.keyCache, self.decoder.valueCache = state["k"], state["v"]
        out = self.decoder(torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["causal_mask"].astype(np.float32)))
        return {"logits": out.numpy()}


@pytest.fixture
async def torch_backed(decoder: Any, default_registry: Any, tmp_path: Path) -> AsyncIterator[CoreMLEngine]:
    from gateway.models.convert import hf_checkpoint
    from tests.conftest import MODEL

    hf = hf_checkpoint(default_registry, default_registry.models[MODEL])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json"):
        shutil.copy2(hf / name, tmp_path / name)
    (tmp_path / "coreml_config.json").write_text('{"context_length": 128}')
    e = await _engine(tmp_path, DecoderMLModel(decoder), ctx=128, parallel=1)
    yield e
    await e.close()


async def test_loop_over_traced_decoder_equals_transformers_greedy(
    torch_backed: CoreMLEngine, hf_reference: tuple[Any, Any]
) -> None:
    import torch

    model, tok = hf_reference
    req = _chat(torch_backed, "What is the capital of France?", max_tokens=12)
    ids = torch_backed.prompt_tokens(req)
    want_prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(want_prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    toks, text, _ = await _run(torch_backed, req)
    assert toks == [int(t) for t in out[0, len(ids):]]
    assert "Paris" in text


async def test_a_resumed_request_on_the_traced_decoder_goes_on_as_greedy_did(torch_backed: CoreMLEngine) -> None:
    req = _chat(torch_backed, "Tell a long story about a lighthouse keeper.", max_tokens=24, ignore_eos=True)
    toks, text, _ = await _run(torch_backed, req)
    rest, rest_text, finish = await _run(torch_backed, replace(req, request_id="r", resume_ids=tuple(toks[:10])))
    assert rest == toks[10:] and finish == "length"
    assert text.endswith(rest_text) and rest_text
