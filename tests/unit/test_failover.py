"""The pure parts of failover (`app/failover.py`): a detokenizer restored from its state hands out
exactly what the original would have; an engine continuing a stream from any of its events (the
tokens sent so far, the seed, the detokenizer state) gives the uninterrupted run's tokens, text and
usage; the ingress's bookkeeping and its failover loop (on a fake Serve handle) retry only replica
and engine failures, a bounded number of times and within a deadline, avoiding the replicas that
failed, an n-choice request going on choice by choice; the router never offers an avoided replica."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import pytest

from app.failover import MAX_FAILOVERS, FailoverRouter, Progress, continuation, routing
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine
from tests.unit.test_detokenizer import random_chunks
from workers.front.async_engine import AsyncEngine
from workers.protocol import (
    ChoiceChunk,
    Continuation,
    Failure,
    GenerateRequest,
    Item,
    LogprobItem,
    Resume,
    StreamEvent,
    decode_item,
    decode_request,
    encode,
)
from workers.serving.detokenizer import DetokState, IncrementalDetokenizer
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import InvalidRequest, SamplingParams, choice_seed

pytestmark = pytest.mark.timeout(60)
BOS = 256


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream_pieces(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[tuple[str, bool]]:
    """What each chunk hands out, then the flush (as a last piece) unless a stop string hit."""
    out = []
    for chunk in chunks:
        out.append(detok.add(chunk))
        if out[-1][1]:
            return out
    return [*out, detok.flush()]


# ---------------------------------------------------------------- detokenizer state


def test_a_restored_detokenizer_goes_on_as_the_original(tiny):
    """Cut a stream after any chunk and restore a new detokenizer from the state there: the rest of
    the pieces are the uninterrupted stream's, held-back text (a possible stop string's start, an
    incomplete character) neither lost nor repeated. Random texts, stop strings and chunkings; some
    cuts hold text back, some streams end on a stop string."""
    held_back = stopped = 0
    for seed in range(16):
        rng = random.Random(seed)
        text = "".join(rng.choice("aab€ ") for _ in range(90))
        stops = tuple({"".join(rng.choice("aab€") for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(0, 3))})
        chunks = random_chunks(rng, enc(tiny.tokenizer, text), most=5)
        prompt = enc(tiny.tokenizer, "".join(rng.choice("ab€ ") for _ in range(rng.randint(1, 9))))
        whole = stream_pieces(IncrementalDetokenizer(tiny.tokenizer, stops, prompt), chunks)
        stopped += whole[-1][1]
        for cut in range(1, len(whole)):
            original = IncrementalDetokenizer(tiny.tokenizer, stops, prompt)
            for chunk in chunks[:cut]:
                original.add(chunk)
            state = original.state()
            held_back += bool(state.pending)
            sent = [t for chunk in chunks[:cut] for t in chunk]
            restored = IncrementalDetokenizer.restore(tiny.tokenizer, stops, prompt, sent, state)
            assert restored.state() == state
            assert whole[:cut] + stream_pieces(restored, chunks[cut:]) == whole, (seed, cut)
    assert held_back >= 10 and stopped >= 3, (held_back, stopped)


def test_a_state_no_stream_could_be_in_is_refused(tiny):
    ids = enc(tiny.tokenizer, "abcab")
    stops = ("abd",)
    good = IncrementalDetokenizer(tiny.tokenizer, stops)
    assert good.add(ids) == ("abc", False) and good.state() == DetokState(0, 5, "ab")
    for bad in (
        DetokState(0, 6, "ab"),
        DetokState(3, 2, "ab"),
        DetokState(0, 5, "abd"),
        DetokState(0, 5, "b"),
        DetokState(0, 5, "x"),
        DetokState("0", 5, "ab"),
    ):
        with pytest.raises(ValueError):
            IncrementalDetokenizer.restore(tiny.tokenizer, stops, (), ids, bad)
    with pytest.raises(ValueError):  # without stop strings nothing is ever held back
        IncrementalDetokenizer.restore(tiny.tokenizer, (), (), ids, DetokState(0, 5, "ab"))


# ---------------------------------------------------------------- continuing a stream in an engine


@pytest.fixture
async def runner(tiny):
    engine = AsyncEngine(new_engine(tiny, max_num_seqs=4), tiny.tokenizer).start()
    yield engine
    engine.shutdown()


async def events_of(stream) -> list[StreamEvent]:
    return [event async for event in stream]


def summary(events: list[StreamEvent]) -> tuple:
    last = events[-1]
    ids = [t for e in events for t in e.token_ids]
    return ids, "".join(e.text for e in events), last.finish_reason, last.prompt_tokens, last.completion_tokens


CASES = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
    "unseeded": SamplingParams(max_tokens=40, temperature=1.2, top_k=40, ignore_eos=True),
    "schema": SamplingParams(  # its grammar replays the tokens sent
        max_tokens=40,
        temperature=1.0,
        seed=5,
        json_schema=canonical_schema({"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 20}),
    ),
}


@pytest.mark.parametrize("case", [*CASES, "stop"])
async def test_a_continuation_from_any_event_gives_the_uninterrupted_run(tiny, runner, case):
    """Each event of a run is a place a replica could die: continuing from the tokens sent up to
    it, with the run's seed (for an unseeded request the one its engine drew, from the events) and
    the detokenizer state it carried, the rest has the run's token ids, text, finish reason and
    usage. The stop-string case ends on a stop string taken from the run's own late text."""
    prompt = [BOS, *enc(tiny.tokenizer, f"failover {case}")]
    params = CASES.get(case) or CASES["greedy"]
    if case == "stop":
        text = summary(await events_of(runner.submit(prompt, params)))[1]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(text[-8:-5],))
    events = await events_of(runner.submit(prompt, params))
    ids, text, reason, prompt_tokens, completion_tokens = whole = summary(events)
    assert len(events) > 5 and reason == ("stop" if case == "stop" else "length")
    seed = events[0].seed
    assert seed is not None and all(e.seed == seed for e in events)
    again = SamplingParams(**{**params.__dict__, "seed": seed})
    for n, event in enumerate(events[:-1], 1):
        sent = [t for e in events[:n] for t in e.token_ids]
        rest = await events_of(runner.submit(prompt, again, resume=Resume(sent, event.detok)))
        assert summary(events[:n] + rest) == whole, f"continued after event {n}"
        assert rest[0].completion_tokens > len(sent) and rest[-1].prompt_tokens == prompt_tokens
    assert completion_tokens == len(ids) and text


