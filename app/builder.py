"""`app:deployment`: the Serve application builder (ingress -> LLM replicas, plus the controller
actor the two create on first use). Serve calls it with the `args` of the config file, or with
`key=value` pairs from `serve run app:deployment ...`; with none it serves the embedded tiny model."""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig, use_gpu
from app.ingress import Ingress
from app.replica import LLMReplica

HEALTH_CHECK_PERIOD_S = 5.0
# Serve's power of two choices, except that a request failing over never goes back to a replica that failed it.
FAILOVER_ROUTER = RequestRouterConfig(request_router_class="app.failover.FailoverRouter")


def deployment(args: dict) -> Application:
    config = AppConfig.from_args(args)
    gpu = use_gpu(config)
    config = config.on_device(gpu)
    args = config.model_dump(mode="json")
    tp = config.tensor_parallel_size
    placement = {}
    if tp > 1:
        # The replica (bundle 0) needs no GPU; each shard gets a bundle of its own, all on one node.
        shard_bundle = {"CPU": config.shard_num_cpus, **({"GPU": 1} if gpu else {})}
        placement = dict(
            placement_group_bundles=[{"CPU": config.replica_num_cpus}] + [shard_bundle] * tp,
            placement_group_strategy="STRICT_PACK",
        )
    replica = serve.deployment(LLMReplica).options(
        name="LLMReplica",
        ray_actor_options={"num_cpus": config.replica_num_cpus, "num_gpus": 1 if gpu and tp == 1 else 0},
        autoscaling_config=config.autoscaling.model_dump(),
        max_ongoing_requests=config.max_num_seqs + config.max_waiting,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=FAILOVER_ROUTER,
        **placement,
    )
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        autoscaling_config=config.ingress_autoscaling.model_dump(),
        max_ongoing_requests=4 * (config.max_num_seqs + config.max_waiting),
    )
    return ingress.bind(replica.bind(args), args)
