"""Engine counters: steps, tokens, decode batch sizes, time to first token, time per output token."""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque


def _summary(values: deque[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


class EngineStats:
    """Updated by the engine thread, read from anywhere; recent latencies are kept in a window."""

    def __init__(self, window: int = 10000) -> None:
        self._lock = threading.Lock()
        self.prefill_steps = 0
        self.decode_steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished_requests: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.tpot_s: deque[float] = deque(maxlen=window)

    def record_prefill(self, num_prompts: int, num_tokens: int) -> None:
        with self._lock:
            self.prefill_steps += 1
            self.prompt_tokens += num_tokens
            self.generated_tokens += num_prompts

    def record_decode(self, batch_size: int) -> None:
        with self._lock:
            self.decode_steps += 1
            self.generated_tokens += batch_size
            self.batch_sizes[batch_size] += 1

    def record_finish(self, reason: str, ttft: float | None, tpot: float | None) -> None:
        with self._lock:
            self.finished_requests[reason] += 1
            if ttft is not None:
                self.ttft_s.append(ttft)
            if tpot is not None:
                self.tpot_s.append(tpot)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "prefill_steps": self.prefill_steps,
                "decode_steps": self.decode_steps,
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "finished_requests": dict(self.finished_requests),
                "decode_batch_sizes": dict(sorted(self.batch_sizes.items())),
                "ttft_s": _summary(self.ttft_s),
                "tpot_s": _summary(self.tpot_s),
            }
