"""How many sequences an ingress replica takes under way before it answers 503 at once.

Serve holds a replica's requests to its `max_ongoing_requests` (max_num_seqs + max_waiting) and
queues the rest in each caller's router without a bound, so without this a full server made
requests wait for as long as their clients would. A request counts its n sequences.
"""

from __future__ import annotations


def ingress_capacity(replicas_serving: int, max_num_seqs: int, max_waiting: int) -> int:
    """What the serving replicas hold (running and queued), and max_waiting more waiting for room."""
    return replicas_serving * (max_num_seqs + max_waiting) + max_waiting


def admits(under_way: int, n: int, replicas_serving: int, max_num_seqs: int, max_waiting: int) -> bool:
    """With nothing under way a request always goes on: one that no replica could ever hold (n past
    a replica's room) is then the replica's 400, not a 503 that no retry gets past."""
    return under_way == 0 or under_way + n <= ingress_capacity(replicas_serving, max_num_seqs, max_waiting)
