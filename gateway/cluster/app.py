"""The gateway as a Ray Serve application.

- `gateway` (the ingress): the gateway's FastAPI app, built on its replica, where every model
  served here is a `ServeEngine` over that model's deployment handle; admission control (429 +
  Retry-After), API keys, metrics and the web page work as on one host.
- `model-<id>` (one per model): replicas of `ModelReplica`, each hosting an engine worker on a
  node's device.  `ray_actor_options` place them: `num_gpus` for CUDA, the custom resource
  `vulkan` / `directml` (declared by `ray start --resources`) for those engines, CPUs otherwise.
  Replica counts follow models.yaml's `replicas:` through Serve's autoscaler.
- Requests carry a conversation-affinity key that `AffinityRouter` reads.

`build_application(settings, registry)` is used by `gateway serve --cluster`; `app_builder(args)`
by `serve run` / `serve deploy` (deploy/ray/serve.yaml).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from engines.base import Engine
from gateway.cluster.engine import ServeEngine
from gateway.cluster.replica import ModelReplica
from gateway.cluster.router import AffinityRouter
from gateway.metrics import Metrics
from gateway.models.pool import configured_parallel, kv_sharing
from gateway.models.registry import ModelSpec, Registry, RegistryFile, Replicas, _default_cache, load_registry
from gateway.settings import Settings

INGRESS = "gateway"  # the ingress deployment
INGRESS_APP = "gateway"  # the Serve application


def deployment_name(model_id: str) -> str:
    return f"model-{model_id}"


def replicas_of(spec: ModelSpec, registry: Registry) -> Replicas:
    """models.yaml's `replicas`, or: the default model keeps one replica, the others scale from zero."""
    if spec.replicas is not None:
        return spec.replicas
    return Replicas(min=1 if spec.id == registry.default else 0, max=1)


def parallel_of(spec: ModelSpec, settings: Settings) -> int:
    """Requests a replica runs at once: its sequences, more than `parallel` where a llama.cpp model
    shares one KV cache among them (models.yaml `kv_unified` + `sequences`, or --sequences)."""
    parallel = configured_parallel(spec, settings)
    kv_unified, sequences = kv_sharing(spec, settings)
    return max(sequences, parallel) if kv_unified and "gguf" in spec.formats else parallel


def actor_options(spec: ModelSpec, registry: Registry, settings: Settings) -> dict[str, Any]:
    """Where a replica of `spec` may run: the resources Ray reserves for it on a node."""
    r = replicas_of(spec, registry)
    options: dict[str, Any] = {"num_cpus": r.cpus}
    if settings.engine == "cuda":
        options["num_gpus"] = r.gpus or 1
    elif settings.engine in ("vulkan", "directml", "metal"):
        options["resources"] = {settings.engine: r.gpus or 1}
    return options


def model_deployment(spec: ModelSpec, registry: Registry, settings: Settings) -> Any:
    r = replicas_of(spec, registry)
    extra: dict[str, Any] = {"max_replicas_per_node": r.max_per_node} if r.max_per_node else {}
    if r.affinity:
        extra["request_router_config"] = RequestRouterConfig(
            request_router_class=AffinityRouter)  # type: ignore[arg-type, unused-ignore]
    return serve.deployment(ModelReplica).options(  # type: ignore[attr-defined, unused-ignore]
        name=deployment_name(spec.id),
        ray_actor_options=actor_options(spec, registry, settings),
        # Requests beyond a replica's sequences wait in the handle's router (counted by the
        # autoscaler as load), not inside a replica that cannot run them yet.
        max_ongoing_requests=parallel_of(spec, settings),
        autoscaling_config=AutoscalingConfig(
            min_replicas=r.min, max_replicas=r.max, initial_replicas=max(r.min, 1 if spec.id == registry.default else 0),
            target_ongoing_requests=r.target_ongoing_requests,
            upscale_delay_s=r.upscale_delay_s, downscale_delay_s=r.downscale_delay_s,
            look_back_period_s=r.look_back_period_s,
        ),
        **extra,
        health_check_period_s=5, health_check_timeout_s=60,
        graceful_shutdown_timeout_s=settings.drain_timeout,
    )


@serve.ingress()
class Ingress:
    """The gateway's HTTP API, with every model's replicas behind it."""

    def __init__(self, settings: Settings, registry_file: RegistryFile, base_dir: str,
                 models: dict[str, DeploymentHandle[Any]]) -> None:
        self.settings = settings
        cache = Path(registry_file.cache_dir).expanduser() if registry_file.cache_dir else _default_cache()
        self.registry = Registry(registry_file, Path(base_dir), cache)
        self.models = models

    def __serve_build_asgi_app__(self) -> FastAPI:
        from gateway.app import create_app

        registry, models, settings = self.registry, self.models, self.settings

        def engine_for(spec: ModelSpec, metrics: Metrics) -> Engine | None:
            handle = models.get(spec.id)
            if handle is None:
                return None  # remote `workers:` are dialled by the ingress itself
            slots = replicas_of(spec, registry).max * parallel_of(spec, settings)
            return ServeEngine(handle, spec.id, slots, metrics)

        return create_app(settings, registry, cluster=engine_for)


def build_application(settings: Settings, registry: Registry) -> Any:
    """The application: the ingress bound to one deployment per model served on the cluster."""
    # A replica's engine runs in a worker process of its own (settings.workers), as on one host.
    models = {
        spec.id: model_deployment(spec, registry, settings).bind(spec.id, registry.file, str(registry.base_dir),
                                                               settings)
        for spec in registry.models.values() if not spec.workers
    }
    # The ingress lives on the head node, beside the HTTP proxy (proxy_location HeadOnly) and the GCS:
    # losing any other node costs only the replicas on it.
    ingress = serve.deployment(Ingress).options(  # type: ignore[attr-defined, unused-ignore]
        name=INGRESS, num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}})
    return ingress.bind(settings, registry.file, str(registry.base_dir), models)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run gateway.cluster.app:app_builder config=models.yaml engine=auto` (or deploy/ray/serve.yaml).

    `args` are Settings fields by name (strings are parsed as their GATEWAY_* variables are);
    settings not given come from the GATEWAY_* environment as for `gateway serve`."""
    unknown = sorted(set(args) - set(Settings.model_fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(Settings.model_fields)}")
    settings = Settings.from_env(**args)
    return build_application(settings, load_registry(settings.config))