async def test_a_continuation_with_nothing_left_to_generate_is_refused(tiny, runner):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    state = DetokState(0, 0, "")
    with pytest.raises(InvalidRequest):
        runner.submit([BOS, 1], params, resume=Resume([5, 6, 7], state))
    with pytest.raises(InvalidRequest):
        runner.submit([BOS, 1], params, resume=Resume([5, tiny.model.cfg.vocab_size], state))
    with pytest.raises(InvalidRequest):
        runner.submit([BOS, 1], params, resume=Resume([5], DetokState(0, 4, "")))  # 2 prompt ids, 1 output id
    events = await asyncio.wait_for(events_of(runner.submit([BOS, 1], params, resume=Resume([5, 6], state))), 30)
    assert events[-1].completion_tokens == 3 and len(events[-1].token_ids) + 2 == 3


# ---------------------------------------------------------------- the ingress's bookkeeping


def chunk(ids: list[int], replica: str = "r1", seed: int = 9, index: int = 0, finish: str | None = None):
    text = "".join(map(str, ids))
    return ChoiceChunk(index, text, finish, 3, 0, 0, ids, seed, DetokState(0, len(ids), ""), replica)


ENGINE_DEAD = Failure("the engine failed", 503, retry=True, replica_id="r1")
GONE = Failure("the replica serving this request failed", 503, retry=True)


