"""Inputs for the paged decode kernels (`workers/kv/paged_attention.py`) on any device, shared by the
GPU tests and the CPU interpreter tests: sequences on random pages of a pool whose other keys and
values are large garbage, so a kernel that reads one key too many (past a row's length, on a free
page) moves the output far past the tolerance."""

from __future__ import annotations

import torch

from workers.kv.paged_attention import (
    WorkConfig,
    paged_decode,
    paged_decode_plan,
    paged_decode_reference,
    run_attention,
    run_plan,
)

GARBAGE = 30.0
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lengths_for(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, page_size + 1, 7, 33, 100, 101, 257, 1000, 2049, 3001]


def scatter(k_pages, v_pages, lengths: list[int], max_pages: int, g: torch.Generator):
    """Fill the pool with garbage, then give each sequence random pages (never page 0, the scratch
    page) holding real keys and values up to its length. Returns the block table (last row: scratch,
    all page 0) and each sequence's table row, a random permutation."""
    num_pages, page_size = k_pages.shape[:2]
    device = k_pages.device
    for pool in (k_pages, v_pages):
        pool.normal_(generator=g).mul_(GARBAGE)
    need = [cdiv(n, page_size) for n in lengths]
    pages = 1 + torch.randperm(num_pages - 1, generator=g, device=device)[: sum(need)]
    table = torch.zeros(len(lengths) + 1, max_pages, dtype=torch.int32, device=device)
    slots = torch.randperm(len(lengths), generator=g, device=device)
    for slot, n, own in zip(slots.tolist(), lengths, pages.split(need)):
        table[slot, : len(own)] = own.int()
        index = (own[:, None] * page_size + torch.arange(page_size, device=device)).flatten()[:n]
        for pool in (k_pages, v_pages):
            flat = pool.view(-1, *pool.shape[2:])
            flat[index] = torch.randn(n, *pool.shape[2:], generator=g, device=device, dtype=pool.dtype)
    return table, slots


def make_case(
    lengths, kv_heads, group, head_dim, page_size, dtype, device="cuda", pad_rows=2, seed=0, max_pages=None
) -> Case:
    """Inputs for len(lengths) sequences plus `pad_rows` padding rows (scratch slot, length 1). The
    pool is layer 1 of a two-layer cache, as the engine passes it; the table is `max_pages` wide
    (default: the longest sequence's pages and 3 more)."""
    g = torch.Generator(device=device).manual_seed(seed)
    max_pages = max_pages or cdiv(max(lengths), page_size) + 3
    num_pages = 8 + sum(cdiv(n, page_size) for n in lengths)
    cache = torch.empty(2, 2, num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    k_pages, v_pages = cache[0, 1], cache[1, 1]
    table, slots = scatter(k_pages, v_pages, lengths, max_pages, g)
    scratch = torch.full((pad_rows,), len(lengths), device=device)
    slot_ids = torch.cat([slots, scratch])
    lengths_t = torch.tensor(list(lengths) + [1] * pad_rows, device=device)
    q = torch.randn(len(slot_ids), kv_heads * group, head_dim, generator=g, device=device, dtype=dtype)
    return q, k_pages, v_pages, table, slot_ids, lengths_t


def decode(args: Case, window: int | None, config: WorkConfig | None = None) -> torch.Tensor:
    """Plan, then attention: through the custom ops with the default config (as the engine runs
    them), or through the launchers with an explicit one."""
    q, k_pages, v_pages, table, slot_ids, lengths = args
    if config is None:
        plan = paged_decode_plan(lengths, window, k_pages.shape[2], q.shape[2])
        return paged_decode(q, k_pages, v_pages, table, slot_ids, *plan)
    return run_attention(q, k_pages, v_pages, table, slot_ids, run_plan(lengths, window, config), config)


def assert_matches(out: torch.Tensor, args: Case, window: int | None) -> None:
    expected = paged_decode_reference(*args, window)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
