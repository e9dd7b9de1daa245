"""How many pages the KV pool gets: sized from the device memory left after the weights, the largest
prefill's activations and the graphs, not from max_num_seqs x max_model_len.

On CUDA a profile prefill of the largest size the engine runs (into a one-page cache, so it costs
no pool memory) measures the activation peak; the pool then takes `kv_cache_memory_fraction` of
the memory free after that, less the peak, the graph memory budget and the sampler's token
history. More pages than every slot at max_model_len could use are never allocated. An explicit
`kv_cache_tokens` overrides both, and on CPU (no device memory to measure) the pool holds every slot
at max_model_len. With tensor parallelism every rank sizes its own pool and they take the smallest,
because rank 0's block manager hands out page numbers for all of them.
"""

from __future__ import annotations

import torch

from workers.kv.kv_cache import KVCache, pages_needed
from workers.modeling.model import LlamaModel
from workers.serving.batch_sampler import BatchSampler

MB = 1 << 20


def prefill_sizes(max_num_batched_tokens: int, max_model_len: int) -> list[list[int]]:
    """Prompt lengths of a ladder of prefills up to the largest one the engine runs (each split into
    prompts of at most max_model_len): what startup runs to warm and to measure prefill."""
    sizes = [16]
    largest = max(max_num_batched_tokens, max_model_len)
    while sizes[-1] < largest:
        sizes.append(min(2 * sizes[-1], largest))
    return [[min(max_model_len, n - start) for start in range(0, n, max_model_len)] for n in sizes]


def scratch_cache(model: LlamaModel, page_size: int) -> KVCache:
    """A cache of only the scratch page: a prefill into it writes nowhere that matters."""
    return model.make_kv_cache(0, num_pages=1, page_size=page_size)


@torch.inference_mode()
def activation_peak_bytes(model: LlamaModel, max_num_batched_tokens: int, max_num_seqs: int, page_size: int) -> int:
    """Device memory the largest prefill and the largest batch's sampling (with every part: top-k
    and top-p, penalties, logit_bias, logprobs) take at their peak."""
    device = model.embed.weight.device
    lens = prefill_sizes(max_num_batched_tokens, model.max_model_len)[-1]
    n = sum(lens)
    cache = scratch_cache(model, page_size)
    sampler = BatchSampler(max_num_seqs, model.cfg.vocab_size, device)  # before `base`: its history is reserved apart
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = torch.zeros(n, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(m, device=device) for m in lens])
    model.prefill(tokens, positions, torch.zeros_like(tokens), lens, cache)
    logits = torch.zeros(max_num_seqs, model.cfg.vocab_size, dtype=model.cfg.dtype, device=device)
    sampler.sample(logits, sampler.probe(max_num_seqs))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def plan_num_pages(
    model: LlamaModel,
    max_num_seqs: int,
    page_size: int,
    kv_cache_tokens: int | None,
    memory_fraction: float,
    max_num_batched_tokens: int,
    reserved_bytes: int,
) -> int:
    """Pages of this rank's pool, the scratch page included; `reserved_bytes` is what other
    allocations (the graphs' budget, the sampler's token history) are left."""
    if page_size < 1:
        raise ValueError(f"kv_page_size={page_size}: a KV page holds at least one token position")
    useful = 1 + max_num_seqs * pages_needed(model.max_model_len, page_size)
    if kv_cache_tokens is not None:
        if kv_cache_tokens < model.max_model_len:
            raise ValueError(
                f"kv_cache_tokens={kv_cache_tokens} cannot hold one sequence of max_model_len={model.max_model_len}; "
                "raise kv_cache_tokens or lower max_model_len"
            )
        return 1 + pages_needed(kv_cache_tokens, page_size)
    device = model.embed.weight.device
    if device.type != "cuda":
        return useful
    peak = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, page_size)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    budget = memory_fraction * free - peak - reserved_bytes
    page_bytes = model.kv_bytes_per_token() * page_size
    num_pages = min(useful, max(0, int(budget // page_bytes)))
    if (num_pages - 1) * page_size < model.max_model_len:
        raise ValueError(
            f"the device memory left for the KV pool ({max(0, budget) / 2**20:.0f} MB of "
            f"kv_cache_memory_fraction={memory_fraction} of {free / 2**20:.0f} MB free) cannot hold one sequence "
            f"of max_model_len={model.max_model_len}; lower max_model_len or max_num_batched_tokens, or raise "
            "kv_cache_memory_fraction"
        )
    return num_pages


def agree_num_pages(model: LlamaModel, num_pages: int) -> int:
    """With tensor parallelism, the smallest of the ranks' pools (one all-reduce)."""
    tp = model.tp
    if tp.world_size == 1:
        return num_pages
    pages = torch.tensor([num_pages], dtype=torch.int64, device=model.embed.weight.device)
    torch.distributed.all_reduce(pages, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(pages.item())
