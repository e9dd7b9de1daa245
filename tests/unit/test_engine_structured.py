"""response_format in the engine, on CPU with the tiny model (random weights, byte-level tokenizer):
constrained sequences write JSON their schema accepts and end when it is complete, share batches
with free ones without changing them, compile off the step loop, and a continuation replays the
tokens already sent into its grammar."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest

from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine, run_alone
from workers.front.async_engine import AsyncEngine
from workers.serving import batch_sampler
from workers.serving import grammar as grammar_module
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.grammar import GrammarCompiler
from workers.serving.json_schema import InvalidSchema, canonical_schema
from workers.serving.sampling import InvalidRequest, SamplingParams

pytestmark = pytest.mark.timeout(60)
BOS = 256
SCHEMA = {  # short enough for the tiny model's 64 positions: at most 37 bytes (one token each)
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "n", "ok"],
    "additionalProperties": False,
}
SCHEMA_JSON = canonical_schema(SCHEMA)
SAMPLING = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=1),
    dict(temperature=0.9, top_p=0.8, seed=2),
    dict(temperature=1.5, top_k=3, seed=3, presence_penalty=1.0),
]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def engine_for(tiny: Tiny, **config) -> LLMEngine:
    return new_engine(tiny, **{"max_num_seqs": 8, **config})


def prompt(seed: int, n: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [BOS] + [rng.randrange(256) for _ in range(n - 1)]


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 50, "json_schema": SCHEMA_JSON, **kwargs})


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], output_ids=None):
    seqs = [engine.add_request(p, params, output_ids=output_ids or ()) for p, params in requests]
    events = []
    for _ in range(500):
        if not engine.has_work():
            return seqs, events
        events += engine.step()
    pytest.fail("the engine does not finish")


def text(tiny: Tiny, ids: list[int]) -> str:
    return tiny.tokenizer.decode(ids)


def test_constrained_requests_write_what_their_schema_accepts_and_stop_when_complete(tiny):
    """Each sequence has a grammar state of its own: a request twice in one batch draws twice the
    same (seeded, or greedy), the copies in step though they share one compiled grammar."""
    engine = engine_for(tiny)
    seqs, _ = run(engine, [(prompt(i % 4), constrained(**kw)) for i, kw in enumerate(SAMPLING * 2)])
    for seq in seqs:
        document = json.loads(text(tiny, seq.output_ids))
        jsonschema.validate(document, SCHEMA)
        assert seq.finish_reason == "stop" and not set(seq.output_ids) & set(tiny.eos_token_ids)
    assert [s.output_ids for s in seqs[:4]] == [s.output_ids for s in seqs[4:]]
    assert len({text(tiny, s.output_ids) for s in seqs[:4]}) > 1


def test_masks_filled_by_a_pool_over_lineages_draw_what_one_thread_draws(tiny, monkeypatch):
    """Hosts of 8 cores or more fill a batch's masks on llguidance's pool, over matchers compiled
    apart (lineages): a batch past the fill-ahead threshold draws token for token what it draws
    on a host that fills on one thread."""
    requests = [(prompt(i % 4), constrained(**kw)) for i, kw in enumerate(SAMPLING * 3)]
    one_thread = [s.output_ids for s in run(engine_for(tiny, max_num_seqs=12), requests)[0]]
    monkeypatch.setattr(grammar_module, "FILL_THREADS", 2)
    monkeypatch.setattr(grammar_module, "LINEAGES", 3)
    pooled = []  # rows of each fill ahead
    run_fill = grammar_module._run_fill

    def counted(executor, pairs, *rest):
        pooled.append(len(pairs))
        return run_fill(executor, pairs, *rest)

    monkeypatch.setattr(grammar_module, "_run_fill", counted)
    seqs, _ = run(engine_for(tiny, max_num_seqs=12), requests)
    assert [s.output_ids for s in seqs] == one_thread
    assert pooled and max(pooled) == 12  # the whole batch was filled ahead


def test_the_next_masks_fill_before_the_step_is_recorded_and_only_for_rows_that_go_on(tiny):
    """Once the grammars have taken a step's tokens, the masks of the rows that go on start filling
    before the step's events are recorded and its ended rows retired (the fill is on the path from
    the tokens' read to the next draw); a row that ends on the token just taken is not filled."""
    requests = [(prompt(i % 4), constrained(**kw)) for i, kw in enumerate(SAMPLING * 3)]
    requests += [(prompt(20 + i), constrained(max_tokens=4, **kw)) for i, kw in enumerate(SAMPLING)]
    engine = engine_for(tiny, max_num_seqs=16)
    calls = []  # ("fill", request ids) and ("retire", request id), in order
    fill_ahead, retire = engine.sampler.fill_ahead, engine._retire

    def filled(seqs):
        calls.append(("fill", {s.request_id for s in seqs if s.grammar is not None}))
        return fill_ahead(seqs)

    def retired(seq, reason, event):
        calls.append(("retire", seq.request_id))
        return retire(seq, reason, event)

    engine.sampler.fill_ahead, engine._retire = filled, retired
    seqs, _ = run(engine, requests)
    short = {s.request_id for s in seqs[12:]}
    assert all(s.finish_reason == "length" and len(s.output_ids) == 4 for s in seqs[12:])
    at = next(i for i, (kind, rid) in enumerate(calls) if kind == "retire" and rid in short)
    fill = max(i for i in range(at) if calls[i][0] == "fill")
    assert all(kind == "retire" for kind, _ in calls[fill + 1 : at + 1])  # this step's fill came first
    assert not calls[fill][1] & short and len(calls[fill][1]) == 12  # without the rows that end there
    for seq in seqs[:12]:
        jsonschema.validate(json.loads(text(tiny, seq.output_ids)), SCHEMA)


