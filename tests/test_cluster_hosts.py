"""Ray Serve across two network hosts: two network namespaces of this machine, each with its own
address on a veth pair, joined by the commands of docs/deploy.md (`ray start --head` on the head,
`ray start --address` on the worker, `gateway serve --cluster ray` on the head). Streams run on
both hosts' replicas; the worker host then disappears (every process in its namespace killed, the
namespace and its link removed) and its streams go on from the head host's replica.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) for `ip netns`: skipped, with the reason, where
namespaces cannot be made.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.test_cluster import MODEL, MODELS_YAML, assert_streams_finished, poll, stream_events

pytest.importorskip("ray", reason="the `cluster` extra (ray[serve]) is not installed")

ROOT = Path(__file__).resolve().parent.parent
TAG = f"gw{os.getpid() % 10000}"
HEAD_NS, WORKER_NS = f"{TAG}h", f"{TAG}w"
HEAD_IP, WORKER_IP, CLIENT_IP, API_IP = "10.211.0.1", "10.211.0.2", "10.211.1.1", "10.211.1.2"
PORT = 8080
# test_cluster's model, two replicas: one on each host.
_CONFIG = yaml.safe_load(MODELS_YAML)
_CONFIG["models"][0]["replicas"] = {"min": 2, "max": 2, "max_per_node": 1}


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=120)


def _namespaces_possible() -> str:
    """"" when network namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"{TAG}p"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode:
        return f"network namespaces cannot be made here (`ip netns add`: {r.stderr.strip()})"
    sh("ip", "netns", "del", probe, check=False)
    return ""


WHY_NOT = _namespaces_possible()
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT), pytest.mark.timeout(900)]


def _network() -> None:
    """Two hosts on one link (head, worker), and the head's API reachable from this namespace."""
    for ns in (HEAD_NS, WORKER_NS):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", f"{TAG}a", "type", "veth", "peer", "name", f"{TAG}b")
    sh("ip", "link", "set", f"{TAG}a", "netns", HEAD_NS)
    sh("ip", "link", "set", f"{TAG}b", "netns", WORKER_NS)
    sh("ip", "-n", HEAD_NS, "addr", "add", f"{HEAD_IP}/24", "dev", f"{TAG}a")
    sh("ip", "-n", WORKER_NS, "addr", "add", f"{WORKER_IP}/24", "dev", f"{TAG}b")
    sh("ip", "-n", HEAD_NS, "link", "set", f"{TAG}a", "up")
    sh("ip", "-n", WORKER_NS, "link", "set", f"{TAG}b", "up")
    sh("ip", "link", "add", f"{TAG}c", "type", "veth", "peer", "name", f"{TAG}d")
    sh("ip", "link", "set", f"{TAG}d", "netns", HEAD_NS)
    sh("ip", "addr", "add", f"{CLIENT_IP}/24", "dev", f"{TAG}c")
    sh("ip", "link", "set", f"{TAG}c", "up")
    sh("ip", "-n", HEAD_NS, "addr", "add", f"{API_IP}/24", "dev", f"{TAG}d")
    sh("ip", "-n", HEAD_NS, "link", "set", f"{TAG}d", "up")


def _remove(ns: str) -> None:
    """A host gone: every process in the namespace killed, then the namespace. Its end of the link
    goes back to this namespace, down, first: deleting a veth's end deletes its peer, and the head's
    end holds the head's address (its GCS would lose its socket)."""
    pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    if ns == WORKER_NS:
        sh("ip", "-n", ns, "link", "set", f"{TAG}b", "down", check=False)
        sh("ip", "-n", ns, "link", "set", f"{TAG}b", "netns", "1", check=False)
    sh("ip", "netns", "del", ns, check=False)


