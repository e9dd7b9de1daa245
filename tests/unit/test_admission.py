"""The ingress's admission bound: what it takes under way before a 503, and that its count follows
each request's items to their end, whether they finish, fail or are left by the client."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from policies.admission import admits, ingress_capacity


def test_capacity_is_every_serving_replicas_room_and_max_waiting_more():
    assert ingress_capacity(2, 8, 4) == 2 * (8 + 4) + 4
    assert admits(27, 1, 2, 8, 4) and not admits(28, 1, 2, 8, 4)
    assert not admits(20, 9, 2, 8, 4)  # a request counts its n sequences
    assert admits(0, 1, 1, 1, 0) and not admits(1, 1, 1, 1, 0)  # max_num_seqs 1, no queue: one at a time
    assert admits(0, 2, 1, 1, 0)  # more than could ever fit goes on to the replica's 400, on an idle server


def counting_ingress():
    from app.ingress import Ingress

    fake = SimpleNamespace(_sequences=0)
    fake._counted = Ingress._counted.__get__(fake)
    return fake


async def items(n: int, fail: bool = False):
    for i in range(n):
        yield i
    if fail:
        raise ConnectionError("the replica is gone")


def test_sequences_are_counted_while_their_items_are_under_way():
    async def scenario():
        fake = counting_ingress()
        finished = fake._counted(items(2), 3)
        assert [i async for i in finished] == [0, 1] and fake._sequences == 0
        left = fake._counted(items(5), 2)
        assert await anext(left) == 0 and fake._sequences == 2
        other = fake._counted(items(5), 1)
        await anext(other)
        assert fake._sequences == 3
        await left.aclose()  # the client went away
        assert fake._sequences == 1
        failed = fake._counted(items(1, fail=True), 4)
        try:
            async for _ in failed:
                pass
        except ConnectionError:
            pass
        assert fake._sequences == 1
        await other.aclose()
        assert fake._sequences == 0

    asyncio.run(scenario())
