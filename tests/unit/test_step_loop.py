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
