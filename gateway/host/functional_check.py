"""Before an engine is trusted: load the model and run what requests run, in a child process.

The check (`exercise`) takes the paths real requests take, not one token after "Hello": prompts
of a few hundred, ~130 and a few tokens (ggml's batched matrix kernels — AMX, repacked weights —
only run on batches, and a one-token prompt never reaches them), decoding at the engine's
parallel sequence count, a grammar-constrained request and one with logprobs, then a prompt
that extends a cached prefix. It costs about a second of prefill on 2 cores for the default model.

A driver that crashes, hangs or runs out of memory takes the child (or the worker) down, not the
gateway; the pool then tries the next rung of the fallback ladder with the reason. Results are
cached per (model file, runtime build, CPU variant, repacking, device, driver, CPU), so a host
pays for each check once.

`python -m gateway.host.functional_check '<json>'` is the child: it prints one JSON line.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from engines.base import Constraint, EngineConfig, GenerationRequest, ModelLoadError, SamplingParams
from engines.runtimes import option_values, with_option_values
from gateway.host.jsonfile import JsonFile

log = logging.getLogger(__name__)

FAILURE_TTL_S = 24 * 3600  # a failure is retried after a day (or with --recheck)
PROMPT = "Hello"


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    reason: str = ""
    seconds: float = 0.0
    text: str = ""
    cached: bool = False
    tok_s: float | None = None  # measured decode speed (--rank-by-speed), when measured
    note: str = ""  # a cached failure: when it is tried again
    # "load": the engine could not load (a missing device, a bad file) without crashing; other ways
    # to run the same candidate (the fallback ladder) would fail alike, so they are skipped.
    stage: str = ""


SPEED_TOKENS = 32  # tokens decoded to measure an engine's speed


async def measure_decode(engine: Any, tokens: int = SPEED_TOKENS) -> float:
    """Single-stream greedy decode speed in tokens/s, from the first token to the last."""
    req = GenerationRequest(
        request_id="speed-check",
        sampling=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
        prompt=PROMPT,
    )
    stamps: list[float] = []
    async for ev in engine.generate(req):
        if ev.token_ids:
            stamps.extend([time.perf_counter()] * len(ev.token_ids))
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        raise RuntimeError("too few tokens to measure a decode speed")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _text(items: int) -> str:
    """A deterministic paragraph of about 16 tokens per item."""
    return " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog and counts to {i * 7}."
                    for i in range(1, items + 1))


async def _run(engine: Any, req: GenerationRequest) -> str:
    text, got = "", False
    async for ev in engine.generate(req):
        text += ev.text
        got = got or bool(ev.token_ids) or bool(ev.text)
    if not got:
        raise RuntimeError(f"the engine produced no token (the check's {req.request_id} request)")
    return text


async def exercise(engine: Any, parallel: int = 1, context_length: int = 2048, light: bool = False) -> str:
    """The functional check's work: the request shapes serving will see, at once. Raises whatever
    the engine raises; returns the long prompt's text.

    `light` (GPU devices): prompts of ~30 and ~16 tokens instead of ~380 and ~130. A GPU's batched
    paths are exercised all the same, and a software Vulkan device (lavapipe) would otherwise spend
    minutes compiling pipelines for shapes the check does not need."""
    from engines.base import InvalidGenerationRequest

    items = max(2, min(2 if light else 24, context_length // 48))  # ~380 tokens with a 2k context; always fits
    long = _text(items)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reqs = [
        GenerationRequest("check-long", greedy, prompt=long),
        GenerationRequest("check-logprobs", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                           logprobs=True, top_logprobs=2), prompt=_text(max(1, items // 3))),
        GenerationRequest("check-grammar", SamplingParams(temperature=0.0, max_tokens=6, constraint=Constraint("json")),
                          prompt=PROMPT),
    ]
    reqs += [GenerationRequest(f"check-{i}", SamplingParams(temperature=0.8, seed=i, max_tokens=4, ignore_eos=True),
                               prompt=f"{PROMPT} {i}") for i in range(max(1, parallel - len(reqs) + 1))]

    slots = asyncio.Semaphore(max(1, parallel))  # at most the engine's sequences at once: none waits in its queue

    async def one(req: GenerationRequest) -> str:
        try:
            async with slots:
                return await _run(engine, req)
        except InvalidGenerationRequest:
            if req.request_id in ("check-grammar", "check-logprobs"):
                return ""  # an engine without grammars or logprobs says so per request; not a failure
            raise

    texts = await asyncio.gather(*(one(r) for r in reqs))
    # The same long prompt extended: a prefix-cache hit, then a short batch after it.
    await _run(engine, GenerationRequest("check-prefix", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                         prompt=long + " " + _text(1)))
    return texts[0]


async def one_token(engine: Any) -> str:
    """Generate exactly one token greedily; raises whatever the engine raises."""
    req = GenerationRequest(
        request_id="functional-check",
        sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prompt=PROMPT,
    )
    return await _run(engine, req)


class CheckCache(JsonFile):
    """A JSON file of results keyed by a fingerprint of everything that can change them."""

    def get(self, key: str) -> CheckResult | None:
        item = self.read().get(key)
        if not isinstance(item, dict):
            return None
        ttl = float(item.get("ttl", FAILURE_TTL_S))
        age = time.time() - item.get("at", 0)
        if not item.get("ok") and age > ttl:
            return None
        note = ""
        if not item.get("ok") and "ttl" in item:
            note = f"recorded {age / 60:.0f} min ago, tried again {max(0.0, ttl - age) / 60:.0f} min from now or with --recheck"
        return CheckResult(bool(item.get("ok")), item.get("reason", ""), item.get("seconds", 0.0), "", True,
                           item.get("tok_s"), note, item.get("stage", ""))

    def put(self, key: str, result: CheckResult, what: str, ttl: float | None = None) -> None:
        """Record `result`; a failure with `ttl` (seconds) expires sooner than a failed check does."""
        old = self.read().get(key)
        before: dict[str, Any] = old if isinstance(old, dict) else {}
        item: dict[str, Any] = {"ok": result.ok, "reason": result.reason, "seconds": round(result.seconds, 2),
                                "at": time.time(), "what": what}
        if ttl is not None and not result.ok:
            item["ttl"] = ttl
        if result.stage and not result.ok:
            item["stage"] = result.stage
        tok_s = result.tok_s if result.tok_s is not None else (before.get("tok_s") if result.ok else None)
        if tok_s is not None:  # a passing re-check keeps the speed measured before
            item["tok_s"] = round(tok_s, 1)
        self.set(key, item)


def fingerprint(runtime: str, config: EngineConfig, build: str, driver: str) -> str:
    try:
        st = os.stat(config.model_path)
        model = f"{config.model_path}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        model = config.model_path
    # The rung of llama.cpp's fallback ladder (its CPU variant and repacking): a verdict holds for
    # one rung. Other runtimes' configs read as llama.cpp's defaults here, as they always have.
    opts = option_values(config) or {}
    raw = "|".join((runtime, config.backend, config.device, config.device_key, model, build, driver,
                    f"variant={opts.get('cpu_variant', '')}", f"repack={opts.get('repack', True)}"))
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def run_isolated(runtime: str, config: EngineConfig, timeout: float, env: dict[str, str] | None = None) -> CheckResult:
    """The check in a child process; any failure, hang or crash becomes a reason."""
    # The options travel as plain values beside the config, validated again in the child.
    payload = json.dumps({"runtime": runtime, "config": asdict(replace(config, options=None)),
                          "options": option_values(config)})
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.host.functional_check", payload],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return CheckResult(False, f"functional check did not finish within {timeout:.0f}s", time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        tail = proc.stderr.strip().splitlines()[-3:]
        return CheckResult(False, f"functional check crashed ({sig}): {' | '.join(tail)}", dt)
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            out = json.loads(line)
        except ValueError:
            continue
        return CheckResult(bool(out.get("ok")), out.get("reason", ""), dt, out.get("text", ""), stage=out.get("stage", ""))
    tail = proc.stderr.strip().splitlines()[-3:]
    return CheckResult(False, f"functional check failed (exit {proc.returncode}): {' | '.join(tail)}", dt)


async def _child(runtime: str, config: EngineConfig, options: dict[str, Any] | None = None) -> dict[str, Any]:
    from engines.registry import create_engine

    try:
        config = with_option_values(runtime, config, options)
    except ModelLoadError as exc:
        return {"ok": False, "reason": f"ModelLoadError: {exc}", "stage": "load"}
    engine = create_engine(runtime, config)
    stage = "load"
    try:
        await engine.load()
        stage = ""
        text = await exercise(engine, config.parallel, config.context_length, light=config.backend != "cpu")
        return {"ok": True, "text": text}
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "stage": stage}
    finally:
        await engine.close()


if __name__ == "__main__":
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    arg = json.loads(sys.argv[1])
    result = asyncio.run(_child(arg["runtime"], EngineConfig(**arg["config"]), arg.get("options")))
    print(json.dumps(result), flush=True)
