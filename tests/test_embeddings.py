"""`/v1/embeddings` and model cards on the real model, through the official client and LangChain."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import MODEL

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "A kitten is sleeping on a rug."]
WIDTH = 576  # SmolLM2-135M's hidden size
# Vectors of one text computed alone, in a batch and under load go through the same kernels on
# different batch layouts: float32 sums in another order. Measured max |difference|: 0 on this CPU;
# 1e-5 leaves room for other SIMD paths while any cross-talk between inputs moves vectors by ≫ 1e-2.
CROSS_TALK_TOL = 1e-5


def vec(client: openai.OpenAI, text: str | list[str], **kw: object) -> np.ndarray:
    r = client.embeddings.create(model=MODEL, input=text, encoding_format="float", **kw)  # type: ignore[arg-type]
    return np.array([d.embedding for d in r.data], dtype=np.float32)


def test_shapes_usage_and_normalisation(client: openai.OpenAI, gateway_url: str) -> None:
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == [0, 1, 2]
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, WIDTH)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(v[0], v[1])
    # usage counts the tokens embedded (BOS included where the model adds one).
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(_ids(gateway_url, t)) for t in TEXTS)


def test_base64_is_little_endian_float32_of_the_same_vector(client: openai.OpenAI, gateway_url: str) -> None:
    floats = vec(client, TEXTS[0])[0]
    raw = httpx.post(f"{gateway_url}/v1/embeddings",
                     json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, floats)
    # The SDK asks for base64 by default and decodes it itself.
    sdk = client.embeddings.create(model=MODEL, input=TEXTS[0])
    np.testing.assert_allclose(np.array(sdk.data[0].embedding), floats, rtol=0, atol=1e-7)


def test_token_id_inputs_equal_text_inputs(client: openai.OpenAI, gateway_url: str) -> None:
    # A list of ids embeds to the same vector as the text it tokenizes to.
    text_vec = vec(client, TEXTS[1])[0]
    ids = _ids(gateway_url, TEXTS[1])
    np.testing.assert_allclose(vec(client, ids)[0], text_vec, atol=CROSS_TALK_TOL)  # type: ignore[arg-type]
    both = vec(client, [ids, ids[:5]])  # type: ignore[list-item]
    np.testing.assert_allclose(both[0], text_vec, atol=CROSS_TALK_TOL)


def _ids(gateway_url: str, text: str) -> list[int]:
    """The model's token ids for `text`, from llama.cpp's tokenizer on the same GGUF (vocab only)."""
    from llama_cpp import llama_cpp as lc  # the same tokenizer the engine uses

    from gateway.models.registry import load_registry
    from tests.conftest import ROOT

    reg = load_registry(ROOT / "models.yaml")
    path = reg.resolve(reg.models[MODEL], "gguf")
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    try:
        vocab = lc.llama_model_get_vocab(model)
        data = text.encode()
        arr = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(vocab, data, len(data), arr, len(arr), True, True)
        return list(arr[:n])
    finally:
        lc.llama_model_free(model)


def test_same_vector_alone_in_a_batch_and_under_load(client: openai.OpenAI) -> None:
    alone = np.stack([vec(client, t)[0] for t in TEXTS])
    batched = vec(client, TEXTS)
    assert np.abs(batched - alone).max() <= CROSS_TALK_TOL

    def chat(i: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                           max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    def embed(i: int) -> np.ndarray:
        order = TEXTS[i % 3:] + TEXTS[: i % 3]
        v = vec(client, order)
        return np.roll(v, i % 3, axis=0)

    with ThreadPoolExecutor(16) as pool:
        chats = [pool.submit(chat, i) for i in range(8)]
        embeds = [pool.submit(embed, i) for i in range(8)]
        assert all(c.result() for c in chats)
        for e in embeds:
            assert np.abs(e.result() - alone).max() <= CROSS_TALK_TOL


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": [[]]}, "input", 400),
    ({"input": [1, 2, 10_000_000]}, "input", 400),
    ({"input": [-1]}, "input", 400),
    ({"input": "word " * 3000}, "input", 400),
    ({"input": "hi", "dimensions": 128}, "dimensions", 400),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", 400),
    ({"input": "hi", "model": "no-such-model"}, "model", 404),
])
def test_bad_input_is_a_clear_error(gateway_url: str, body: dict[str, object], param: str, status: int) -> None:
    r = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_dimensions_equal_to_the_width_is_accepted(client: openai.OpenAI) -> None:
    assert vec(client, "hi", dimensions=WIDTH).shape == (1, WIDTH)


def test_model_card(gateway_url: str) -> None:
    r = httpx.get(f"{gateway_url}/v1/models/{MODEL}")
    assert r.status_code == 200
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert set(card["endpoints"]) == {"chat.completions", "completions", "responses", "embeddings"}
    missing = httpx.get(f"{gateway_url}/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{gateway_url}/v1/models").json()["data"]
    assert card["endpoints"] == next(m for m in listed if m["id"] == MODEL)["endpoints"]


def test_langchain_openai_embeddings(gateway_url: str, client: openai.OpenAI) -> None:
    from langchain_openai import OpenAIEmbeddings

    with httpx.Client(timeout=60) as http:
        emb = OpenAIEmbeddings(model=MODEL, base_url=f"{gateway_url}/v1", api_key="unused",  # type: ignore[arg-type]
                               check_embedding_ctx_length=False, http_client=http)
        docs = emb.embed_documents(TEXTS)
        query = emb.embed_query(TEXTS[0])
    assert len(docs) == 3 and all(len(d) == WIDTH for d in docs)
    np.testing.assert_allclose(np.array(query), vec(client, TEXTS[0])[0], atol=1e-6)
