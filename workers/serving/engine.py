"""The engine: one `step()` admits and prefills new requests, then decodes the whole running batch
by one token. It is driven from a thread (`async_engine.py`) or, in a serving replica, from a
process of its own (`engine_process.py`).

With async scheduling (`EngineConfig.async_scheduling`), a decode step is launched before the host
has read the tokens of the step before: the new step's inputs take those tokens on the device, and
the host reads them and does its work on them (stop checks, grammars, events) while the device
runs the new step. So a step's tokens come out of the next `step()`, and a row that ends on a token
the host had not read yet (EOS, a stop id, a complete grammar) has computed one position more,
whose logits are dropped. A row whose next token is its last by length is not decoded again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from policies.dispatch import EngineState, FallbackReason, split_by_permission
from policies.kv_blocks import BlockManager
from policies.lora_slots import AdapterKey, AdapterSlots
from policies.prefix_hash import adapter_salt
from workers.graphs.compile_cache import use_compile_cache
from workers.graphs.graph_runner import GraphRunner, StepRunners
from workers.kv.attention import make_backend
from workers.kv.kv_cache import KVCache
from workers.model_runner.step_inputs import DecodeInputs, PrefillInputs
from workers.modeling.checkpoint import load_model, model_revision
from workers.modeling.checkpoint_dir import load_tokenizer
from workers.modeling.config import DTYPES, ModelConfig, load_config
from workers.modeling.default_model import model_dir as resolve_model_dir
from workers.modeling.lora import AdapterError, adapter_version, load_adapter, screen_adapter
from workers.modeling.model import LlamaModel
from workers.modeling.parallel import TPGroup
from workers.serving.batch_sampler import AHEAD_MIN_ROWS, BatchSampler, Draw
from workers.serving.compile_key import key_inputs
from workers.serving.engine_config import EngineConfig
from workers.serving.grammar import GrammarCompiler
from workers.serving.json_schema import InvalidSchema
from workers.serving.kv_sizing import agree_num_pages, plan_num_pages, prefill_sizes
from workers.serving.outputs import EngineStatus, KvCacheStatus, TokenEvent
from workers.serving.sampling import InvalidRequest, SamplingParams, TokenLogprob
from workers.serving.sampling_ops import apply_token_bitmask, on_device, sample
from workers.serving.scheduler import QueueFull, Scheduler, Sequence, new_sequence
from workers.serving.startup import StartupClock
from workers.serving.stats import CallTimer, EngineStats
from workers.tensor_parallel.tp import (
    AGREE,
    DECODE,
    EAGER,
    EAGER_PREFILL,
    LORA_LOAD,
    NOOP,
    PREFILL,
    STOP,
    StepChannel,
    agree,
)

log = logging.getLogger(__name__)
MB = 1 << 20
COMPILE_WAIT_S = 0.01  # with nothing but grammars compiling, a step waits this long for one (no spinning)


class Ending(NamedTuple):
    """How a sequence ends on the token just drawn: its finish reason, whether the token is kept
    (an end-of-sequence or stop token, or one its failed grammar refused, is not), and the error
    its stream raises."""

    reason: str
    takes_token: bool = True
    error: BaseException | None = None


@dataclass
class InFlight:
    """A decode step launched whose tokens the host has not read: its rows' sequences, the timings
    of its model calls (readable once the draw is) and the draw; or, while its rows' masks are
    filled ahead, its logits, drawn by `LLMEngine.launch_draw` before the engine's next device work
    (the host's work between the steps then overlaps the fill instead of following it)."""

    seqs: list[Sequence]
    timer: CallTimer
    draw: Draw | None = None
    logits: torch.Tensor | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare_model(model: LlamaModel, config: EngineConfig) -> KVCache:
    """What every rank does to a loaded model before capture: pick the attention backend, allocate
    the LoRA slots if enabled, and then the paged KV pool (sized by `kv_sizing.py` from what is left
    after the graph budget and the sampler's token history, the same on every rank)."""
    device = model.embed.weight.device
    model.attention_backend = make_backend(config.attention_backend, device)
    if config.lora is not None:
        model.enable_lora(config.lora.max_loras, config.lora.max_lora_rank, config.lora.target_modules)
    if config.compile_cache_dir:  # before anything compiles: a start that finds its key there compiles ~5x faster
        use_compile_cache(config.compile_cache_dir, key_inputs(model, config))
    max_num_seqs = config.batch_limit(device)
    policy = config.graph_policy
    graph_reserve = int(policy.graph_memory_budget_mb * MB) if policy.mode != "eager" else 0
    reserve = graph_reserve + BatchSampler.history_bytes(max_num_seqs, model.cfg.vocab_size)
    num_pages = plan_num_pages(
        model,
        max_num_seqs,
        config.kv_page_size,
        config.kv_cache_tokens,
        config.kv_cache_memory_fraction,
        config.max_num_batched_tokens,
        reserve,
    )
    num_pages = agree_num_pages(model, num_pages)
    try:
        return model.make_kv_cache(max_num_seqs, num_pages, config.kv_page_size)
    except RuntimeError as e:  # the host's allocator, or the device's (torch.OutOfMemoryError)
        if "allocate" not in str(e):
            raise
        if config.kv_cache_tokens:
            sized = f"kv_cache_tokens {config.kv_cache_tokens}"
        elif device.type == "cpu":
            sized = f"max_num_seqs {max_num_seqs} x max_model_len {model.max_model_len}: on CPU every slot's"
        else:
            sized = "from the free device memory"
        raise ValueError(
            f"the KV pool of {num_pages * config.kv_page_size} tokens ({sized}) cannot be allocated; lower "
            f"max_num_seqs or max_model_len, or set kv_cache_tokens. {str(e).splitlines()[0]}"
        ) from e


def first_calls(runners: Iterable[GraphRunner]) -> dict[str, float]:
    """Seconds of each bucket's first decode step at warm-up, over all runners: where compiling went."""
    seconds: dict[str, float] = {}
    for runner in runners:
        for bucket, s in runner.first_call_s.items():
            seconds[str(bucket)] = seconds.get(str(bucket), 0.0) + s
    return seconds


def make_runners(model: LlamaModel, cache: KVCache, config: EngineConfig) -> StepRunners:
    """The plain runner (its prefills captured too, per bucket of token counts up to the step's
    token budget) and, with LoRA slots, one captured with them (sharing one shadow verifier, whose
    rate counts the replays of both)."""
    policy = config.graph_policy
    base = GraphRunner(model, cache, policy, prefill_buckets=policy.prefill_buckets(config.max_num_batched_tokens))
    if model.lora is None:
        return StepRunners(base)
    lora = GraphRunner(model, cache, policy, lora=True)
    lora.shadow = base.shadow
    return StepRunners(base, lora)


def load_for_engine(config: EngineConfig, device: torch.device, tp: TPGroup | None = None):
    """(model, tokenizer, eos ids, revision) for the checkpoint the config names. The tokenizer loads
    in a thread while the weights are read and copied (importing transformers and parsing a
    tokenizer is a second or two of a warm start that needs the device for nothing)."""
    model_dir = resolve_model_dir(config.model)
    cfg = load_config(model_dir)
    max_len = min(config.max_model_len, cfg.max_position_embeddings)
    if max_len < config.max_model_len:
        log.warning(
            "max_model_len=%d is more than %s was trained for: serving max_model_len=%d (its max_position_embeddings)",
            config.max_model_len,
            model_dir.name,
            max_len,
        )
    if max_len < 2:
        raise ValueError(
            f"max_model_len {max_len} (the config's {config.max_model_len}, the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}): a sequence needs at least 2 positions, a prompt token and one generated"
        )
    dtype = DTYPES[config.dtype] if config.dtype else None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, model_dir)
        model = load_model(model_dir, max_len, device, dtype, tp=tp)
        tokenizer = tokenizer.result()
    return model, tokenizer, eos_ids(cfg, tokenizer), config.model_revision or model_revision(model_dir)


