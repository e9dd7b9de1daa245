"""The Triton paged decode kernels against the plain-torch reference, on the GPU: pages scattered over
the pool, rows in shuffled slot order, padding rows, GQA, sliding windows, three dtypes, and the two
ways the engine runs them: replayed from a CUDA graph after lengths, table and queries changed in
place (one plan read by two layers, as in a step), and inside torch.compile. Every key and value the
kernel must not read (past a row's length, on free pages) is large garbage, so reading any of it
moves the output far past the tolerance (`tests/paged_decode_cases.py`)."""

import pytest
import torch

from tests.paged_decode_cases import assert_matches, cdiv, decode, lengths_for, make_case, scatter
from workers.kv.paged_attention import (
    WorkConfig,
    available,
    paged_decode,
    paged_decode_plan,
    paged_decode_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(), reason="needs triton and CUDA")]


@pytest.mark.parametrize(
    "dtype, group, head_dim, page_size, window",
    [
        (torch.bfloat16, 4, 128, 16, None),  # the 8B shape
        (torch.bfloat16, 4, 64, 16, None),  # the 1B shape
        (torch.bfloat16, 1, 128, 16, None),
        (torch.bfloat16, 8, 64, 32, None),
        (torch.bfloat16, 6, 64, 16, None),
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
    assert_matches(decode(args, window), args, window)


@pytest.mark.parametrize("items_per_kv_head", [1, 7, 66, 500])
@pytest.mark.parametrize("block_n", [16, 64])
def test_any_config(items_per_kv_head, block_n):
    """One item for the whole batch (every row one chunk), an odd count, the 8B's, and many more items
    than rows have blocks. The workspace is first made likely to start as NaN (a freed NaN block the
    allocator hands out again), so a partial or an output that was read before being written would
    show."""
    args = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16, seed=1)
    torch.full((1 << 24,), float("nan"), device="cuda")
    config = WorkConfig(items_per_kv_head, block_n)
    for window in (None, 100):
        assert_matches(decode(args, window, config), args, window)


def test_garbage_would_show():
    """The check has teeth: a row read one key past its length differs from the reference."""
    q, k_pages, v_pages, table, slot_ids, lengths = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16)
    out = decode((q, k_pages, v_pages, table, slot_ids, lengths + 1), None)
    with pytest.raises(AssertionError):
        assert_matches(out, (q, k_pages, v_pages, table, slot_ids, lengths), None)


# Length sets a captured graph is replayed over: short rows; a log-normal-like mix; one row as long as
# the table among rows of one key; a bimodal mix; uniform. Without a window their totals put the chunk
# size (264 items a KV head on an H200: 2 KV heads of 128) at 64, 64, 64, 128 and 64 tokens, so the
# chunk size, the counts and the order all change between replays.
STATES = [
    [1, 5, 17, 40, 3, 2, 9, 1],
    [3000, 16, 1, 999, 250, 64, 65, 2049],
    [4096, 1, 1, 1, 1, 1, 1, 1],
    [4096, 128, 4096, 4096, 4096, 128, 4096, 4096],
    [256] * 8,
]


@pytest.mark.parametrize("window", [None, 100])
def test_cuda_graph_replay_over_mixed_lengths(window):
    """A step as the engine captures it (one plan, then two layers' attention reading it), captured
    once on short rows; then lengths, block table, pools and queries change in place for each of
    STATES and every replay equals the same calls run eagerly, bit for bit, and the reference."""
    kv_heads, group, head_dim, page_size = 2, 4, 128, 16
    max_pages = cdiv(4096, page_size)
    num_pages = 8 + max(sum(cdiv(n, page_size) for n in s) for s in STATES)
    g = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.empty(2, 2, num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    rows = len(STATES[0]) + 1  # one padding row
    q = torch.empty(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.empty(rows, max_pages, dtype=torch.int32, device="cuda")
    slot_ids = torch.empty(rows, dtype=torch.int64, device="cuda")
    lengths = torch.empty(rows, dtype=torch.int64, device="cuda")
    layers = [(cache[0, layer], cache[1, layer]) for layer in (0, 1)]

    def load(state):
        t, slots = scatter(*layers[0], state, max_pages, g)
        cache[:, 1].copy_(cache[:, 0] * -0.5)  # the same pages, other keys and values
        table.copy_(t)
        slot_ids.copy_(torch.cat([slots, slots.new_tensor([rows - 1])]))
        lengths.copy_(torch.tensor(state + [1]))
        q.normal_(generator=g)

    def step():
        plan = paged_decode_plan(lengths, window, kv_heads, head_dim)
        return plan, [paged_decode(q, k_pages, v_pages, table, slot_ids, *plan) for k_pages, v_pages in layers]

    load(STATES[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (items, _), outs = step()
    shapes = set()  # (items used, the longest item) of each replay's plan
    for state in STATES:
        load(state)
        graph.replay()
        real = items[items[:, 0] >= 0]
        shapes.add((len(real), int((real[:, 2] - real[:, 1]).max())))
        _, eager = step()
        for out, expected, (k_pages, v_pages) in zip(outs, eager, layers):
            assert torch.equal(out, expected)
            assert_matches(out, (q, k_pages, v_pages, table, slot_ids, lengths), window)
    assert len(shapes) >= 3, shapes


def test_inside_torch_compile():
    """Plan and attention stay opaque to inductor (one graph, no break) and give the eager result."""
    args = make_case(lengths_for(16), 2, 4, 64, 16, torch.bfloat16, seed=3)

    def step(q, k_pages, v_pages, table, slot_ids, lengths):
        plan = paged_decode_plan(lengths, 100, k_pages.shape[2], q.shape[2])
        return paged_decode(q * 1.5, k_pages, v_pages, table, slot_ids, *plan) + 1

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    q, *rest = args
    expected = paged_decode_reference(q * 1.5, *rest, 100) + 1
    torch.testing.assert_close(compiled(*args).float(), expected.float(), atol=2e-2, rtol=2e-2)
