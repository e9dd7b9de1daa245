"""Drawing one token per row from the step's logits, outside the model step so the step itself can
be captured.

Randomness is counter-based: the noise for a request's n-th token is a hash of (seed, n, token id),
computed with 32-bit integer arithmetic that is exact on CPU and GPU alike. A seeded request
therefore draws the same tokens whatever else shares its batch, whichever bucket it lands in, and on
either device, with no generator state to carry between steps. Sampling is Gumbel-max over the
temperature-scaled logits after top-k and then top-p filtering, which draws exactly from that
filtered softmax. Penalties and logit_bias change the logits before that (`batch_sampler.py` keeps the
token history they need); the noise is the same with or without them.
"""

from __future__ import annotations

import torch

from workers.serving import token_mask
from workers.serving.sampling import LOGPROB_FLOOR, SamplingParams

MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest fp32 below 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32); never overflows."""
    x = (((x >> 16) ^ x) * _HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape (rows, vocab) that depends only on each row's (seed, step). Always
    finite: the top uniform, (2**24 - 0.5) / 2**24, rounds to 1.0 in fp32, whose noise would be +inf,
    and a token filtered to -inf (top-k, top-p, a grammar's mask) would then score NaN and be drawn;
    it is held just below 1 (every other value keeps its noise, so seeded draws stay as they were)."""
    vocab_keys = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    key = _mix32((seeds & MASK32) ^ _mix32(((steps * _GOLDEN) & MASK32) ^ (seeds >> 32)))
    bits = _mix32(key[:, None] ^ vocab_keys[None, :])
    u = (((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp(max=_BELOW_ONE)
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
    # Rows without top-p keep everything: float rounding of the cumulative mass must not cut their tail;
    # every row keeps its top token (a top_p that rounds to 0 in fp32 would cut it too).
    cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks[None, :] > 0)
    values = values.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, values)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Rows (rows, vocab) with HF's repetition penalty on every token seen (in the prompt or
    generated: positive logits divided by it, negative ones multiplied), then OpenAI's frequency
    and presence penalties on the generated ones: logit - frequency * count - presence * (count > 0).
    `counts` holds each row's generated-token counts, `in_prompt` its prompt's tokens; the
    penalties are per row, (rows,)."""
    generated = counts > 0
    rep = repetition[:, None]
    logits = torch.where(in_prompt | generated, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, masks: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits`, changed in place: row rows[i]'s tokens outside bitmask row masks[i] (default: row
    i) set to -inf (bit j of word w allows token 32 * w + j; columns past the bitmask's are never
    allowed). Other rows are not touched. On CUDA one kernel (`token_mask.py`), elsewhere the same
    in torch ops."""
    rows = rows.to(torch.int32)  # one dtype, so the warm-up compiles the kernel serving launches
    if token_mask.available(logits):
        token_mask.ban(logits, rows, bitmask, None if masks is None else masks.to(torch.int32))
        return logits
    if masks is not None:
        bitmask = bitmask[masks.long()]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    banned = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[1]] == 0
    index = rows.long()
    picked = logits[index]
    picked[:, : banned.shape[1]].masked_fill_(banned, float("-inf"))
    picked[:, banned.shape[1] :] = float("-inf")
    logits[index] = picked
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(the drawn tokens' logprobs (rows,), the k highest logprobs (rows, k), their token ids) of
    log_softmax(logits) in fp32."""
    logprobs = logits.float().log_softmax(dim=-1).clamp(min=LOGPROB_FLOOR)
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(-1, tokens[:, None])[:, 0], top.values, top.indices


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a device tensor, by a copy that does not wait for the device: on CUDA,
    `torch.tensor(values, device=cuda)` synchronizes with the stream, so the host would wait for the
    replayed step to end and the device then idle while each later kernel is launched."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> torch.Tensor:
    """One token per row. `seeds[i]` is row i's request seed, `steps[i]` how many tokens it has drawn."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    device = logits.device
    temps = on_device([p.temperature or 1.0 for p in params], torch.float32, device)
    scaled = logits / temps[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        # a top_k beyond the vocabulary keeps every token; clamped, it also fits the int64 tensor
        top_k = on_device([min(p.top_k, logits.shape[-1]) for p in params], torch.int64, device)
        top_p = on_device([p.top_p for p in params], torch.float32, device)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    seed_t = on_device(seeds, torch.int64, device)
    step_t = on_device(steps, torch.int64, device)
    drawn = (scaled + gumbel_noise(seed_t, step_t, logits.shape[-1])).argmax(dim=-1)
    is_greedy = on_device([p.greedy for p in params], torch.bool, device)
    return torch.where(is_greedy, greedy, drawn)
