"""Whether any LLM replica is READY, as the ingress sees it: the controller's replica statuses, looked
up at most every `max_age_s`.

Requests ask on every call, so the look-up must stay off their path. A burst arriving just after the
view expired shares one controller call instead of making one each, and while some replica was READY
at the last look, callers get that answer at once and the view refreshes in the background. Only
before any replica was seen READY do callers wait for the controller. A restarted controller knows
no replica until each reports again (about every second), so a replica it stops listing stays in
the view for `grace_s` of answers that lack it. The grace starts with the first such answer, not
with the last listing: a controller down for longer than the grace is no outage either.

A view the controller has never answered (a new ingress while the controller hangs) is not `known`:
its emptiness says nothing, and the ingress lets Serve route (Serve sends requests only to replicas
whose start-up, capture included, has finished) instead of refusing every request. While the
controller fails, callers do not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
# A replica swapping its model serves again in moments: requests wait for it (the ingress retries).
SERVING_STATES = ("READY", "REBUILDING")


class ReadinessView:
    def __init__(
        self,
        fetch: Callable[[], Awaitable[dict[str, dict]]],
        max_age_s: float = 1.0,
        grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """fetch: the controller's replica statuses, {replica id: status with a "state"}."""
        self.fetch = fetch
        self.max_age_s = max_age_s
        self.grace_s = grace_s
        self.clock = clock
        self._ready: dict[str, bool] = {}
        self._missing_since: dict[str, float] = {}  # replica id -> first answer that did not list it
        self._fetched_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._keeper: asyncio.Task | None = None
        self._failing = False
        self._known = False

    @property
    def known(self) -> bool:
        """Whether the controller has answered since this view was made."""
        return self._known

    def keep_fresh(self) -> None:
        """Refresh the view every max_age_s from now on, whether requests come or not (on the
        running event loop; a second call does nothing): the router reads `not_serving` from the
        view as a request arrives, and a view last refreshed before a quiet spell would still show
        a replica that began restarting meanwhile as serving."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.ensure_future(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.max_age_s)
            await self._refresh()

    async def any_ready(self) -> bool:
        if self.clock() - self._fetched_at > self.max_age_s:
            refresh = self._refresh()
            if not any(self._ready.values()) and not self._failing:
                await asyncio.shield(refresh)  # a caller that goes away must not cancel the others' wait
        return any(self._ready.values())

    async def serving(self) -> set[str]:
        """The replicas serving (READY, or swapping and back in moments), as any_ready sees them."""
        await self.any_ready()
        return {r for r, ready in self._ready.items() if ready}

    def not_serving(self) -> set[str]:
        """The replicas known and not serving at the last look (an engine restarting, a failed one)."""
        return {r for r, ready in self._ready.items() if not ready}

    def _refresh(self) -> asyncio.Task:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._fetch())
        return self._refreshing

    async def _fetch(self) -> None:
        try:
            fresh = await self.fetch()
        except Exception:  # keep the last view; the next caller tries again
            if not self._failing:  # once per outage, not once per request
                log.warning("replica statuses unavailable from the controller", exc_info=True)
            self._failing = True
            return
        if self._failing:
            log.info("replica statuses available from the controller again")
        self._failing, self._known = False, True
        now = self.clock()
        self._missing_since = {r: self._missing_since.get(r, now) for r in self._ready if r not in fresh}
        self._ready = {
            r: ready for r, ready in self._ready.items() if now - self._missing_since.get(r, now) < self.grace_s
        }
        self._ready.update({r: s.get("state") in SERVING_STATES for r, s in fresh.items()})
        self._fetched_at = now
