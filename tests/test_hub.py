"""`gateway pull / ls / rm` against a local stand-in of the Hugging Face Hub (tests/hub_standin.py),
serving the real GGUF files of the test models through the endpoints huggingface-hub uses."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.models.gguf_info import read_gguf
from gateway.models.hub import HubName, RemoteFile, choose, choose_projector, parse_name, quant_of
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.hub_standin import HubStandIn, Repo, split_gguf

sys.path.insert(0, str(ROOT / "scripts"))
import tiny_vlm  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SMOL = "test-org/SmolLM2-135M-Instruct-GGUF"
GEMMA = "test-org/gemma-3-270m-GGUF"
SPLIT = "test-org/SmolLM2-split-GGUF"
GATED = "test-org/gated-GGUF"
VISION = "test-org/tiny-gemma3-vision-GGUF"
TOKEN = "hf_standin_token_0123456789"
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


def _file(model_id: str) -> Path:
    registry = load_registry(ROOT / "models.yaml", user_dir="/nonexistent")
    return registry.resolve(registry.get(model_id), "gguf")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    smol = _file("smollm2-135m-instruct")
    gemma = _file("gemma-3-270m")
    shards = split_gguf(smol, tmp_path_factory.mktemp("split") / "smollm2-Q4_1.gguf", 3)
    vlm, mmproj = tiny_vlm.write(tmp_path_factory.mktemp("vision"))
    hub = HubStandIn(repos={
        SMOL: Repo({SMOL_FILE: smol, "SmolLM2-135M-Instruct-Q8_0.gguf": smol, "README.md": ROOT / "README.md"}),
        GEMMA: Repo({"gemma-3-270m-Q4_K_M.gguf": gemma, "gemma-3-270m-Q8_0.gguf": gemma}),
        SPLIT: Repo({f"Q4_1/{p.name}": p for p in shards}),
        GATED: Repo({SMOL_FILE: smol}, gated_token=TOKEN),
        # (both projectors are the same f32 file; the names are what the choice reads)
        VISION: Repo({"tiny-gemma3-vision-F32.gguf": vlm, "mmproj-tiny-gemma3-vision-F32.gguf": mmproj,
                      "mmproj-tiny-gemma3-vision-F16.gguf": mmproj}),
    }).start()
    yield hub
    hub.stop()


@pytest.fixture
def env(hub: HubStandIn, tmp_path: Path) -> dict[str, str]:
    hub.log.clear()
    out = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    out.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), GATEWAY_MODELS_DIR=str(tmp_path / "models.d"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
    return out


def gateway(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def entries(env: dict[str, str]) -> dict[str, dict]:
    d = Path(env["GATEWAY_MODELS_DIR"])
    return {e["id"]: e for e in (yaml.safe_load(f.read_text()) for f in d.glob("*.yaml"))} if d.is_dir() else {}


def blobs(env: dict[str, str]) -> list[Path]:
    return [p for p in (Path(env["HF_HOME"]) / "hub").glob("models--*/blobs/*") if p.is_file()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- names and choices (no network) ---------------------------------------------------------


def test_names_and_quantisations() -> None:
    assert parse_name("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == \
        HubName("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert parse_name("https://huggingface.co/u/r") == HubName("u/r")
    assert parse_name("u/r@v1.0:q8_0") == HubName("u/r", "q8_0", "v1.0")
    assert parse_name("smollm2-135m-instruct") is None
    assert parse_name("hf.co/not a repo") is None
    assert quant_of("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("gemma-3-270m-q4_k_m.gguf") == "Q4_K_M"
    assert quant_of("Q8_0/model-Q8_0-00001-of-00002.gguf") == "Q8_0"
    assert quant_of("model.IQ4_XS.gguf") == "IQ4_XS"
    assert quant_of("model-f16.gguf") == "F16"
    files = [RemoteFile(n, 10, None) for n in ("m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf")]
    assert choose(files, None, "u/r").files[0].path == "m-Q4_K_M.gguf"
    assert choose(files, "q4_k_s", "u/r").files[0].path == "m-Q4_K_S.gguf"
    with pytest.raises(Exception, match="has no Q4_K.*Q4_K_M, Q4_K_S, Q8_0"):
        choose(files, "Q4_K", "u/r")
    split = [RemoteFile(f"d/m-Q4_K_M-0000{i}-of-00003.gguf", 10, None) for i in (2, 1, 3)]
    assert [f.path for f in choose(split, None, "u/r").files] == [
        f"d/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(Exception, match="split in 3 files but the repository has 2"):
        choose(split[:2], None, "u/r")


def test_the_vision_projector_is_chosen_by_precision_or_by_name() -> None:
    files = [RemoteFile(n, size, None) for n, size in (
        ("m-Q4_K_M.gguf", 50), ("mmproj-m-Q8_0.gguf", 5), ("mmproj-m-F32.gguf", 20), ("mmproj-m-F16.gguf", 10),
        ("mmproj-m-bf16.gguf", 10))]
    assert choose_projector(files, None, "u/r").path == "mmproj-m-F16.gguf"  # type: ignore[union-attr]
    assert choose_projector(files[:3], None, "u/r").path == "mmproj-m-F32.gguf"  # type: ignore[union-attr]
    assert choose_projector(files, "mmproj-m-Q8_0.gguf", "u/r").path == "mmproj-m-Q8_0.gguf"  # type: ignore[union-attr]
    assert choose_projector(files[:1], None, "u/r") is None  # a text model
    with pytest.raises(Exception, match="has no projector 'x.gguf'; it has: mmproj-m-Q8_0.gguf"):
        choose_projector(files, "x.gguf", "u/r")
    assert choose(files, None, "u/r").files[0].path == "m-Q4_K_M.gguf"  # never the projector as the model


# --- pulls ---------------------------------------------------------------------------------


def test_pull_by_repo_and_quant_then_again(hub: HubStandIn, env: dict[str, str]) -> None:
    r = gateway(env, "pull", f"hf.co/{SMOL}:Q4_1")
    assert r.returncode == 0, r.stderr
    model_id = f"hf.co/{SMOL}:Q4_1"
    assert f"pulled: {model_id}" in r.stdout
    e = entries(env)[model_id]
    info = read_gguf(_file("smollm2-135m-instruct"))
    assert e["context_length"] == 8192 and e["pulled"]["context_trained"] == info.context_length
    assert e["pulled"]["parameters"] == info.parameters == 134515008
    assert e["formats"]["gguf"]["hf"] == {"repo": SMOL, "file": SMOL_FILE, "revision": hub.repos[SMOL].commit}
    assert [digest(b) for b in blobs(env)] == [digest(_file("smollm2-135m-instruct"))]
    assert hub.downloads(SMOL_FILE) == [""]
    again = gateway(env, "pull", f"{SMOL}:q4_1")  # the short spelling, any case
    assert again.returncode == 0 and f"already present: {model_id}" in again.stdout, again.stderr
    assert hub.downloads(SMOL_FILE) == [""], "a present, verified file is not downloaded again"


def test_pull_a_vision_model_with_its_projector_then_remove_both(hub: HubStandIn, env: dict[str, str]) -> None:
    r = gateway(env, "pull", f"hf.co/{VISION}")
    assert r.returncode == 0, r.stderr
    assert "vision projector: mmproj-tiny-gemma3-vision-F16.gguf" in r.stdout
    model_id = f"hf.co/{VISION}:F32"
    e = entries(env)[model_id]
    assert e["mmproj"] == {"hf": {"repo": VISION, "file": "mmproj-tiny-gemma3-vision-F16.gguf",
                                  "revision": hub.repos[VISION].commit}}
    assert hub.downloads("mmproj-tiny-gemma3-vision-F16.gguf") == [""]
    assert hub.downloads("mmproj-tiny-gemma3-vision-F32.gguf") == []
    files = hub.repos[VISION].files
    assert sorted(digest(b) for b in blobs(env)) == sorted(
        digest(files[f]) for f in ("tiny-gemma3-vision-F32.gguf", "mmproj-tiny-gemma3-vision-F16.gguf"))
    shown = gateway(env, "models")
    assert shown.returncode == 0 and model_id in shown.stdout, shown.stderr
    gone = gateway(env, "rm", model_id)
    assert gone.returncode == 0, gone.stderr
    assert blobs(env) == [], "the model's and its projector's files are removed"


def test_pull_default_quantisation_and_unknown_one(hub: HubStandIn, env: dict[str, str]) -> None:
    r = gateway(env, "pull", GEMMA)
    assert r.returncode == 0, r.stderr
    e = entries(env)[f"hf.co/{GEMMA}:Q4_K_M"]
    assert e["formats"]["gguf"]["hf"]["file"] == "gemma-3-270m-Q4_K_M.gguf"
    assert e["context_length"] == 8192 and e["pulled"]["context_trained"] == 32768
    assert f"hf.co/{GEMMA}" in e["aliases"] and GEMMA in e["aliases"]  # the name it was pulled by
    assert e["pulled"]["chat_template"] is False  # this GGUF has none: said, not invented
    bad = gateway(env, "pull", f"hf.co/{SMOL}:Q3_K_S")
    assert bad.returncode == 1
    assert f"{SMOL} has no Q3_K_S GGUF; it has: Q4_1, Q8_0" in bad.stderr
    missing = gateway(env, "pull", "hf.co/test-org/no-such-repo")
    assert missing.returncode == 1 and "no repository test-org/no-such-repo" in missing.stderr


def test_pull_split_gguf_into_one_folder(hub: HubStandIn, env: dict[str, str]) -> None:
    r = gateway(env, "pull", f"hf.co/{SPLIT}")
    assert r.returncode == 0, r.stderr
    e = entries(env)[f"hf.co/{SPLIT}:Q4_1"]
    src = e["formats"]["gguf"]["hf"]
    assert src["file"] == "Q4_1/smollm2-Q4_1-00001-of-00003.gguf"
    assert src["parts"] == [f"Q4_1/smollm2-Q4_1-0000{i}-of-00003.gguf" for i in (2, 3)]
    registry = load_registry(ROOT / "models.yaml", user_dir=env["GATEWAY_MODELS_DIR"])
    spec = registry.get(f"{SPLIT}:Q4_1")
    assert spec is not None
    os.environ["HF_HOME"], old = env["HF_HOME"], os.environ.get("HF_HOME")
    try:
        first = registry.local_path(spec, "gguf")
    finally:
        os.environ.pop("HF_HOME") if old is None else os.environ.update(HF_HOME=old)
    # HF_HOME is read by huggingface-hub at import: the path is found from the entry instead.
    first = first or next(Path(env["HF_HOME"]).glob("hub/models--*split*/snapshots/*/Q4_1/*00001-of-00003.gguf"))
    assert sorted(p.name for p in first.parent.iterdir()) == [
        f"smollm2-Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert read_gguf(first).parameters == 134515008  # the tensors of all three files


def test_interrupted_download_resumes(hub: HubStandIn, env: dict[str, str]) -> None:
    # A connection dropped mid-file: the rest is asked for with a Range request.
    hub.cut[SMOL_FILE], hub.cut_at = 1, 10 << 20
    r = gateway(env, "pull", f"{SMOL}:Q4_1")
    assert r.returncode == 0, r.stderr
    assert hub.downloads(SMOL_FILE) == ["", f"bytes={10 << 20}-"]
    assert [digest(b) for b in blobs(env)] == [digest(_file("smollm2-135m-instruct"))]


def test_pull_killed_midway_resumes_where_it_stopped(hub: HubStandIn, env: dict[str, str]) -> None:
    hub.pace_bps = 20e6  # ~5 s for the file: time to stop the pull halfway
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "pull", f"{SMOL}:Q4_1"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        part: list[Path] = []
        while time.monotonic() < deadline:
            part = list((Path(env["HF_HOME"]) / "hub").glob("models--*/blobs/*.incomplete"))
            if part and part[0].stat().st_size > 20 << 20:
                break
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        assert part, "the download never started"
        kept = part[0].stat().st_size
    finally:
        hub.pace_bps = 0
    assert not entries(env), "a pull that did not finish registers nothing"
    r = gateway(env, "pull", f"{SMOL}:Q4_1")
    assert r.returncode == 0, r.stderr
    resumed = hub.downloads(SMOL_FILE)[-1]
    assert resumed.startswith("bytes=") and int(resumed[6:-1]) >= kept - (1 << 20), (resumed, kept)
    assert [digest(b) for b in blobs(env)] == [digest(_file("smollm2-135m-instruct"))]


def test_corrupted_download_is_rejected(hub: HubStandIn, env: dict[str, str]) -> None:
    hub.corrupt[SMOL_FILE] = 2  # wrong twice: the pull gives up
    r = gateway(env, "pull", f"{SMOL}:Q4_1")
    assert r.returncode == 1
    assert "has SHA-256" in r.stderr and "twice; the download was removed" in r.stderr
    assert not blobs(env) and not entries(env)
    hub.corrupt[SMOL_FILE] = 1  # wrong once: fetched again, and right
    r = gateway(env, "pull", f"{SMOL}:Q4_1")
    assert r.returncode == 0, r.stderr
    assert len(hub.downloads(SMOL_FILE)) == 4
    assert [digest(b) for b in blobs(env)] == [digest(_file("smollm2-135m-instruct"))]


def test_two_pulls_of_one_model_at_once(hub: HubStandIn, env: dict[str, str]) -> None:
    hub.pace_bps = 50e6
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "gateway.cli", "pull", f"{SMOL}:Q4_1"], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        hub.pace_bps = 0
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(hub.downloads(SMOL_FILE)) == 1, "the second pull waits for the first one's file"
    assert [digest(b) for b in blobs(env)] == [digest(_file("smollm2-135m-instruct"))]
    assert list(entries(env)) == [f"hf.co/{SMOL}:Q4_1"]


def test_gated_repository_needs_the_token(hub: HubStandIn, env: dict[str, str]) -> None:
    r = gateway(env, "pull", f"{GATED}:Q4_1")
    assert r.returncode == 1 and "is gated" in r.stderr and "HF_TOKEN" in r.stderr
    r = gateway({**env, "HF_TOKEN": TOKEN}, "pull", f"{GATED}:Q4_1")
    assert r.returncode == 0, r.stderr


def test_ls_and_rm(hub: HubStandIn, env: dict[str, str]) -> None:
    for name in (f"{SMOL}:Q4_1", f"{SMOL}:Q8_0", GEMMA):
        assert gateway(env, "pull", name).returncode == 0
    ls = gateway(env, "ls", "--url", "http://127.0.0.1:9")
    assert ls.returncode == 0, ls.stderr
    rows = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert f"hf.co/{SMOL}" in rows[f"hf.co/{SMOL}:Q4_1"] and "135M" in rows[f"hf.co/{SMOL}:Q4_1"]
    assert "Q4_K_M" in rows[f"hf.co/{GEMMA}:Q4_K_M"] and "268M" in rows[f"hf.co/{GEMMA}:Q4_K_M"]
    assert "smollm2-135m-instruct" in rows and "LOADED unknown" in ls.stdout
    # Q4_1 and Q8_0 of the stand-in are the same bytes, one blob: removing one keeps it for the other.
    assert len(blobs(env)) == 2
    r = gateway(env, "rm", f"hf.co/{SMOL}:Q8_0", "--url", "http://127.0.0.1:9")
    assert r.returncode == 0, r.stderr
    assert "kept 1 file(s) other models use" in r.stdout and len(blobs(env)) == 2
    r = gateway(env, "rm", f"{SMOL}:Q4_1", "--url", "http://127.0.0.1:9")  # by alias
    freed = f"freed {_file('smollm2-135m-instruct').stat().st_size / 2**20:.1f} MiB"
    assert r.returncode == 0 and freed in r.stdout, r.stdout + r.stderr
    assert len(blobs(env)) == 1 and list(entries(env)) == [f"hf.co/{GEMMA}:Q4_K_M"]
    refused = gateway(env, "rm", "smollm2-135m-instruct")
    assert refused.returncode == 2 and "not pulled" in refused.stderr
    assert gateway(env, "rm", "no-such-model").returncode == 2


# --- serving pulled models --------------------------------------------------------------------


def test_serve_pulls_on_first_use_and_serves_through_every_api(hub: HubStandIn, env: dict[str, str],
                                                                 tmp_path: Path) -> None:
    import ollama
    import openai

    from tests.test_production import Gateway

    g = Gateway(tmp_path, "--model", f"hf.co/{SPLIT}", env=env)  # not pulled yet: pulled, then served
    ol = ollama.Client(host=g.url)
    try:
        model_id = f"hf.co/{SPLIT}:Q4_1"
        assert model_id in entries(env)
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x")
        for name in (f"hf.co/{SPLIT}", model_id):  # the name it was pulled by, and its id
            r = client.chat.completions.create(model=name, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Say hello."}])
            assert r.choices[0].message.content and r.model == name  # echoed as asked, like other aliases
        assert {m.id for m in client.models.list()} >= {model_id, "smollm2-135m-instruct"}
        refused = gateway(env, "rm", model_id, "--url", g.url)
        assert refused.returncode == 1 and "is loaded by the gateway" in refused.stderr

        # Ollama's client pulls through the running server, with progress, and the model serves at once.
        name = f"hf.co/{SMOL}:Q4_1"
        steps = list(ol.pull(name, stream=True))
        assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
        assert any(s.total and s.completed for s in steps)
        listed = {m.model: m for m in ol.list().models}
        assert listed[name].details.quantization_level == "Q4_1" and listed[name].details.parameter_size == "135M"
        assert listed[name].details.family == "llama"
        chat = ol.chat(model=name, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4})
        assert chat.message.content
        status = httpx.get(f"{g.url}/api/status", timeout=30).json()
        assert [p["status"] for p in status["pulls"] if p["name"] == name] == ["done"]
        assert status["memory"]["cpu"]["used_bytes"] > 0
        row = next(m for m in status["models"] if m["id"] == name)
        assert row["source"] == f"hf.co/{SMOL}" and row["memory_bytes"] > 100 << 20
        with pytest.raises(ollama.ResponseError) as err:
            ol.delete(name)  # loaded: refused
        assert err.value.status_code == 409 and "unload it first" in str(err.value)
        ol.generate(model=name, keep_alive=0)  # Ollama's way to unload
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(m.model == name for m in ol.ps().models):
            time.sleep(0.2)
        ol.delete(name)
        assert name not in {m.model for m in ol.list().models}
        assert name not in entries(env)
        with pytest.raises(ollama.ResponseError) as err:
            list(ol.pull(f"hf.co/{SMOL}:Q3_K_S", stream=True))
        assert "has no Q3_K_S GGUF; it has: Q4_1, Q8_0" in str(err.value)

        # Ollama's create from a Hub model that is not here yet pulls it first, with its progress.
        steps = list(ol.create(model="smol-pirate", from_=f"hf.co/{SMOL}:Q8_0", system="Talk like a pirate.",
                               parameters={"num_predict": 3}, stream=True))
        assert steps[0].status == "pulling manifest" and steps[-1].status == "success", steps
        assert f"hf.co/{SMOL}:Q8_0" in entries(env) and "smol-pirate" in entries(env)
        assert ol.chat(model="smol-pirate", messages=[{"role": "user", "content": "Hi"}]).eval_count == 3
        with pytest.raises(ollama.ResponseError) as err:
            ol.create(model="smol-pirate2", from_=f"hf.co/{SMOL}:Q3_K_S")
        assert err.value.status_code == 404 and "has no Q3_K_S GGUF" in str(err.value)
        assert "smol-pirate2" not in entries(env)
    finally:
        ol._client.close()
        g.stop()


# --- the web page -------------------------------------------------------------------------------------


from tests.test_web import _page, browser  # noqa: E402, F401 - the Chromium fixture


async def test_page_pulls_a_model_and_shows_memory(browser, hub: HubStandIn, env: dict[str, str],  # noqa: F811
                                                   tmp_path: Path) -> None:
    import asyncio

    from playwright.async_api import expect

    from tests.test_production import Gateway

    g = await asyncio.to_thread(Gateway, tmp_path, "--memory-budget", "3G", env=env)
    hub.pace_bps = 25e6  # ~4 s: long enough to see the pull under way
    try:
        page, console = await _page(browser, g.url)
        await page.wait_for_selector('#models tr[data-model="smollm2-135m-instruct"]')
        assert "RAM:" in await page.inner_text("#memory-budget") and "3072 MiB budget" in await page.inner_text(
            "#memory-budget")
        row = page.locator('#models tr[data-model="smollm2-135m-instruct"]')
        assert "MiB" in await row.locator("td").nth(4).inner_text()  # the loaded default model's memory
        name = f"hf.co/{SMOL}:Q4_1"
        await page.fill("#pull-name", name)
        await page.click("#pull-form button")
        item = page.locator(f'#pulls li[data-pull="{name}"]')
        await item.locator("progress").wait_for(timeout=30_000)  # shown while it downloads
        assert "downloading" in await item.inner_text()
        await expect(item).to_contain_text("done", timeout=60_000)
        new_row = page.locator(f'#models tr[data-model="{name}"]')
        await new_row.wait_for(timeout=30_000)
        await new_row.get_by_role("button", name=f"load {name}").click()
        await expect(new_row).to_have_attribute("data-state", "loaded", timeout=120_000)
        assert "MiB" in await new_row.locator("td").nth(4).inner_text()
        assert "unloads in" in await new_row.locator("td").nth(4).inner_text()  # keep_alive applies to it
        assert console.errors == []
        await page.close()
    finally:
        hub.pace_bps = 0
        await asyncio.to_thread(g.stop)
