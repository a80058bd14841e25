"""CPU prefill and decode speed per CPU variant of the llama.cpp build, with weight repacking on and off.

    .venv/bin/python benchmarks/bench_cpu_variants.py [--model PATH.gguf] [--rounds 3] [--prompt 480] [--tokens 64]

Each (variant, repacking) runs in its own child process (a process loads one CPU variant) through
the gateway's own llama.cpp engine: one warm-up request, then a greedy request of --prompt tokens
generating --tokens. Prefill = prompt tokens / time to the first token; decode = tokens after the
first / their time. Rounds alternate the order. A variant this CPU cannot run is listed as such; one
that crashes (AMX on Sapphire Rapids, llama.cpp issue 20824) is reported with its signal.
Prints a Markdown table with the machine, CPU, commit and build.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _text(n_items: int) -> str:
    return " ".join(f"Paragraph {i}: a lighthouse keeper writes down the weather, the ships and the tides."
                    for i in range(n_items))


async def _child(model: str, variant: str, repack: bool, prompt_tokens: int, tokens: int, threads: int) -> dict[str, Any]:
    from engines.base import GenerationRequest, SamplingParams
    from engines.llamacpp.runtime import LlamaCppOptions
    from engines.registry import create_engine

    eng = create_engine("llamacpp", LlamaCppOptions.engine_config(model_path=model, context_length=4096, parallel=1,
                                                                  n_batch=512, n_threads=threads, cpu_variant=variant,
                                                                  repack=repack))
    await eng.load()
    items = 1
    while len(await eng.tokenize(_text(items))) < prompt_tokens:
        items += 1
    prompt = _text(items)
    n_prompt = len(await eng.tokenize(prompt))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async for _ in eng.generate(GenerationRequest("warm", greedy, prompt="Warm up with a short prompt.")):
        pass
    t0 = time.perf_counter()
    stamps: list[float] = []
    req = GenerationRequest("bench", SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), prompt=prompt)
    async for ev in eng.generate(req):
        stamps += [time.perf_counter()] * len(ev.token_ids)
    await eng.close()
    return {"prompt_tokens": n_prompt, "prefill_tok_s": n_prompt / (stamps[0] - t0),
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "variant": eng.info.extra.get("cpu_variant")}


def _run(args: argparse.Namespace, variant: str, repack: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps([args.model, variant, repack, args.prompt, args.tokens, args.threads])]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if p.returncode < 0:
        return {"error": f"crashed ({signal.Signals(-p.returncode).name})"}
    try:
        return dict(json.loads(p.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF (default: the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=480)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--variants", default="", help="comma-separated (default: every one this CPU supports)")
    ap.add_argument("--repack", default="on,off")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(*json.loads(args.child)))), flush=True)
        return 0
    from engines.llamacpp.ggml_backends import AMX_VARIANTS, variants

    if not args.model:
        from gateway.models.registry import load_registry

        reg = load_registry(str(ROOT / "models.yaml"))
        args.model = str(reg.resolve(reg.models[reg.default], "gguf"))
    found = variants()
    if not found:
        print("this build has its CPU backend compiled in: no variants to compare", file=sys.stderr)
        return 1
    chosen = [v.name for v in found if v.score > 0 and (not args.variants or v.name in args.variants.split(","))]
    configs = [(v, r == "on") for v in chosen for r in args.repack.split(",")]
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for c in (configs if rnd % 2 == 0 else configs[::-1]):
            results[c].append(_run(args, *c))
            print(f"round {rnd + 1}: {c[0]} repack {'on' if c[1] else 'off'}: {results[c][-1]}", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    from engines.llamacpp.ggml_devices import build_report

    rep = build_report()
    print(f"Machine: {platform.node()}, {_cpu_model()}, {os.cpu_count()} logical CPUs; commit {commit}; "
          f"llama-cpp-python {rep.get('version')} build {rep.get('build_id')}; model {Path(args.model).name}, "
          f"{args.prompt}-token prompt, {args.tokens} tokens, median of {args.rounds} [min-max]")
    print("Unsupported here: " + (", ".join(v.name for v in found if v.score <= 0) or "none"))
    print()
    print("| CPU variant | repack | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|")

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]" if xs else "-"

    for (v, r), runs in results.items():
        ok = [x for x in runs if "error" not in x]
        errs = sorted({x["error"] for x in runs if "error" in x})
        tag = f"{v}{' (AMX)' if v in AMX_VARIANTS else ''}"
        if not ok:
            print(f"| {tag} | {'on' if r else 'off'} | {'; '.join(errs)} | |")
            continue
        note = f" ({len(errs)} runs: {'; '.join(errs)})" if errs else ""
        print(f"| {tag} | {'on' if r else 'off'} | {fmt([x['prefill_tok_s'] for x in ok])}{note} | "
              f"{fmt([x['decode_tok_s'] for x in ok])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
