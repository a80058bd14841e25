"""Ollama's `/api/create`, `/api/copy` and `/api/blobs/<digest>`, with the official `ollama` client on a
gateway of its own serving the real SmolLM2: a model made from an uploaded GGUF and from another model,
with its own system prompt, preset messages and sampling defaults, applied on every protocol; copies,
and removal that keeps a blob while another model links it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from gateway.conversation import Conversation, Turn, with_preamble
from gateway.models.hub import sha256_of
from gateway.models.modelfile import ModelfileError, parse
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.test_production import Gateway

pytestmark = pytest.mark.timeout(600)

BASE = "smollm2-135m-instruct"
SYSTEM = "You are a pirate. Answer every question like a pirate would."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PRESET = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada, how can I help?"}]


def _smol() -> Path:
    registry = load_registry(ROOT / "models.yaml", user_dir="/nonexistent")
    return registry.resolve(registry.get(BASE), "gguf")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    tmp = tmp_path_factory.mktemp("create")
    data = tmp / "data"
    g = Gateway(tmp, "--keep-alive", "600", env={"GATEWAY_MODELS_DIR": str(data / "models.d")})
    try:
        yield g, data
    finally:
        g.stop()


@pytest.fixture
def client(served: tuple[Gateway, Path]) -> Iterator[ollama.Client]:
    with ollama.Client(host=served[0].url) as c:
        yield c


def _show(g: Gateway, name: str) -> dict:
    r = httpx.post(f"{g.url}/api/show", json={"model": name}, timeout=30)
    assert r.status_code == 200, r.text
    body: dict = r.json()
    return body


def _prompt_tokens(g: Gateway, model: str, messages: list[dict]) -> int:
    """The whole prompt's tokens (Ollama's prompt_eval_count leaves out those from the cache)."""
    r = httpx.post(f"{g.url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1},
                   timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def _unload(client: ollama.Client, name: str) -> None:
    client.generate(model=name, keep_alive=0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(m.model == name for m in client.ps().models):
        time.sleep(0.2)


def test_preamble_order() -> None:
    """The model's system prompt only when the request brings none; preset messages after the system turns."""
    q = Turn.of("user", "q")
    conv = Conversation(turns=(q,))
    assert [(t.role, t.text) for t in with_preamble(conv, "S", [("user", "a"), ("assistant", "b")]).turns] == [
        ("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "q")]
    own = Conversation(turns=(Turn.of("system", "mine"), q))
    assert [t.text for t in with_preamble(own, "S", [("user", "a")]).turns] == ["mine", "a", "q"]
    assert with_preamble(conv, None, []) is conv


def test_blob_upload_checks_its_digest(served: tuple[Gateway, Path]) -> None:
    g, data = served
    body = b"GGUF not really a model"
    right = hashlib.sha256(body).hexdigest()
    wrong = hashlib.sha256(b"other").hexdigest()
    r = httpx.post(f"{g.url}/api/blobs/sha256:{wrong}", content=body, timeout=30)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{g.url}/api/blobs/sha256:{wrong}", timeout=30).status_code == 404
    assert not list((data / "blobs").glob("*")), "a wrong upload leaves nothing"
    assert httpx.post(f"{g.url}/api/blobs/sha256:{right}", content=body, timeout=30).status_code == 201
    assert httpx.head(f"{g.url}/api/blobs/sha256:{right}", timeout=30).status_code == 200
    assert httpx.post(f"{g.url}/api/blobs/sha256:{right}", content=body, timeout=30).status_code == 200
    r = httpx.post(f"{g.url}/api/blobs/md5:abc", content=body, timeout=30)
    assert r.status_code == 400 and "invalid digest" in r.json()["error"]
    # Not a GGUF model: create says so.
    r = httpx.post(f"{g.url}/api/create", json={"model": "fake", "files": {"fake.gguf": f"sha256:{right}"},
                                                "stream": False}, timeout=30)
    assert r.status_code == 400, r.text
    assert "fake.gguf" in r.json()["error"]


def test_create_from_an_uploaded_gguf_applies_its_system_prompt_and_defaults(served: tuple[Gateway, Path],
                                                                          client: ollama.Client) -> None:
    g, data = served
    smol = _smol()
    digest = client.create_blob(smol)  # ~90 MB: past --max-body (4 MiB), which blob uploads are not bound by
    assert digest == f"sha256:{sha256_of(smol)}"
    steps = list(client.create(model="pirate", files={"smol.gguf": digest}, system=SYSTEM,
                               parameters={"temperature": 0, "num_predict": 6, "seed": 7}, stream=True))
    assert steps[-1].status == "success" and any(s.status == "parsing GGUF" for s in steps)
    listed = {m.model: m for m in client.list().models}
    assert listed["pirate"].details.quantization_level == "Q4_1"
    assert listed["pirate"].details.parameter_size == "135M" and listed["pirate"].details.family == "llama"
    shown = client.show("pirate")
    assert _show(g, "pirate")["system"] == SYSTEM  # Ollama sends it; its Python client does not read it
    assert "num_predict" in (shown.parameters or "") and "temperature" in (shown.parameters or "")
    assert f'SYSTEM """{SYSTEM}"""' in (shown.modelfile or "")

    # The same request to the base model with the system prompt written out, and the defaults given:
    # the same prompt and the same greedy answer, six tokens long.
    made = client.chat(model="pirate", messages=QUESTION)
    base = client.chat(model=BASE, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
                       options={"temperature": 0, "num_predict": 6, "seed": 7})
    assert _prompt_tokens(g, "pirate", QUESTION) == _prompt_tokens(
        g, BASE, [{"role": "system", "content": SYSTEM}, *QUESTION]) != _prompt_tokens(g, BASE, QUESTION)
    assert made.eval_count == 6 and made.message.content == base.message.content
    # A request's own system prompt replaces the model's.
    brief = [{"role": "system", "content": "Be brief."}, *QUESTION]
    own = client.chat(model="pirate", messages=brief)
    plain = client.chat(model=BASE, messages=brief, options={"temperature": 0, "num_predict": 6})
    assert _prompt_tokens(g, "pirate", brief) == _prompt_tokens(g, BASE, brief)
    assert own.message.content == plain.message.content
    # OpenAI's API serves the same model the same way.
    with openai.OpenAI(base_url=f"{g.url}/v1", api_key="x") as oa:
        r = oa.chat.completions.create(model="pirate", messages=QUESTION)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == _prompt_tokens(g, "pirate", QUESTION)
    assert r.usage.completion_tokens == 6 and r.choices[0].message.content == made.message.content
    assert len(list((data / "blobs").glob("sha256-*"))) == 2  # the model's and the earlier test's


def test_create_from_a_model_with_preset_messages_then_copy_and_remove(served: tuple[Gateway, Path],
                                                                      client: ollama.Client) -> None:
    g, data = served
    done = client.create(model="ada", from_="pirate", messages=PRESET, parameters={"num_predict": 4})
    assert done.status == "success"
    shown = client.show("ada")
    assert shown.details is not None and shown.details.parent_model == "pirate"
    assert _show(g, "ada")["system"] == SYSTEM and _show(g, "ada")["messages"] == PRESET
    made = client.chat(model="ada", messages=QUESTION)
    base = client.chat(model=BASE, messages=[{"role": "system", "content": SYSTEM}, *PRESET, *QUESTION],
                       options={"temperature": 0, "num_predict": 4})
    assert _prompt_tokens(g, "ada", QUESTION) == _prompt_tokens(
        g, BASE, [{"role": "system", "content": SYSTEM}, *PRESET, *QUESTION])
    assert made.eval_count == 4 and made.message.content == base.message.content

    assert client.copy("ada", "ada-copy").status == "success"
    copied = client.chat(model="ada-copy", messages=QUESTION)
    assert copied.message.content == made.message.content
    blob = next(p for p in (data / "blobs").glob("sha256-*") if p.stat().st_size > 1 << 20)
    # Removing the model made from the upload keeps the blob: "ada" and "ada-copy" link it.
    for name in ("pirate", "ada"):
        _unload(client, name)
        client.delete(name)
        assert blob.exists(), f"the blob went with {name}"
    assert {m.model for m in client.list().models} >= {"ada-copy", BASE}
    assert client.chat(model="ada-copy", messages=QUESTION).message.content == made.message.content
    _unload(client, "ada-copy")
    client.delete("ada-copy")
    assert not blob.exists(), "the last model's removal frees the blob"
    assert not [p for p in (data / "created").iterdir()], "no folder of links is left"
    assert not list((data / "models.d").glob("*.yaml"))


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"model": "x", "from": BASE, "template": "{{ .Prompt }}"}, 400, "Go templates"),
    ({"model": "x", "from": BASE, "adapters": {"a.gguf": "sha256:" + "0" * 64}}, 400, "LoRA"),
    ({"model": "x", "from": BASE, "quantize": "q4_K_M"}, 400, "is Q4_1; only F16, BF16 and F32"),
    ({"model": "x", "from": BASE, "quantize": "q9_X"}, 400, "unknown quantization 'q9_X'"),
    ({"model": "x", "modelfile": "FROM smollm2"}, 400, "Modelfile"),
    ({"model": "x", "from": "nope"}, 404, "not found"),
    ({"model": "x"}, 400, "neither"),
    ({"model": "x", "files": {"m.gguf": "sha256:" + "1" * 64}}, 400, "upload it first"),
    ({"model": "x", "files": {"m.safetensors": "sha256:" + "1" * 64}}, 400, "not a GGUF"),
    ({"model": "x", "files": {"../m.gguf": "sha256:" + "1" * 64}}, 400, "plain file name"),
    ({"model": BASE, "from": BASE}, 400, "models.yaml"),
    ({"model": "bad name!", "from": BASE}, 400, "invalid model name"),
    ({"model": "x", "from": BASE, "parameters": {"temperature": "hot"}}, 400, "parameters.temperature"),
    ({"model": "x", "from": BASE, "parameters": {"num_ctx": 4}}, 400, "num_ctx"),
    ({"model": "x", "from": BASE, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ({"model": "x", "from": BASE, "files": {"m.gguf": "sha256:" + "1" * 64}}, 400, "not both"),
])
def test_create_errors(served: tuple[Gateway, Path], body: dict, status: int, says: str) -> None:
    g, _ = served
    r = httpx.post(f"{g.url}/api/create", json={**body, "stream": False}, timeout=30)
    assert r.status_code == status, r.text
    assert says in r.json()["error"], r.text


