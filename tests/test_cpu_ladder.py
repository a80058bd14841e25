"""Serve on every CPU. The CPU variants of the build, the fallback ladder (repacking off,
a lower CPU variant, the next candidate) walked by a stand-in for ggml's AMX crash that SIGSEGVs
the real worker on any CPU (tests/amx_standin.py), and the crash policy that never stops serving
the only engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engines.llamacpp.ggml_backends import AMX_VARIANTS, Variant, choose, lower, variants
from engines.worker.connections import Supervision
from gateway.host.functional_check import CheckCache
from tests.conftest import MODEL, ROOT
from tests.test_production import Gateway, _chat
from tests.test_workers import _ready_again, _wait_gone

# A prompt of a few hundred tokens: what the stand-in (like the AMX kernel) crashes on.
LONG_PROMPT = " ".join(f"Sentence {i} describes a lighthouse on a rocky coast at night." for i in range(30))


# --- choosing a variant (pure) ------------------------------------------------------------------

SPR = [Variant("sapphirerapids", "", 300), Variant("zen4", "", 250), Variant("icelake", "", 200),
       Variant("skylakex", "", 150), Variant("haswell", "", 100), Variant("sse42", "", 20), Variant("x64", "", 1)]
ZEN3 = [Variant("sapphirerapids", "", 0), Variant("zen4", "", 0), Variant("icelake", "", 0),
        Variant("skylakex", "", 0), Variant("haswell", "", 100), Variant("sse42", "", 20), Variant("x64", "", 1)]


def test_auto_takes_the_fastest_variant_but_not_amx() -> None:
    assert choose(SPR).name == "zen4"  # AVX-512 BF16/VNNI, no AMX
    assert choose(SPR, "sapphirerapids").name == "sapphirerapids"  # AMX only when asked for
    assert choose(ZEN3).name == "haswell"


def test_a_variant_the_cpu_cannot_run_or_the_build_lacks_is_refused_with_the_reason() -> None:
    with pytest.raises(OSError, match="needs instructions this CPU lacks"):
        choose(ZEN3, "icelake")
    with pytest.raises(OSError, match="no CPU variant 'power10'"):
        choose(ZEN3, "power10")
    with pytest.raises(OSError, match="no CPU variant of this llama.cpp build runs"):
        choose([Variant("zen4", "", 0)])


def test_the_ladder_steps_down_from_avx512_to_avx2_then_lower() -> None:
    pairs = [(v.name, v.score) for v in SPR]
    assert lower(pairs, "zen4") == "haswell"
    assert lower(pairs, "sapphirerapids") == "haswell"
    assert lower(pairs, "haswell") == "sse42"
    assert lower(pairs, "x64") is None
    assert lower([(v.name, v.score) for v in ZEN3], "haswell") == "sse42"


def test_restarts_back_off_to_at_most_30_s() -> None:
    s = Supervision()
    assert [s.delay(n) for n in (1, 2, 3)] == [0.5, 2.0, 8.0]
    assert s.delay(4) == 16.0 and s.delay(5) == 30.0 and s.delay(50) == 30.0


# --- the installed build ------------------------------------------------------------------------


def _build_variants() -> list[Variant]:
    found = variants()
    if not found:
        pytest.skip("this llama.cpp build has its CPU backend compiled in (GGML_NATIVE=1): no variants to choose")
    return found


def test_the_build_runs_on_this_cpu_with_a_variant_chosen_for_it() -> None:
    found = _build_variants()
    names = {v.name for v in found}
    assert {"x64", "haswell", "sapphirerapids"} <= names, names
    assert next(v for v in found if v.name == "x64").score > 0  # the baseline runs anywhere
    # The variant a probe loads is auto's choice: supported and not AMX.
    out = subprocess.run([sys.executable, "-m", "engines.llamacpp.ggml_devices"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "GATEWAY_CPU_VARIANT"}, check=True)
    report = json.loads(out.stdout)
    assert report["cpu_variant"] == choose(found).name and report["cpu_variant"] not in AMX_VARIANTS
    assert "CPU" in report["backends"], report


# --- the ladder with the stand-in crash ---------------------------------------------------------


def _config(tmp: Path, **extra: Any) -> Path:
    """models.yaml with its own cache folder: crash verdicts must not reach other tests."""
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    cfg["cache_dir"] = str(tmp / "cache")
    entry = next(m for m in cfg["models"] if m["id"] == MODEL)
    entry.update(extra)
    path = tmp / "models.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _gateway(tmp: Path, *args: str, standin: str = "", env: dict[str, str] | None = None) -> Gateway:
    return Gateway(tmp, "--parallel", "2", "--config", str(tmp / "models.yaml"), *args,
                   env={"GATEWAY_WORKER_PLUGINS": "tests.amx_standin", "AMX_STANDIN": standin, **(env or {})})


def _health(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/health", timeout=10).json()
    return body


def _long_chat(url: str) -> httpx.Response:
    return _chat(url, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=8)


def test_a_crash_on_long_prompts_falls_back_to_repack_off_then_a_lower_variant(tmp_path: Path) -> None:
    top = choose(_build_variants())
    low = lower([(v.name, v.score) for v in variants()], top.name)
    assert low is not None
    _config(tmp_path)
    # The stand-in crashes on the variant auto picks, with or without repacking: two rungs fail.
    g = _gateway(tmp_path, standin="variant=top")
    try:
        r = _long_chat(g.url)
        assert r.status_code == 200, r.text
        assert r.headers["x-engine"] == "llamacpp/cpu"
        reason = r.headers["x-fallback-reason"]
        assert f"CPU variant {top.name}, repack on" in reason and f"CPU variant {top.name}, repack off" in reason, reason
        assert reason.count("SIGSEGV") == 2 and "functional check" in reason, reason
        model = _health(g.url)["models"][MODEL]
        assert model["cpu_variant"] == low and model["repack"] == "off", model
        assert len(model["failed_candidates"]) == 2
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        line = next(x for x in metrics.splitlines()
                    if x.startswith("gateway_fallbacks_total") and 'reason="check_failed"' in x)
        assert line.endswith(" 2.0"), line
        # gateway devices shows the ladder from the same cache.
        out = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--engine", "cpu", "--config",
                              str(tmp_path / "models.yaml")], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert "check ok, after 2 fallback(s) inside its build:" in out.stdout, out.stdout
        assert f"(CPU variant {low}, repack off): ok" in out.stdout, out.stdout
        assert out.stdout.count("SIGSEGV") >= 2, out.stdout
    finally:
        g.stop()
    # A restart trusts the cached verdicts: straight to the rung that works, no crash on the way.
    g = _gateway(tmp_path, standin="variant=top")
    try:
        assert _long_chat(g.url).status_code == 200
        assert _health(g.url)["models"][MODEL]["cpu_variant"] == low
        assert "crash(es) counted" not in g.log()  # no worker died on the way
    finally:
        g.stop()


@pytest.mark.timeout(600)  # lavapipe's functional check alone takes about a minute on 2 cores
def test_when_the_whole_ladder_crashes_the_next_candidate_serves(tmp_path: Path) -> None:
    from tests.test_builds import _vulkan_host_or_skip

    _vulkan_host_or_skip()
    # CPU first, then Vulkan on lavapipe (--device llvmpipe lets auto take the software device).
    _config(tmp_path, engines=["cpu", "vulkan"])
    g = _gateway(tmp_path, "--engine", "auto", "--device", "llvmpipe", standin="backend=cpu")
    try:
        # Every CPU rung crashes at its check (the stand-in's condition is the backend), so a short
        # chat shows the fallback; a long one only made lavapipe's prefill slow.
        r = _chat(g.url)
        assert r.status_code == 200, r.text
        assert r.headers["x-engine"] == "llamacpp/vulkan"
        reason = r.headers["x-fallback-reason"]
        assert reason.count("llamacpp/cpu on cpu") == 3 and reason.count("SIGSEGV") == 3, reason
        assert "repack on" in reason and "repack off" in reason
    finally:
        g.stop()


def test_external_kills_never_exclude_the_engine_and_a_restart_serves_without_recheck(tmp_path: Path) -> None:
    _config(tmp_path)
    g = _gateway(tmp_path)
    try:
        assert _chat(g.url).status_code == 200
        first = _health(g.url)["models"][MODEL]
        pid = first["worker"]["pid"]
        for _ in range(3):  # what the OOM killer or an operator's kill -9 does, three times in a minute
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            assert _wait_gone(pid, 5)
            pid = _ready_again(g.url, pid, timeout=30)["pid"]
            assert time.monotonic() - t0 < 10
            assert _chat(g.url).status_code == 200
        model = _health(g.url)["models"][MODEL]
        assert model["worker"]["crashes"] == 3 and model["worker"]["counted_crashes"] == 0, model
        assert model["cpu_variant"] == first.get("cpu_variant") and model["repack"] == "on"
        assert "from outside" in model["worker"]["last_crash"]
        entries = CheckCache(tmp_path / "cache" / "functional-checks.json").read()
        assert entries and all(e["ok"] for e in entries.values()), entries
    finally:
        g.stop()
    g = _gateway(tmp_path)  # no --recheck
    try:
        assert _chat(g.url).status_code == 200
        assert _health(g.url)["models"][MODEL]["repack"] == "on"
    finally:
        g.stop()


def test_the_only_engine_keeps_serving_through_crashes_and_its_verdicts_expire(tmp_path: Path) -> None:
    """Crashes that pass the check (the stand-in spares the check's own requests): each rung gives up
    after one, the last never does; /health says degraded meanwhile; short prompts keep working."""
    _config(tmp_path)
    env = {"GATEWAY_WORKER_MAX_CRASHES": "1", "GATEWAY_WORKER_MAX_BACKOFF": "3"}
    g = _gateway(tmp_path, standin="serving", env=env)
    rungs = 3 if lower([(v.name, v.score) for v in variants()], choose(variants()).name) else 2
    cache = tmp_path / "cache" / "functional-checks.json"
    try:
        assert _chat(g.url).status_code == 200
        seen, degraded = [], 0
        for _ in range(rungs + 2):
            model = _health(g.url)["models"][MODEL]
            seen.append((model.get("cpu_variant"), model.get("repack")))
            r = _long_chat(g.url)
            assert r.status_code == 502 and "SIGSEGV" in r.text, (r.status_code, r.text)
            h = httpx.get(f"{g.url}/health", timeout=10)
            if h.status_code == 503 and h.json()["status"] == "degraded":
                degraded += 1
                assert int(h.headers["retry-after"]) >= 1 and "SIGSEGV" in h.json()["reason"], h.json()
            assert _wait_ok(g.url)  # short prompts are served all along
        assert len(set(seen)) == rungs and seen[-1] == seen[-2], seen  # every rung, in order; the last stays
        assert degraded >= 1  # the last rung restarting after its crashes
        model = _health(g.url)["models"][MODEL]
        assert model["worker"]["counted_crashes"] >= 1 and model["worker"].get("degraded"), model
        crashed = [e for e in CheckCache(cache).read().values() if not e["ok"]]
        assert len(crashed) == rungs - 1, crashed
        assert all(e["ttl"] == 1800.0 and "worker crashed" in e["reason"] for e in crashed), crashed
    finally:
        g.stop()
    # Half an hour later the verdicts have expired: a restart tries the first rung again.
    data = json.loads(cache.read_text())
    for e in data.values():
        e["at"] -= 1801 if "ttl" in e else 0
    cache.write_text(json.dumps(data))
    g = _gateway(tmp_path)
    try:
        assert _chat(g.url).status_code == 200
        model = _health(g.url)["models"][MODEL]
        assert (model.get("cpu_variant"), model["repack"]) == seen[0], model
    finally:
        g.stop()


def _wait_ok(url: str, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _chat(url).status_code == 200:
            return True
        time.sleep(0.2)
    return False
