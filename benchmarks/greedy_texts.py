"""Greedy answers of every engine on one model, through the HTTP API: a regression check that a
change (a refactor of the prompt path, the scheduler, an engine) left every engine's output as it
was. Run it on two checkouts and compare the files:

    python benchmarks/greedy_texts.py --out before.json            # at the old commit
    python benchmarks/greedy_texts.py --out after.json --compare before.json

Each engine is one `gateway serve` process (the checkout's own code, the default model pinned to
that runtime's converted artifact where it needs one); the chats cover plain turns, a system
prompt, several turns, tools (a JSON answer under the grammar) and a JSON response format.
Engines whose runtime or artifact is missing here are reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.host.ports import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
# (name, --engine, --runtime, converted format pin or None)
ENGINES: list[tuple[str, str, str, tuple[str, dict[str, str]] | None]] = [
    ("llamacpp/cpu", "cpu", "llamacpp", None),
    ("llamacpp/vulkan", "vulkan", "llamacpp", None),
    ("ortgenai/cpu", "cpu", "ortgenai", ("onnx", {"precision": "fp32", "provider": "cpu"})),
    ("executorch/xnnpack", "cpu", "executorch", ("pte", {"precision": "fp32", "provider": "xnnpack"})),
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a short story about a lighthouse."}]},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
     "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "Describe a cat as JSON with name and age."}],
     "response_format": {"type": "json_object"}},
]


def _config(runtime: str, pin: tuple[str, dict[str, str]] | None, where: Path) -> Path:
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec = next(m for m in data["models"] if m["id"] == MODEL)
    spec["runtimes"] = [runtime]
    if pin is not None:
        spec["formats"][pin[0]] = {"converted": pin[1]}
    data["models"], data["default"] = [spec], MODEL
    path = where / f"{runtime}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _answers(url: str, max_tokens: int) -> list[Any]:
    out: list[Any] = []
    for chat in CHATS:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                                                             **chat}, timeout=600)
        if r.status_code != 200:
            out.append({"status": r.status_code, "error": r.json().get("error", {}).get("message")})
            continue
        m = r.json()["choices"][0]["message"]
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or []]
        out.append({"content": m.get("content"), "tool_calls": calls})
    return out


def run_engine(name: str, engine: str, runtime: str, pin: tuple[str, dict[str, str]] | None, where: Path,
               max_tokens: int) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", engine, "--runtime", runtime, "--port", str(port),
           "--config", str(_config(runtime, pin, where))]
    log = where / f"{name.replace('/', '-')}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return {"skipped": f"the gateway exited ({proc.returncode}): {log.read_text()[-300:]}"}
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        first = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Hi"}]}, timeout=900)
        if first.status_code != 200:
            return {"skipped": first.json().get("error", {}).get("message", first.text)[:300]}
        return {"engine": first.headers.get("x-engine"), "answers": _answers(url, max_tokens)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where to write the answers (JSON)")
    ap.add_argument("--compare", help="an earlier run's file: exit 1 if any engine's answers differ")
    ap.add_argument("--engines", default=",".join(e[0] for e in ENGINES), help="which engines (names above)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    wanted = set(args.engines.split(","))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {"commit": commit, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, engine, runtime, pin in ENGINES:
            if name in wanted:
                results["engines"][name] = run_engine(name, engine, runtime, pin, Path(tmp), args.max_tokens)
                got = results["engines"][name]
                print(f"{name}: {'skipped: ' + got['skipped'] if 'skipped' in got else 'served by ' + str(got['engine'])}")
    Path(args.out).write_text(json.dumps(results, indent=1, ensure_ascii=False))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = 0
    for name, got in results["engines"].items():
        old = before["engines"].get(name)
        if old is None or "answers" not in old or "answers" not in got:
            print(f"{name}: not compared ({'skipped' if old is None or 'answers' not in old else 'skipped now'})")
            continue
        same = [a == b for a, b in zip(old["answers"], got["answers"], strict=True)]
        differ += not all(same)
        print(f"{name}: {sum(same)}/{len(same)} answers equal to {before['commit']}'s")
        for k, ok in enumerate(same):
            if not ok:
                print(f"  chat {k}: before {old['answers'][k]!r}\n          after  {got['answers'][k]!r}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