def test_free_requests_draw_the_same_beside_constrained_ones(tiny):
    engine = engine_for(tiny)
    free = [(prompt(10 + i), SamplingParams(max_tokens=12, ignore_eos=True, **kw)) for i, kw in enumerate(SAMPLING)]
    mixed = [r for pair in zip(free, [(prompt(i), constrained(**kw)) for i, kw in enumerate(SAMPLING)]) for r in pair]
    seqs, _ = run(engine, mixed)
    for (p, params), seq in zip(free, seqs[::2]):
        assert (seq.output_ids, seq.finish_reason) == run_alone(tiny, p, params)


def test_a_constrained_request_draws_the_same_alone_batched_or_preempted(tiny):
    requests = [(prompt(i, 12), constrained(**kw)) for i, kw in enumerate(SAMPLING)]
    alone = [run(engine_for(tiny, max_num_seqs=1), [r])[0][0].output_ids for r in requests]
    engine = engine_for(tiny, max_num_seqs=4, kv_page_size=8, kv_cache_tokens=120)
    seqs, _ = run(engine, requests)
    assert engine.status().kv_cache.preemptions > 0
    assert [s.output_ids for s in seqs] == alone


def test_a_continuation_replays_the_tokens_sent_and_draws_what_the_first_engine_would(tiny):
    """Failover: another engine gets the prompt and the tokens its client has; the grammar state
    replayed from them, the seeded draw goes on token for token as it would have."""
    p, params = prompt(3), constrained(temperature=1.0, seed=42)
    (whole,), _ = run(engine_for(tiny), [(p, params)])
    for sent in (1, 9, len(whole.output_ids) - 1):
        (resumed,), _ = run(engine_for(tiny), [(p, params)], output_ids=whole.output_ids[:sent])
        assert (resumed.output_ids, resumed.finish_reason) == (whole.output_ids, "stop")
    (refused,), events = run(engine_for(tiny), [(p, params)], output_ids=tiny.tokenizer("[1]")["input_ids"][1:])
    assert refused.finish_reason == "error" and isinstance(events[0].error, InvalidRequest)
    assert "do not fit its schema" in str(events[0].error)


def test_eos_ends_a_constrained_request_only_where_its_grammar_may_end(tiny):
    """A model that wants nothing but EOS: free, it ends at once; with a top-level integer schema
    it must write a digit first (a minus sign may come before it: the draw is unseeded) and may end
    after any."""
    eos = tiny.eos_token_ids[0]
    bias = ((eos, 100.0),)
    engine = engine_for(tiny)
    integer = canonical_schema({"type": "integer"})
    free, number = run(
        engine,
        [
            (prompt(1), SamplingParams(logit_bias=bias)),
            (prompt(1), SamplingParams(logit_bias=bias, json_schema=integer)),
        ],
    )[0]
    assert (free.output_ids, free.finish_reason) == ([], "stop")
    assert re.fullmatch("-?[0-9]", text(tiny, number.output_ids)) and number.finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_request_with_length(tiny):
    (seq,), _ = run(engine_for(tiny), [(prompt(2), constrained(max_tokens=5))])
    assert len(seq.output_ids) == 5 and seq.finish_reason == "length"
    assert text(tiny, seq.output_ids).startswith('{"')


