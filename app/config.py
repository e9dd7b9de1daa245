"""The application's configuration: one pydantic model, filled from the `args` of a Serve config file
(`config/graphserve.yaml`, also a serveConfigV2 for KubeRay) or from `serve run app:deployment k=v`.

Secrets never live here: API keys and the admin token come from environment variables whose names
this config holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.graph_policy import GraphPolicy, load_policy


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cuda_graph: bool = True  # the tenant's graph permission until an operator changes it


class AutoscalingConfig(BaseModel):
    """Serve autoscaling for the LLM replicas. One replica batches up to max_num_seqs sequences, so
    the target sits below that to scale out before requests queue."""

    model_config = ConfigDict(extra="allow")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(24, gt=0)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # checkpoint directory; None = the embedded tiny default
    served_model_name: str | None = None  # the `model` clients ask for; default: the directory's name
    max_num_seqs: int = Field(32, ge=1)
    max_model_len: int = Field(2048, ge=2)
    max_waiting: int = Field(256, ge=0)
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    attention_backend: str = "sdpa"
    tensor_parallel_size: int = Field(1, ge=1)
    shard_num_cpus: float = Field(1.0, gt=0)
    collective_timeout_s: float = Field(30.0, gt=0)  # every wait between shards is bounded by this
    cuda_graph_policy: GraphPolicy = GraphPolicy()
    # A YAML file with a `cuda_graph_policy:` section (on Kubernetes, a mounted ConfigMap); when set,
    # replicas read the policy from it when they start, in place of `cuda_graph_policy`.
    cuda_graph_policy_file: str | None = None
    tenants: dict[str, TenantConfig] = {}
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    accelerator: Literal["auto", "gpu", "cpu"] = "auto"  # auto: gpu when the Ray cluster has GPUs
    replica_num_cpus: float = Field(1.0, gt=0)
    ingress_num_cpus: float = Field(0.5, gt=0)
    stream_interval_ms: float = Field(20.0, ge=0)  # coalesce a stream's tokens into items this far apart
    api_keys_env: str = "GRAPHSERVE_API_KEYS"
    admin_token_env: str = "GRAPHSERVE_ADMIN_TOKEN"
    controller_name: str = "graphserve-controller"
    controller_namespace: str = "graphserve"
    controller_state_path: str = str(Path.home() / ".cache" / "graphserve" / "controller-state.json")
    toggle_poll_s: float = Field(0.5, gt=0)
    startup_delay_s: float = Field(0.0, ge=0)  # testing aid: a replica that takes this long to capture

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        return cls.model_validate(args or {})

    def graph_policy(self) -> GraphPolicy:
        return load_policy(self.cuda_graph_policy_file) if self.cuda_graph_policy_file else self.cuda_graph_policy

    def initial_toggles(self) -> dict[str, bool]:
        return {name: t.cuda_graph for name, t in self.tenants.items()}


def parse_api_keys(raw: str | None) -> dict[str, str]:
    """`tenant-a:key-a,tenant-b:key-b` -> {key: tenant}. Malformed entries are refused (naming the
    entry's position, never its content: it holds a secret)."""
    keys: dict[str, str] = {}
    for i, entry in enumerate(filter(None, (e.strip() for e in (raw or "").split(",")))):
        tenant, sep, key = entry.partition(":")
        if not sep or not tenant or not key:
            raise ValueError(f"API key entry #{i + 1} is not of the form tenant:key")
        keys[key] = tenant
    return keys


def api_keys_from_env(config: AppConfig) -> dict[str, str]:
    return parse_api_keys(os.environ.get(config.api_keys_env))


def admin_token_from_env(config: AppConfig) -> str | None:
    return os.environ.get(config.admin_token_env) or None
