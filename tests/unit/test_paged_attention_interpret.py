"""The paged decode kernels (`workers/kv/paged_attention.py`) on the CPU under Triton's interpreter:
attention against the plain-torch reference over mixed lengths (rows of one key, rows across page
and chunk boundaries, a row as long as the table, padding rows), GQA groups of 1, 4, 8 and 6, head
dims 64 and 128, pages of 8, 16 and 32, sliding windows; and the work plan's invariants over random
batches. Triton picks the interpreter when it is imported, so these run in a child pytest started
with TRITON_INTERPRET=1 (`test_kernels_under_the_interpreter`); in this process they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.paged_decode_cases import assert_matches, cdiv, decode, make_case  # noqa: E402
from workers.kv.paged_attention import MERGE_BLOCK, NO_WINDOW, SLACK, WorkConfig, max_items, run_plan  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_the_interpreter's child")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_under_the_interpreter():
    """Every other test of this file, in a child pytest whose Triton interprets the kernels."""
    if INTERPRETED:
        pytest.skip("this is the child")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).relative_to(ROOT))]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.fixture(autouse=True, scope="module")
def _scalar_index():
    """Triton 3.6's interpreter makes an int of a scalar with int() on a one-element array, which
    numpy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6); .item() is what it means. Without
    this, a loop whose bound is a loaded value cannot run."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patched)
        yield


def mixed_lengths(page_size: int, max_len: int) -> list[int]:
    """Rows of one key, on both sides of a page boundary and of 64-token blocks, long ones that the
    small configs below cut into several chunks, and one as long as the table."""
    return [1, page_size - 1, page_size + 1, 63, 64, 65, 129, 300, max_len]


@interpreted
@pytest.mark.parametrize(
    "dtype, group, head_dim, page_size, window, config",
    [
        (torch.float32, 4, 64, 16, None, WorkConfig(8)),
        (torch.float32, 4, 64, 16, None, WorkConfig(24, block_n=16)),
        (torch.float32, 1, 128, 16, None, WorkConfig(8, block_n=32)),
        (torch.float32, 8, 64, 32, None, WorkConfig(16, block_n=16)),
        (torch.float32, 6, 64, 8, None, WorkConfig(12, block_n=16)),
        (torch.float32, 4, 128, 16, 7, WorkConfig(12, block_n=16)),
        (torch.float32, 4, 64, 16, 100, WorkConfig(12, block_n=16)),
        (torch.float16, 4, 64, 16, None, WorkConfig(12, block_n=16)),
        (torch.float16, 8, 128, 8, 100, WorkConfig(12, block_n=16)),
    ],
)
def test_matches_reference(dtype, group, head_dim, page_size, window, config):
    max_pages = cdiv(300, page_size) + 3
    lengths = mixed_lengths(page_size, max_pages * page_size)
    args = make_case(lengths, 2, group, head_dim, page_size, dtype, "cpu", max_pages=max_pages)
    if window != 7:  # a window of 7 keeps every row to one chunk; the other cases must cut some
        assert (run_plan(args[5], window, config)[1][:, 1] > 1).sum() >= 2
    assert_matches(decode(args, window, config), args, window)


@interpreted
def test_more_chunks_than_the_merge_reads_at_once():
    """A row of 63 chunks: the merge reads them MERGE_BLOCK at a time with a running max."""
    args = make_case([1000, 3], 2, 4, 64, 16, torch.float32, "cpu")
    config = WorkConfig(100, block_n=16)
    assert run_plan(args[5], None, config)[1][0, 1] > MERGE_BLOCK
    assert_matches(decode(args, None, config), args, None)


@interpreted
def test_one_key_too_many_would_show():
    """The check has teeth: rows read one key past their length differ from the reference."""
    q, k_pages, v_pages, table, slot_ids, lengths = make_case([5, 40, 100], 2, 4, 64, 16, torch.float32, "cpu")
    out = decode((q, k_pages, v_pages, table, slot_ids, lengths + 1), None, WorkConfig(4, block_n=16))
    with pytest.raises(AssertionError):
        assert_matches(out, (q, k_pages, v_pages, table, slot_ids, lengths), None)


