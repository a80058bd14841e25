"""OpenAI legacy completions as evaluation harnesses call them, with the official `openai` client:
token-id prompts, batches of strings or of token-id lists, `n` choices per prompt in OpenAI's
order, and `echo` with the prompt tokens' logprobs (log-likelihood scoring, `max_tokens` 0)."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from engines.base import EngineConfig
from engines.llamacpp.engine import LlamaCppEngine
from tests.conftest import MODEL
from tests.test_prefix_cache import _path

PROMPTS = ["The capital of France is", "Once upon a time, there was a"]


def _greedy(client: openai.OpenAI, prompt: object, **kw: object) -> openai.types.Completion:
    args: dict[str, object] = {"max_tokens": 6, **kw}
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **args)  # type: ignore[call-overload,no-any-return]


@pytest.fixture(scope="module")
def token_prompts(gateway_url: str) -> list[list[int]]:
    """The prompts as the served model tokenizes them (llama-server's /tokenize has no equal here:
    an engine of the same model file, in this process)."""
    import asyncio

    async def tokenize() -> list[list[int]]:
        path, spec = _path(MODEL)
        e = LlamaCppEngine(EngineConfig(model_path=path, context_length=512, chat_template=spec.chat_template))
        await e.load()
        try:
            return [await e.tokenize(p) for p in PROMPTS]
        finally:
            await e.close()

    return asyncio.run(tokenize())


def test_a_token_prompt_answers_as_its_text(client: openai.OpenAI, token_prompts: list[list[int]]) -> None:
    by_text = _greedy(client, PROMPTS[0])
    by_ids = _greedy(client, token_prompts[0])
    assert by_ids.choices[0].text == by_text.choices[0].text and by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(token_prompts[0])


@pytest.mark.parametrize("form", ["strings", "token lists"])
def test_a_batch_answers_each_prompt_n_times_in_order(client: openai.OpenAI, token_prompts: list[list[int]],
                                                      form: str) -> None:
    singles = [_greedy(client, p).choices[0].text for p in PROMPTS]
    batch = _greedy(client, PROMPTS if form == "strings" else token_prompts, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # OpenAI's order: prompt 0's n choices, then prompt 1's; greedy, so each equals the prompt alone.
    assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(len(t) for t in token_prompts)
    assert batch.usage.completion_tokens == 4 * 6


def test_a_batch_streams_every_choice(client: openai.OpenAI) -> None:
    whole = _greedy(client, PROMPTS, n=2)
    texts = [""] * 4
    finished = [None] * 4
    for chunk in _greedy(client, PROMPTS, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [c.text for c in whole.choices] and finished == ["length"] * 4


async def _logprobs_of(ids: list[int]) -> np.ndarray:  # type: ignore[type-arg]
    path, spec = _path(MODEL)
    e = LlamaCppEngine(EngineConfig(model_path=path, context_length=512, chat_template=spec.chat_template))
    await e.load()
    try:
        rows = (await e.logits(ids)).astype(np.float64)
    finally:
        await e.close()
    m = rows.max(axis=1, keepdims=True)
    lsm = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
    return np.array([lsm[k - 1, ids[k]] for k in range(1, len(ids))])


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_gives_the_prompt_tokens_logprobs(client: openai.OpenAI, token_prompts: list[list[int]],
                                               max_tokens: int) -> None:
    import asyncio

    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
                                  echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(PROMPTS[0]) and (len(c.text) > len(PROMPTS[0])) == (max_tokens > 0)
    assert c.logprobs is not None and c.logprobs.token_logprobs is not None and c.logprobs.tokens is not None
    n = len(token_prompts[0])
    assert len(c.logprobs.tokens) == n + max_tokens
    assert "".join(c.logprobs.tokens[:n]) == PROMPTS[0]
    # Nothing comes before the first token: no logprob (as OpenAI); the others are the model's.
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs is not None
    assert c.logprobs.top_logprobs[0] is None and all(len(t or {}) >= 1 for t in c.logprobs.top_logprobs[1:])
    got = np.array(c.logprobs.token_logprobs[1:n], dtype=np.float64)
    want = asyncio.run(_logprobs_of(token_prompts[0]))
    # The same prompt scored the same way (one prefill) by an engine of the same file.
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert c.logprobs.text_offset is not None and c.logprobs.text_offset[:2] == [0, len(c.logprobs.tokens[0])]
    assert r.usage is not None and r.usage.prompt_tokens == n and r.usage.completion_tokens == max_tokens


def test_echo_of_a_token_prompt_is_its_text(client: openai.OpenAI, token_prompts: list[list[int]]) -> None:
    r = client.completions.create(model=MODEL, prompt=token_prompts[1], max_tokens=3, temperature=0, echo=True)
    plain = _greedy(client, token_prompts[1], max_tokens=3)
    assert r.choices[0].text == PROMPTS[1] + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=token_prompts[1], max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == r.choices[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ["x"] * 70, "n": 2}, "prompt"),
])
def test_bad_prompts_are_400s_that_name_the_field(gateway_url: str, body: dict[str, object], param: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
