"""Serve a vision model on one engine and check what images do through it: the prompt grows by the
image's tokens, the same image gives the same logits and another image others, a damaged image is a
400 and the model serves on. For any host (a GPU build's multimodal library included); httpx only.

    python benchmarks/check_images.py --engine cuda --out DIR [--model M.gguf --mmproj P.gguf]

Without --model, the tiny test model of scripts/tiny_vlm.py (needs the dev lock to make it, or pass
the two files it made). Writes DIR/images-<engine>.json, with the machine class and commit.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import _wait  # noqa: E402


def png(rgb: tuple[int, int, int], w: int = 40, h: int = 30) -> bytes:
    """A one-colour PNG, written without an imaging library."""
    raw = b"".join(b"\0" + bytes(rgb) * w for _ in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def ask(url: str, image: bytes | None) -> tuple[int, dict[str, float], float]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}})
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": "vision", "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
        "messages": [{"role": "user", "content": content}]})
    r.raise_for_status()
    j = r.json()
    top = {t["token"]: t["logprob"] for t in j["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    return j["usage"]["prompt_tokens"], top, time.perf_counter() - t0


def machine() -> str:
    """The CPU model and its core count (the GPU is in `served_by`)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{platform.machine()}, {cpu or 'unknown CPU'}, {os.cpu_count()} cores"


def gap(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a.get(t, -100.0) - b.get(t, -100.0)) for t in {*a, *b})


def check(url: str) -> dict[str, Any]:
    red, blue = png((220, 20, 30)), png((20, 40, 230))
    plain, _, _ = ask(url, None)
    n, first, took = ask(url, red)
    _, other, _ = ask(url, blue)
    _, again, _ = ask(url, red)
    bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": "vision", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(red[:40]).decode()}}]}]})
    return {"image_tokens": n - plain, "same_image_gap": gap(first, again), "other_image_gap": gap(first, other),
            "first_top_logprobs": first, "first_image_request_s": round(took, 4),
            "damaged_image": [bad.status_code, bad.json()["error"]["message"]],
            "health_after": httpx.get(f"{url}/health", timeout=10).status_code}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path)
    p.add_argument("--mmproj", type=Path)
    p.add_argument("--port", type=int, default=18090)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="check-images-"))
    if a.model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        import tiny_vlm

        a.model, a.mmproj = tiny_vlm.write(work)
    cfg = work / "models.yaml"
    cfg.write_text(json.dumps({"models": [{"id": "vision", "formats": {"gguf": {"path": str(a.model)}},
                                           "mmproj": {"path": str(a.mmproj)}, "parallel": 2, "context_length": 4096}]}))
    url = f"http://127.0.0.1:{a.port}"
    log = open(a.out / f"serve-{a.engine}.log", "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--engine", a.engine,
                             "--port", str(a.port), "--model", "vision"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(url, proc, timeout=600)
        model = httpx.get(f"{url}/health", timeout=10).json()["models"]["vision"]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        res = {"engine": a.engine, "served_by": f"{model['engine']} on {model['device']}",
               "machine": machine(), "commit": commit or "unknown",
               **check(url)}
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    (a.out / f"images-{a.engine}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    ok = res["image_tokens"] > 0 and res["same_image_gap"] < 1e-3 < res["other_image_gap"] and res["damaged_image"][0] == 400
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