def test_copy_and_create_refuse_what_they_must(served: tuple[Gateway, Path], client: ollama.Client) -> None:
    g, data = served
    with pytest.raises(ollama.ResponseError) as err:
        client.copy("nope", "x")
    assert err.value.status_code == 404
    r = httpx.post(f"{g.url}/api/copy", json={"source": BASE, "destination": BASE}, timeout=30)
    assert r.status_code == 400 and "models.yaml" in r.json()["error"]
    # A copy of a models.yaml model is a model of its own, with defaults of its own.
    assert client.copy(BASE, "smol-copy").status == "success"
    assert client.create(model="smol-copy", from_="smol-copy", parameters={"num_predict": 3}).status == "success"
    assert client.chat(model="smol-copy", messages=QUESTION).eval_count == 3
    with pytest.raises(ollama.ResponseError) as err:  # loaded: not replaced under its requests
        client.create(model="smol-copy", from_=BASE)
    assert err.value.status_code == 409
    r = httpx.post(f"{g.url}/api/create", json={"model": "odd", "from": BASE, "parameters": {"mirostat": 2},
                                                "stream": False}, timeout=30)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "parameters.mirostat"
    for name in ("smol-copy", "odd"):
        _unload(client, name)
        client.delete(name)
    assert not list((data / "models.d").glob("*.yaml"))
    assert os.path.exists(_smol()), "a copy's removal leaves the files of the model it copied"