def check_plan(lengths: list[int], window: int | None, config: WorkConfig) -> None:
    """The plan of one batch: each row's live range [len - span, len) is cut into consecutive nonempty
    items of whole blocks (but the last), span / C of them rounded up unless the row is at most
    1/SLACK over a multiple of C, their sizes within a block of each other and at most (1 + 1/SLACK)
    C plus a block; items are listed by tokens per chunk, longest first; the unused slots say -1."""
    items, row_chunks = (t.tolist() for t in run_plan(torch.tensor(lengths), window, config))
    block = config.block_n
    spans = [min(n, window or NO_WINDOW) for n in lengths]
    chunk = cdiv(cdiv(sum(spans), config.items_per_kv_head), block) * block
    used = sum(count for _, count in row_chunks)
    assert len(items) == max_items(len(lengths), config) > used
    assert all(row == -1 for row, _, _ in items[used:])
    for row, (n, span) in enumerate(zip(lengths, spans)):
        first, count = row_chunks[row]
        assert count == max(1, cdiv(SLACK * span - chunk, SLACK * chunk))
        mine = items[first : first + count]
        assert count >= 1 and all(r == row for r, _, _ in mine)
        bounds = [n - span] + [hi for _, _, hi in mine]
        assert [lo for _, lo, _ in mine] == bounds[:-1] and bounds[-1] == n
        sizes = [hi - lo for _, lo, hi in mine]
        assert min(sizes) > 0 and max(sizes) - min(sizes) <= block and max(sizes) <= (1 + 1 / SLACK) * chunk + block
        assert all((lo - (n - span)) % block == 0 for _, lo, _ in mine)
    per_chunk = [cdiv(spans[row], row_chunks[row][1]) for row, _, _ in items[:used]]
    assert per_chunk == sorted(per_chunk, reverse=True)


@interpreted
def test_plan_over_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        lengths = torch.randint(1, 3000, (rows,), generator=g).tolist()
        window = [None, 50, 1000][int(torch.randint(3, (1,), generator=g))]
        config = WorkConfig(int(torch.randint(1, 70, (1,), generator=g)), block_n=[16, 64][rows % 2])
        check_plan(lengths, window, config)


@interpreted
def test_plan_extremes():
    """One row much longer than the rest (it takes nearly every item), rows of one key only (one
    item each), and more rows than items_per_kv_head."""
    check_plan([6000] + [1] * 30, None, WorkConfig(8))
    check_plan([1] * 17, None, WorkConfig(66))
    check_plan([256] * 40 + [7000] * 3, None, WorkConfig(4, block_n=16))


@interpreted
@pytest.mark.parametrize(
    "items_per_kv_head, rows, length, chunks",
    [(66, 1, 4096, 64), (66, 8, 4096, 8), (66, 32, 4096, 2), (66, 64, 4096, 1), (66, 32, 256, 2), (66, 1, 256, 4)]
    + [(132, 8, 4096, 16), (132, 32, 4096, 4), (132, 64, 4096, 2)],
)
def test_uniform_batches_get_the_swept_split_counts(items_per_kv_head, rows, length, chunks):
    """The module docstring's claim: on uniform batches of an H200's 8B (66 items a KV head) and 1B
    (132) shapes, each row gets the split count that was the fastest in the old per-row sweep."""
    _, row_chunks = run_plan(torch.full((rows,), length), None, WorkConfig(items_per_kv_head))
    assert row_chunks[:, 1].tolist() == [chunks] * rows


@interpreted
@pytest.mark.parametrize("window", [None, 20])
def test_a_short_prefill_over_a_cached_context_is_the_kernels(monkeypatch, window):
    """A prefill call of few tokens over cached contexts, each token a row of the paged kernel (its
    slot, length position + 1), equals the per-prompt SDPA over the context read back from the
    pages: prompts of one token and of several, a prompt with no context beside them, contexts
    across page boundaries, a GQA group of 4."""
    from tests.kv_pages import assign_pages
    from workers.kv import paged_attention, prefill_attention
    from workers.kv.kv_cache import KVCache
    from workers.kv.paged_attention import run_attention

    config = WorkConfig(items_per_kv_head=6)
    monkeypatch.setattr(prefill_attention, "paged_supported", lambda like, tokens, context: bool(context))
    monkeypatch.setattr(paged_attention, "paged_decode_plan", lambda lengths, w, *_: run_plan(lengths, w, config))
    monkeypatch.setattr(
        paged_attention, "paged_decode", lambda q, k, v, t, s, *plan: run_attention(q, k, v, t, s, plan, config)
    )
    cache = KVCache(2, 96, 8, 4, 160, num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu")
    assign_pages(cache)
    g = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    context_lens, seq_lens, slots = [37, 0, 90, 8], [5, 3, 1, 9], [2, 0, 3, 1]
    token_slots = torch.tensor([s for s, n in zip(slots, seq_lens) for _ in range(n)])
    positions = torch.tensor([c + i for c, n in zip(context_lens, seq_lens) for i in range(n)])
    q = torch.randn(sum(seq_lens), 8, 64, generator=g)
    layer = 1
    attention = prefill_attention.PrefillAttention(cache, token_slots, positions, seq_lens, context_lens, window, q)
    assert attention.plan is not None  # the paged path was taken
    got = attention(layer, q, None, None)

    key_slots = torch.tensor([s for s, c, n in zip(slots, context_lens, seq_lens) for _ in range(c + n)])
    key_positions = torch.tensor([p for c, n in zip(context_lens, seq_lens) for p in range(c + n)])
    k, v = cache.read(layer, cache.write_index(key_slots, key_positions))
    want = prefill_attention.per_prompt_attention(q, k, v, seq_lens, window, context_lens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
