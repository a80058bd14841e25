"""`gateway serve --cluster ray[://ADDRESS]`: join (or start) Ray, run the application, drain on a signal.

- `ray`: join the Ray cluster this host belongs to (`ray start` ran here, or RAY_ADDRESS names the
  head); when there is none, start a one-host cluster with no dashboard, bound to loopback.
- Token authentication is on (RAY_AUTH_MODE=token; the token from RAY_AUTH_TOKEN or
  ~/.ray/auth_token, generated for a new local cluster) unless RAY_AUTH_MODE says otherwise.
- `ray://HOST:PORT`: Ray Client to a remote head.

Ray's ports run code for whoever can reach them; this module refuses nothing, but says so when the
cluster it joined has token authentication off (RAY_AUTH_MODE != token).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
from pathlib import Path

from gateway.host.ports import free_port
from gateway.models.registry import Registry
from gateway.settings import Settings

log = logging.getLogger(__name__)


def running_cluster() -> str | None:
    """The GCS address of the Ray cluster this host belongs to: RAY_ADDRESS, or the one `ray start`
    recorded in Ray's temp directory if it answers; None when there is none."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    base = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "ray_current_cluster"
    try:
        address = base.read_text().strip()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=1):
            return address
    except (OSError, ValueError):
        return None


def connect(cluster: str) -> bool:
    """Connect this process to Ray; True when it started a new local cluster (to stop on exit)."""
    # Token authentication unless told otherwise (RAY_AUTH_MODE=disabled joins an open cluster, with
    # a warning). Ray reads it when it is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if cluster != "ray" and not cluster.startswith("ray://"):
        raise ValueError(f"--cluster {cluster!r}: expected 'ray' or 'ray://HOST:PORT'")
    address = cluster if cluster.startswith("ray://") else running_cluster()
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        started = False
    else:
        # No cluster on this host: a private one, reachable from loopback only.
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
        started = True
    if os.environ.get("RAY_AUTH_MODE", "disabled") != "token":
        log.warning("this Ray cluster runs without token authentication (RAY_AUTH_MODE=token on every node "
                    "turns it on): anyone who can reach its ports can run code on its nodes")
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call, unused-ignore]
    log.info("Ray cluster: %d node(s), resources %s", len(nodes),
             ray.cluster_resources())  # type: ignore[no-untyped-call, unused-ignore]
    return started


def ingress_port_first(port: int) -> None:
    """Before Ray starts: the ingress replica answers clients on `port` itself (Serve's direct ingress
    given a range of one port), unless the environment says otherwise.

    In throughput mode the ingress replica runs an HTTP server of its own on a port of
    RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT, while Serve's proxy, on the port given to
    `serve.start`, answers clients by forwarding to it: one more process between the client and
    the tokens (2-core Xeon, default model: the Serve path went from 0.82-0.84x to 0.86-0.90x the
    direct one, docs/benchmarks/history.md#the-serve-path-without-serves-proxy). Without quarantine
    for that one port, a replaced ingress takes it again at once."""
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port))
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(port + 1))  # the end is not in it
    os.environ.setdefault("RAY_SERVE_PORT_QUARANTINE_S", "0")


def http_options(host: str, port: int) -> dict[str, object]:
    """Serve's http_options for an API on host:port. Where the ingress replica itself listens on that
    port (`ingress_port_first`, or `ray start` given the same range of one port), Serve's proxy
    goes to a free port of its own: clients reach the ingress with no proxy between."""
    env = os.environ
    direct = (env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1" and env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "0") \
        or env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
    own = (env.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"), env.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")) \
        == (str(port), str(port + 1))
    if direct and own and env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return {"host": host, "port": free_port(host)}
    return {"host": host, "port": port}


def serve_on_ray(settings: Settings, registry: Registry, cluster: str) -> int:
    """Run the gateway's Serve application until SIGTERM/SIGINT, then delete it (replicas drain)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # before Ray is imported: it reads it then
    if cluster == "ray" and running_cluster() is None:
        # A private cluster runs in Ray Serve's throughput mode (direct ingress, gRPC between replicas,
        # user code on each replica's own loop): on the 2-core CPU, a tiny model at 16 streams went
        # through the Serve path 1.4-1.5x faster with it (docs/benchmarks/history.md#the-serve-path-at-many-streams).
        # Every process of the cluster must see it, so it is set before Ray starts; a cluster of
        # `ray start` has it from the environment of those commands (docs/deploy.md).
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
        ingress_port_first(settings.port)
    import ray
    from ray import serve

    from gateway.cluster.app import INGRESS_APP, build_application

    started = connect(cluster)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=http_options(settings.host, settings.port), proxy_location="HeadOnly")
        serve.run(build_application(settings, registry), name=INGRESS_APP, route_prefix="/", blocking=False)
        log.info("serving on Ray Serve at http://%s:%d/v1 (models: %s)", settings.host, settings.port,
                 ", ".join(registry.models))
        stop.wait()
        log.info("stopping: deleting the application (replicas finish running requests for up to %gs)",
                 settings.drain_timeout)
        serve.delete(INGRESS_APP)
    finally:
        if started:
            serve.shutdown()  # type: ignore[no-untyped-call, unused-ignore]
            ray.shutdown()  # type: ignore[no-untyped-call, unused-ignore]
    return 0
