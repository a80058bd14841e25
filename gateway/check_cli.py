"""`gateway check MODEL`: what a model really does here (gateway/api/capabilities.py), asked of the
running gateway, or of one started for the check and stopped after it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from gateway.host.ports import free_port

CHECK_TIMEOUT_S = 900.0  # a first load (a build's functional check) and the probes on a CPU


def add_parser(sub: Any) -> None:
    c = sub.add_parser("check", help="probe what a model really does here: tool calls (one, parallel, streamed), "
                       "tool_choice required and named, JSON schema output, stop strings, reasoning on and off")
    c.add_argument("model", help="the model's id (as `gateway ls` shows it)")
    c.add_argument("--url", default=None, help="the gateway to ask (default: this host's; one is started for the "
                   "check when none answers)")
    c.add_argument("--config", default=None, help="models.yaml path (for a gateway started for the check)")
    c.set_defaults(func=run)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=3.0).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def run(args: argparse.Namespace) -> int:
    import httpx

    from gateway.cli import _default_url

    url = (args.url or _default_url()).rstrip("/")
    server = None
    if not _answers(url):
        if args.url:
            print(f"error: no gateway answers at {url}", file=sys.stderr)
            return 2
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if args.config:
            cmd += ["--config", args.config]
        print(f"no gateway at {url}: starting one on port {port} for the check", file=sys.stderr)
        server = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _answers(url):
            if server.poll() is not None or time.monotonic() > deadline:
                err = server.stderr.read().decode(errors="replace")[-2000:] if server.stderr else ""
                server.kill()
                print(f"error: the gateway did not start: {err}", file=sys.stderr)
                return 2
            time.sleep(0.5)
    try:
        r = httpx.post(f"{url}/v1/checks/{args.model}", timeout=CHECK_TIMEOUT_S)
        body = r.json()
        if r.status_code != 200:
            print(f"error: {body.get('error', body)}", file=sys.stderr)
            return 2
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    _print(body)
    return 0


def _print(report: dict[str, Any]) -> None:
    print(f"{report['model']} (format {report['format']}): {report['summary']} in {report['seconds']:.0f} s")
    width = max(len(f["name"]) for f in report["findings"])
    for f in report["findings"]:
        mark = {True: "ok", False: "NOT OK", None: "n/a"}[f["ok"]]
        print(f"  {f['name']:<{width}}  {mark:<6}  {f['detail']}")
