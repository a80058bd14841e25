"""`gateway bench` against the real gateway: its numbers agree with what the server served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.bench import Result, summarise
from tests.conftest import MODEL, ROOT


def test_bench_concurrency_run(gateway_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "--url", gateway_url, "--model", MODEL, "--num-prompts", "6",
         "--input-len", "32", "--output-len", "8", "--concurrency", "3", "--warmup", "1", "--slo-ttft", "60",
         "--json", str(out), "--quiet", "--plot", str(tmp_path / "latency.png")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(out.read_text())
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == 6 * 8  # ignore_eos: fixed output length
    assert s["total_prompt_tokens"] >= 6 * 32
    assert s["ttft"]["p50"] <= s["e2e"]["p50"]
    assert s["ttft"]["p50"] <= s["ttft"]["p90"] <= s["ttft"]["p99"] <= s["ttft"]["max"]
    assert s["slo"]["met"] == 6
    assert "ttft" in r.stdout and "goodput" in r.stdout
    png = (tmp_path / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_bench_poisson_and_failures_reported(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "--url", "http://127.0.0.1:9", "--num-prompts", "2",
         "--rate", "50", "--warmup", "0", "--json", str(out), "--quiet", "--timeout", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert r.returncode == 1
    s = json.loads(out.read_text())
    assert s["failed"] == 2 and s["errors"]


def test_summary_goodput_counts_slo() -> None:
    rs = [Result(ok=True, ttft=0.1, e2e=1.1, output_tokens=11, itl=[0.01, 0.3, 0.02]),
          Result(ok=True, ttft=0.9, e2e=1.9, output_tokens=11, itl=[0.05]),
          Result(ok=False, error="x")]
    s = summarise(rs, duration=2.0, slo_ttft=0.5, slo_tpot=0.2)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["slo"]["met"] == 1 and s["goodput"] == 0.5
    assert abs(s["tpot"]["mean"] - 0.1) < 1e-9
    assert s["ttft"]["max"] == 0.9 and s["e2e"]["max"] == 1.9
    assert s["itl"]["max"] == 0.3  # the longest gap between two tokens of any stream