def request(n: int = 1, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest("tenant", "completion", SamplingParams(seed=seed), n=n, prompt="hi")


def test_progress_resumes_from_what_the_client_has_and_avoids_who_failed():
    first = request()
    progress = Progress()
    assert progress.payload(first) is first  # a first attempt goes out as it came
    progress.record(chunk([1, 2]))
    progress.record(chunk([3]))
    assert progress.fail(ENGINE_DEAD)
    payload = progress.payload(first)
    assert payload.avoid == ("r1",) and payload.prompt == "hi" and first.resume is None
    assert payload.resume == Continuation([1, 2, 3], 9, DetokState(0, 1, ""))
    assert continuation(payload) == Resume([1, 2, 3], DetokState(0, 1, "")) and continuation(first) is None

    progress.record(chunk([4], replica="r2"))  # the second replica fails without naming itself
    assert progress.fail(GONE)
    assert progress.payload(first).avoid == ("r1", "r2")
    assert progress.payload(first).resume.output_ids == [1, 2, 3, 4]


def test_a_failure_before_any_item_resumes_nothing():
    progress = Progress()
    assert progress.fail(GONE)
    assert progress.payload(request()) == msgspec.structs.replace(request(), avoid=(), resume=None)


def test_only_a_one_choice_request_is_continued():
    resumed = msgspec.structs.replace(request(n=2), resume=Continuation([1], 9, DetokState(0, 1, "")))
    with pytest.raises(InvalidRequest):
        continuation(resumed)


@pytest.mark.parametrize(
    "failure",
    [
        Failure("bad adapter", 400),
        Failure("the queue is full", 503),
        Failure("the engine failed to run this request", 500),
        Failure("this replica is swapping its model", 503, swapping=True),
    ],
)
def test_client_errors_and_other_failures_are_not_retried(failure):
    progress = Progress()
    progress.record(chunk([1]))
    assert not progress.fail(failure)
    assert progress.payload(request()) == request()


def test_failovers_are_bounded():
    progress = Progress()
    for n in range(MAX_FAILOVERS):
        progress.record(chunk([n], replica=f"r{n}"))
        assert progress.fail(msgspec.structs.replace(ENGINE_DEAD, replica_id=f"r{n}"))
    assert not progress.fail(ENGINE_DEAD)


def test_the_wire_round_trips_every_message():
    """What the ingress and a replica exchange decodes to what was encoded, and a message of the
    wrong shape is refused when decoded rather than read wrong."""
    resumed = msgspec.structs.replace(
        request(n=1, seed=5), resume=Continuation([1, 2], 5, DetokState(0, 2, "a")), avoid=("r1",)
    )
    assert decode_request(encode(resumed)) == resumed
    with_logprobs = msgspec.structs.replace(
        chunk([7]), logprobs=[LogprobItem(b"x", -0.5, [(b"x", -0.5), (b"y", -1.0)])]
    )
    for item in (chunk([1, 2], finish="stop"), with_logprobs, ENGINE_DEAD, GONE):
        assert decode_item(encode(item)) == item
    with pytest.raises(msgspec.ValidationError):
        decode_item(encode(request()))
    bad = msgspec.structs.replace(request(), max_tokens=None)
    wire = encode(bad)
    zero_tokens = wire.replace(
        msgspec.msgpack.encode("max_tokens") + b"\x10", msgspec.msgpack.encode("max_tokens") + b"\x00"
    )
    assert zero_tokens != wire
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):  # sampling is checked when decoded
        decode_request(zero_tokens)


def test_the_router_reads_what_a_request_avoids():
    def pending(*args):
        return SimpleNamespace(args=list(args))

    hinted = msgspec.structs.replace(request(), avoid=("r1", "r2"), not_serving=("r3",))
    assert routing(pending(encode(hinted))) == ({"r1", "r2"}, {"r3"})
    assert routing(pending(encode(request()))) == (set(), set())
    assert routing(pending("adapter-name", "/path")) == (set(), set())  # check_adapter calls
    assert routing(None) == (set(), set())


@dataclass(frozen=True)
class FakeId:
    unique_id: str


async def test_the_router_never_offers_an_avoided_replica():
    """choose_replicas (on a stand-in for Serve's router state): two of the candidates Serve's
    preferences give, never one the request avoids; none when it avoids them all (Serve then backs
    off and asks again)."""
    ids = [FakeId(f"r{n}") for n in range(3)]
    router = SimpleNamespace(
        curr_replicas={i: f"replica {i.unique_id}" for i in ids},
        apply_locality_routing=lambda pending_request: set(ids),
    )

    def pending(avoid):
        args = [encode(msgspec.structs.replace(request(), avoid=tuple(avoid)))]
        return SimpleNamespace(args=args, metadata=SimpleNamespace(multiplexed_model_id=""))

    for _ in range(20):
        (chosen,) = await FailoverRouter.choose_replicas(router, [], pending(["r1"]))
        assert len(chosen) == 2 and "replica r1" not in chosen
    assert await FailoverRouter.choose_replicas(router, [], pending(["r0", "r2"])) == [["replica r1"]]
    assert await FailoverRouter.choose_replicas(router, [], pending(["r0", "r1", "r2"])) == []


