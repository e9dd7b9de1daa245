"""A prefill's attention over a cached context: flash attention (context gathered from the pages)
against the paged decode kernel (every new token a row), per prefill call of one model's layers.

Where the engine switches (`policies/cached_prefill.py`; the `rule` column) comes from this
table: a call of n new tokens behind a cached context of c tokens, for the 1B and 8B shapes (query
heads / KV heads / head dim 32/8/64 and 32/8/128, 16 and 32 layers), bf16, pages of 16. Each time
is the call's setup (plan, or key positions) plus every layer's attention, CUDA events around
20 repeats after 3 untimed.

    python -m bench.cached_prefill_attention --out bench/results/cached_prefill_attention_h200.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.report import write_report
from policies.cached_prefill import paged_prefill_pays
from workers.kv import prefill_attention
from workers.kv.kv_cache import KVCache
from workers.kv.prefill_attention import PrefillAttention

SHAPES = {"1b": (32, 8, 64, 16), "8b": (32, 8, 128, 32)}  # query heads, KV heads, head dim, layers
PAGE = 16


def one_call_ms(shape: str, tokens: int, context: int, paged: bool) -> float:
    heads, kv_heads, dim, layers = SHAPES[shape]
    total = context + tokens
    pages = -(-total // PAGE)
    cache = KVCache(layers, pages + 2, PAGE, 1, total, kv_heads, dim, torch.bfloat16, "cuda")
    cache.block_table[0, :pages] = torch.arange(1, pages + 1, dtype=torch.int32)
    cache.k.normal_()
    cache.v.normal_()
    slots = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    positions = torch.arange(context, total, device="cuda")
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    prefill_attention.paged_prefill_pays = lambda tokens, context_lens: paged

    def call() -> None:
        attention = PrefillAttention(cache, slots, positions, [tokens], [context], None, q)
        assert (attention.plan is not None) == paged
        for layer in range(layers):
            attention(layer, q, kv, kv)

    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2000, 4096, 8000])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        for context in args.contexts:
            for tokens in args.tokens:
                flash = one_call_ms(shape, tokens, context, paged=False)
                paged = one_call_ms(shape, tokens, context, paged=True)
                rows.append(
                    {
                        "shape": shape,
                        "context": context,
                        "tokens": tokens,
                        "flash_ms": flash,
                        "paged_ms": paged,
                        "paged_over_flash": paged / flash,
                        "rule": "paged" if paged_prefill_pays(tokens, [context]) else "flash",
                    }
                )
                print(rows[-1], flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "page_size": PAGE}
    lines = [
        "# A prefill's attention over a cached context: flash attention vs the paged decode kernel",
        "",
        "Per prefill call: setup plus every layer's attention (ms, median of 20); bf16.",
        "",
        "| shape | context | new tokens | flash ms | paged ms | paged / flash | rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['context']} | {r['tokens']} | {r['flash_ms']:.3f} | {r['paged_ms']:.3f} | "
            f"{r['paged_over_flash']:.2f} | {r['rule']} |"
        )
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
