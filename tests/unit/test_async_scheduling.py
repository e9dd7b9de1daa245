"""Async scheduling: each decode step is launched before the host reads the step before's tokens.
It must decode what the synchronous engine decodes (fp32 on CPU: token for token, logprobs too),
report each token once and in order, end every row where the synchronous engine ends it, and give
nothing to a request that ended while its token was in flight."""

from __future__ import annotations

import concurrent.futures
import random
from collections import Counter

import pytest

from policies.dispatch import FallbackReason
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine, run_sync
from workers.front.async_engine import apply_contained
from workers.protocol import Call, Deny
from workers.serving import grammar as grammar_module
from workers.serving.batch_sampler import AHEAD_MIN_ROWS, Draw
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
BOS = 256
SCHEMA = canonical_schema(
    {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [BOS] + [rng.randrange(256) for _ in range(n - 1)]


def mixed_params(rng: random.Random) -> SamplingParams:
    """One of the ways a request samples, ends and reports; lengths from one token up."""
    kind = rng.randrange(7)
    common = dict(max_tokens=rng.choice([1, 2, 3, 7, 19, 40]), seed=rng.randrange(1000))
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)  # may end on EOS
    if kind == 1:
        return SamplingParams(temperature=1.0, top_p=0.9, ignore_eos=True, logprobs=2, **common)
    if kind == 2:
        return SamplingParams(temperature=0.8, frequency_penalty=0.7, logit_bias=((65, 2.0),), **common)
    if kind == 3:  # ends on a token the host reads a step late
        return SamplingParams(temperature=1.0, stop_token_ids=(rng.randrange(256), rng.randrange(256)), **common)
    if kind == 4:
        return SamplingParams(temperature=0.0, repetition_penalty=1.3, ignore_eos=True, logprobs=0, **common)
    if kind == 5:
        return SamplingParams(temperature=0.7, top_k=5, json_schema=SCHEMA, **{**common, "max_tokens": 30})
    return SamplingParams(temperature=1.2, ignore_eos=True, **common)


def workload(seed: int, waves: int = 6, per_wave: int = 4):
    """Waves of requests, one wave a step: prompts sharing prefixes (the prefix cache), a few denied
    graphs (their steps run without async scheduling), every kind of `mixed_params`."""
    rng = random.Random(seed)
    shared = prompt(rng, 17)
    out = []
    for _ in range(waves):
        wave = []
        for _ in range(per_wave):
            p = shared + prompt(rng, rng.randint(2, 8))[1:] if rng.random() < 0.4 else prompt(rng, rng.randint(2, 24))
            denial = FallbackReason.TENANT_DISABLED if rng.random() < 0.15 else None
            wave.append((p, mixed_params(rng), denial))
        out.append(wave)
    return out


def drive(engine, waves) -> tuple[list, dict[str, list[int]], dict[str, list]]:
    """Each wave added before a step, then steps to the end; (sequences, tokens reported per
    request, logprobs reported per request)."""
    seqs, tokens, logprobs = [], {}, {}
    steps = 0
    pending = list(waves)
    while pending or engine.has_work():
        if pending:
            for p, params, denial in pending.pop(0):
                seq = engine.add_request(p, params, graph_denial=denial)
                seqs.append(seq)
                tokens[seq.request_id], logprobs[seq.request_id] = [], []
        for event in engine.step():
            tokens[event.request_id] += event.token_ids
            logprobs[event.request_id] += event.logprobs or []
        steps += 1
        assert steps < 5000, "the engine does not finish"
    return seqs, tokens, logprobs


def outcomes(seqs, logprobs: dict[str, list]) -> list[tuple]:
    """Per request: its tokens, its finish reason and the logprobs reported for it."""
    return [(s.output_ids, s.finish_reason, logprobs[s.request_id]) for s in seqs]


def assert_same_outcomes(got: list[tuple], expected: list[tuple]) -> None:
    """The same tokens and finish reasons; logprobs within 1e-4 and the same top tokens."""
    for (ids, reason, lps), (want_ids, want_reason, want_lps) in zip(got, expected, strict=True):
        assert (ids, reason) == (want_ids, want_reason)
        for a, b in zip(lps, want_lps, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_steps_decode_what_synchronous_steps_decode(tiny, seed):
    """A small KV pool (the newest are preempted and prefilled again, some with a token in flight),
    arrivals every step, every way of sampling and ending: the same tokens, logprobs and finish
    reasons as the synchronous engine, each token reported once, in order, and every page back."""
    runs = {}
    for async_scheduling in (False, True):
        engine = new_engine(
            tiny, max_num_seqs=8, kv_page_size=8, kv_cache_tokens=160, async_scheduling=async_scheduling
        )
        seqs, tokens, logprobs = drive(engine, workload(seed))
        assert engine.status().kv_cache.preemptions > 0
        for seq in seqs:
            assert tokens[seq.request_id] == seq.output_ids
            assert seq.finish_reason in ("stop", "length")
            assert len(logprobs[seq.request_id]) == (len(seq.output_ids) if seq.params.logprobs is not None else 0)
        assert engine.scheduler.blocks.num_free == engine.cache.num_pages - 1
        assert not engine.has_work() and engine._in_flight is None
        runs[async_scheduling] = outcomes(seqs, logprobs)
    assert_same_outcomes(runs[True], runs[False])
    assert any(reason == "stop" for _, reason, _ in runs[True])  # some ended on a token read a step late


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 14])
def test_a_row_is_decoded_no_more_than_its_length_needs(tiny, max_tokens):
    """A row whose drawn token is its last by max_tokens is not decoded again, and gets no position
    for it: the same decode steps as the synchronous engine, and the same pages when it ends (a
    3-token prompt and 8-token pages: after 6 and 14 tokens the next position would start a page)."""
    ends = {}
    for async_scheduling in (False, True):
        engine = new_engine(tiny, max_num_seqs=2, kv_page_size=8, async_scheduling=async_scheduling)
        blocks = engine.scheduler.blocks
        free = blocks.free
        held = []

        def freeing(seq_id, free=free, held=held, blocks=blocks):
            held.append((len(blocks.block_table(seq_id)), blocks.tokens(seq_id)))
            free(seq_id)

        blocks.free = freeing
        seq = engine.add_request([BOS, 5, 6], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert len(seq.output_ids) == max_tokens and seq.finish_reason == "length"
        ends[async_scheduling] = engine.stats.decode_steps, held
    assert ends[True] == ends[False] == (max_tokens - 1, [(-(-(max_tokens + 2) // 8), max_tokens + 2)])


def test_the_next_step_is_launched_before_the_last_tokens_are_read(tiny, monkeypatch):
    """What the overlap is: with async scheduling a decode step is launched, then the step
    before's tokens read; synchronously every step's tokens are read before the next launch."""
    read = Draw.read
    engines = {a: new_engine(tiny, max_num_seqs=2, async_scheduling=a) for a in (False, True)}
    logs = {}
    for async_scheduling, engine in engines.items():
        log = logs[async_scheduling] = []
        decode = engine.runner.decode

        def launched(batch, drawn=None, decode=decode, log=log):
            log.append("decode")
            return decode(batch, drawn)

        def reading(self, log=log):
            log.append("read")
            return read(self)

        monkeypatch.setattr(engine.runner, "decode", launched)
        monkeypatch.setattr(Draw, "read", reading)
        engine.add_request([BOS, 9, 8, 7], SamplingParams(max_tokens=5, ignore_eos=True))
        while engine.has_work():
            engine.step()
    # the prefill's first token, then tokens 2 to 5 from four decode steps
    assert logs[False] == ["read", "decode", "read", "decode", "read", "decode", "read", "decode", "read"]
    assert logs[True] == ["read", "decode", "decode", "read", "decode", "read", "decode", "read", "read"]


def test_a_request_ended_while_its_token_is_in_flight_gets_no_more(tiny):
    """An abort (a client gone, a stop string) between steps ends the request at once: the token
    drawn for it and not read yet is dropped, and the others decode as before."""
    engine = new_engine(tiny, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kept = engine.add_request([BOS, 1, 2, 3], params)
    ended = engine.add_request([BOS, 4, 5, 6], params)
    reported = {kept.request_id: [], ended.request_id: []}
    for _ in range(4):
        for event in engine.step():
            reported[event.request_id] += event.token_ids
    assert ended in engine._in_flight.seqs
    assert engine.abort(ended.request_id)
    held = list(ended.output_ids)
    while engine.has_work():
        for event in engine.step():
            reported[event.request_id] += event.token_ids
    assert ended.output_ids == held == reported[ended.request_id] and ended.finish_reason == "abort"
    assert reported[kept.request_id] == kept.output_ids and len(kept.output_ids) == 12
    alone = new_engine(tiny, max_num_seqs=4, async_scheduling=False)
    again = alone.add_request([BOS, 1, 2, 3], params)
    while alone.has_work():
        alone.step()
    assert again.output_ids == kept.output_ids


def test_a_row_denied_graphs_mid_stream_takes_its_tokens_first(tiny):
    """A tenant toggled off while its request's token is in flight: that step reads the tokens
    before it launches (the denied row's eager call takes its token from the host), then decodes
    on; the tokens are those of an engine that never overlaps."""
    outputs = {}
    for async_scheduling in (False, True):
        engine = new_engine(tiny, max_num_seqs=4, async_scheduling=async_scheduling)
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
        seqs = [engine.add_request([BOS, 7, i], params) for i in range(3)]
        for _ in range(3):
            engine.step()
        apply_contained(engine, Deny(seqs[1].request_id, FallbackReason.TENANT_DISABLED))
        while engine.has_work():
            engine.step()
        outputs[async_scheduling] = [s.output_ids for s in seqs]
        denied = [p for p in engine.stats.snapshot()["decode_step_parts"] if p["fallback_reason"] == "tenant_disabled"]
        assert denied and denied[0]["rows"] == 10 - 4  # its rows after the 4 tokens drawn before the toggle
    assert outputs[True] == outputs[False]


class Clock:
    """A perf_counter that moves `tick` seconds a call: the fill thread's two calls time a fill at `tick`."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


@pytest.mark.parametrize("fill_s", [0.0, 60.0])
def test_masks_slower_than_the_step_are_filled_while_it_launches(tiny, monkeypatch, fill_s):
    """A batch whose masks are filled ahead and took longer to fill than the device's step reads its
    tokens first and launches while they fill (async, the launch would add to the fill); one whose
    masks fill faster launches first. Either way the tokens are the synchronous engine's."""
    rows = AHEAD_MIN_ROWS + 2
    params = [SamplingParams(temperature=0.7, seed=i, json_schema=SCHEMA, max_tokens=30) for i in range(rows)]
    prompts = [[BOS, 5, i] for i in range(rows)]
    expected_seqs = run_sync(new_engine(tiny, max_num_seqs=rows, async_scheduling=False), list(zip(prompts, params)))
    monkeypatch.setattr(grammar_module, "time", Clock(fill_s))
    engine = new_engine(tiny, max_num_seqs=rows)
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    launched_in_flight = []  # per decode launch: whether a step's tokens were still unread
    decode = engine.runner.decode

    def launched(batch, drawn=None):
        launched_in_flight.append(engine._in_flight is not None)
        return decode(batch, drawn)

    monkeypatch.setattr(engine.runner, "decode", launched)
    while engine.has_work():
        engine.step()
    assert [(s.output_ids, s.finish_reason) for s in seqs] == [(s.output_ids, s.finish_reason) for s in expected_seqs]
    assert len(launched_in_flight) > 5
    # the first launch has nothing in flight; the second follows the first fill ahead, timed at fill_s
    assert launched_in_flight[1:4] == [fill_s == 0.0] * 3


LIST_SCHEMA = canonical_schema({"type": "array", "items": {"type": "integer"}, "minItems": 40})


def constrained_batch(rows: int) -> list[tuple[list[int], SamplingParams]]:
    """Rows enough for their masks to be filled ahead, each under a schema and penalized (the draw
    reads each row's slot: its bitmask row and its token history). The first and the last row (in
    the last slot) are alike, greedy and strongly penalized: the last's tokens change if a token
    drawn for the first is counted in its history."""
    twin = SamplingParams(temperature=0.0, frequency_penalty=2.0, json_schema=LIST_SCHEMA, max_tokens=30)
    return [
        (
            [BOS, 5, 0 if i in (0, rows - 1) else i],
            twin
            if i in (0, rows - 1)
            else SamplingParams(temperature=0.7, seed=i, frequency_penalty=0.5, json_schema=SCHEMA, max_tokens=30),
        )
        for i in range(rows)
    ]


def until_a_step_waits_for_its_draw(engine, seqs: list) -> None:
    """Step until a step of all of `seqs` (each schema compiled, in its own time) is left undrawn."""
    for _ in range(50):
        engine.step()
        flight = engine._in_flight
        if flight is not None and flight.draw is None and {id(s) for s in seqs} <= {id(s) for s in flight.seqs}:
            return
    raise AssertionError("no step of every row was left undrawn")


def test_a_step_whose_masks_are_filling_is_drawn_by_the_next_one(tiny, monkeypatch):
    """With its rows' masks filled ahead, a decode step is left undrawn when it returns: what the
    host does between the steps (and the next step's admissions) overlaps the fill, and the next
    step draws it before its own device work. The tokens are the synchronous engine's."""
    batch = constrained_batch(AHEAD_MIN_ROWS + 2)
    expected_seqs = run_sync(new_engine(tiny, max_num_seqs=len(batch), async_scheduling=False), batch)
    engine = new_engine(tiny, max_num_seqs=len(batch))
    seqs = [engine.add_request(p, q) for p, q in batch]
    log = []
    draw, decode = engine.sampler.draw, engine.runner.decode
    monkeypatch.setattr(engine.sampler, "draw", lambda logits, rows: log.append("D") or draw(logits, rows))
    monkeypatch.setattr(engine.runner, "decode", lambda b, drawn=None: log.append("L") or decode(b, drawn))
    undrawn = 0
    while engine.has_work():
        log.append("|")
        engine.step()
        undrawn += engine._in_flight is not None and engine._in_flight.draw is None
    assert [(s.output_ids, s.finish_reason) for s in seqs] == [(s.output_ids, s.finish_reason) for s in expected_seqs]
    assert undrawn > 5
    steps = "".join(log).split("|")
    # a step that draws the one before, then launches its own (D, L); undeferred, a step launches, then draws (L, D)
    assert steps.count("DL") > 5


def test_a_row_ended_while_its_step_waits_for_its_draw_leaves_the_others_unchanged(tiny):
    """An abort between steps, of a row of a step left undrawn: the step is drawn first, with the
    row's slot (which the abort frees), so the rows beside it, in the other slots, draw what they
    would have drawn and their token histories hold their own tokens only; the ended row gets
    nothing more."""
    batch = constrained_batch(AHEAD_MIN_ROWS + 2)
    expected_seqs = run_sync(new_engine(tiny, max_num_seqs=len(batch), async_scheduling=False), batch)
    engine = new_engine(tiny, max_num_seqs=len(batch))
    seqs = [engine.add_request(p, q) for p, q in batch]
    until_a_step_waits_for_its_draw(engine, seqs)
    ended, last = seqs[0], seqs[-1]
    last_slot = last.slot
    assert ended in engine._in_flight.seqs and engine.abort(ended.request_id)
    held = list(ended.output_ids)
    while engine.has_work():
        engine.step()
    assert ended.output_ids == held and ended.finish_reason == "abort"
    # the last slot's token history (what its penalties read) holds the last row's tokens, nothing else
    counts = engine.sampler.counts[last_slot]
    assert {t: int(counts[t]) for t in counts.nonzero().flatten().tolist()} == Counter(last.output_ids)
    got = [(s.output_ids, s.finish_reason) for s in seqs[1:]]
    assert got == [(s.output_ids, s.finish_reason) for s in expected_seqs[1:]]


def test_a_command_between_steps_finds_the_step_in_flight_drawn(tiny):
    """A call run by the step loop between two steps may run the model (a gate replays every
    graph, which writes the logits a step left undrawn holds) or change the rows' slots: the step
    is drawn before it runs (outside the step, whose logits are inference tensors: unpenalized,
    the masks are applied to them in place)."""
    engine = new_engine(tiny, max_num_seqs=AHEAD_MIN_ROWS + 2)
    params = [
        SamplingParams(temperature=0.7, seed=i, json_schema=SCHEMA, max_tokens=30) for i in range(AHEAD_MIN_ROWS + 2)
    ]
    seqs = [engine.add_request([BOS, 5, i], p) for i, p in enumerate(params)]
    until_a_step_waits_for_its_draw(engine, seqs)
    done = concurrent.futures.Future()
    apply_contained(engine, Call(lambda e: e._in_flight.draw is not None, done))
    assert done.result() is True