async def test_the_router_offers_a_replica_not_serving_only_when_no_other_is_left():
    """A replica the ingress saw restarting its engine would hold a new request until it is back:
    the router passes it over while another is left, and offers it when it is the only one (the
    request then waits there, as before), never when the request avoids it."""
    ids = [FakeId(f"r{n}") for n in range(3)]
    router = SimpleNamespace(
        curr_replicas={i: f"replica {i.unique_id}" for i in ids},
        apply_locality_routing=lambda pending_request: set(ids),
    )

    def pending(not_serving, avoid=()):
        hinted = msgspec.structs.replace(request(), avoid=tuple(avoid), not_serving=tuple(not_serving))
        return SimpleNamespace(args=[encode(hinted)], metadata=SimpleNamespace(multiplexed_model_id=""))

    for _ in range(20):
        assert await FailoverRouter.choose_replicas(router, [], pending(["r0", "r1"])) == [["replica r2"]]
        (chosen,) = await FailoverRouter.choose_replicas(router, [], pending(["r1"]))
        assert sorted(chosen) == ["replica r0", "replica r2"]
    (chosen,) = await FailoverRouter.choose_replicas(router, [], pending(["r0", "r1", "r2"]))
    assert len(chosen) == 2  # none serving: Serve's choice as before
    (chosen,) = await FailoverRouter.choose_replicas(router, [], pending(["r0", "r1"], avoid=["r2"]))
    assert sorted(chosen) == ["replica r0", "replica r1"]  # an avoided replica is never the one left


# ---------------------------------------------------------------- the ingress's failover loop


class FakeResponse:
    """A replica's streamed answer: its items, then the stream ends, raises, or never goes on."""

    def __init__(self, items: list[Item], then: str = "end") -> None:
        self.items, self.then, self.cancelled = items, then, False
        self._stream = self._items()

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self._stream  # one iterator, as Serve's response generator is its own

    async def _items(self):
        for item in self.items:
            yield encode(item)
        if self.then == "raise":
            raise ConnectionError("the replica's actor died")
        if self.then == "hang":
            await asyncio.Event().wait()


class FakeHandle:
    """The LLM deployment's handle: each call takes the next scripted response and keeps the payload."""

    def __init__(self, responses: list[FakeResponse]) -> None:
        self.responses, self.payloads = list(responses), []
        self.generate = SimpleNamespace(remote=self._remote)

    def _remote(self, data: bytes) -> FakeResponse:
        self.payloads.append(decode_request(data))
        return self.responses.pop(0)


def ingress(responses: list[FakeResponse], serving: set[str]):
    """The ingress's failover methods on a stand-in with a fake handle and readiness view."""
    from app.ingress import Ingress

    async def serving_now() -> set[str]:
        return serving

    fake = SimpleNamespace(
        config=SimpleNamespace(swap_queue_timeout_s=1.0),
        llm=FakeHandle(responses),
        readiness=SimpleNamespace(serving=serving_now),
    )
    for name in ("_resumable", "_choices", "_first_item", "_fails_over"):
        setattr(fake, name, getattr(Ingress, name).__get__(fake))
    return fake


def text_chunk(ids: list[int], replica: str, finish: str | None = None) -> ChoiceChunk:
    return chunk(ids, replica, finish=finish)


async def drain(fake) -> list[Item]:
    return [item async for item in fake._resumable(request(), None)]


async def test_the_ingress_goes_on_on_another_replica_after_an_engine_or_replica_failure():
    first = FakeResponse([text_chunk([1, 2], "r1"), ENGINE_DEAD])
    second = FakeResponse([text_chunk([3], "r2")], then="raise")  # this replica is lost mid-stream
    third = FakeResponse([text_chunk([4], "r3", "length")])
    fake = ingress([first, second, third], {"r1", "r2", "r3"})
    items = await drain(fake)
    assert [i.text for i in items] == ["12", "3", "4"] and items[-1].finish_reason == "length"
    assert first.cancelled and second.cancelled
    _, to_r2, to_r3 = fake.llm.payloads
    assert to_r2.avoid == ("r1",) and to_r2.resume.output_ids == [1, 2]
    assert to_r3.avoid == ("r1", "r2") and to_r3.resume.output_ids == [1, 2, 3]


