"""How often a replica may restart its engine in place before it gives up and lets Serve replace it.

A crash-looping engine (a bad GPU, a checkpoint that kills every step) must not restart forever:
after `max_restarts` within `window_s` the replica stops trying and fails its health check. Pure
bookkeeping with the clock passed in, so the rule is testable without processes.
"""

from __future__ import annotations

from collections import deque


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._starts: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Whether one more restart may begin at `now`; if so it is counted."""
        while self._starts and now - self._starts[0] >= self.window_s:
            self._starts.popleft()
        if len(self._starts) >= self.max_restarts:
            return False
        self._starts.append(now)
        return True
