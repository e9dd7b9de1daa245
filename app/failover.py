"""Failover: a request whose replica (or that replica's engine) dies goes on on another replica,
and its client sees one stream, token for token what an uninterrupted run gives.

The sampler's noise for token n is a hash of the request's seed and n, so a continuation draws the
same tokens if it re-prefills the prompt and the tokens already sent, keeps the seed (for an
unseeded request, the one its engine drew: every item carries it) and samples its next token at
step n. Its detokenizer goes on from the state the last item carried, so no text is repeated or
lost, held-back text that could still become a stop string included.

The ingress keeps a `Progress` per request from the chunks it relays, and when a `Failure` says the
replica or its engine failed (`retry`), sends the request again with a `resume` (what the client
has) and an `avoid` list (the replicas that failed it). A request for n > 1 choices runs
them side by side on one replica; when that fails, each unfinished choice goes on by itself, as a
one-choice request with that choice's seed and progress, and its items come back under its index.
Serve's own router could pick the failed replica again: with its engine restarting in place it is
alive and, its streams gone, the least loaded. `FailoverRouter`, the LLM deployment's request
router, is Serve's power of two choices (with its locality and model multiplexing preferences) that
never offers a replica the request avoids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import msgspec
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from workers.protocol import ChoiceChunk, Continuation, Failure, GenerateRequest, Item, Resume, decode_request
from workers.serving.detokenizer import DetokState
from workers.serving.sampling import InvalidRequest, choice_seed

MAX_FAILOVERS = 3  # a request fails over at most this often, then the failure stands
FAILOVER_TIMEOUT_S = 30.0  # bound on each continuation's wait for its first item (routing, queue, prefill)


@dataclass
class Progress:
    """What the client of one request has been sent, and which replicas failed it."""

    output_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    detok: DetokState | None = None  # the last chunk's detokenizer state
    replica_id: str | None = None  # the replica of the current attempt, once a chunk named it
    avoid: list[str] = field(default_factory=list)
    failovers: int = 0

    def record(self, chunk: ChoiceChunk) -> None:
        """A chunk relayed to the client."""
        self.output_ids += chunk.token_ids
        self.seed, self.detok, self.replica_id = chunk.seed, chunk.detok, chunk.replica_id

    def fail(self, failure: Failure) -> bool:
        """Note a failed attempt; whether the request may go on elsewhere: only after a failure of
        the replica or its engine (never a client's error or a cancellation), a bounded number of times."""
        if not failure.retry or self.failovers >= MAX_FAILOVERS:
            return False
        failed = failure.replica_id or self.replica_id
        if failed is not None and failed not in self.avoid:
            self.avoid.append(failed)
        self.replica_id = None
        self.failovers += 1
        return True

    def payload(self, request: GenerateRequest) -> GenerateRequest:
        """The request for the next attempt: as first sent, plus where to go on from (once a chunk
        was relayed: its seed must stay, even with no token yet) and which replicas to avoid."""
        if not self.failovers:
            return request
        resume = None
        if self.detok is not None:
            resume = Continuation(list(self.output_ids), self.seed, self.detok)
        return msgspec.structs.replace(request, avoid=tuple(self.avoid), resume=resume)


def with_request_seed(request: GenerateRequest, first_seed: int | None) -> GenerateRequest:
    """An n-choice request whose choices go on by themselves, seeded as its replica seeded them: an
    unseeded one's choices derive from the seed its replica drew, which is choice 0's (known once a
    chunk of choice 0 came; the seed header is that one), or, with none sent yet, from one drawn
    now. A choice that lost its replica before its first chunk then draws what the header's seed
    samples again, not a seed of its own."""
    if request.sampling.seed is not None:
        return request
    seed = random.getrandbits(63) if first_seed is None else first_seed
    return msgspec.structs.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))


def one_choice(request: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of an n-choice request as a request of its own: n = 1, and the seed the
    replica gave that choice (a seeded request derives it; an unseeded one's comes with the
    choice's chunks, in its progress)."""
    seed = request.sampling.seed
    sampling = dataclasses.replace(request.sampling, seed=None if seed is None else choice_seed(seed, index))
    return msgspec.structs.replace(request, n=1, sampling=sampling)


async def merged(streams: dict[int, AsyncGenerator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """(index, item) of each stream's items as they come. The streams start one after another, each
    once the one before has yielded its first item (or ended): Serve's router keeps the calls of one
    request that wait for a replica under the request's id, one per id, so two waiting together
    leave one unrouted for good. The first item is the first stream's (choice 0's, when nothing was
    sent yet: the seed header is choice 0's). Leaving early cancels every stream."""
    waiting = list(streams.items())
    pending: dict[asyncio.Future, tuple[int, bool]] = {}  # the next read of a stream: its index, is it its first

    def start_next() -> None:
        if waiting:
            i, stream = waiting.pop(0)
            pending[asyncio.ensure_future(anext(stream, None))] = (i, True)

    start_next()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                (i, first), item = pending.pop(task), task.result()
                if first:
                    start_next()
                if item is None:
                    continue
                pending[asyncio.ensure_future(anext(streams[i], None))] = (i, False)
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams.values():
            await stream.aclose()


def continuation(request: GenerateRequest) -> Resume | None:
    """The engine's side of a request's `resume` (None for a first attempt). Only a one-choice
    request is continued: the ingress continues each choice of an n-choice request on its own."""
    if request.resume is None:
        return None
    if request.n != 1:
        raise InvalidRequest("a continuation has one choice (n = 1)")
    return Resume(list(request.resume.output_ids), request.resume.detok)


def routing(pending_request: PendingRequest | None) -> tuple[set[str], set[str]]:
    """The replica ids a generate request says to avoid, and those to take only when no other is
    left (none for other calls)."""
    args = pending_request.args if pending_request is not None else ()
    if not args or not isinstance(args[0], bytes):
        return set(), set()
    request = decode_request(args[0])
    return set(request.avoid), set(request.not_serving)


class FailoverRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Power of two choices among the replicas Serve's preferences offer (a request's adapter's
    replicas first, then those with the fewest adapters, then all; or the local node's, then all),
    less those the request avoids, and less those the ingress saw not serving while others are left
    (a replica restarting its engine would hold a new request until it is back). When that leaves
    none, Serve asks again after a backoff (the preferences widen); a request that avoids every
    replica waits for a new one, or for its caller's deadline. Each chosen replica serves the request
    it was chosen for (no FIFO hand-over: the next request in line might avoid it)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            ids = self.apply_locality_routing(pending_request=pending_request)
        avoid, not_serving = routing(pending_request)
        replicas = self.curr_replicas
        ids = [i for i in ids if i.unique_id not in avoid and i in replicas]
        ids = [i for i in ids if i.unique_id not in not_serving] or ids
        if not ids:
            return []
        return [[replicas[i] for i in random.sample(ids, min(2, len(ids)))]]