@pytest.mark.parametrize("serving", [{"r1"}, {"r1", "r2"}])
async def test_the_ingress_does_not_retry_client_errors_or_without_another_replica(serving):
    refused = Failure("adapter 'x' cannot be served", 400)
    rest = FakeResponse([text_chunk([2], "r2", "length")])
    fake = ingress([FakeResponse([text_chunk([1], "r1"), refused]), rest], serving)
    assert (await drain(fake))[-1] == refused and len(fake.llm.payloads) == 1
    fake = ingress([FakeResponse([text_chunk([1], "r1"), ENGINE_DEAD]), rest], serving)
    last = (await drain(fake))[-1]
    assert last == (ENGINE_DEAD if serving == {"r1"} else rest.items[0]) and len(fake.llm.payloads) == len(serving)


@pytest.mark.parametrize("serving", [{"r1"}, {"r1", "r2"}])
async def test_a_failure_that_names_no_replica_goes_on_only_with_two_serving(serving):
    """A stream that broke before its first item names no replica: with one serving, that one may
    be it, and the request ended there (it was sent to it again, MAX_FAILOVERS times); with two,
    it goes on."""
    fake = ingress([FakeResponse([], then="raise"), FakeResponse([text_chunk([1], "r2", "length")])], serving)
    items = await drain(fake)
    assert len(fake.llm.payloads) == len(serving)
    assert items[-1].finish_reason == "length" if len(serving) == 2 else items[-1].retry


async def test_the_ingress_gives_up_after_the_bound_or_the_deadline(monkeypatch):
    from app.ingress import Ingress

    failing = [
        FakeResponse([msgspec.structs.replace(ENGINE_DEAD, replica_id=f"r{n}")]) for n in range(MAX_FAILOVERS + 1)
    ]
    fake = ingress(failing, {f"r{n}" for n in range(MAX_FAILOVERS + 2)})
    assert (await drain(fake))[-1].retry and len(fake.llm.payloads) == MAX_FAILOVERS + 1

    # Serve's ingress decorator gives the class's functions globals of their own: patch those.
    monkeypatch.setitem(Ingress._resumable.__globals__, "FAILOVER_TIMEOUT_S", 0.05)
    stuck = FakeResponse([], then="hang")  # the continuation's first item never comes
    fake = ingress([FakeResponse([text_chunk([1], "r1"), ENGINE_DEAD]), stuck], {"r1", "r2"})
    items = await asyncio.wait_for(drain(fake), 5)
    assert items[-1] == ENGINE_DEAD and stuck.cancelled


class ByChoiceHandle(FakeHandle):
    """The first call (all n choices) takes `first`; each one-choice continuation the response
    scripted for the tokens it resumes from (by its seed when it resumes from none)."""

    def __init__(self, first: FakeResponse, continuations: dict) -> None:
        super().__init__([first])
        self.continuations = continuations

    def _remote(self, data: bytes) -> FakeResponse:
        payload = decode_request(data)
        if payload.n > 1:
            return super()._remote(data)
        self.payloads.append(payload)
        resume = payload.resume
        return self.continuations[tuple(resume.output_ids) if resume else payload.sampling.seed]


def choice(index: int, ids: list[int], replica: str = "r1", finish: str | None = None, seed: int = 9) -> ChoiceChunk:
    return chunk(ids, replica, seed, index, finish)


def choices_ingress(first: FakeResponse, continuations: dict, serving: set[str]):
    fake = ingress([], serving)
    fake.llm = ByChoiceHandle(first, continuations)
    return fake


N_CHOICES = request(n=3, seed=7)


