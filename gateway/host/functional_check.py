"""Before an engine is trusted: load the model and generate one token, in a child process.

A driver that crashes, hangs or runs out of memory takes the child down, not the gateway;
the pool then falls back to the next candidate with the reason. Results are cached per
(model file, runtime build, device, driver), so a host pays for each check once.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engines.base import EngineConfig, GenerationRequest, SamplingParams

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


async def one_token(engine: Any) -> str:
    """Generate exactly one token greedily; raises whatever the engine raises."""
    req = GenerationRequest(
        request_id="functional-check",
        sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prompt=PROMPT,
    )
    text = ""
    got = False
    async for ev in engine.generate(req):
        text += ev.text
        got = got or bool(ev.token_ids) or bool(ev.text)
    if not got:
        raise RuntimeError("the engine produced no token")
    return text


class CheckCache:
    """A JSON file of results keyed by a fingerprint of everything that can change them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> CheckResult | None:
        item = self._read().get(key)
        if not isinstance(item, dict):
            return None
        if not item.get("ok") and time.time() - item.get("at", 0) > FAILURE_TTL_S:
            return None
        return CheckResult(bool(item.get("ok")), item.get("reason", ""), item.get("seconds", 0.0), "", True,
                           item.get("tok_s"))

    def put(self, key: str, result: CheckResult, what: str) -> None:
        data = self._read()
        old = data.get(key)
        before: dict[str, Any] = old if isinstance(old, dict) else {}
        data[key] = {"ok": result.ok, "reason": result.reason, "seconds": round(result.seconds, 2),
                     "at": time.time(), "what": what}
        tok_s = result.tok_s if result.tok_s is not None else (before.get("tok_s") if result.ok else None)
        if tok_s is not None:  # a passing re-check keeps the speed measured before
            data[key]["tok_s"] = round(tok_s, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def entries(self) -> dict[str, Any]:
        return self._read()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def fingerprint(runtime: str, config: EngineConfig, build: str, driver: str) -> str:
    try:
        st = os.stat(config.model_path)
        model = f"{config.model_path}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        model = config.model_path
    raw = "|".join((runtime, config.backend, config.device, config.device_key, model, build, driver))
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def run_isolated(runtime: str, config: EngineConfig, timeout: float, env: dict[str, str] | None = None) -> CheckResult:
    """The check in a child process; any failure, hang or crash becomes a reason."""
    payload = json.dumps({"runtime": runtime, "config": asdict(config)})
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
        return CheckResult(bool(out.get("ok")), out.get("reason", ""), dt, out.get("text", ""))
    tail = proc.stderr.strip().splitlines()[-3:]
    return CheckResult(False, f"functional check failed (exit {proc.returncode}): {' | '.join(tail)}", dt)


async def _child(runtime: str, config: EngineConfig) -> dict[str, Any]:
    from engines.registry import create_engine

    engine = create_engine(runtime, config)
    try:
        await engine.load()
        text = await one_token(engine)
        return {"ok": True, "text": text}
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        await engine.close()


if __name__ == "__main__":
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    arg = json.loads(sys.argv[1])
    result = asyncio.run(_child(arg["runtime"], EngineConfig(**arg["config"])))
    print(json.dumps(result), flush=True)