# --- Modelfiles and `gateway create` ------------------------------------------------------------------


def test_modelfile_reads_what_ollama_writes() -> None:
    mf = parse('''# a comment
FROM ./model.gguf
PARAMETER temperature 0.2
PARAMETER num_ctx 4096
PARAMETER stop "<|im_end|>"
PARAMETER stop User:
SYSTEM """You are a pirate.
Answer like one."""
MESSAGE user Hello there
MESSAGE assistant "Ahoy!"
LICENSE MIT
''')
    assert mf.from_ == "./model.gguf" and mf.system == "You are a pirate.\nAnswer like one."
    assert mf.parameters == {"temperature": 0.2, "num_ctx": 4096, "stop": ["<|im_end|>", "User:"]}
    assert mf.messages == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Ahoy!"}]
    assert mf.license == ["MIT"]
    for text, says in (("PARAMETER temperature 1", "no FROM"), ("FROM x\nSYSTEM \"\"\"open", "never closed"),
                       ("FROM x\nMESSAGE tool hi", "MESSAGE's role"), ("FROM x\nRUN rm -rf /", "unknown instruction"),
                       ("FROM x\nPARAMETER temperature", "PARAMETER needs")):
        with pytest.raises(ModelfileError, match=says):
            parse(text)


def test_gateway_create_from_a_modelfile(served: tuple[Gateway, Path], client: ollama.Client, tmp_path: Path) -> None:
    g, data = served
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(data / "models.d")}
    (tmp_path / "Modelfile").write_text(f'FROM {_smol()}\nSYSTEM """{SYSTEM}"""\nPARAMETER temperature 0\n'
                                        "PARAMETER num_predict 5\nPARAMETER mirostat 1\n"
                                        f'MESSAGE user {PRESET[0]["content"]}\nMESSAGE assistant {PRESET[1]["content"]}\n')
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "create", "pirate-cli", "--url", g.url],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "copying" in done.stdout and "ignored: parameters.mirostat" in done.stdout
    # The running gateway serves it (a name it does not know makes it read the user registry again).
    made = client.chat(model="pirate-cli", messages=QUESTION)
    base = client.chat(model=BASE, messages=[{"role": "system", "content": SYSTEM}, *PRESET, *QUESTION],
                       options={"temperature": 0, "num_predict": 5})
    assert made.eval_count == 5 and made.message.content == base.message.content
    (tmp_path / "Modelfile").write_text(f"FROM {BASE}\nTEMPLATE {{{{ .Prompt }}}}\n")
    refused = subprocess.run([sys.executable, "-m", "gateway.cli", "create", "templated", "-f",
                              str(tmp_path / "Modelfile")], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Go templates" in refused.stderr
    (tmp_path / "Modelfile").write_text(f"FROM {BASE}\n")
    loaded = subprocess.run([sys.executable, "-m", "gateway.cli", "create", "pirate-cli", "--url", g.url, "-f",
                             str(tmp_path / "Modelfile")], env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 1 and "is loaded" in loaded.stderr
    _unload(client, "pirate-cli")
    client.delete("pirate-cli")
    assert not [p for p in (data / "blobs").glob("sha256-*") if p.stat().st_size > 1 << 20]


# --- quantize ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 at F16 (its Q4_1 weights dequantized by llama.cpp), a model to quantize."""
    out = tmp_path_factory.mktemp("f16") / "SmolLM2-135M-Instruct-F16.gguf"
    subprocess.run([sys.executable, "-m", "gateway.models.quantize", str(_smol()), str(out), "F16",
                    "--allow-requantize"], check=True, capture_output=True, timeout=300)
    return out


def test_create_quantizes_an_uploaded_f16_model(served: tuple[Gateway, Path], client: ollama.Client,
                                                 f16: Path) -> None:
    g, data = served
    digest = client.create_blob(f16)
    steps = [s.status for s in client.create(model="smol-q4km", files={f16.name: digest}, quantize="q4_K_M",
                                             parameters={"num_predict": 4, "temperature": 0}, stream=True)]
    assert "quantizing F16 model to Q4_K_M" in steps and steps[-1] == "success", steps
    listed = {m.model: m for m in client.list().models}
    assert listed["smol-q4km"].details.quantization_level == "Q4_K_M"
    assert listed["smol-q4km"].size < f16.stat().st_size / 2
    assert client.chat(model="smol-q4km", messages=QUESTION).eval_count == 4
    assert not (data / "blobs" / digest.replace(":", "-")).exists(), "the F16 upload is not kept"
    _unload(client, "smol-q4km")
    client.delete("smol-q4km")
    assert not [p for p in (data / "blobs").iterdir() if p.stat().st_size > 1 << 20]


def test_gateway_create_quantizes_from_a_modelfile(served: tuple[Gateway, Path], client: ollama.Client,
                                                   f16: Path, tmp_path: Path) -> None:
    g, data = served
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(data / "models.d")}
    (tmp_path / "Modelfile").write_text(f"FROM {f16}\nPARAMETER num_predict 3\n")
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "create", "smol-q8", "-q", "q8_0", "--url", g.url],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "quantizing F16 model to Q8_0" in done.stdout
    listed = {m.model: m for m in client.list().models}
    assert listed["smol-q8"].details.quantization_level == "Q8_0"
    assert client.chat(model="smol-q8", messages=QUESTION).eval_count == 3
    _unload(client, "smol-q8")
    client.delete("smol-q8")
