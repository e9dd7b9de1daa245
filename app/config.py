"""The application's configuration: one pydantic model, filled from the `args` of a Serve config file
(`config/graphserve.yaml`, also a serveConfigV2 for KubeRay) or from `serve run app:deployment k=v`.

Secrets never live here: API keys and admin tokens come from environment variables whose names
this config holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.graph_policy import GraphPolicy, load_policy
from policies.lora_slots import LORA_TARGETS
from workers.modeling.default_model import model_name


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cuda_graph: bool = True  # the tenant's graph permission until an operator changes it


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEPLOYMENT_SCOPE = re.compile(r"[^A-Za-z0-9._-]")  # what may not stand in an actor or file name
STATE_DIR = Path.home() / ".cache" / "graphserve" / "controller-state"


class LoraConfig(BaseModel):
    """LoRA slots, allocated once at start: up to max_loras adapters at a time per replica, of rank
    up to max_lora_rank, on the layers target_modules names. An adapter that needs more is refused."""

    model_config = ConfigDict(extra="forbid")
    max_loras: int = Field(8, ge=1, le=64)
    max_lora_rank: int = Field(64, ge=1, le=512)
    target_modules: list[Literal[LORA_TARGETS]] = list(LORA_TARGETS)


def check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: 1-64 letters, digits and ._-, starting with a letter or digit")
    return name


class AutoscalingConfig(BaseModel):
    """Serve autoscaling for the LLM replicas. One replica batches up to max_num_seqs sequences, so
    the target sits below that to scale out before requests queue."""

    model_config = ConfigDict(extra="allow")
    min_replicas: int = 1
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(24, gt=0)

    @field_validator("min_replicas")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        """Scale-to-zero cannot wake up here: with no replica READY the ingress answers 503 before it
        routes anything (so Serve never sees the request that would scale up), and on Kubernetes the
        readiness probe takes the pods out of the API Service."""
        if value < 1:
            raise ValueError(
                "min_replicas must be >= 1: with no replica READY the ingress answers 503 before routing, "
                "so Serve never sees a request to scale up from zero"
            )
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # checkpoint directory; None = the embedded tiny default
    served_model_name: str | None = None  # the `model` clients ask for; default: the directory's name
    model_revision: str | None = None  # the model's label in status and metrics; None: a content id
    # JSON lines of {"prompt", "completion"[, "max_tokens"]}: a swapped-in model must decode each greedily.
    gate_prompts_file: str | None = None
    # A request that finds its replica swapping is sent to another; with none free it waits this long.
    swap_queue_timeout_s: float = Field(60.0, gt=0)
    max_num_seqs: int | None = Field(None, ge=1)  # the batch limit; None: 256 on GPU, 32 on CPU
    max_model_len: int = Field(2048, ge=2)
    max_waiting: int = Field(256, ge=0)
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    attention_backend: Literal["auto", "triton", "sdpa", "sdpa_varlen"] = "auto"
    # The paged KV pool: pages of kv_page_size positions; kv_cache_tokens positions in all, or when
    # unset, kv_cache_memory_fraction of the device memory free after weights, the largest
    # prefill's activations and the graph budget (on CPU: every slot at max_model_len).
    kv_page_size: int = Field(16, ge=1)
    kv_cache_tokens: int | None = Field(None, ge=1)
    kv_cache_memory_fraction: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = Field(
        True,
        description=(
            "Reuse the KV pages of a prompt prefix already computed (chat histories, shared system "
            "prompts): full pages only, keyed by a SHA-256 chain of their tokens and the LoRA adapter "
            "(name, path, load); idle cached pages are evicted least recently used when the pool needs room."
        ),
    )
    # Inductor's on-disk cache for compiled decode steps (compile: on by default with full graphs): a
    # start that finds it compiles ~5x faster. null: inductor's default under /tmp (kept across restarts
    # of the engine in place, not across Pods; the GPU overlay mounts a volume here).
    compile_cache_dir: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    shard_num_cpus: float = Field(1.0, gt=0)
    collective_timeout_s: float = Field(30.0, gt=0)  # every wait between shards is bounded by this
    # The engine process: an answer slower than engine_timeout_s marks it wedged (killed, restarted);
    # it is restarted in place at most engine_max_restarts times per engine_restart_window_s, then the
    # replica fails its health check. Requests that have no token yet wait up to engine_start_timeout_s
    # for the restart (load + capture), which also bounds every start.
    engine_timeout_s: float = Field(20.0, gt=0)
    engine_max_restarts: int = Field(3, ge=0)
    engine_restart_window_s: float = Field(600.0, gt=0)
    engine_start_timeout_s: float = Field(1800.0, gt=0)
    # Bound on each call to the controller actor; a starting replica waits 6x this for its swap state.
    controller_timeout_s: float = Field(5.0, gt=0)
    cuda_graph_policy: GraphPolicy = GraphPolicy()
    # A YAML file with a `cuda_graph_policy:` section (on Kubernetes, a mounted ConfigMap); when set,
    # replicas read the policy from it when they start, in place of `cuda_graph_policy`.
    cuda_graph_policy_file: str | None = None
    tenants: dict[str, TenantConfig] = {}
    lora: LoraConfig | None = None  # LoRA adapter slots; absent: LoRA off, and no cost
    lora_modules: dict[str, str] = {}  # adapters served from the start: {name: PEFT adapter directory}
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    # The ingress (HTTP, validation, SSE): Serve adds replicas under load, so no one interpreter
    # caps what the LLM replicas stream.
    ingress_autoscaling: AutoscalingConfig = AutoscalingConfig(
        min_replicas=1, max_replicas=4, target_ongoing_requests=128
    )
    accelerator: Literal["auto", "gpu", "cpu"] = "auto"  # auto: gpu when the Ray cluster has GPUs
    replica_num_cpus: float = Field(1.0, gt=0)
    ingress_num_cpus: float = Field(0.5, gt=0)
    stream_interval_ms: float = Field(20.0, ge=0)  # coalesce a stream's tokens into items this far apart
    # ... and further apart under load: all of a replica's streams together send at most this many
    # items per second (each item costs the replica and the ingress the same, whatever it carries).
    stream_items_per_s: float = Field(2000.0, gt=0)
    api_keys_env: str = "GRAPHSERVE_API_KEYS"
    admin_token_env: str = "GRAPHSERVE_ADMIN_TOKEN"  # one token, operator `admin`
    admin_tokens_env: str = "GRAPHSERVE_ADMIN_TOKENS"  # named tokens, `alice:token-1,bob:token-2`
    # The controller actor and its state file belong to one deployment: unset, both are named after
    # the Serve application and the served model name (`for_app`), so no two deployments share them.
    controller_name: str | None = None
    controller_namespace: str = "graphserve"
    controller_state_path: str | None = None
    toggle_poll_s: float = Field(0.5, gt=0)
    startup_delay_s: float = Field(0.0, ge=0)  # testing aid: a replica that takes this long to capture

    @model_validator(mode="after")
    def _lora_modules_need_slots(self) -> AppConfig:
        for name in self.lora_modules:
            check_adapter_name(name)
        if self.lora_modules and self.lora is None:
            raise ValueError("lora_modules needs lora: {max_loras, max_lora_rank} to allocate adapter slots")
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        return cls.model_validate(args or {})

    def on_device(self, gpu: bool) -> AppConfig:
        """This config with what depends on the accelerator resolved: the accelerator itself and
        the batch limit."""
        update: dict[str, Any] = {"accelerator": "gpu" if gpu else "cpu"}
        if self.max_num_seqs is None:
            update["max_num_seqs"] = 256 if gpu else 32
        return self.model_copy(update=update)

    def served_name(self) -> str:
        """The `model` clients ask for."""
        return self.served_model_name or model_name(self.model)

    def for_app(self, app_name: str) -> AppConfig:
        """This config inside Serve application `app_name`: the controller's name and state file,
        where unset, scoped to this deployment (application and served model name)."""
        scope = DEPLOYMENT_SCOPE.sub("_", f"{app_name}.{self.served_name()}")
        return self.model_copy(
            update={
                "controller_name": self.controller_name or f"graphserve-controller.{scope}",
                "controller_state_path": self.controller_state_path or str(STATE_DIR / f"{scope}.json"),
            }
        )

    def made_for(self) -> dict[str, Any]:
        """What the controller's persisted swap target is valid for: the configured model, its
        revision and graph policy. When the configuration changes, the configuration wins."""
        return {
            "model": self.model,
            "revision": self.model_revision,
            "graph_policy": self.graph_policy().model_dump(mode="json"),
        }

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


ADMIN_OPERATOR = "admin"  # the operator name of the single token in admin_token_env
OPERATOR_NAME = re.compile(r"[A-Za-z0-9._@+-]+")


def parse_admin_tokens(raw: str | None, single: str | None = None) -> dict[str, str]:
    """`alice:token-1,bob:token-2` (plus `single`, the token of operator `admin`) -> {token: name}.
    Malformed entries, a name or a token given twice, are refused naming positions only, never
    content (it holds secrets). Names are letters, digits and `._@+-`: they go into logs and the
    audit log."""
    tokens: dict[str, str] = {single: ADMIN_OPERATOR} if single else {}
    names: dict[str, int] = {ADMIN_OPERATOR: 0} if single else {}
    for i, entry in enumerate(filter(None, (e.strip() for e in (raw or "").split(","))), start=1):
        name, sep, token = entry.partition(":")
        if not sep or not name or not token:
            raise ValueError(f"admin token entry #{i} is not of the form name:token")
        if not OPERATOR_NAME.fullmatch(name):
            raise ValueError(f"admin token entry #{i}: a name may hold only letters, digits and ._@+-")
        if name in names:
            first = f"entry #{names[name]}" if names[name] else "the single admin token (operator admin)"
            raise ValueError(f"admin token entry #{i} has the same name as {first}")
        if token in tokens:
            first = f"entry #{names[tokens[token]]}" if names[tokens[token]] else "the single admin token"
            raise ValueError(f"admin token entry #{i} has the same token as {first}")
        names[name], tokens[token] = i, name
    return tokens


def admin_tokens_from_env(config: AppConfig) -> dict[str, str]:
    """Every operator's admin token, {token: operator name}: the named tokens of `admin_tokens_env`
    and the single token of `admin_token_env` (operator `admin`). Empty: the admin API is off. A
    token that is also a tenant's API key is refused: that tenant would be an operator."""
    tokens = parse_admin_tokens(os.environ.get(config.admin_tokens_env), os.environ.get(config.admin_token_env) or None)
    if tokens.keys() & api_keys_from_env(config).keys():
        raise ValueError(
            f"an admin token is also an API key in {config.api_keys_env}; give operators tokens of their own"
        )
    return tokens