def grammar_compiler(tokenizer, eos_token_ids: set[int], vocab_size: int) -> GrammarCompiler | None:
    """The compiler of response_format schemas for this tokenizer (none without one)."""
    return None if tokenizer is None else GrammarCompiler(tokenizer, tuple(sorted(eos_token_ids)), vocab_size)


def eos_ids(cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: its config's and its tokenizer's."""
    eos = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


class LLMEngine:
    """Construction takes the engine through MODEL_LOADED -> EAGER_WARMED -> GRAPH_CAPTURED -> READY:
    by the time it returns, every graph the policy allows is captured and verified. With tensor
    parallelism this is rank 0: `channel` hands each model call's inputs to the other ranks. The
    tokenizer is what response_format schemas compile against; without it they are refused.
    `load_s`: how long reading the model took, the first phase of the start (`startup.py`)."""

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        revision: str = "random",
        channel: StepChannel | None = None,
        load_s: float = 0.0,
        tokenizer=None,
    ) -> None:
        clock = StartupClock(load_s)
        self.model = model
        self.config = config
        self.revision = revision
        self.state = EngineState.MODEL_LOADED
        self.device = model.embed.weight.device
        self.max_model_len = model.max_model_len
        self.eos_token_ids = set(eos_token_ids)
        with clock.phase("allocate"):
            self.cache = prepare_model(model, config)
        self.scheduler = Scheduler(
            self.cache.num_slots,
            self.max_model_len,
            config.max_waiting,
            config.max_num_batched_tokens,
            vocab_size=model.cfg.vocab_size,
            blocks=BlockManager(self.cache.num_pages, self.cache.page_size, reserved=1),
            prefix_caching=config.enable_prefix_caching,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_prefill_delay_s=config.max_prefill_delay_ms / 1e3,
        )
        self.stats = EngineStats(revision, model.attention_backend.name)
        self.sampler = BatchSampler(self.cache.num_slots, model.cfg.vocab_size, self.device)
        self.runners = make_runners(model, self.cache, config)
        self.runner = self.runners.base
        self.adapter_slots = AdapterSlots(model.lora.max_loras) if model.lora else None
        # adapters whose last load here was refused, name -> {"path", "reason"}: listed for operators,
        # kept from /v1/models; a later request loads again (files mended, new weights) and clears it
        self.refused_adapters: dict[str, dict[str, str]] = {}
        self._adapter_loads = 0  # adapters loaded into slots so far: each load's generation
        # slot -> the load it holds: its generation, and the version of the files it read (`adapter_version`)
        self._slot_load: dict[int, tuple[int, tuple]] = {}
        self._refused: list[TokenEvent] = []  # requests whose adapter failed to load at admission
        self.grammars = grammar_compiler(tokenizer, self.eos_token_ids, model.cfg.vocab_size)
        self._compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}  # waiting for their grammar
        self.channel = channel
        # followers take each step's tokens from the channel, which has them only once read
        self.async_scheduling = config.async_scheduling and channel is None
        self._in_flight: InFlight | None = None
        self._step_device_s = 0.0  # the device time of the last decode step read
        try:
            self.runners.prepare(on_state=self._set_state)
            for runner in self.runners.all:
                clock.add(runner.phase_s)
            with clock.phase("warmup"):
                self._warm_first_token_path()
        except Exception:
            self.state = EngineState.FAILED
            raise
        clock.stop()
        self.startup = clock.report() | {
            "compiled_graphs": sum(r.graphs for r in self.runners.all),
            "first_call_s": first_calls(self.runners.all),
        }
        self.state = EngineState.READY
        buckets = sum(len(r.table.ready) for r in self.runners.all)
        log.info(
            "engine READY in %s; %d buckets captured, %d compiled graphs",
            clock.summary(),
            buckets,
            self.startup["compiled_graphs"],
        )

    @torch.inference_mode()
    def _warm_first_token_path(self) -> None:
        """Prefills into the scratch slot, and sampling of their logits, before READY. A process's
        first prefill pays one-time set-up, and on CUDA a prefill of a new total length loads
        kernels not used before (both measured in `bench/results/prefill_shapes_h200.md`): a ladder
        of sizes up to the largest prefill moves that cost from the first requests to startup.
        Greedy and filtered sampling run once each for the same reason, and so do penalties,
        logit_bias and logprobs."""
        ladder = prefill_sizes(self.config.max_num_batched_tokens, self.max_model_len)
        for lens in ladder if self.device.type == "cuda" else ladder[:1]:
            batch = PrefillInputs.scratch(lens, self.cache.scratch_slot)
            self._send(PREFILL, batch)
            logits, _ = self.runner.prefill(batch)
        if self.runners.lora is not None:  # the LoRA path's first call pays its own set-up
            batch = batch._replace(adapters=[1] * len(batch.tokens))
            self._send(PREFILL, batch)
            self.runners.lora.prefill(batch)
        # A prefill after a cached prefix reads it back from the pages: its own first call too.
        half = max(1, min(self.cache.page_size, self.max_model_len // 2))
        context = PrefillInputs.scratch([half], self.cache.scratch_slot, context=half)
        self._send(PREFILL, context)
        self.runner.prefill(context)
        rows = len(lens)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=50, top_p=0.9)):
            sample(logits, [params] * rows, [0] * rows, [0] * rows).tolist()
        self.sampler.sample(logits[:1], self.sampler.probe(1))
        everything = torch.full((1, (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=self.device)
        apply_token_bitmask(logits[:1].float(), torch.zeros(1, dtype=torch.long, device=self.device), everything)

    @classmethod
    def from_config(cls, config: EngineConfig) -> tuple[LLMEngine, object]:
        """Load the checkpoint named by the config (or the default); returns (engine, tokenizer)."""
        t0 = time.perf_counter()
        model, tokenizer, eos, revision = load_for_engine(config, resolve_device(config.device))
        return cls(model, config, eos, revision, tokenizer=tokenizer, load_s=time.perf_counter() - t0), tokenizer

    def status(self) -> EngineStatus:
        """What operators see per replica: state, revision, backend, buckets, counters."""
        return EngineStatus(
            state=self.state.value,
            max_model_len=self.max_model_len,
            model_revision=self.revision,
            attention_backend=self.model.attention_backend.name,
            buckets={k: v for r in self.runners.all for k, v in r.report().items()},
            compile_s=sum(r.compile_s for r in self.runners.all),
            stats={**self.stats.snapshot(), "shadow": self.runner.shadow.report()},
            memory_mb={
                "weights": sum(t.nbytes for t in self.model.parameters()) / MB,
                "kv_pool": self.cache.nbytes / MB,
                "graphs": sum(r.graph_memory_mb() for r in self.runners.all),
                **({"lora": self.model.lora.nbytes / MB} if self.adapter_slots else {}),
            },
            kv_cache=KvCacheStatus(
                page_size=self.cache.page_size,
                pages=self.cache.num_pages - 1,
                pages_free=self.scheduler.blocks.num_free,
                pages_cached=self.scheduler.blocks.prefix.num_cached,
                max_num_seqs=self.cache.num_slots,
                preemptions=self.scheduler.num_preempted,
            ),
            lora=self._lora_status(),
            startup=self.startup,
            prefill_buckets=self.runner.prefill_graphs.report() if self.runner.prefill_graphs else None,
        )

    def _lora_status(self) -> dict | None:
        lora = self.model.lora
        if self.adapter_slots is None:  # LoRA off here, even if another engine gave the model slots
            return None
        return {
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_rank,
            "target_modules": list(lora.targets),
            "adapters": self.adapter_slots.report(),
            "refused": {name: dict(why) for name, why in self.refused_adapters.items()},
        }

    def _set_state(self, state: EngineState) -> None:
        self.state = state

    def _send(self, op: int, batch: DecodeInputs | PrefillInputs | None = None) -> None:
        """Hand a model call's inputs to the follower ranks (nothing to do without tensor parallelism)."""
        if self.channel is not None:
            self.tell_followers(op, batch.rows if batch else 0, batch.to_ints() if batch else None)

    def tell_followers(self, op: int, rows: int = 0, values: list[int] | None = None) -> None:
        """Send the follower ranks one operation (`workers/tensor_parallel/tp.py`); none without TP."""
        if self.channel is not None:
            self.channel.send(op, rows, values)

    def agree(self, problem: str | None, ends_swap: bool = False) -> list[int]:
        """Every rank's vote on what it did since the last one (this rank's `problem`, if any): the
        ranks that failed. `ends_swap`: the followers then keep their new weights or put the old back."""
        if self.channel is None:
            return [] if problem is None else [0]
        self.tell_followers(AGREE, int(ends_swap))
        return agree(self.channel.tp, self.device, problem)

    def heartbeat(self) -> None:
        """Tell follower ranks rank 0 is alive while there is nothing to do."""
        self._send(NOOP)

    def stop_followers(self) -> None:
        self._send(STOP)

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        graph_denial: FallbackReason | None = None,
        adapter: AdapterKey | None = None,
        output_ids: Iterable[int] = (),
    ) -> Sequence:
        """Queue a new request, or with output_ids one continued from where another engine left it."""
        seq = new_sequence(prompt_ids, params, request_id, graph_denial, adapter, output_ids)
        self.add_sequence(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a request. One with a LoRA adapter gets its slot now when one is free (loading and
        verifying the adapter if no slot holds it: a refusal is this request's InvalidRequest),
        else when it reaches the head of the queue (a queued request's slot gives way to the head's
        need, `_unpin_queued`). One with a response_format waits apart until
        its grammar is compiled (in a thread; the others decode meanwhile), then is queued."""
        if seq.adapter is not None and self.adapter_slots is None:
            raise InvalidRequest(f"adapter {seq.adapter[0]!r}: LoRA is not enabled on this server (lora: unset)")
        if self.find(seq.request_id) is not None:  # queued, running, or waiting for its grammar
            raise InvalidRequest(f"request id {seq.request_id!r} is already in use")
        if seq.params.json_schema is None:
            self._queue(seq)
            return
        if self.grammars is None:
            raise InvalidSchema("this engine was started without its tokenizer: it cannot compile a schema")
        self._compiling[seq.request_id] = (seq, self.grammars.compile(seq.params.json_schema))

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        if seq.adapter is not None:
            try:
                self._grant_adapter(seq)
            except InvalidRequest:
                self.scheduler.finish(seq, "error")
                raise

    def check_adapter(self, name: str, path: str) -> dict:
        """Load (if no slot holds it) and verify an adapter without a request: what an operator's
        registration runs first. Raises InvalidRequest naming why it cannot be served."""
        if self.adapter_slots is None:
            raise InvalidRequest("LoRA is not enabled on this server (lora: unset)")
        start = time.perf_counter()
        seq = new_sequence([0], SamplingParams(max_tokens=1), adapter=(name, path))
        if not self._grant_adapter(seq):
            raise InvalidRequest(
                f"adapter {name!r}: every one of the {self.adapter_slots.max_loras} slots "
                "is in use by running requests; try again"
            )
        self._release_adapter(seq)
        return {"name": name, "slot": self.adapter_slots.slot_of((name, path)), "seconds": time.perf_counter() - start}

    def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        """Read each adapter's config (name -> path; no tensors) against this engine's slots: those
        it refuses are remembered as a refused load is, so /v1/models leaves them out before anyone
        asks for them (a restart that lowered max_lora_rank). Returns name -> why, of those."""
        if self.adapter_slots is None:
            return {}
        lora = self.model.lora
        refused = {}
        for name, path in adapters.items():
            why = screen_adapter(path, self.model.cfg.num_layers, lora.max_rank, lora.targets)
            if why is not None:
                refused[name] = why
                self.refused_adapters[name] = {"path": path, "reason": why}
        return refused

    def _grant_adapter(self, seq: Sequence) -> bool:
        """Pin a slot holding seq's adapter (loading it into the least recently used idle slot if
        none does); False when every slot is pinned by other adapters' requests."""
        if seq.adapter_slot:
            return True
        grant = self.adapter_slots.acquire(seq.adapter)
        if grant is not None and not grant.load and self._slot_load[grant.slot][1] != adapter_version(seq.adapter[1]):
            # its files changed since they were loaded (an adapter retrained into the same directory):
            # this request and later ones load them again; requests of the old load keep their slot
            self.adapter_slots.release(grant.slot)
            self.adapter_slots.drop(seq.adapter)
            grant = self.adapter_slots.acquire(seq.adapter)
        if grant is None:
            return False
        if grant.load:
            try:
                self._load_adapter(grant.slot, seq.adapter)
            except BaseException as e:  # whatever failed, the slot must not stay pinned or named for it
                self.adapter_slots.release(grant.slot)
                self.adapter_slots.drop(seq.adapter)
                self.stats.record_adapter_load("refused", 0.0)
                if isinstance(e, AdapterError):
                    self.refused_adapters[seq.adapter[0]] = {"path": seq.adapter[1], "reason": str(e)}
                    raise InvalidRequest(f"adapter {seq.adapter[0]!r} cannot be served: {e}") from e
                raise
        self.refused_adapters.pop(seq.adapter[0], None)
        seq.adapter_slot = grant.slot
        seq.cache_salt = adapter_salt(*seq.adapter, self._slot_load[grant.slot][0])
        return True

    def _load_adapter(self, slot: int, key: AdapterKey) -> None:
        """Copy an adapter into a slot (every rank), then verify it: a probe step with it must
        replay what eager computes. Nothing is captured again: the graphs read the slots."""
        self.launch_draw()  # its probe step writes the logits the step in flight may hold undrawn
        name, path = key
        lora = self.model.lora
        version = adapter_version(path)  # before the read: a change during it loads again next time
        adapter = load_adapter(path, name, self.model.cfg, lora.max_rank, self.device)
        lora.check(adapter)  # before the followers are told: they must not fail where rank 0 refuses
        others = sorted(s for s in self.adapter_slots.holder if s != slot)
        start = time.perf_counter()
        if self.channel is not None:
            self.channel.send(LORA_LOAD, slot, [len(others), *others, *path.encode()])
        lora.load(slot, adapter)
        if self.device.type == "cuda":  # the copy runs on the stream: time it to its end (loads are rare)
            torch.cuda.synchronize(self.device)
        loaded = time.perf_counter() - start
        why = self.runners.lora.check_adapter(slot, others)
        if why is not None:
            raise AdapterError(f"verification: a probe step with it did not replay what eager computes: {why}")
        self._adapter_loads += 1
        self._slot_load[slot] = (self._adapter_loads, version)  # KV cached with an earlier load is not reused
        self.stats.record_adapter_load("loaded", loaded)

    def forget_adapters(self) -> None:
        """Empty every adapter slot's entry (with no requests running): the next request for each
        adapter loads and verifies it again."""
        if self.adapter_slots is not None:
            self.adapter_slots = AdapterSlots(self.adapter_slots.max_loras)
        self.refused_adapters.clear()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix: what new weights compute differs from what the pages hold."""
        self.scheduler.blocks.clear_prefix_cache()

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_slot:
            self.adapter_slots.release(seq.adapter_slot)
            seq.adapter_slot = 0

    def _admissible(self, seq: Sequence) -> bool:
        """Admission's hook: a request waits while its adapter has no slot; one whose adapter
        fails to load now ends with that error."""
        if seq.adapter is None:
            return True
        try:
            return self._grant_adapter(seq) or (self._unpin_queued(seq) and self._grant_adapter(seq))
        except InvalidRequest as e:
            self.scheduler.finish(seq, "error")
            self._refused.append(self._refusal(seq, e))
            return False

    def _refusal(self, seq: Sequence, error: Exception) -> TokenEvent:
        """The last event of a request refused after it was accepted, counted as it finished."""
        seq.finish_reason = "error"
        self.stats.record_finish("error", None, None)
        return TokenEvent(seq.request_id, [], "error", error)

    def _unpin_queued(self, head: Sequence) -> bool:
        """Release the slots that requests queued behind the queue's `head` pinned when they
        arrived: they cannot run before it, so a slot pinned only by them must not keep it waiting
        (for ever, when nothing running holds the slot). They pin a slot again when they reach the
        head, loading their adapter again if its slot went to another. Whether any was released."""
        queued = [s for s in self.scheduler.waiting if s is not head and s.adapter_slot]
        for seq in queued:
            self._release_adapter(seq)
            seq.cache_salt, seq.page_hashes = None, []  # its salt names the load it will pin
        return bool(queued)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request from outside the step loop: `abort` (its client left) or `stop` (a stop
        string found in its detokenized text)."""
        parked = self._compiling.pop(request_id, None)
        if parked is not None:
            parked[0].finish_reason = reason
            self.stats.record_finish(reason, None, None)
            return True
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.launch_draw()  # the step in flight may hold its row
        self.scheduler.finish(seq, reason)
        self._release_adapter(seq)
        self.stats.record_finish(reason, None, None)
        return True

    def find(self, request_id: str) -> Sequence | None:
        """A request not finished yet: queued, running, or waiting for its grammar."""
        parked = self._compiling.get(request_id)
        return parked[0] if parked is not None else self.scheduler.find(request_id)

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._compiling) or self._in_flight is not None

    def _take_compiled(self, events: dict[str, TokenEvent]) -> None:
        """Queue the requests whose grammar is ready (a continuation's replays the tokens its client
        has); one whose schema did not compile ends with that error, its 400."""
        if not self.scheduler.num_unfinished:  # nothing else to do: wait for a compile rather than spin
            futures = [future for _, future in self._compiling.values()]
            done, _ = concurrent.futures.wait(futures, COMPILE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
            if not done:
                self.heartbeat()
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                compiled = future.result()
            except InvalidRequest as e:
                error = e
            except Exception as e:  # whatever else the grammar engine raised: the schema is what it could not take
                error = InvalidSchema(f"the JSON schema could not be compiled: {type(e).__name__}: {e}")
            else:
                try:
                    seq.grammar = self.grammars.grammar(compiled)
                    seq.grammar.replay(seq.output_ids)
                    self._queue(seq)
                    continue
                except (InvalidRequest, QueueFull) as e:
                    error = e
            events[request_id] = self._refusal(seq, error)

    @torch.inference_mode()
    def step(self, first_tokens: Callable[[list[TokenEvent]], None] | None = None) -> list[TokenEvent]:
        """One step: admissions, this step's prefill chunks, then a token for every running
        sequence; the events of the step. With `first_tokens`, what the prefill produced (a new
        request's first token, the end of one that wanted one token) goes out through it as soon
        as it is sampled, before the decode is launched: a first token does not wait for the running
        batch's step (which also gives it its second), and the events returned are the rest."""
        events: dict[str, TokenEvent] = {}
        if self._compiling:
            self._take_compiled(events)
        # rows whose drawn token is their last by length: not decoded again, so neither budget nor a position for them
        ending = self._ending()
        admitted = self.scheduler.admit(self._admissible if self.adapter_slots else lambda seq: True, idle=ending)
        for refused in self._refused:
            events[refused.request_id] = refused
        self._refused.clear()
        # before this step's device work (it may write the logits) and preemption (it frees slots the draw reads)
        self.launch_draw()
        if self.scheduler.chunks:
            start = time.perf_counter()
            self._prefill(self.scheduler.chunks, admitted, events)
            self.stats.record_busy("prefill", time.perf_counter() - start)
            if first_tokens is not None and events:
                first_tokens(list(events.values()))
                events = {}
        if self.scheduler.running:
            self.scheduler.reserve_decode(ending)  # may preempt the newest: they wait to be prefilled again
        batch = [s for s in self.scheduler.running.values() if not s.in_prefill]
        if batch:
            start = time.perf_counter()
            self._decode(batch, events, self.scheduler.take_edits(), ending)
            self.stats.record_busy("decode", time.perf_counter() - start)
        elif self._in_flight is not None:
            self._take(events)
        return list(events.values())

    def _prefill(self, chunks: list[Sequence], admitted: list[Sequence], events: dict[str, TokenEvent]) -> None:
        """This step's prefill chunks in one call; the sequences whose last chunk this was sample
        their first token."""
        if self.scheduler.prefix_caching and admitted:  # tokens looked up in the prefix cache, and found there
            self.stats.record_prefix_cache(sum(s.length for s in admitted), sum(s.prefill_start for s in admitted))
        batch = PrefillInputs.of(chunks, self.scheduler.take_edits())
        # a request denied graphs makes the whole call eager (the graphs' eager twin: same numbers)
        denial = next((s.graph_denial for s in chunks if s.graph_denial is not None), None)
        self._send(PREFILL if denial is None else EAGER_PREFILL, batch)
        runner = self.runners.of(batch)
        logits, d = runner.prefill(batch, graphs=denial is None)
        rows = [i for i, s in enumerate(chunks) if s.prefill_end == s.length]
        reason = denial or d.reason
        padding = (d.bucket or len(batch.tokens)) - len(batch.tokens)
        self.stats.record_prefill(
            len(rows),
            len(batch.tokens),
            d.mode.value,
            runner.bucket_id(d.bucket) if d.decode_rows else runner.prefill_bucket_id(d.bucket),
            reason.value if reason else "none",
            padding,
        )
        if rows:
            seqs = [chunks[i] for i in rows]
            self.sampler.admit(seqs)
            self._accept(seqs, *self.sampler.sample(logits[rows] if len(rows) < len(chunks) else logits, seqs), events)

    def _decode(self, seqs: list[Sequence], events: dict[str, TokenEvent], pages: list[int], ending: set[str]) -> None:
        """One token for every running sequence: the step launched and drawn; its tokens are read
        now, or with async scheduling by the next step, once that is launched (then this step's
        events are the step before's tokens)."""
        flight = self._in_flight
        if flight is not None and (any(s.graph_denial is not None for s in seqs) or self._fill_outlasts_step(flight)):
            # a denied row's eager call takes its token from the host
            self._take(events)
            flight = None
            seqs = [s for s in seqs if s.finish_reason is None]
        drawn = None
        if flight is not None:
            seqs, drawn = self._continue(flight, seqs, ending)
        if seqs:
            logits, timer = self._forward(seqs, pages, drawn)
        if flight is not None:
            self._take(events)  # the step before's tokens, while the device runs this one
        if not seqs:
            return
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        if len(live) < len(seqs):  # ended on the tokens just read: their rows are dropped
            seqs = [seqs[i] for i in live]
            logits = logits[on_device(live, torch.int64, logits.device)]
        if self.async_scheduling and self.sampler.filling:  # drawn by the next step, once the masks are filled
            self._in_flight = InFlight(seqs, timer, logits=logits)
            return
        self._in_flight = InFlight(seqs, timer, self.sampler.draw(logits, seqs))
        if not self.async_scheduling:
            self._take(events)

    @torch.inference_mode()
    def launch_draw(self) -> None:
        """Launch the draw of the step in flight, if it waits for its masks (see `InFlight`): before
        anything else reaches the device or changes its rows' slots."""
        flight = self._in_flight
        if flight is not None and flight.draw is None:
            start = time.perf_counter()
            flight.draw, flight.logits = self.sampler.draw(flight.logits, flight.seqs), None
            self.stats.record_busy("decode", time.perf_counter() - start)

    def _fill_outlasts_step(self, flight: InFlight) -> bool:
        """Whether the masks the in-flight rows draw under next are filled ahead, and the last fill
        ahead took longer than the device's step. Then this step reads first and launches while the
        masks fill (the synchronous order): launched first, the launch adds to the fill, which the
        device's step cannot hide."""
        if self.sampler.masks.last_fill_s <= self._step_device_s:
            return False
        return sum(s.grammar is not None for s in flight.seqs) >= AHEAD_MIN_ROWS

    def _continue(
        self, flight: InFlight, seqs: list[Sequence], ending: set[str]
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        """The step's rows with the in-flight step's rows first, in its order, and their drawn
        tokens (still on the device) as those rows' inputs. The `ending` rows are left out: they
        end when their token is read."""
        in_batch = {id(s) for s in seqs}
        rows = [i for i, s in enumerate(flight.seqs) if id(s) in in_batch and s.request_id not in ending]
        in_flight = {id(s) for s in flight.seqs}
        rest = [s for s in seqs if id(s) not in in_flight]
        if not rows:
            return rest, None
        tokens = flight.draw.tokens
        in_order = rows[-1] == len(rows) - 1  # the in-flight rows continue in place: no gather
        drawn = tokens[: len(rows)] if in_order else tokens[on_device(rows, torch.int64, tokens.device)]
        return [flight.seqs[i] for i in rows] + rest, drawn

    def _ending(self) -> set[str]:
        """The running sequences whose token in flight is their last by max_tokens or max_model_len."""
        if self._in_flight is None:
            return set()
        return {
            s.request_id
            for s in self._in_flight.seqs
            if s.finish_reason is None
            and (len(s.output_ids) + 1 >= s.params.max_tokens or s.length + 1 >= self.max_model_len)
        }

    def _forward(
        self, seqs: list[Sequence], pages: list[int], drawn: torch.Tensor | None
    ) -> tuple[torch.Tensor, CallTimer]:
        """Launch the step's model calls: its logits, and its calls' timer. Rows whose request may
        not use graphs run eager in a second call (never with `drawn` tokens); the others still
        replay (they are not dragged to eager). The step's block-table edits go with its first
        model call."""
        allowed, denied = split_by_permission([s.graph_denial for s in seqs])
        timer = CallTimer(self.device)
        if not denied:
            with timer.call("graph", len(seqs)):
                logits = self._decode_rows(seqs, pages, drawn)
        else:
            logits = torch.empty(len(seqs), self.model.cfg.vocab_size, device=self.device)
            if allowed:
                with timer.call("graph", len(allowed)):
                    logits[allowed] = self._decode_rows([seqs[i] for i in allowed], pages).float()
                pages = []
            rows = [i for group in denied.values() for i in group]
            batch = DecodeInputs.of([seqs[i] for i in rows], pages)
            self._send(EAGER, batch)
            # A rollout compares its cohort's calls with the holdback's; tenant-disabled rows are neither.
            cohort = "holdback" if FallbackReason.ROLLOUT_HOLDBACK in denied else None
            with timer.call(cohort, len(rows)):
                logits[rows] = self.runners.of(batch).eager(batch).float()
            for reason, group in denied.items():
                self.stats.record_step("eager", "none", reason.value, len(group), 0)
        self.stats.record_decode(len(seqs))
        return logits, timer

    def _take(self, events: dict[str, TokenEvent]) -> None:
        """Read the in-flight step's tokens and take them."""
        flight, self._in_flight = self._in_flight, None
        self._accept(flight.seqs, *flight.draw.read(), events)
        calls = flight.timer.results()  # the draw read: every call has ended
        for cohort, rows, seconds in calls:
            self.stats.record_cohort_call(cohort, rows, seconds)
        self._step_device_s = sum(seconds for _, _, seconds in calls)

    def _decode_rows(self, seqs: list[Sequence], pages: list[int], drawn: torch.Tensor | None = None) -> torch.Tensor:
        batch = DecodeInputs.of(seqs, pages, 0 if drawn is None else len(drawn))
        self._send(DECODE, batch)
        runner = self.runners.of(batch)
        logits, d = runner.decode(batch, drawn)
        reason = d.reason.value if d.reason else "none"
        padding = (d.bucket or len(seqs)) - len(seqs)
        self.stats.record_step(d.mode.value, runner.bucket_id(d.bucket), reason, len(seqs), padding)
        return logits

    def _accept(
        self,
        seqs: list[Sequence],
        drawn: list[int],
        logprobs: list[TokenLogprob | None] | None,
        events: dict[str, TokenEvent],
    ) -> None:
        """Record the token drawn for each sequence, and retire sequences that are done. A sequence
        that ended while its token was drawn (aborted, or a stop string found) takes none.

        The grammars take their tokens first, and the next masks of the rows that go on are filled
        on the filler's pool while the rest of this step is recorded, the next prepared and launched:
        the next draw waits for them, and a step of many constrained rows is as long as the host's
        path from the tokens' read to that draw, when that is longer than the device's step."""
        now = time.monotonic()
        if self.adapter_slots is not None:
            self.stats.record_adapter_tokens(Counter(s.adapter[0] for s in seqs if s.adapter is not None))
        endings = [self._end_on(seq, token) for seq, token in zip(seqs, drawn)]
        self.sampler.fill_ahead([s for s, e in zip(seqs, endings) if e is None and s.finish_reason is None])
        for i, (seq, token, ending) in enumerate(zip(seqs, drawn, endings)):
            if seq.finish_reason is not None:
                continue
            kept = None if seq.params.logprobs is None else []  # the logprobs of its tokens, when it asked for them
            event = events.setdefault(
                seq.request_id, TokenEvent(seq.request_id, [], logprobs=kept, cached_tokens=seq.cached_tokens)
            )
            if ending is not None and not ending.takes_token:
                self._retire(seq, ending.reason, event)
                event.error = ending.error
                continue
            seq.output_ids.append(token)
            event.token_ids.append(token)
            if event.logprobs is not None:
                event.logprobs.append(logprobs[i])
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
            if ending is not None:
                self._retire(seq, ending.reason, event)

    def _end_on(self, seq: Sequence, token: int) -> Ending | None:
        """How the sequence ends on this token (None: it goes on), its grammar advanced by it. The
        only place a step touches a grammar before its next mask's fill."""
        if seq.finish_reason is not None:
            return None
        p = seq.params
        # first: a grammar that failed (a limit of llguidance's hit mid-way) allows only EOS
        if seq.grammar is not None and not seq.grammar.accept(token):
            return Ending("error", takes_token=False, error=self._grammar_failure(seq, token))
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return Ending("stop", takes_token=False)
        if seq.grammar is not None and seq.grammar.done:  # the document is complete
            return Ending("stop")
        if len(seq.output_ids) + 1 >= p.max_tokens or seq.length + 1 >= self.max_model_len:
            return Ending("length")
        return None

    def _grammar_failure(self, seq: Sequence, token: int) -> InvalidSchema:
        """The error of a grammar that refused its drawn token. A grammar that failed (a limit of
        llguidance's, a `$ref` loop) allowed only EOS, so its mask allowed the token; a mask that
        did not is a fault of the engine's (its draw did not apply the mask it was filled with), and
        is logged as one."""
        error = f"the JSON schema's grammar failed after {len(seq.output_ids)} tokens: {seq.grammar.error}"
        if self.sampler.mask_allowed(seq, token) is False:
            log.error(
                "request %s drew token %d, which its grammar's mask did not allow (slot %d)",
                seq.request_id,
                token,
                seq.slot,
            )
            error += f" (token {token} was drawn outside its mask: an engine fault)"
        return InvalidSchema(error)

    def _retire(self, seq: Sequence, reason: str, event: TokenEvent) -> None:
        self.scheduler.finish(seq, reason)
        self._release_adapter(seq)
        event.finish_reason = reason
        ttft = tpot = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
            if len(seq.output_ids) > 1:
                tpot = (seq.last_token_time - seq.first_token_time) / (len(seq.output_ids) - 1)
        self.stats.record_finish(reason, ttft, tpot)