def _in(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


class Hosts:
    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.url = f"http://{API_IP}:{PORT}"
        self.gateway: subprocess.Popen[bytes] | None = None
        self.log: Any = None

    def ray(self, ns: str, *args: str) -> None:
        r = subprocess.run(_in(ns, str(Path(sys.executable).parent / "ray"), *args), env=self.env, cwd=self.tmp,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"ray {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    def model(self) -> dict[str, Any]:
        m: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10).json()["models"][MODEL]
        return m

    def replicas(self) -> dict[str, Any]:
        r: dict[str, Any] = self.model().get("cluster", {}).get("replicas", {})
        return r

    def wait(self, what: str, cond: Any, timeout: float) -> None:
        if poll(cond, timeout, 0.5, (httpx.HTTPError, KeyError, ValueError)):
            return
        log = (self.tmp / "gateway.log").read_text()[-3000:]
        try:
            seen = httpx.get(f"{self.url}/health", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            seen = {"unreachable": str(exc)}
        raise AssertionError(f"{what} within {timeout}s; /health: {seen}; gateway log:\n{log}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("hosts")
    (tmp / "models.yaml").write_text(yaml.safe_dump(_CONFIG))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(PORT), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(PORT + 1),
           "RAY_SERVE_PORT_QUARANTINE_S": "0", "GATEWAY_THREADS": "1", "PYTHONPATH": str(ROOT), "GATEWAY_CONFIG": str(tmp / "models.yaml")}
    h = Hosts(tmp, env)
    _network()
    try:
        # docs/deploy.md's commands, with these hosts' addresses.
        h.ray(HEAD_NS, "start", "--head", "--node-ip-address", HEAD_IP, "--port", "6379", "--dashboard-host",
              "127.0.0.1")
        h.ray(WORKER_NS, "start", "--address", f"{HEAD_IP}:6379", "--node-ip-address", WORKER_IP)
        h.log = open(tmp / "gateway.log", "w")  # noqa: SIM115 - closed at teardown
        h.gateway = subprocess.Popen(_in(HEAD_NS, sys.executable, "-m", "gateway.cli", "serve", "--cluster", "ray",
                                         "--host", API_IP, "--port", str(PORT)),
                                     env={**env, "RAY_ADDRESS": f"{HEAD_IP}:6379"}, cwd=ROOT, stdout=h.log,
                                     stderr=subprocess.STDOUT)
        h.wait("the gateway up with its two replicas running",
               lambda: h.model()["cluster"]["deployment"].get("replicas", {}).get("RUNNING", 0) == 2, 300)
        yield h
    finally:
        if h.gateway is not None:
            h.gateway.terminate()
            try:
                h.gateway.wait(60)
            except subprocess.TimeoutExpired:
                h.gateway.kill()
        subprocess.run(_in(HEAD_NS, str(Path(sys.executable).parent / "ray"), "stop", "--force"), env=env,
                       capture_output=True, timeout=120, check=False)
        for ns in (WORKER_NS, HEAD_NS):
            _remove(ns)
        sh("ip", "link", "del", f"{TAG}c", check=False)
        sh("ip", "link", "del", f"{TAG}b", check=False)
        if h.log is not None:
            h.log.close()


def test_streams_go_on_when_the_worker_host_disappears(hosts: Hosts) -> None:
    results: list[list[Any]] = []
    threads = [threading.Thread(target=lambda i=i: results.append(stream_events(hosts.url, {
        "messages": [{"role": "user", "content": f"Tell me everything about topic {i}."}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True}, timeout=300)), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    hosts.wait("streams on the worker host", lambda: any(
        v["running"] > 0 and v["node"].startswith(f"{WORKER_IP}/") for v in hosts.replicas().values()), 120)
    # One replica on each host (Serve placed them; max_per_node: 1).
    assert {v["node"].split("/")[0] for v in hosts.replicas().values()} == {HEAD_IP, WORKER_IP}, hosts.replicas()
    time.sleep(1.0)
    _remove(WORKER_NS)
    for t in threads:
        t.join(400)
    assert_streams_finished(results, 4)
    for r in results:
        assert sum(1 for e in r if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content"))
    metrics = httpx.get(f"{hosts.url}/metrics", timeout=10).text
    assert f'gateway_failovers_total{{model="{MODEL}",reason="restarted"}}' in metrics, "no stream ran on the lost host"
    assert f'gateway_replica_lost_requests_total{{model="{MODEL}"' in metrics
    # The head host serves on.
    r = httpx.post(f"{hosts.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Are you still there?"}]})
    assert r.status_code == 200, r.text
