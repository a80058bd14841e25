"""`gateway serve --cluster ray` on a host with no Ray cluster: it starts a private one (token
authentication on, loopback only), serves the API through Serve, and on SIGTERM deletes the
application and stops Ray, leaving no Ray process behind.

Runs after tests/test_cluster.py has stopped its cluster (`--cluster ray` would join a running one).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, wait_for

pytest.importorskip("ray", reason="the `cluster` extra (ray[serve]) is not installed")


def _ray_processes(session: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", session], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln]


def _listener(port: int) -> str:
    """The command line of the process listening on TCP `port` (from /proc: no tool needed)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            if any(f"socket:[{i}]" in links for i in inodes):
                return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
    return ""


def test_the_api_port_goes_to_the_ingress_only_where_the_cluster_gave_it_that_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cluster.runtime import http_options, ingress_port_first

    for k in [k for k in os.environ if k.startswith("RAY_")]:
        monkeypatch.delenv(k)
    # Serve's defaults (no direct ingress): its proxy answers on the API's port.
    assert http_options("127.0.0.1", 8080) == {"host": "127.0.0.1", "port": 8080}
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    assert http_options("127.0.0.1", 8080)["port"] == 8080  # the ingress's ports are Serve's 30000-31000
    ingress_port_first(8080)
    assert (os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) \
        == ("8080", "8081")
    moved = http_options("127.0.0.1", 8080)
    assert moved["host"] == "127.0.0.1" and moved["port"] != 8080  # the proxy steps aside
    assert http_options("127.0.0.1", 9090)["port"] == 9090  # another API port: not the ingress's
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert http_options("127.0.0.1", 8080)["port"] == 8080
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    assert http_options("127.0.0.1", 8080)["port"] == 8080


def test_serve_cluster_ray_starts_and_stops_a_private_cluster(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # A short directory of its own: Ray's socket paths must stay under 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rg-", dir="/tmp"))
    env.update(GATEWAY_THREADS="1", RAY_TMPDIR=str(ray_tmp))
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--cluster", "ray", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_for(f"http://127.0.0.1:{port}/health", 240, alive=lambda: proc.poll() is None), log.read_text()[-3000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6})
        assert r.status_code == 200, r.text
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["models"]["smollm2-135m-instruct"]["cluster"]["replicas"]
        # Clients reach the ingress replica itself, not through Serve's proxy.
        assert "ServeReplica:gateway:gateway" in _listener(port), _listener(port)
        text = log.read_text()
        assert "without token authentication" not in text  # the private cluster has it on
        session_dirs = list(ray_tmp.glob("ray/session_*"))
        assert session_dirs, "Ray did not use RAY_TMPDIR"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        assert not _ray_processes(str(ray_tmp)), "Ray processes outlived the gateway"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
