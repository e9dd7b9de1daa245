"""Per-request sampling, outside the model step so the step itself can be captured.

Randomness is counter-based: the noise for a request's n-th token is a hash of (seed, n, token id),
computed with 32-bit integer arithmetic that is exact on CPU and GPU alike. A seeded request
therefore draws the same tokens whatever else shares its batch, whichever bucket it lands in, and on
either device, with no generator state to carry between steps. Sampling is Gumbel-max over the
temperature-scaled logits after top-k and then top-p filtering, which draws exactly from that
filtered softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B1


class InvalidRequest(ValueError):
    """A request that can never be served as asked (the serving layer's 400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            # the sampler holds seeds in int64: a larger one would crash the engine step, not this request
            raise InvalidRequest(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32); never overflows."""
    x = (((x >> 16) ^ x) * _HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape (rows, vocab) that depends only on each row's (seed, step)."""
    vocab_keys = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    key = _mix32((seeds & MASK32) ^ _mix32(((steps * _GOLDEN) & MASK32) ^ (seeds >> 32)))
    bits = _mix32(key[:, None] ^ vocab_keys[None, :])
    u = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k (0 = all) and then outside its top-p nucleus."""
    vocab = logits.shape[-1]
    values, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    values = values.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows without top-p keep everything: float rounding of the cumulative mass must not cut their tail.
    values = values.masked_fill((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, values)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> torch.Tensor:
    """One token per row. `seeds[i]` is row i's request seed, `steps[i]` how many tokens it has drawn."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    device = logits.device
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        # a top_k beyond the vocabulary keeps every token; clamped, it also fits the int64 tensor
        top_k = torch.tensor([min(p.top_k, logits.shape[-1]) for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    step_t = torch.tensor(steps, dtype=torch.int64, device=device)
    drawn = (scaled + gumbel_noise(seed_t, step_t, logits.shape[-1])).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy, drawn)
