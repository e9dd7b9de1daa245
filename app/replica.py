"""The LLM replica deployment: one engine (one GPU when there is one) behind a streaming method.

`__init__` loads the model and captures every graph before it returns, so Serve keeps the replica
STARTING and routes nothing to it until capture is complete. A background task polls the controller
for tenant toggles (applied to new and running requests within `toggle_poll_s`, without leaving
traffic) and another pushes this replica's status. A stream reads its tokens at most every
`stream_interval_ms` and yields what gathered as one item (the first and the last at once): one
item per token through the ingress hop would not keep up at high concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator

from jinja2 import TemplateError
from ray import serve

from app.config import AppConfig, use_gpu
from app.controller import ControllerClient, ControllerUnavailable, GraphController
from app.failover import continuation
from app.logs import send_app_logs_to_stderr
from app.metrics import CarriedCounters, RequestMetrics
from app.shards import LocalEngine, ShardGroup
from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from policies.restarts import RestartBudget
from policies.rollout import CohortRule, graph_denial
from workers.front.async_engine import EngineDeadError, RequestFailed
from workers.front.engine_process import EngineChild
from workers.modeling.checkpoint_dir import CheckpointError, check_model_path
from workers.modeling.token_bytes import token_bytes
from workers.protocol import (
    ChoiceChunk,
    Coalescing,
    Engine,
    EngineRequest,
    EngineStatus,
    Failure,
    GenerateRequest,
    Item,
    LogprobItem,
    Resume,
    StreamEvent,
    decode_request,
    encode,
)
from workers.serving.engine_config import EngineConfig
from workers.serving.outputs import KvCacheStatus
from workers.serving.sampling import InvalidRequest, SamplingParams, choice_seed
from workers.serving.scheduler import QueueFull

log = logging.getLogger(__name__)
STATUS_EVERY_S = 1.0
START_CONTROLLER_WAITS = 6  # a starting replica waits this many controller_timeout_s for the swap state
ROLLOUT_STATUS_EVERY_S = 0.2  # while a rollout splits traffic: a shadow mismatch reaches the controller soon
COHORTS = {None: "graph", FallbackReason.ROLLOUT_HOLDBACK: "holdback"}  # tenant-disabled requests are in neither
LONG_PROMPT_CHARS = 1 << 16  # a prompt of this many characters is tokenized in a thread (`tokenized`)
NORMALIZER_FOLD = 4  # characters a tokenizer's normalizer may fold into one (NFC composes at most 3)


def engine_config(config: AppConfig) -> EngineConfig:
    policy = config.graph_policy()  # a policy file is read here, where it is mounted
    return EngineConfig(
        model=config.model,
        model_revision=config.model_revision,
        gate_prompts_file=config.gate_prompts_file,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        max_waiting=config.max_waiting,
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        kv_page_size=config.kv_page_size,
        kv_cache_tokens=config.kv_cache_tokens,
        kv_cache_memory_fraction=config.kv_cache_memory_fraction,
        compile_cache_dir=config.compile_cache_dir,
        enable_prefix_caching=config.enable_prefix_caching,
        async_scheduling=config.async_scheduling,
        max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_prefill_delay_ms=config.max_prefill_delay_ms or 0.0,
        graph_policy=policy,
        lora=LoraLimits(config.lora.max_loras, config.lora.max_lora_rank, tuple(config.lora.target_modules))
        if config.lora
        else None,
    )


def with_target(config: AppConfig, target: dict | None) -> AppConfig:
    """The config with a swap's target in force: a model (and its label), or a graph policy."""
    if not target:
        return config
    update: dict = {}
    if target.get("model"):
        update.update(model=target["model"], model_revision=target.get("revision"))
    if target.get("graph_policy") is not None:
        update.update(cuda_graph_policy=GraphPolicy.model_validate(target["graph_policy"]), cuda_graph_policy_file=None)
    return config.model_copy(update=update)


def plain_backend(tokenizer):
    """The Rust tokenizer behind a fast tokenizer with no truncation or padding set, whose `encode`
    gives the ids `tokenizer(text)` does without ~50 us of Python around each call (a quarter of a
    short prompt's tokenizing); None for any other."""
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend


