"""The gate a model passes before a swap lets it serve, and the in-place swap of weights behind it.

A new checkpoint can be wrong in ways that load fine: NaN or inf weights, weights that captured
graphs do not read (a parameter whose storage was replaced instead of written), numerics a graph
gets wrong. The gate checks, on an engine with no live sequences:
1. an eager prefill of golden prompts gives finite logits (this part needs no graphs: CPU too);
2. every captured bucket replays what eager computes on probe batches (`GraphRunner.check_buckets`);
3. the golden prompts decoded greedily through the graphs give the tokens eager decoding gives;
4. optionally, an operator's JSON-lines file of {"prompt", "completion"} decodes greedily to each
   completion.
It withdraws nothing, so a failed in-place swap can copy the old weights back (kept on the host)
and serve on with the graphs it had. Counters restart after a gate: they are the new model's.

With tensor parallelism rank 0 runs the gate and every step of it reaches the other ranks as usual;
each rank checks its own buckets and loads its own shard, and all vote before the swap is kept: one
rank's failure undoes it on every rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from policies.dispatch import FallbackReason
from workers.model_runner.step_inputs import PrefillInputs
from workers.modeling.checkpoint import load_weights, model_revision
from workers.modeling.checkpoint_dir import load_tokenizer
from workers.modeling.config import load_config
from workers.modeling.default_model import model_dir as resolve_model_dir
from workers.serving.engine import LLMEngine, eos_ids, grammar_compiler
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams
from workers.serving.stats import EngineStats
from workers.tensor_parallel.tp import CHECK_BUCKETS, EAGER_PREFILL, SWAP_LOAD, restore_weights

GOLDEN_PROMPTS = 4  # rows of one decode batch: a captured bucket of the smallest ladders
GOLDEN_PROMPT_LEN = 12
GOLDEN_TOKENS = 8


class GateFailed(RuntimeError):
    """The model did not pass the gate; the message says which check and the numbers."""


def golden_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(20261201)
    return torch.randint(0, vocab_size, (GOLDEN_PROMPTS, GOLDEN_PROMPT_LEN), generator=g).tolist()


@torch.inference_mode()
def run_gate(engine: LLMEngine, tokenizer, prompts_file: str | None) -> dict:
    """Raise GateFailed at the first check that fails; else what was checked, and how long it took."""
    if engine.has_work():
        raise GateFailed("the engine still has requests: the gate needs it drained")
    start = time.perf_counter()
    prompts = golden_prompts(engine.model.cfg.vocab_size)
    _eager_probe(engine, prompts)
    engine.tell_followers(CHECK_BUCKETS)
    failed = {bucket: d for r in engine.runners.all for bucket, d in r.check_buckets().items()}
    if failed:
        engine.agree("buckets disagree")
        raise GateFailed("graphs disagree with eager: " + "; ".join(f"{b}: {d}" for b, d in failed.items()))
    ranks = engine.agree(None)
    if ranks:
        raise GateFailed(f"tensor-parallel rank(s) {ranks} failed the gate (their logs say why)")
    graphs = _greedy(engine, prompts, GOLDEN_TOKENS, None)
    eager = _greedy(engine, prompts, GOLDEN_TOKENS, FallbackReason.DISABLED)
    for i, (g, e) in enumerate(zip(graphs, eager, strict=True)):
        if g != e:
            raise GateFailed(f"golden prompt {i}: graph decoding gave {g}, eager {e}")
    checked = len(_operator_prompts(engine, tokenizer, prompts_file)) if prompts_file else 0
    engine.stats = EngineStats(engine.revision, engine.model.attention_backend.name)
    engine.runner.shadow.results.clear()
    return {
        "buckets": len(engine.runner.table.ready),
        "golden_prompts": len(prompts),
        "operator_prompts": checked,
        "seconds": time.perf_counter() - start,
    }


def _eager_probe(engine: LLMEngine, prompts: list[list[int]]) -> None:
    lens = [len(p) for p in prompts]
    n = sum(lens)
    batch = PrefillInputs(
        [t for p in prompts for t in p],
        [i for m in lens for i in range(m)],
        [engine.cache.scratch_slot] * n,
        [0] * n,
        lens,
    )
    engine._send(EAGER_PREFILL, batch)
    logits, _ = engine.runner.prefill(batch, graphs=False)
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise GateFailed(f"eager probe: {bad} of {logits.numel()} logits are not finite (NaN or inf weights?)")


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, denial: FallbackReason | None) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params, f"gate-{i}", denial) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [list(s.output_ids) for s in seqs]


def _operator_prompts(engine: LLMEngine, tokenizer, path: str) -> list[dict]:
    """Each line's prompt, decoded greedily (stopping at EOS) for its `max_tokens` (default: as many
    tokens as its completion has), must give exactly that completion."""
    try:
        cases = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise GateFailed(f"gate_prompts_file {path}: {e}") from e
    for i, case in enumerate(cases, 1):
        if not (
            isinstance(case, dict)
            and isinstance(case.get("prompt"), str)
            and isinstance(case.get("completion"), str)
            and isinstance(case.get("max_tokens", 1), int)
        ):
            raise GateFailed(
                f"gate_prompts_file {path}, line {i}: want "
                '{"prompt": str, "completion": str, optional "max_tokens": int}'
            )
        n = case.get("max_tokens") or len(tokenizer(case["completion"], add_special_tokens=False)["input_ids"])
        seq = engine.add_request(
            tokenizer(case["prompt"])["input_ids"],
            SamplingParams(max_tokens=max(1, n), temperature=0.0),
            f"gate-file-{i}",
        )
        while engine.has_work():
            engine.step()
        got = tokenizer.decode([t for t in seq.output_ids if t not in engine.eos_token_ids], skip_special_tokens=True)
        if got != case["completion"]:
            raise GateFailed(f"gate_prompts_file line {i}: expected {case['completion']!r}, got {got!r}")
    return cases


def same_shapes(old_dir: Path, new_dir: Path) -> bool:
    """Whether new_dir's model has old_dir's architecture and every shape (then weights load in place)."""
    return load_config(old_dir) == load_config(new_dir)


def swap_weights_in_place(engine: LLMEngine, config: EngineConfig):
    """Load the weights of `config.model` (a checkpoint of the same shapes) into the engine's
    parameters, so graphs keep their addresses, and gate them, on every rank. On failure anywhere
    the old weights, kept on the host, are copied back on every rank and GateFailed (or the load's
    error) is raised: the engine serves the old model as before. Returns (tokenizer, gate report)."""
    if engine.has_work():
        raise GateFailed("the engine still has requests: a swap needs it drained")
    model_dir = resolve_model_dir(config.model)
    saved = [(p, p.data, p.data.to("cpu", copy=True)) for p in engine.model.parameters()]
    names = [name for name, _ in engine.model.named_parameters()]
    old = engine.config, engine.revision, engine.eos_token_ids, engine.grammars
    engine.tell_followers(SWAP_LOAD, 0, list(str(model_dir).encode()))
    engine.clear_prefix_cache()  # K/V of the old weights: the gate's own prompts must not reuse them
    failure: BaseException | None = None
    try:
        load_weights(engine.model, model_dir)
        moved = [name for name, (p, data, _) in zip(names, saved) if p.data.data_ptr() != data.data_ptr()]
        if moved:
            raise GateFailed(
                f"{len(moved)} parameter(s) moved to new storage while loading (e.g. {moved[0]}): "
                "captured graphs would read the old weights"
            )
        tokenizer = load_tokenizer(model_dir)
        engine.config, engine.revision = config, config.model_revision or model_revision(model_dir)
        engine.eos_token_ids = set(eos_ids(load_config(model_dir), tokenizer))
        engine.grammars = grammar_compiler(tokenizer, engine.eos_token_ids, engine.model.cfg.vocab_size)
        report = run_gate(engine, tokenizer, config.gate_prompts_file)
    except Exception as e:
        failure = e
    ranks = engine.agree(None if failure is None else str(failure), ends_swap=True)
    if failure is None and not ranks:
        engine.forget_adapters()  # verified against the old weights: each loads and verifies again on use
        if old[3] is not None:
            old[3].close()
        return tokenizer, report
    restore_weights(saved)
    engine.cache.clear()  # what the failed model wrote (NaN, maybe) must not reach a later attention
    engine.clear_prefix_cache()  # and the pages cached meanwhile hold the failed model's K/V (or zeros now)
    engine.config, engine.revision, engine.eos_token_ids, engine.grammars = old
    if failure is not None:
        raise failure
    raise GateFailed(f"the new weights failed on tensor-parallel rank(s) {ranks} (their logs say why)")