async def test_an_n_choice_request_goes_on_choice_by_choice_after_its_engine_fails():
    first = FakeResponse(
        [choice(0, [1]), choice(1, [5], seed=71), choice(2, [9], finish="length"), choice(0, [2]), ENGINE_DEAD]
    )
    going_on = {
        (1, 2): FakeResponse([choice(0, [3], "r2", "length")]),
        (5,): FakeResponse([choice(0, [6], "r2", "length", seed=71)]),
    }
    fake = choices_ingress(first, going_on, {"r1", "r2"})
    items = [item async for item in fake._choices(N_CHOICES, None)]
    texts = {i: "".join(item.text for item in items if item.index == i) for i in range(3)}
    assert texts == {0: "123", 1: "56", 2: "9"}
    assert sorted(item.index for item in items if item.finish_reason) == [0, 1, 2]
    assert first.cancelled and all(r.cancelled for r in going_on.values())
    sent = {tuple(p.resume.output_ids): p for p in fake.llm.payloads[1:]}
    assert set(sent) == {(1, 2), (5,)}  # the finished choice 2 is not sent again
    for ids, index in (((1, 2), 0), ((5,), 1)):
        payload = sent[ids]
        assert payload.n == 1 and payload.avoid == ("r1",)
        assert payload.sampling.seed == choice_seed(7, index)
    assert sent[(5,)].resume.seed == 71  # the seed the replica gave choice 1 carries over


async def test_choices_lost_before_any_item_go_on_one_after_another_each_with_its_seed():
    """Each choice's continuation is sent once the one before has its first item (Serve's router
    holds one waiting call per request), choice 0 first: the response's first item is choice 0's."""
    log = []

    class Logged(FakeResponse):
        async def _items(self):
            async for data in super()._items():
                log.append(("item", decode_item(data).seed))
                yield data

    seeds = [choice_seed(7, i) for i in range(3)]
    going_on = {seed: Logged([choice(0, [i], "r2", "length", seed=seed)]) for i, seed in enumerate(seeds)}
    fake = choices_ingress(FakeResponse([], then="raise"), going_on, {"r1", "r2"})
    remote = fake.llm.generate.remote
    fake.llm.generate.remote = lambda data: log.append(("sent", decode_request(data).sampling.seed)) or remote(data)
    items = await asyncio.wait_for(_drain_choices(fake), 5)
    assert items[0].index == 0 and items[0].seed == 7  # the seed header is choice 0's
    assert sorted((item.index, item.text) for item in items) == [(0, "0"), (1, "1"), (2, "2")]
    assert [p.resume for p in fake.llm.payloads[1:]] == [None] * 3
    assert log == [("sent", 7)] + [(kind, seed) for seed in seeds for kind in ("sent", "item")]  # 7: all 3, lost


async def test_an_unseeded_choice_lost_before_its_first_chunk_goes_on_from_the_header_seed():
    """Unseeded, the replica drew seed 9 for all three choices (choice 0's chunk carries it, and so
    does the seed header): choice 2, whose replica died before its first chunk, goes on seeded from
    9 as the replica seeded it (it went on unseeded and drew a seed the header does not give)."""
    first = FakeResponse([choice(0, [1], seed=9), choice(1, [5], seed=choice_seed(9, 1)), ENGINE_DEAD])
    going_on = {
        (1,): FakeResponse([choice(0, [2], "r2", "length", seed=9)]),
        (5,): FakeResponse([choice(0, [6], "r2", "length", seed=choice_seed(9, 1))]),
        choice_seed(9, 2): FakeResponse([choice(0, [7], "r2", "length", seed=choice_seed(9, 2))]),
    }
    fake = choices_ingress(first, going_on, {"r1", "r2"})

    async def drained() -> list[Item]:
        return [item async for item in fake._choices(request(n=3), None)]

    items = await asyncio.wait_for(drained(), 5)
    assert sorted((item.index, item.text) for item in items if item.finish_reason) == [(0, "2"), (1, "6"), (2, "7")]
    (fresh,) = [p for p in fake.llm.payloads[1:] if p.resume is None]
    assert fresh.sampling.seed == choice_seed(9, 2)


async def _drain_choices(fake) -> list[Item]:
    return [item async for item in fake._choices(N_CHOICES, None)]


@pytest.mark.parametrize("serving", [{"r1"}, {"r1", "r2"}])
async def test_an_n_choice_request_is_not_continued_after_a_client_error_or_without_another_replica(serving):
    refused = Failure("adapter 'x' cannot be served", 400)
    fake = choices_ingress(FakeResponse([choice(0, [1]), refused]), {}, serving)
    assert (await _drain_choices(fake))[-1] == refused and len(fake.llm.payloads) == 1
    if serving == {"r1"}:
        fake = choices_ingress(FakeResponse([choice(0, [1]), ENGINE_DEAD]), {}, serving)
        assert (await _drain_choices(fake))[-1] == ENGINE_DEAD and len(fake.llm.payloads) == 1