def test_a_schema_the_engine_cannot_compile_ends_its_request_with_that_error(tiny):
    """...and is counted among the finished requests (it ended without a count: finished plus
    aborted fell short of the requests submitted by one a refused schema)."""
    engine = engine_for(tiny)
    (seq,), events = run(engine, [(prompt(1), constrained(json_schema='{"type":"strin"}'))])
    (event,) = events
    assert seq.finish_reason == event.finish_reason == "error"
    assert isinstance(event.error, InvalidSchema) and "strin" in str(event.error)
    assert event.error.param == "response_format"
    assert engine.stats.snapshot()["finished_requests"] == {"error": 1}


def test_a_schema_whose_document_cannot_go_on_ends_with_an_error_not_a_stop(tiny):
    """A `$ref` loop met after the first tokens compiles, and its grammar fails where the loop is
    reached, allowing only end-of-sequence: the request ends with the grammar's error, never with
    an unfinished document marked `stop`."""
    loop = canonical_schema(
        {
            "$defs": {"a": {"$ref": "#/$defs/a"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/a"}},
            "required": ["a"],
        }
    )
    (seq,), events = run(engine_for(tiny), [(prompt(1), constrained(json_schema=loop))])
    (event,) = [e for e in events if e.finish_reason is not None]
    assert seq.finish_reason == event.finish_reason == "error"
    assert isinstance(event.error, InvalidSchema) and "grammar failed after" in str(event.error)
    assert "outside its mask" not in str(event.error)  # its mask allowed only EOS, and EOS was drawn
    assert text(tiny, seq.output_ids) == '{"a": '
    assert [t for e in events for t in e.token_ids] == seq.output_ids  # and nothing after them


def test_a_token_drawn_outside_its_mask_is_an_error_naming_an_engine_fault(tiny, monkeypatch, caplog):
    """Were a draw not to apply the mask filled for it (a fault of the engine's, never the
    schema's), the grammar refuses the token and the error and the log say so."""
    monkeypatch.setattr(batch_sampler.BitmaskBuffers, "apply", lambda self, logits: None)
    engine = engine_for(tiny)
    (seq,), events = run(engine, [(prompt(3), constrained())])
    (event,) = [e for e in events if e.finish_reason is not None]
    assert seq.finish_reason == "error" and not seq.output_ids
    assert "after 0 tokens" in str(event.error) and "was drawn outside its mask" in str(event.error)
    assert "which its grammar's mask did not allow" in caplog.text


def test_an_id_waiting_for_its_grammar_is_in_use(tiny):
    """A plain request under the id of one whose schema still compiles was queued beside it: two
    sequences under one id."""
    engine = engine_for(tiny)
    engine.add_request(prompt(1), constrained(), request_id="same")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(prompt(2), SamplingParams(max_tokens=3), request_id="same")


def test_an_engine_without_its_tokenizer_refuses_a_schema(tiny):
    engine = LLMEngine(tiny.model, EngineConfig(max_model_len=tiny.max_model_len, device="cpu"), tiny.eos_token_ids)
    with pytest.raises(InvalidSchema, match="tokenizer"):
        engine.add_request(prompt(1), constrained())


def test_compiling_holds_up_only_its_own_request(tiny, monkeypatch):
    """While a schema compiles (here: until the test lets it), the other requests are admitted and
    decode; the waiting one can be cancelled; once compiled it runs like any other."""
    release = threading.Event()
    compile_now = GrammarCompiler._compile

    def slow_compile(self, schema):
        assert release.wait(10)
        return compile_now(self, schema)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    engine = engine_for(tiny)
    waiting = engine.add_request(prompt(1), constrained())
    cancelled = engine.add_request(prompt(2), constrained(temperature=1.0, seed=5))
    free = engine.add_request(prompt(3), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    # a token a step at least (the first prefills, and decodes a second unless async scheduling keeps
    # that token on the device until the next step)
    assert len(free.output_ids) >= 4 and not waiting.output_ids and engine.find(waiting.request_id) is waiting
    assert engine.abort(cancelled.request_id) and cancelled.finish_reason == "abort"
    release.set()
    while engine.has_work():
        engine.step()
    assert free.finish_reason == "length" and waiting.finish_reason == "stop" and not cancelled.output_ids
    jsonschema.validate(json.loads(text(tiny, waiting.output_ids)), SCHEMA)


async def test_a_stream_of_a_schema_and_one_the_engine_refuses(tiny):
    front = AsyncEngine(engine_for(tiny), tiny.tokenizer).start()
    try:
        chunks = [event.text async for event in front.submit(prompt(4), constrained(temperature=1.0, seed=9))]
        jsonschema.validate(json.loads("".join(chunks)), SCHEMA)
        with pytest.raises(InvalidSchema, match="strin"):
            await anext(aiter(front.submit(prompt(4), constrained(json_schema='{"type":"strin"}'))))
    finally:
        front.shutdown()
