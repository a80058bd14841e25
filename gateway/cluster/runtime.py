"""`gateway serve --cluster ray[://ADDRESS]`: join (or start) Ray, run the application, drain on a signal.

- `ray`: join the Ray cluster this host belongs to (`ray start` ran here, or RAY_ADDRESS names the
  head); when there is none, start a one-host cluster with token authentication and no dashboard,
  bound to loopback.
- `ray://HOST:PORT`: Ray Client to a remote head.

Ray's ports run code for whoever can reach them; this module refuses nothing, but says so when the
cluster it joined has token authentication off (RAY_AUTH_MODE != token).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from gateway.models.registry import Registry
from gateway.settings import Settings

log = logging.getLogger(__name__)


def connect(cluster: str) -> bool:
    """Connect this process to Ray; True when it started a new local cluster (to stop on exit)."""
    import ray

    if cluster != "ray" and not cluster.startswith("ray://"):
        raise ValueError(f"--cluster {cluster!r}: expected 'ray' or 'ray://HOST:PORT'")
    if cluster.startswith("ray://"):
        ray.init(address=cluster, logging_level=logging.WARNING)
        started = False
    else:
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
            started = False
        except ConnectionError:
            # No cluster on this host: a private one, authenticated, reachable from loopback only.
            os.environ.setdefault("RAY_AUTH_MODE", "token")
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
            started = True
    if os.environ.get("RAY_AUTH_MODE", "disabled") != "token":
        log.warning("this Ray cluster runs without token authentication (RAY_AUTH_MODE=token on every node "
                    "turns it on): anyone who can reach its ports can run code on its nodes")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    log.info("Ray cluster: %d node(s), resources %s", len(nodes), ray.cluster_resources())
    return started


def serve_on_ray(settings: Settings, registry: Registry, cluster: str) -> int:
    """Run the gateway's Serve application until SIGTERM/SIGINT, then delete it (replicas drain)."""
    import ray
    from ray import serve

    from gateway.cluster.app import INGRESS_APP, build_application

    started = connect(cluster)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port}, proxy_location="HeadOnly")
        serve.run(build_application(settings, registry), name=INGRESS_APP, route_prefix="/", blocking=False)
        log.info("serving on Ray Serve at http://%s:%d/v1 (models: %s)", settings.host, settings.port,
                 ", ".join(registry.models))
        stop.wait()
        log.info("stopping: deleting the application (replicas finish running requests for up to %gs)",
                 settings.drain_timeout)
        serve.delete(INGRESS_APP)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
    return 0