@functools.lru_cache(maxsize=4)  # the tokenizers served lately (a swap brings another)
def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for, by its vocabulary string: a
    byte-level token's string has a character per byte, so at least as many as its text."""
    return max(map(len, tokenizer.get_vocab()))


TEMPLATE_PROBE = "graphserve template probe"


@functools.lru_cache(maxsize=4)  # the tokenizers served lately (a swap brings another)
def template_reads_parts(tokenizer) -> bool:
    """Whether the chat template reads a message's content as OpenAI's list of parts (it loops
    over `message['content']` for parts of type text) rather than as a string: found once by
    rendering a probe message both ways, as vLLM detects a template's content format. Such a
    template given a string renders no text at all (it loops over characters)."""

    def renders(content) -> bool:
        try:
            messages = [{"role": "user", "content": content}]
            return TEMPLATE_PROBE in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses the probe reads the other form, or neither
            return False

    return not renders(TEMPLATE_PROBE) and renders([{"type": "text", "text": TEMPLATE_PROBE}])


def template_messages(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages in the form the chat template reads their content (`template_reads_parts`)."""
    if not template_reads_parts(tokenizer):
        return messages
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]


def prompt_chars(request: GenerateRequest) -> int:
    if request.kind == "chat":
        return sum(len(v) for m in request.messages for v in m.values() if isinstance(v, str))
    return len(request.prompt) if isinstance(request.prompt, str) else 0


async def tokenized(tokenizer, request: GenerateRequest, max_model_len: int) -> list[int]:
    """`tokenize`, without holding up the replica's other streams: a text too long for the context
    whatever its tokens (more characters than max_model_len of the longest tokens, with room for a
    normalizer's folding) is refused before it is tokenized, and a long one is tokenized in a thread,
    by the Rust tokenizer's batch call, which lets go of the interpreter lock (its single call does
    not: a 10 MB prompt held every other stream for ~10 s)."""
    chars = prompt_chars(request)
    if chars > max_model_len * longest_token_chars(tokenizer) * NORMALIZER_FOLD:
        raise InvalidRequest(
            f"the prompt's {chars} characters are more than max_model_len={max_model_len} tokens can hold",
            "messages" if request.kind == "chat" else "prompt",
        )
    if chars < LONG_PROMPT_CHARS:
        return tokenize(tokenizer, request)
    return await asyncio.to_thread(tokenize, tokenizer, request, True)


def tokenize(tokenizer, request: GenerateRequest, unlocked: bool = False) -> list[int]:
    """The prompt's token ids (`unlocked`: by a call that lets go of the interpreter lock, for a
    thread). What the tokenizer or the chat template refuses (text that is not valid Unicode, a
    template's raise_exception, ...) is the client's error: InvalidRequest, a 400."""
    chat = request.kind == "chat"
    if chat and not tokenizer.chat_template:
        raise InvalidRequest("this model has no chat template; use /v1/completions")
    backend = plain_backend(tokenizer)

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if unlocked:
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    try:
        messages = template_messages(tokenizer, request.messages) if chat else None
        if chat and backend is not None:  # rendered, then encoded as apply_chat_template does: no special tokens added
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return encode(text, False)
        if chat:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        prompt = request.prompt
        if not isinstance(prompt, str):
            return list(prompt)
        return encode(prompt, True) if backend is not None else tokenizer(prompt)["input_ids"]
    except TemplateError as e:
        raise InvalidRequest(f"the model's chat template refused these messages: {e}") from e
    except (TypeError, ValueError) as e:
        texts = [v for m in request.messages for v in m.values()] if chat else [request.prompt]
        if any(isinstance(t, str) and re.search("[\ud800-\udfff]", t) for t in texts):
            raise InvalidRequest("the prompt holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text") from e
        raise InvalidRequest(f"the prompt could not be tokenized: {e}") from e


class LLMReplica:
    async def __init__(self, args: dict) -> None:
        send_app_logs_to_stderr()
        started = time.monotonic()
        self.start_s: float | None = None  # from here to the engine's first READY, engine process start included
        # where start_s went outside the engine's own phases, and when (epoch) this replica began
        self.start_parts: dict[str, float] = {"started_at": time.time()}
        context = serve.get_replica_context()
        self.config = AppConfig.from_args(args).for_app(context.app_name)
        self.configured = self.config  # what the deployment was configured with, before any swap target
        self.config.check_lora_modules()
        self.replica_id = context.replica_id.unique_id
        self.controller = ControllerClient(self.config)
        self.state = "STARTING"  # until the engine exists; then the engine's own state
        self.engine: Engine | None = None
        self.engine_status: EngineStatus | None = None
        self.model_fallback: dict | None = None  # the persisted swap target it could not load, and why
        self.metrics = RequestMetrics()
        self.counters = CarriedCounters()  # engine counters across the engine's restarts and swaps
        self.tenant_of: dict[str, str] = {}
        self.denial_of: dict[str, FallbackReason | None] = {}  # what each running request was last given
        # The config's toggles until the controller answers: an unreachable controller delays no start.
        self.disabled = {tenant for tenant, on in self.config.initial_toggles().items() if not on}
        self.cohort_rule: CohortRule | None = None  # the rollout's, once the controller answers
        self.toggle_version = -1
        self._controller_down = False
        self.swap_progress: dict | None = None  # this replica's part in the latest swap it was told of
        self._swap_task: asyncio.Task | None = None
        self.draining = False  # while swapping: new requests are turned away (the ingress sends them on)
        # Serve's model multiplexing routes a request for an adapter to a replica that reported it:
        # this replica reports the adapters its last max_loras adapter requests named (its slots' LRU).
        self._note_adapter = (
            serve.multiplexed(max_num_models_per_replica=self.config.lora.max_loras)(_adapter_id)
            if self.config.lora
            else None
        )
        self._screened_restarts: int | None = None  # the engine's restarts when it last screened adapters
        self._background = [asyncio.create_task(self._report())]  # STARTING until the engine is READY
        if self.config.startup_delay_s:
            await asyncio.sleep(self.config.startup_delay_s)
        asked = time.monotonic()
        # The engine process starts loading the configured model while the controller is asked
        # whether a swap put another in force (rare: then this child is discarded for one that loads it).
        child = EngineChild(engine_config(self.config)) if self.config.tensor_parallel_size == 1 else None
        try:
            target = await self._serving_model()
        except BaseException:
            if child is not None:
                child.discard()
            raise
        spawned = time.monotonic()
        self.engine = await self._start_engine(target, child)
        self.start_parts |= {"controller_s": spawned - asked, "engine_start_s": time.monotonic() - spawned}
        self.tokenizer = self.engine.tokenizer
        self.engine_status = await self.engine.status()
        self.start_s = time.monotonic() - started
        await self._sync_toggles_logged()
        self._background.append(asyncio.create_task(self._poll_toggles()))
        self.controller.notify(GraphController.report, self.replica_id, self.status())
        loaded = self.config.model or "the default model"
        log.info(
            "replica %s: %s, serving %s (%s)",
            self.replica_id,
            self.engine_status.state,
            self.config.served_name(),
            loaded,
        )

    def status(self) -> dict:
        status = {"replica_id": self.replica_id, "state": self.state, "requests": self.metrics.as_dict()}
        if self.engine_status is not None:
            status.update(self.engine_status.as_dict(), engine_restarts=self.engine.restarts)
            status["startup"] = {**status.get("startup", {}), "replica_s": self.start_s, **self.start_parts}
        if self.draining:
            status["state"] = EngineState.REBUILDING.value
        status["swap"] = self.swap_progress
        status["model"] = self.config.model  # what this replica loaded: the configured model or a swap's target
        status["model_fallback"] = self.model_fallback
        return self.counters.apply(status)

    async def _serving_model(self) -> dict | None:
        """The model (or graph policy) the last swap put in force, which a replica starting now loads;
        None when no swap succeeded for this configuration (then: the configured model). Asking
        joins a swap under way (`GraphController.adopt`). A start waits for the controller (a new
        actor takes seconds to start); one that still does not answer loads the configured model
        and says so in `model_fallback`."""
        try:
            return await self.controller.call_within(
                START_CONTROLLER_WAITS * self.config.controller_timeout_s,
                GraphController.adopt,
                self.configured.made_for(),
                f"replica {self.replica_id}",
                self.replica_id,
                self.configured.initial_toggles(),
            )
        except Exception as e:
            log.warning(
                "replica %s: controller unreachable at start (%r); loading the configured model", self.replica_id, e
            )
            self.model_fallback = {
                "target": None,
                "reason": f"the controller did not answer at start ({e}): "
                "a persisted swap target, if any, was not read",
            }
            return None

    async def _start_engine(self, target: dict | None, child: EngineChild | None = None) -> Engine:
        """The engine on a persisted swap target, behind the model gate; when the target cannot be
        loaded (missing, unreadable, failing the gate) the configured model instead, with the reason
        in `model_fallback` (status, /admin/model, the audit log) and the log. `child`: an engine
        process started ahead, for the first engine made here."""
        if target:
            config = with_target(self.config, target)
            try:
                engine = await asyncio.to_thread(make_engine, config, child)
                try:
                    await engine.start()
                    await engine.gate()
                except BaseException:
                    await engine.close()
                    raise
                self.config = config
                return engine
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                log.error(
                    "replica %s: the persisted swap target %s could not be served (%s); serving the configured "
                    "model %s instead",
                    self.replica_id,
                    target,
                    reason,
                    self.config.model,
                )
                self.model_fallback = {"target": target, "reason": reason}
            child = None  # the target's engine had it
        engine = await asyncio.to_thread(make_engine, self.config, child)
        await engine.start()
        return engine

    async def _sync_toggles(self) -> None:
        """Toggles and the rollout's cohort rule; running requests whose permission changed get it
        in their next step."""
        version, permissions = await self.controller.call(GraphController.get_permissions, self.toggle_version)
        if permissions is None:
            return
        self.toggle_version = version
        self.disabled = {tenant for tenant, on in permissions["toggles"].items() if not on}
        rule = permissions["rollout"]
        self.cohort_rule = CohortRule.model_validate(rule) if rule else None
        order = permissions.get("swap")
        if (
            order
            and self.replica_id in order["now"]
            and (self.swap_progress or {}).get("id") != order["id"]
            and (self._swap_task is None or self._swap_task.done())
        ):
            self._swap_task = asyncio.create_task(self._swap(order))
        for request_id, tenant in list(self.tenant_of.items()) if not self.draining else ():  # draining: rebuilding
            denial = self._denial(tenant, request_id)
            if request_id in self.denial_of and self.denial_of[request_id] != denial:
                self.denial_of[request_id] = denial
                self.engine.set_graph_denial(request_id, denial)

    async def _sync_toggles_logged(self) -> None:
        """Sync, logging an unreachable controller once per outage (the last toggles stay)."""
        try:
            await self._sync_toggles()
        except Exception as e:
            if not self._controller_down:
                log.warning(
                    "replica %s: controller unreachable (%r); keeping the last tenant toggles until it answers",
                    self.replica_id,
                    e,
                )
            self._controller_down = True
            return
        if self._controller_down:
            log.info("replica %s: controller reachable again; tenant toggles synced", self.replica_id)
        self._controller_down = False

    def _denial(self, tenant: str, request_id: str) -> FallbackReason | None:
        return graph_denial(tenant, request_id, tenant not in self.disabled, self.cohort_rule)

    async def _refresh_status(self) -> None:
        """The engine's status; while it restarts in place the replica reads STARTING, once it is
        down for good FAILED (a change of state is logged with its cause). Not while it swaps: the
        child is busy loading and answers afterwards."""
        if self.engine is None or self.engine.swapping:
            return
        try:
            self.engine_status = await self.engine.status()
        except Exception as e:
            state = EngineState.FAILED.value if self.engine.failure else "STARTING"
            if self.engine_status.state != state:
                log.error("replica %s: engine %s: %r", self.replica_id, state, self.engine.failure or e)
            self.engine_status = dataclasses.replace(self.engine_status, state=state)

    async def _poll_toggles(self) -> None:
        while True:
            await self._sync_toggles_logged()
            await asyncio.sleep(self.config.toggle_poll_s)

    async def _report(self) -> None:
        """Apart from the toggle poll: a slow engine (a wedged one takes engine_timeout_s to be
        noticed) or a slow controller delays neither the other. Five times a second while a
        rollout splits traffic (a status costs the engine well under a millisecond between steps)."""
        while True:
            await self._refresh_status()
            self.controller.notify(GraphController.report, self.replica_id, self.status())
            serving = self.engine_status is not None and self.engine_status.state == EngineState.READY.value
            if serving and not self.draining and self._screened_restarts != self.engine.restarts:
                self._screened_restarts = self.engine.restarts
                self._background.append(asyncio.create_task(self._screen_adapters()))
            splitting = self.cohort_rule is not None and 0 < self.cohort_rule.percent < 100
            await asyncio.sleep(ROLLOUT_STATUS_EVERY_S if splitting else STATUS_EVERY_S)

    # -- model swap ------------------------------------------------------------------------------

    async def _swap(self, order: dict) -> None:
        """This replica's turn in a rolling swap: drain, swap the engine (gated), report each step."""
        swap_id = order["id"]
        target = with_target(self.config, order["target"])
        try:
            if target.model is not None:
                check_model_path(target.model)  # a typo must not drain anyone's stream
        except CheckpointError as e:
            log.error("replica %s: swap %s refused before draining: %s", self.replica_id, swap_id, e)
            self._set_swap_step(swap_id, "reverted", str(e))
            return
        self._set_swap_step(swap_id, "draining")
        self.draining = True
        try:
            await self._drain(order["drain_timeout_s"])
            await self._refresh_status()  # the drained streams' last counts, before the swap starts them again
            self._set_swap_step(swap_id, "loading")
            try:
                report = await self.engine.swap(engine_config(target))
            except Exception as e:
                log.error("replica %s: swap %s failed, the previous model serves: %s", self.replica_id, swap_id, e)
                step, detail, path = "reverted", str(e), None
            else:
                self.config, self.model_fallback = target, None
                step, path = "serving", report.pop("path")
                self._screened_restarts = None  # the new weights forgot the refusals: screen again
                detail = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items())
                log.info("replica %s: swap %s done (%s): %s", self.replica_id, swap_id, path, detail)
            self.tokenizer = self.engine.tokenizer
            await self._refresh_status()  # an engine that died meanwhile restarts: the step is reported all the same
        finally:
            self.draining = False
        self._set_swap_step(swap_id, step, detail, path)

    def _set_swap_step(self, swap_id: str, step: str, detail: str | None = None, path: str | None = None) -> None:
        self.swap_progress = {"id": swap_id, "step": step, "detail": detail, "path": path, "at": time.time()}
        self.controller.notify(GraphController.report, self.replica_id, self.status())

    async def _drain(self, timeout_s: float) -> None:
        """Let running requests finish on the old model (their steps run eager, labelled
        rebuilding); past timeout_s the rest end with an error event (a 503 to retry)."""
        for request_id in list(self.tenant_of):
            self.denial_of[request_id] = FallbackReason.REBUILDING
            self.engine.set_graph_denial(request_id, FallbackReason.REBUILDING)
        deadline = time.monotonic() + timeout_s
        while self.tenant_of and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for request_id in list(self.tenant_of):
            log.warning(
                "replica %s: request %s still running after the %g s drain; ending it",
                self.replica_id,
                request_id,
                timeout_s,
            )
            self.engine.cancel(request_id)
        while self.tenant_of:  # their streams end at the engine's next step
            await asyncio.sleep(0.02)

    async def check_health(self) -> None:
        await self.engine.check()

    async def __del__(self) -> None:
        """Serve stops this replica: the controller hears it at once (once it had one to tell)."""
        if "controller" in self.__dict__:
            self.controller.notify(GraphController.leave, self.replica_id)

    async def _screen_adapters(self) -> None:
        """Every adapter served (the config's and those registered through the admin API) read
        against this engine's slots: one this configuration refuses (a restart that lowered
        max_lora_rank or narrowed lora.target_modules) is logged and listed as refused in the
        status, so /v1/models leaves it out before a request for it finds out with a 400. Run
        once the engine serves, and again after a swap or a restart in place (each forgets)."""
        if self.config.lora is None:
            return
        try:
            registered = await self.controller.call(GraphController.get_lora_adapters)
        except ControllerUnavailable:
            registered = {}  # requests for them still find a refusal out, one at a time
        try:
            refused = await self.engine.screen_adapters(self.configured.served_adapters(registered))
        except (EngineDeadError, TimeoutError) as e:
            log.warning("replica %s: the served adapters were not screened: %s", self.replica_id, e)
            return
        for name, why in sorted(refused.items()):
            log.warning("replica %s: adapter %r cannot be served by this configuration: %s", self.replica_id, name, why)

    async def check_adapter(self, name: str, path: str) -> dict:
        """Load and verify an adapter before an operator registers it: {"replica_id", "slot",
        "seconds"}, or {"error", "status": 400} saying why it cannot be served (503: not now)."""
        if self.draining:  # its engine is being swapped or rebuilt: its pipe may be closed under it
            return {"error": f"replica {self.replica_id} is swapping its model; retry", "status": 503, "swapping": True}
        try:
            report = await self.engine.check_adapter(name, path)
        except InvalidRequest as e:
            return {"error": str(e), "status": 400}
        except (EngineDeadError, TimeoutError) as e:
            return {"error": f"replica {self.replica_id} could not check the adapter now: {e}", "status": 503}
        await self._note_adapter(name)
        return {"replica_id": self.replica_id, **report}

    async def generate(self, data: bytes) -> AsyncIterator[bytes]:
        """A `GenerateRequest`'s items (`workers/protocol.py`), encoded: a `Failure` alone, or the
        `ChoiceChunk`s of the request's n choices, possibly ended by a `Failure` when the engine
        failed mid-stream (its `retry` set: another replica may go on). The first chunk is sent as
        soon as it exists. A request with a `resume` continues one that another replica could not
        finish."""
        async for item in self._generate(decode_request(data)):
            yield encode(item)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Item]:
        if self.draining:  # not counted: the ingress sends it to another replica
            yield Failure("this replica is swapping its model", 503, swapping=True)
            return
        tenant, n = request.tenant, request.n
        request_id = uuid.uuid4().hex
        choice_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        start = time.monotonic()
        outcome, streams = "cancelled", []  # cancelled unless it ends otherwise (its client left)
        self.tenant_of.update(dict.fromkeys(choice_ids, tenant))
        cohort = COHORTS.get(self._denial(tenant, request_id))  # the rollout cohort it starts in, if any
        try:
            try:
                prompt_ids = await tokenized(self.tokenizer, request, self.engine_status.max_model_len)
                max_tokens = fit_max_tokens(
                    request.kind,
                    request.max_tokens,
                    len(prompt_ids),
                    self.engine_status.max_model_len,
                    request.max_tokens_field,
                )
                max_tokens = fit_choices(
                    n,
                    max_tokens,
                    request.max_tokens is not None,
                    len(prompt_ids),
                    self.engine_status.kv_cache,
                    self.config.max_waiting,
                    request.max_tokens_field,
                )
                sampling = dataclasses.replace(request.sampling, max_tokens=max_tokens)
                resume = continuation(request)
                if resume is not None:
                    sampling = dataclasses.replace(sampling, seed=request.resume.seed)
                if request.adapter is not None:
                    await self._note_adapter(request.adapter[0])
                if sampling.seed is None:  # drawn here, once for all n choices: the header's seed samples them again
                    sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
                params = [choice_sampling(sampling, i) for i in range(n)]
                streams = await self._first_events(prompt_ids, params, choice_ids, tenant, request.adapter, resume)
            except InvalidRequest as e:
                outcome = "invalid"
                yield Failure(str(e), 400, param=e.param)
                return
            except (QueueFull, EngineDeadError) as e:
                outcome = "unavailable"
                yield self._failure(str(e), e)
                return
            except RequestFailed as e:
                outcome = "error"
                log.error("replica %s: request %s failed in the engine: %s", self.replica_id, request_id, e)
                yield Failure("the engine failed to run this request", 500)
                return
            first_at, ended = None, 0
            try:
                async for index, event in _merged(streams):
                    now = time.monotonic()
                    if first_at is None and event.completion_tokens and resume is None:  # not the client's first token
                        first_at = now
                        self.metrics.ttft.observe(now - start)
                    logprobs = logprob_items(self.tokenizer, event) if params[index].logprobs is not None else None
                    drained = event.finish_reason == "abort" and self.draining  # ended by a swap's drain timeout
                    if drained:  # no finish reason: the client's stream ends with an error instead
                        outcome = "unavailable"
                    elif event.finish_reason is not None:  # counted before the yield: the ingress leaves at the last
                        ended += 1
                        outcome = "ok" if ended == n else outcome
                        if first_at is not None and event.completion_tokens > 1:
                            self.metrics.tpot.observe((now - first_at) / (event.completion_tokens - 1))
                    yield ChoiceChunk(
                        index,
                        event.text,
                        None if drained else event.finish_reason,
                        event.prompt_tokens,
                        event.cached_tokens,
                        event.completion_tokens,
                        event.token_ids,
                        event.seed,
                        event.detok,
                        self.replica_id,
                        logprobs,
                    )
                    if drained:
                        yield Failure(
                            "the model is being swapped and this request ran past the drain timeout; retry it", 503
                        )
                        return
            except (EngineDeadError, RequestFailed) as e:
                outcome = "engine_failed"
                log.warning("replica %s: request %s ended by an engine failure: %s", self.replica_id, request_id, e)
                yield self._failure("the engine failed while generating this completion; retry the request", e)
            except InvalidRequest as e:  # a schema's grammar that could not go on: the request's own fault
                outcome = "invalid"
                yield Failure(str(e), 400, param=e.param)
        finally:
            for choice_id in choice_ids:
                self.tenant_of.pop(choice_id, None)
                self.denial_of.pop(choice_id, None)
            self.metrics.count(tenant, outcome, cohort)
            for _, stream in streams:
                await stream.aclose()  # a request left early (its client went away) is cancelled now

    async def _first_events(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        choice_ids: list[str],
        tenant: str,
        adapter=None,
        resume: Resume | None = None,
    ) -> list[tuple[StreamEvent, AsyncIterator[StreamEvent]]]:
        """Every choice submitted and its first event awaited, side by side (their prefills share a
        step). If one fails, the others' streams are closed (ending them) and its error is raised.
        A continuation (`resume`) has one choice. One choice is awaited as it is (a task to gather
        it would cost ~20 us of every request)."""
        if len(choice_ids) == 1:
            return [await self._first_event(prompt_ids, params[0], choice_ids[0], tenant, adapter, resume)]
        firsts = (
            self._first_event(prompt_ids, p, choice_id, tenant, adapter, resume)
            for p, choice_id in zip(params, choice_ids)
        )
        results = await asyncio.gather(*firsts, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for result in results:
                if not isinstance(result, BaseException):
                    await result[1].aclose()
            raise failures[0]
        return results

    def _failure(self, message: str, error: Exception) -> Failure:
        """A 503 for the ingress: a dead engine's request is retried on another replica."""
        if isinstance(error, EngineDeadError):
            return Failure(message, 503, retry=True, replica_id=self.replica_id)
        return Failure(message, 503)

    async def _first_event(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        adapter=None,
        resume: Resume | None = None,
    ) -> tuple[StreamEvent, AsyncIterator[StreamEvent]]:
        """Submit and wait for the first event. An engine that dies before it costs the request
        nothing: it waits for the engine's restart in place and is submitted again."""
        coalescing = Coalescing(self.config.stream_interval_ms / 1e3, self.config.stream_items_per_s)
        for _ in range(self.config.engine_max_restarts + 1):
            try:
                denial = self.denial_of[request_id] = self._denial(tenant, request_id)
                request = EngineRequest(prompt_ids, params, request_id, denial, coalescing, adapter, resume)
                stream = aiter(self.engine.submit(request))
                return await anext(stream), stream
            except EngineDeadError as e:
                log.warning("replica %s: request %s waits for the engine (%s)", self.replica_id, request_id, e)
                if not await self.engine.wait_ready(self.config.engine_start_timeout_s):
                    raise
        raise EngineDeadError("the engine kept failing before this request's first token")


async def _adapter_id(name: str) -> str:
    """What Serve's multiplexing keeps per replica: the adapter's name (the engine holds its slot)."""
    return name


async def _chain(first: StreamEvent, rest: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    yield first
    async for event in rest:
        yield event


async def _merged(
    streams: list[tuple[StreamEvent, AsyncIterator[StreamEvent]]],
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(choice index, event) of every choice's stream, as the events come; one choice's stream as it is."""
    if len(streams) == 1:
        async for event in _chain(*streams[0]):
            yield 0, event
        return
    for index, (first, _) in enumerate(streams):
        yield index, first
    pending = {asyncio.ensure_future(anext(rest)): index for index, (_, rest) in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                with contextlib.suppress(StopAsyncIteration):
                    event = task.result()
                    pending[asyncio.ensure_future(anext(streams[index][1]))] = index
                    yield index, event
    finally:  # a consumer that stops early: each stream's next read is cancelled (ending its choice)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: choice 0 draws with the request's seed, choice i with a hash of
    (seed, i). `_generate` seeds an unseeded request first, so the seed the client is told
    (choice 0's) samples every choice again."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=choice_seed(sampling.seed, index))


def logprob_items(tokenizer, event: StreamEvent) -> list[LogprobItem]:
    """The event's tokens' logprobs with their alternatives', each token as its bytes."""
    of = token_bytes(tokenizer)
    return [
        LogprobItem(of(token), lp.logprob, [(of(a), v) for a, v in lp.top])
        for token, lp in zip(event.token_ids, event.logprobs or ())
    ]


def fit_choices(
    n: int,
    max_tokens: int,
    explicit: bool,
    prompt_tokens: int,
    kv_cache: KvCacheStatus,
    max_waiting: int,
    field: str = "max_tokens",
) -> int:
    """max_tokens for n choices, which run side by side as n sequences. More of them than the
    replica holds at once (max_num_seqs running and max_waiting queued) is a 400 naming n, not a
    503 that no retry could get past. All n at full length must fit the replica's KV pool, or one request would
    only run by preempting itself: a default max_tokens shrinks to fit; an explicit one that does
    not fit is a 400 naming `field`, as the client set it."""
    capacity = kv_cache.max_num_seqs + max_waiting
    if n > capacity:
        raise InvalidRequest(
            f"n={n} choices run as {n} sequences, more than this replica holds at once ({capacity}: "
            "max_num_seqs plus max_waiting); ask for fewer choices",
            "n",
        )
    room = kv_cache.pages // n * kv_cache.page_size - prompt_tokens
    if max_tokens <= room:
        return max_tokens
    if explicit or room < 1:
        raise InvalidRequest(
            f"n={n} choices of the prompt's {prompt_tokens} tokens plus {field}={max_tokens} "
            f"do not fit this replica's KV cache ({kv_cache.tokens} "
            "tokens); ask for fewer choices or tokens",
            field if explicit else "n",
        )
    return room


def fit_max_tokens(
    kind: str, requested: int | None, prompt_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> int:
    """OpenAI's rule: prompt + max_tokens must fit the context, else a 400 naming `field` (as the
    client set it). Without max_tokens, completions default to 16 tokens and chat to the rest of the
    context, both within the room left."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens: no room for a completion within max_model_len={max_model_len}",
            "messages" if kind == "chat" else "prompt",
        )
    if requested is None:
        return min(room, 16) if kind == "completion" else room
    if requested > room:
        raise InvalidRequest(
            f"{field}={requested} plus the prompt's {prompt_tokens} tokens exceeds max_model_len={max_model_len}",
            field,
        )
    return requested


def make_engine(config: AppConfig, child: EngineChild | None = None) -> Engine:
    """A child process for tensor_parallel_size 1 (`child` if one was started ahead); otherwise one
    shard actor per GPU."""
    if config.tensor_parallel_size == 1:
        budget = RestartBudget(config.engine_max_restarts, config.engine_restart_window_s)
        return LocalEngine(engine_config(config), budget, config.engine_timeout_s, config.engine_start_timeout_s, child)
    if child is not None:
        child.discard()
    gpu = use_gpu(config)
    return ShardGroup(
        engine_config(config),
        config.tensor_parallel_size,
        num_gpus=1 if gpu else 0,
        num_cpus=config.shard_num_cpus,
        timeout_s=config.collective_timeout_s,
    )
