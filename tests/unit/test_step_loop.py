"""The step loop survives a command that fails: only the request it concerns ends (with the error),
every other request goes on, and the engine stays alive."""

from __future__ import annotations

import pytest

from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine
from workers.front.async_engine import AsyncEngine, RequestFailed
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)
BOS = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


async def drain(stream) -> list[int]:
    ids = []
    async for event in stream:
        ids += event.token_ids
    return ids


async def test_a_failing_command_ends_only_its_request(tiny, monkeypatch):
    engine = new_engine(tiny, max_num_seqs=4)
    add = engine.scheduler.add

    def add_failing_for_poison(seq) -> None:
        if seq.request_id == "poison":
            raise RuntimeError("injected fault in the scheduler")
        add(seq)

    monkeypatch.setattr(engine.scheduler, "add", add_failing_for_poison)
    front = AsyncEngine(engine, tiny.tokenizer).start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        with pytest.raises(RequestFailed, match="injected fault"):
            await drain(front.submit([BOS, 1, 2], params, "poison"))
        assert front.alive
        assert len(await drain(front.submit([BOS, 1, 2], params, "healthy"))) == 6
        assert front._inflight == 0  # the failed request's place in the queue was given back
    finally:
        front.shutdown()


def test_a_prefills_first_tokens_go_out_before_the_decode(tiny):
    """A request admitted beside a running one gets its first token from the prefill, emitted
    before the step's decode runs; the step's events are the rest, and the tokens are what the
    engine gives when every event comes at the end of the step."""
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [[BOS, 5, 6, 7], [BOS, 9, 8]]

    def run(early: bool) -> tuple[dict[str, list[int]], list[tuple[int, str, list[int], str | None]]]:
        engine = new_engine(tiny, max_num_seqs=4)
        decodes = 0
        decode = engine._decode

        def counted(*args) -> None:
            nonlocal decodes
            decodes += 1
            decode(*args)

        engine._decode = counted
        log, tokens = [], {}

        def record(events, where: str) -> None:
            for e in events:
                log.append((decodes, where, list(e.token_ids), e.finish_reason))
                tokens.setdefault(e.request_id, []).extend(e.token_ids)

        first = (lambda events: record(events, "first")) if early else None
        engine.add_request(prompts[0], params, request_id="running")
        record(engine.step(first), "step")
        engine.add_request(prompts[1], params, request_id="new")
        while engine.has_work():
            record(engine.step(first), "step")
        return tokens, log

    plain, _ = run(early=False)
    early, log = run(early=True)
    assert early == plain
    firsts = [(decodes, ids) for decodes, where, ids, _ in log if where == "first"]
    assert firsts[0] == (0, plain["running"][:1])  # the first step's prefill, before any decode
    assert firsts[1] == (1, plain["new"][:1])  # the new request's, before the second step's decode
    assert sum(len(ids) for _, _, ids, _ in log) == 10  # nothing lost, nothing sent twice
