"""Kills take nothing: streams through SIGKILLs of the worker from outside, one command.

    .venv/bin/python benchmarks/bench_chaos.py [--engine cpu] [--model ID | --gguf FILE]
        [--streams 8] [--max-tokens 160] [--kills 3] [--kill-gap 2] [--runs 1]
    .venv/bin/python benchmarks/bench_chaos.py --soak 1800 --kill-every 60 [--streams 4]

Starts `gateway serve` with its defaults (nothing tuned but what is asked here) and then:

- chaos (the default): --streams greedy streams of --max-tokens tokens (`ignore_eos`) start
  together; the model's worker is killed with SIGKILL --kills times, --kill-gap seconds apart, each
  time once /health reports the model ready again. Every stream must end whole: finish reason
  `length`, all its tokens, no error event, no 4xx/5xx. --runs repeats it on the same gateway.
- soak (--soak SECONDS): --streams clients send streams back to back for that long, each in turn
  OpenAI chat, OpenAI Responses, Anthropic Messages and Ollama chat, while the worker is killed
  every --kill-every seconds. A request the gateway accepted (200) must end with its protocol's
  last event and no error; refusals (429, 503 while draining) are counted apart.

Prints a Markdown table with the machine and commit; --json keeps every request's outcome. Exit
status 1 when any accepted request was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import _stop, _wait  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402

PROMPT = "Tell a long story about a lighthouse keeper and the ships she saw."
PROTOCOLS = ("openai", "responses", "anthropic", "ollama")


@dataclass
class Outcome:
    protocol: str
    status: int = 0
    tokens: int = 0  # text pieces received (each protocol's deltas)
    finish: str | None = None  # the protocol's stop reason on its last event
    error: str | None = None  # an error event, a broken stream, or the body of a refusal
    ended: bool = False  # the protocol's last event arrived
    seconds: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return self.status == 200

    def whole(self, max_tokens: int | None) -> bool:
        """Answered completely: the last event, no error (and, asked for, every token)."""
        if not (self.accepted and self.ended and self.error is None):
            return False
        if max_tokens is None:
            return True
        return self.finish == "length" and self.usage.get("completion_tokens") == max_tokens


def _request(protocol: str, url: str, model: str, max_tokens: int, ignore_eos: bool) -> tuple[str, dict[str, Any]]:
    msgs = [{"role": "user", "content": PROMPT}]
    if protocol == "openai":
        body: dict[str, Any] = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        return f"{url}/v1/chat/completions", body
    if protocol == "responses":
        return f"{url}/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": max_tokens,
                                        "temperature": 0, "stream": True, "store": False}
    if protocol == "anthropic":
        return f"{url}/v1/messages", {"model": model, "messages": msgs, "max_tokens": max_tokens,
                                       "temperature": 0, "stream": True}
    return f"{url}/api/chat", {"model": model, "messages": msgs, "stream": True,
                               "options": {"num_predict": max_tokens, "temperature": 0}}


def _read(protocol: str, line: str, out: Outcome) -> None:
    """One line of a stream into the outcome (SSE `data:` lines, or Ollama's NDJSON)."""
    if protocol == "ollama":
        if not line.strip():
            return
        ev = json.loads(line)
        if "error" in ev:
            out.error = str(ev["error"])
        elif ev.get("done"):
            out.ended, out.finish = True, ev.get("done_reason")
            out.usage = {"completion_tokens": ev.get("eval_count")}
        elif ev.get("message", {}).get("content"):
            out.tokens += 1
        return
    if not line.startswith("data: ") or line == "data: [DONE]":
        out.ended = out.ended or (line == "data: [DONE]")
        return
    ev = json.loads(line[6:])
    kind = ev.get("type", "")
    if "error" in ev and (protocol == "openai" or kind == "error"):
        out.error = json.dumps(ev["error"])[:500]
    elif protocol == "openai":
        if ev.get("usage"):
            out.usage = ev["usage"]
        for c in ev.get("choices", []):
            out.tokens += bool(c["delta"].get("content"))
            out.finish = c.get("finish_reason") or out.finish
    elif protocol == "responses":
        out.tokens += kind == "response.output_text.delta"
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            r = ev["response"]
            out.ended = kind != "response.failed"
            out.error = json.dumps(r.get("error"))[:500] if kind == "response.failed" else None
            out.finish = "length" if (r.get("incomplete_details") or {}).get("reason") == "max_output_tokens" else "stop"
            out.usage = {"completion_tokens": (r.get("usage") or {}).get("output_tokens")}
    elif protocol == "anthropic":
        out.tokens += kind == "content_block_delta"
        if kind == "message_delta":
            reason = ev["delta"].get("stop_reason")
            out.finish = "length" if reason == "max_tokens" else reason
            out.usage = {"completion_tokens": ev.get("usage", {}).get("output_tokens")}
        out.ended = out.ended or kind == "message_stop"


def stream(protocol: str, url: str, model: str, max_tokens: int, ignore_eos: bool) -> Outcome:
    out = Outcome(protocol)
    target, body = _request(protocol, url, model, max_tokens, ignore_eos)
    t0 = time.perf_counter()
    try:
        with httpx.stream("POST", target, json=body, timeout=httpx.Timeout(600, connect=30)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")[:500]
            else:
                for line in r.iter_lines():
                    _read(protocol, line, out)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.seconds = time.perf_counter() - t0
    return out


def _health(url: str, model: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{url}/health", timeout=10).json().get("models", {}).get(model, {}))
    except (httpx.HTTPError, ValueError):
        return {}


def _ready_pid(url: str, model: str, other_than: int | None, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _health(url, model)
        pid = m.get("worker", {}).get("pid")
        if pid and m.get("ready") and pid != other_than:
            return int(pid)
        time.sleep(0.1)
    raise RuntimeError("the model's worker did not come back")


def kill_worker(url: str, model: str) -> int:
    """SIGKILL the ready worker; wait until a new one is ready. The pid killed."""
    pid = _ready_pid(url, model, None)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone by itself in between (the gateway's watchdog): it comes back all the same
    _ready_pid(url, model, pid)
    return pid


def chaos(url: str, model: str, args: argparse.Namespace) -> list[Outcome]:
    outs: list[Outcome | None] = [None] * args.streams

    def run(i: int) -> None:
        outs[i] = stream("openai", url, model, args.max_tokens, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.first_kill)
    for _ in range(args.kills):
        kill_worker(url, model)
        time.sleep(args.kill_gap)
    for t in threads:
        t.join()
    return [o for o in outs if o is not None]


def soak(url: str, model: str, args: argparse.Namespace) -> tuple[list[Outcome], int]:
    outs: list[Outcome] = []
    lock = threading.Lock()
    end = time.monotonic() + args.soak
    kills = 0

    def client(i: int) -> None:
        k = i
        while time.monotonic() < end:
            o = stream(PROTOCOLS[k % len(PROTOCOLS)], url, model, args.max_tokens, ignore_eos=False)
            k += 1
            with lock:
                outs.append(o)
            if o.status in (429, 503):
                time.sleep(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    while time.monotonic() + args.kill_every < end:
        time.sleep(args.kill_every)
        kill_worker(url, model)
        kills += 1
    for t in threads:
        t.join()
    return outs, kills


def _machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.splitlines() if _has("nvidia-smi") else []
    return f"{cpu}, {os.cpu_count()} threads" + (f"; {gpu[0]}" if gpu else "")


def _has(cmd: str) -> bool:
    return any((Path(p) / cmd).exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def _serve(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", args.engine, "--port", str(port)]
    model = args.model
    if args.gguf:
        import yaml

        model = Path(args.gguf).stem.lower()
        cfg = Path(tempfile.mkdtemp()) / "models.yaml"
        spec: dict[str, Any] = {"id": model, "formats": {"gguf": {"path": str(Path(args.gguf).resolve())}}}
        if args.context:
            spec["context_length"] = args.context
        cfg.write_text(yaml.safe_dump({"default": model, "models": [spec]}))
        cmd += ["--config", str(cfg)]
    cmd += ["--model", model] if model else []
    cmd += args.serve_args
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, timeout=900)
    if not model:
        model = next(iter(httpx.get(f"{url}/health", timeout=10).json()["models"]))
    return proc, url, model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="cpu")
    ap.add_argument("--model", default=None, help="a models.yaml id (default: its default model)")
    ap.add_argument("--gguf", default=None, help="serve this GGUF file instead")
    ap.add_argument("--context", type=int, default=None, help="--gguf's context length")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kill-gap", type=float, default=2.0)
    ap.add_argument("--first-kill", type=float, default=2.0, help="seconds after the streams start")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of mixed streams instead of chaos runs")
    ap.add_argument("--kill-every", type=float, default=60.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("serve_args", nargs="*", help="after --: more `gateway serve` flags")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "gateway.log"
    proc, url, model = _serve(args, log)
    runs: list[dict[str, Any]] = []
    try:
        if args.soak:
            outs, kills = soak(url, model, args)
            runs.append({"kills": kills, "outcomes": outs})
        else:
            for i in range(args.runs):
                outs = chaos(url, model, args)
                runs.append({"kills": args.kills, "outcomes": outs})
                whole = sum(o.whole(args.max_tokens) for o in outs)
                print(f"run {i + 1}: {whole}/{len(outs)} whole", file=sys.stderr, flush=True)
    finally:
        _stop(proc)
    return _report(args, model, runs, log)


def _report(args: argparse.Namespace, model: str, runs: list[dict[str, Any]], log: Path) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    want = None if args.soak else args.max_tokens
    lost = 0
    what = (f"soak {args.soak:.0f} s, {args.streams} clients, a kill every {args.kill_every:.0f} s" if args.soak
            else f"{args.streams} streams of {args.max_tokens} tokens, {args.kills} kills {args.kill_gap:.0f} s apart")
    print(f"\nKills from outside, {model} on {args.engine}; {_machine()}; commit {commit}; {what}\n")
    print("| run | kills | requests | accepted | answered whole | refused (429/503) | lost | failovers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(runs):
        outs: list[Outcome] = r["outcomes"]
        acc = [o for o in outs if o.accepted]
        whole = sum(o.whole(want) for o in acc)
        # A chaos run asks for no refusal at all; a soak counts them apart (the overload rule at work).
        refused = sum(o.status in (429, 503) for o in outs) if args.soak else 0
        other = len(outs) - len(acc) - refused
        lost += len(acc) - whole + other
        fo = sum(int(o.usage.get("failovers") or 0) for o in acc)
        print(f"| {i + 1} | {r['kills']} | {len(outs)} | {len(acc)} | {whole} | {refused} | {len(acc) - whole + other} | {fo} |")
    for r in runs:
        for o in r["outcomes"]:
            if not (args.soak and o.status in (429, 503)) and not o.whole(want):
                print(f"not whole: {o}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "commit": commit, "machine": _machine(), "args": {k: v for k, v in vars(args).items()},
            "runs": [{"kills": r["kills"], "outcomes": [asdict(o) for o in r["outcomes"]]} for r in runs]}, indent=1))
    if lost:
        print(f"gateway log: {log}", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
