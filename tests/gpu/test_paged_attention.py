"""The Triton paged decode kernel against the plain-torch reference, on the GPU: pages scattered over
the pool, rows in shuffled slot order, padding rows, GQA, sliding windows, three dtypes, and the two
ways the engine runs it: replayed from a CUDA graph after its inputs changed in place, and inside
torch.compile. Every key and value the kernel must not read (past a row's length, on free pages) is
large garbage, so reading any of it moves the output far past the tolerance."""

import pytest
import torch

from workers.kv.paged_attention import SplitConfig, available, paged_decode, paged_decode_reference, run_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="needs triton and CUDA")]

GARBAGE = 30.0
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lengths_for(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, page_size + 1, 7, 33, 100, 101, 257, 1000, 2049, 3001]


def scatter(k_pages, v_pages, lengths: list[int], max_pages: int, g: torch.Generator):
    """Fill the pool with garbage, then give each sequence random pages (never page 0, the scratch
    page) holding real keys and values up to its length. Returns the block table (last row: scratch,
    all page 0) and each sequence's table row, a random permutation."""
    num_pages, page_size = k_pages.shape[:2]
    for pool in (k_pages, v_pages):
        pool.normal_(generator=g).mul_(GARBAGE)
    need = [cdiv(n, page_size) for n in lengths]
    pages = 1 + torch.randperm(num_pages - 1, generator=g, device="cuda")[: sum(need)]
    table = torch.zeros(len(lengths) + 1, max_pages, dtype=torch.int32, device="cuda")
    slots = torch.randperm(len(lengths), generator=g, device="cuda")
    for slot, n, own in zip(slots.tolist(), lengths, pages.split(need)):
        table[slot, : len(own)] = own.int()
        index = (own[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()[:n]
        for pool in (k_pages, v_pages):
            flat = pool.view(-1, *pool.shape[2:])
            flat[index] = torch.randn(n, *pool.shape[2:], generator=g, device="cuda", dtype=pool.dtype)
    return table, slots


def make_case(lengths, kv_heads, group, head_dim, page_size, dtype, pad_rows=2, seed=0):
    """Inputs for len(lengths) sequences plus `pad_rows` padding rows (scratch slot, length 1). The
    pool is layer 1 of a two-layer cache, as the engine passes it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = cdiv(max(lengths), page_size) + 3
    num_pages = 8 + sum(cdiv(n, page_size) for n in lengths)
    cache = torch.empty(2, 2, num_pages, page_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    k_pages, v_pages = cache[0, 1], cache[1, 1]
    table, slots = scatter(k_pages, v_pages, lengths, max_pages, g)
    scratch = torch.full((pad_rows,), len(lengths), device="cuda")
    slot_ids = torch.cat([slots, scratch])
    lengths_t = torch.tensor(list(lengths) + [1] * pad_rows, device="cuda")
    q = torch.randn(len(slot_ids), kv_heads * group, head_dim, generator=g, device="cuda", dtype=dtype)
    return q, k_pages, v_pages, table, slot_ids, lengths_t


def assert_matches(out, args, window):
    expected = paged_decode_reference(*args, window)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype, group, head_dim, page_size, window",
    [
        (torch.bfloat16, 4, 128, 16, None),  # the 8B shape
        (torch.bfloat16, 4, 64, 16, None),  # the 1B shape
        (torch.bfloat16, 1, 128, 16, None),
        (torch.bfloat16, 8, 64, 32, None),
        (torch.bfloat16, 4, 128, 8, None),
        (torch.float16, 8, 128, 16, None),
        (torch.float32, 4, 64, 16, None),
        (torch.bfloat16, 4, 128, 16, 7),
        (torch.bfloat16, 4, 64, 32, 100),
        (torch.float16, 1, 64, 8, 100),
        (torch.float32, 8, 128, 16, 7),
    ],
)
def test_matches_reference(dtype, group, head_dim, page_size, window):
    args = make_case(lengths_for(page_size), 2, group, head_dim, page_size, dtype)
    assert_matches(paged_decode(*args, window), args, window)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("block_n", [16, 64])
def test_any_split_count(num_splits, block_n):
    """More splits than a row has blocks (empty chunks), an odd count, and a single split. The workspace
    is first made likely to start as NaN (a freed NaN block the allocator hands out again), so an
    empty split's partial that was read instead of skipped would show."""
    args = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16, seed=1)
    torch.full((1 << 24,), float("nan"), device="cuda")
    for window in (None, 100):
        assert_matches(run_kernel(*args, window, SplitConfig(num_splits, block_n)), args, window)


def test_garbage_would_show():
    """The check has teeth: a row read one key past its length differs from the reference."""
    q, k_pages, v_pages, table, slot_ids, lengths = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16)
    out = paged_decode(q, k_pages, v_pages, table, slot_ids, lengths + 1, None)
    with pytest.raises(AssertionError):
        assert_matches(out, (q, k_pages, v_pages, table, slot_ids, lengths), None)


@pytest.mark.parametrize("window", [None, 100])
def test_cuda_graph_replay_after_in_place_changes(window):
    """Captured once on short rows; then lengths (longer and shorter), block table, pool contents and
    queries change in place and each replay still matches the reference."""
    kv_heads, group, head_dim, page_size = 2, 4, 128, 16
    states = [[1, 5, 17, 40, 3], [3000, 16, 1, 999, 250], [2, 1, 64, 15, 2049]]
    max_pages = cdiv(3000, page_size) + 1
    num_pages = 8 + max(sum(cdiv(n, page_size) for n in s) for s in states)
    g = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.empty(2, 2, num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_pages, v_pages = cache[0, 1], cache[1, 1]
    rows = len(states[0]) + 1  # one padding row
    q = torch.empty(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.empty(rows, max_pages, dtype=torch.int32, device="cuda")
    slot_ids = torch.empty(rows, dtype=torch.int64, device="cuda")
    lengths = torch.empty(rows, dtype=torch.int32, device="cuda")

    def load(state):
        t, slots = scatter(k_pages, v_pages, state, max_pages, g)
        table.copy_(t)
        slot_ids.copy_(torch.cat([slots, slots.new_tensor([rows - 1])]))
        lengths.copy_(torch.tensor(state + [1]))
        q.normal_(generator=g)

    args = (q, k_pages, v_pages, table, slot_ids, lengths)
    load(states[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode(*args, window)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(*args, window)
    for state in states:
        load(state)
        graph.replay()
        assert_matches(out, args, window)


def test_inside_torch_compile():
    """Opaque to inductor (one graph, no break) and the same result as eager."""
    args = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16, seed=3)

    def step(q, k_pages, v_pages, table, slot_ids, lengths):
        return paged_decode(q * 1.5, k_pages, v_pages, table, slot_ids, lengths, 100) + 1

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    q, *rest = args
    expected = paged_decode_reference(q * 1.5, *rest, 100) + 1
    torch.testing.assert_close(compiled(*args).float(), expected.float(), atol=2e-2, rtol=2e-2)
