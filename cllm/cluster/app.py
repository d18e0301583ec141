"""Build and run the Ray Serve application: `cllm serve --replicas N [--pd prefill=P,decode=D]`.

Deployments: ``cllm-engine`` (N colocated replicas) or ``cllm-prefill`` (P) +
``cllm-decode`` (D) under PD; each replica takes ``n_threads`` CPUs, routes
through PrefixAffinityRouter and is health-checked by Serve (a failing or dead
replica is replaced). One ``cllm-ingress`` replica (no CPU reserved) serves
the OpenAI-compatible HTTP API through Serve's proxy on server.host:port.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cllm.cluster.ingress import CllmIngress
from cllm.cluster.replica import EngineReplica
from cllm.cluster.router import PrefixAffinityRouter
from cllm.cluster.stats_board import BOARD_NAME
from cllm.cluster.transport import HOLDER_NAME
from cllm.config import CllmConfig, parse_pd
from cllm.engine.llm import make_config
from cllm.router import declared_models

log = logging.getLogger("cllm.cluster")
APP_NAME = "cllm"
NAMESPACE = "cllm"


def build_app(config: CllmConfig) -> Any:
    """The Serve application (bound deployment graph) for ``config``."""
    cluster = config.cluster
    nested = config.model_dump()
    engine = serve.deployment(EngineReplica).options(
        max_ongoing_requests=cluster.max_ongoing_requests,
        health_check_period_s=cluster.health_check_period_s,
        health_check_timeout_s=max(10.0, 5 * cluster.health_check_period_s),
        graceful_shutdown_timeout_s=max(5.0, config.server.shutdown_grace_s),
        ray_actor_options={"num_cpus": config.model.n_threads or 1},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"max_imbalance": cluster.route_max_imbalance},
        ),
    )
    models = None
    specs = declared_models(config)
    if config.models or config.router.models_dir:
        # Several models: a replica set each (prefix-aware routing then keys by model and prefix: each
        # deployment has its own router), all loaded for the application's life.
        models = {spec.name: engine.options(
            name=f"cllm-engine-{i}", num_replicas=cluster.replicas,
            ray_actor_options={"num_cpus": spec.config.model.n_threads or 1},
        ).bind(spec.config.model_dump(), "both", spec.name) for i, spec in enumerate(specs)}
        engines = decoders = None
    elif cluster.pd is not None:
        prefill, decode = parse_pd(cluster.pd)
        engines = engine.options(name="cllm-prefill", num_replicas=prefill).bind(nested, "prefill")
        decoders = engine.options(name="cllm-decode", num_replicas=decode).bind(nested, "decode")
    else:
        engines = engine.options(name="cllm-engine", num_replicas=cluster.replicas).bind(nested, "both")
        decoders = None
    ingress = serve.deployment(serve.ingress()(CllmIngress)).options(
        name="cllm-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, cluster.max_ongoing_requests * cluster.replicas),
    )
    return ingress.bind(nested, engines, decoders, models)


def init_ray(config: CllmConfig) -> None:
    """Join ``ray_address``, or start a local Ray instance; nothing if Ray is up in this process."""
    cluster = config.cluster
    if not ray.is_initialized():
        ray.init(address=cluster.ray_address, num_cpus=cluster.ray_num_cpus, namespace=NAMESPACE,
                 object_store_memory=cluster.ray_object_store_mb * 1024 * 1024 if cluster.ray_address is None else None,
                 include_dashboard=False, log_to_driver=False)


def start(config: CllmConfig) -> str:
    """Start (or join) Ray and run the application; returns the endpoint's base URL."""
    init_ray(config)
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{config.server.host}:{config.server.port}"


def stop() -> None:
    """Delete the application (replicas drain under Serve's graceful shutdown) and its helper actors."""
    serve.delete(APP_NAME)
    for name in (BOARD_NAME, HOLDER_NAME):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass  # never created


def serve_ray(model: str | None = None, config: CllmConfig | str | None = None, *, blocking: bool = True,
              **overrides: Any) -> str:
    """Serve N engine replicas behind one OpenAI-compatible endpoint on Ray Serve.

    ``overrides`` are flat settings (replicas=2, pd="prefill=1,decode=1", n_threads=1, port=8000, ...).
    With ``blocking`` it serves until SIGINT/SIGTERM, then shuts the application down; otherwise
    it returns the base URL at once (stop with ``cllm.cluster.app.stop()``).
    """
    cfg = make_config(config, {"model": model, **overrides})
    stopped = threading.Event()
    if blocking:
        init_ray(cfg)
        # After ray.init (which sets its own SIGTERM handler) and before the minute-long deployment, so a
        # signal at any point from here shuts the application down gracefully.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopped.set())
    url = start(cfg)
    log.warning("cllm on Ray Serve at %s (%s)", url, cfg.cluster.pd or f"{cfg.cluster.replicas} replicas")
    if not blocking:
        return url
    stopped.wait()
    stop()
    serve.shutdown()
    return url
