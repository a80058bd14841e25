"""A Ray cluster of two nodes on this machine serving the gateway, driven over stdin/stdout.

Used by tests/test_cluster.py (and benchmarks/bench_cluster.py).  Ray runs here, in its own process,
so the test process never imports it.  Token authentication is on (RAY_AUTH_MODE=token) with the
token in RAY_AUTH_TOKEN.

usage: python tests/ray_cluster.py --port PORT --config MODELS_YAML [--nodes N] [--cpus C]
Prints one JSON object per line behind MARK (stdout carries nothing else): {"ready": ..., "address":
GCS address, "nodes": [...]} first, then one answer per command read from stdin:
  kill NODE_ID_PREFIX   SIGKILL that node's raylet and every process of it (a host lost)
  add                   add a node
  nodes                 the live nodes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

MARK = "@@cluster "


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs per node")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (Ray detects them when unset)")
    args = ap.parse_args()

    # Answers go out on a descriptor of their own; everything else this process and its children write
    # to stdout goes to stderr.  Ray prints from threads of its own (e.g. "Raylet is terminated ..."
    # when a node is killed), and a print of Ray's between an answer and its newline made the answer
    # unreadable once.
    answers = os.dup(1)  # not inherited by Ray's processes (PEP 446)
    sys.stdout.flush()
    os.dup2(2, 1)
    # Every node of this cluster lives on this machine: make Ray's own address detection say loopback
    # too (it otherwise picks the first interface's address for a driver or a node's components).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray Serve's throughput mode, as a private cluster and the documented `ray start` commands run it
    # (RAY_SERVE_THROUGHPUT_OPTIMIZED=0 in the environment: Serve's defaults).
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    from gateway.cluster.runtime import http_options, ingress_port_first

    ingress_port_first(args.port)  # clients reach the ingress with no proxy between, as on a private cluster
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from gateway.cluster.app import INGRESS_APP, build_application
    from gateway.models.registry import load_registry
    from gateway.settings import Settings

    def say(**kw: object) -> None:
        # One write of the whole line: nothing else writes to this descriptor.
        os.write(answers, (MARK + json.dumps(kw) + "\n").encode())

    # Every node on loopback: nothing of this cluster is reachable from another host.
    node_args: dict[str, object] = {"num_cpus": args.cpus, "include_dashboard": False, "node_ip_address": "127.0.0.1"}
    if args.gpus is not None:
        node_args["num_gpus"] = args.gpus
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    nodes = {cluster.head_node.node_id: cluster.head_node}
    for _ in range(args.nodes - 1):
        n = cluster.add_node(**node_args)
        nodes[n.node_id] = n
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    settings = Settings.from_env(config=args.config, host="127.0.0.1", port=args.port)
    serve.start(http_options=http_options("127.0.0.1", args.port), proxy_location="HeadOnly")
    serve.run(build_application(settings, load_registry(args.config)), name=INGRESS_APP, route_prefix="/")

    def alive() -> list[str]:
        return [n["NodeID"] for n in ray.nodes() if n["Alive"]]

    say(ready=True, address=cluster.address, head=cluster.head_node.node_id, nodes=alive())
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        try:
            if cmd == "kill":
                node_id = next(k for k in nodes if k.startswith(arg) and k != cluster.head_node.node_id)
                cluster.remove_node(nodes.pop(node_id), allow_graceful=False)
                say(killed=node_id, nodes=alive())
            elif cmd == "add":
                n = cluster.add_node(**node_args)
                nodes[n.node_id] = n
                cluster.wait_for_nodes()
                say(added=n.node_id, nodes=alive())
            elif cmd == "nodes":
                say(nodes=alive())
            elif cmd == "quit":
                break
            else:
                say(error=f"unknown command {cmd!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            say(error=f"{type(exc).__name__}: {exc}")
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
