"""ORT GenAI / ExecuTorch vs llama.cpp: single-stream decode and prefill tok/s of SmolLM2 through the engine interface.

    .venv/bin/python benchmarks/bench_ortgenai.py [--tokens 128] [--runs 3] [--prefill-tokens 512]
        [--variants llamacpp,ortgenai-fp32,ortgenai-int4,executorch-xnnpack,executorch-vulkan]
        [--backend cpu|cuda|vulkan] [--json-line]

Converts the default model with `gateway convert` where needed (cached in the model cache), loads
each variant in-process with one sequence, and streams the same chat prompt greedily with EOS
ignored.  Decode tok/s = (tokens - 1) / (last token time - first token time); median of `--runs`
after one warm-up.  Prefill tok/s = prompt tokens / time to the first token of a ~`--prefill-tokens`
prompt that begins differently each run (no cached prefix), median of `--runs`.  Prints a Markdown table (or, with --json-line, one line of JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.base import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from engines.registry import create_engine  # noqa: E402
from gateway.chat.template import ChatMessage, compiled  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
PROVIDER = {"cpu": "cpu", "cuda": "cuda", "directml": "dml", "vulkan": "cpu"}
# The runtime's own device id on a GPU backend: ggml's device name, ExecuTorch's Vulkan device index.
DEVICE_KEY = {("llamacpp", "vulkan"): "Vulkan0", ("llamacpp", "cuda"): "CUDA0", ("executorch", "vulkan"): "0"}
LONG = ("The lighthouse stood on a rock at the edge of the world, and every night its keeper climbed the "
        "stairs to light the lamp, counting the steps and listening to the sea. ")


def model_path(variant: str, backend: str) -> str:
    from gateway.models.convert import convert
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    if variant == "llamacpp":
        return str(reg.resolve(spec, "gguf"))
    if variant.startswith("executorch-"):
        delegate = variant.split("-", 1)[1]
        return str(convert(reg, spec, "executorch", "fp32", delegate, progress=lambda m: print(m, file=sys.stderr)))
    precision = variant.split("-", 1)[1]
    return str(convert(reg, spec, "onnx", precision, PROVIDER[backend], progress=lambda m: print(m, file=sys.stderr)))


def chat_request(engine: Engine, messages: tuple[ChatMessage, ...], sp: SamplingParams, rid: str) -> GenerationRequest:
    """A chat request rendered as the gateway renders it, with the model's own template."""
    assert engine.info.template is not None
    return GenerationRequest(rid, sp, prompt=compiled(engine.info.template).render(messages), templated=True)


async def measure(variant: str, backend: str, tokens: int, runs: int, threads: int, prefill: int) -> dict[str, Any]:
    runtime = "llamacpp" if variant == "llamacpp" else variant.split("-", 1)[0]
    cfg = EngineConfig(model_path=model_path(variant, backend), context_length=2048, parallel=1,
                       n_threads=threads, backend=backend, device=backend,
                       device_key=DEVICE_KEY.get((runtime, backend), ""))
    engine = create_engine(runtime, cfg)
    t0 = time.perf_counter()
    await engine.load()
    load_s = time.perf_counter() - t0
    req = chat_request(engine, (ChatMessage("user", PROMPT),),
                       SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), "bench")
    results = []
    try:
        for _ in range(runs + 1):
            start = time.perf_counter()
            stamps = []
            async for _ev in engine.generate(req):
                stamps.append(time.perf_counter())
            results.append({"ttft": stamps[0] - start, "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])})
        prefill_tps: list[float] = []
        prompt_tokens = 0
        for i in range(runs if prefill else 0):
            text = f"Story {i}. " + LONG * max(1, prefill // 36)
            long_req = chat_request(engine, (ChatMessage("user", text),), SamplingParams(temperature=0.0, max_tokens=1),
                                    f"prefill-{i}")
            start = time.perf_counter()
            last = None
            async for ev in engine.generate(long_req):
                last = ev
            assert last is not None and last.usage is not None
            prefill_tps.append(last.usage.prompt_tokens / (time.perf_counter() - start))
            prompt_tokens = last.usage.prompt_tokens
    finally:
        await engine.close()
    timed = results[1:]  # the first run is a warm-up
    return {
        "variant": variant, "backend": backend, "version": engine.info.version,
        "decode_tps": round(statistics.median(r["decode_tps"] for r in timed), 1),
        "ttft_ms": round(1000 * statistics.median(r["ttft"] for r in timed), 1),
        "load_s": round(load_s, 2), "tokens": tokens, "runs": runs,
        "prefill_tps": round(statistics.median(prefill_tps), 1) if prefill_tps else None,
        "prefill_tokens": prompt_tokens,
    }


def machine() -> str:
    cores = os.cpu_count()
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpu = []
    return f"{platform.machine()}, {cores} cores, {platform.system()} {platform.release()}" + (f", {gpu[0]}" if gpu else "")


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per engine (0 = all cores)")
    ap.add_argument("--variants", default="llamacpp,ortgenai-fp32,ortgenai-int4")
    ap.add_argument("--backend", default="cpu", choices=sorted(PROVIDER))
    ap.add_argument("--prefill-tokens", type=int, default=512, help="prompt size of the prefill measurement (0 = skip)")
    ap.add_argument("--json-line", action="store_true", help="print one line of JSON instead of a table")
    args = ap.parse_args()
    if args.backend == "vulkan":  # as the gateway does: ggml hides a software device (lavapipe) otherwise
        from gateway.host.hardware import probe_vulkan, vulkan_visible_env

        os.environ.update(vulkan_visible_env(probe_vulkan()))
    rows = [asyncio.run(measure(v, args.backend, args.tokens, args.runs, args.threads, args.prefill_tokens))
            for v in args.variants.split(",")]
    if args.json_line:
        print(json.dumps({"machine": machine(), "commit": commit(), "model": MODEL, "results": rows}))
        return 0
    print(f"Machine: {machine()}; commit {commit()}; {MODEL}; {args.tokens} tokens greedy (EOS ignored), "
          f"median of {args.runs} after 1 warm-up, one stream\n")
    print("| engine | weights | decode tok/s | TTFT ms | prefill tok/s (prompt) | load s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        kind, _, variant = r["variant"].partition("-")
        weights = {"llamacpp": "Q4_1 GGUF", "ortgenai": f"{variant} ONNX", "executorch": f"fp32 .pte ({variant})"}[kind]
        name = {"llamacpp": "llama.cpp", "ortgenai": "ORT GenAI", "executorch": "ExecuTorch"}[kind]
        engine = f"{name} {r['version']} ({r['backend']})".replace("  ", " ")
        prefill = f"{r['prefill_tps']} ({r['prefill_tokens']})" if r["prefill_tps"] else "-"
        print(f"| {engine} | {weights} | {r['decode_tps']} | {r['ttft_ms']} | {prefill} | {r['load_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
