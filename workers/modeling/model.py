"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) written for serving.

Fused QKV and gate/up projections, RMSNorm, RoPE with Llama 3 / linear scaling, SDPA, GQA, tied or
untied embeddings. Every linear is a tensor-parallel layer (see `parallel.py`). Two entry points:
`prefill` (packed prompts, eager) and `decode` (one token per row, fixed shapes, no host sync, no
allocation that depends on values), which is the step the graph runner captures.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workers.kv.attention import make_backend
from workers.kv.kv_cache import KVCache, kv_write, pages_needed
from workers.kv.prefill_attention import PrefillAttention
from workers.modeling.config import ModelConfig
from workers.modeling.lora import TARGETS, LoraBatch, LoraSlots
from workers.modeling.parallel import ColumnParallelLinear, ReplicatedParameter, RowParallelLinear, TPGroup


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if cfg.rope_type == "linear":
        return inv_freq / s["factor"]
    if cfg.rope_type == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with an fp32 result from bf16/fp16 inputs: on CUDA one GEMM accumulating and
    writing fp32 (no fp32 copy of the weight); on the CPU, which lacks that GEMM, upcast per call."""
    if weight.dtype == torch.float32:
        return F.linear(x, weight)
    if not x.is_cuda:
        return F.linear(x.float(), weight.float())
    return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)


def last_tokens(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """Where each of the packed prompts' last token sits (a copy that does not wait for the device:
    `torch.tensor(values, device=cuda)` would)."""
    return torch.tensor(seq_lens).to(device, non_blocking=True).cumsum(0) - 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim). Rotate-half convention (HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DecodeParts(Protocol):
    """The three parts of a decode step (`LlamaModel.decode`): the model's own, or compiled."""

    def decode_start(self, tokens, positions, slot_ids, cache: KVCache) -> tuple: ...

    def decode_layer(self, block, h, delta, cos, sin, index, k_pages, v_pages, cache, slot_ids, plan, adapters): ...

    def decode_end(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, device: torch.device | str | None) -> None:
        super().__init__()
        d = cfg.head_dim
        q_start, q_stop = tp.shard(cfg.num_heads, "num_attention_heads")
        kv_start, kv_stop = tp.kv_heads(cfg.num_kv_heads)
        self.num_heads = q_stop - q_start
        self.num_kv_heads = kv_stop - kv_start
        self.head_dim = d
        kv_rows = (kv_start * d, kv_stop * d)
        parts = [(q_start * d, q_stop * d), kv_rows, kv_rows]
        self.qkv = ColumnParallelLinear(cfg.hidden_size, parts, cfg.qkv_bias, tp, cfg.dtype, device)
        q = cfg.num_heads * d
        self.o = RowParallelLinear(q, cfg.hidden_size, cfg.o_bias, tp, cfg.dtype, device)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = self.qkv(x, lora).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # split after the view: a view of a split slice (rows strided past it) makes a compiler
        # guard on the row count being > 1, which gives a batch of one a graph of its own
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, device: torch.device | str | None) -> None:
        super().__init__()
        i = tp.shard(cfg.intermediate_size, "intermediate_size")
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, [i, i], False, tp, cfg.dtype, device)
        self.down = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, cfg.dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x, lora).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, lora)


class Block(nn.Module):
    """One decoder layer, split at attention: `attention_inputs` before it, `residuals` after."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = ReplicatedParameter([cfg.hidden_size], cfg.dtype, device)
        self.attn = Attention(cfg, tp, device)
        self.post_attn_norm = ReplicatedParameter([cfg.hidden_size], cfg.dtype, device)
        self.mlp = MLP(cfg, tp, device)

    def attention_inputs(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_index: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV, rope; stores the K/V in this layer's pages at `write_index`; returns q, k, v."""
        q, k, v = self.attn.project(rms_norm(h, self.input_norm.weight, self.eps), cos, sin, lora)
        kv_write(k_pages, v_pages, write_index, k, v)
        return q, k, v

    def residuals(
        self, h: torch.Tensor, attn: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: the hidden state with the attention output added, and the MLP's output
        (the layer's result is their sum)."""
        h = h + self.attn.o(attn, lora)
        return h, self.mlp(rms_norm(h, self.post_attn_norm.weight, self.eps), lora)


class LlamaModel(nn.Module):
    """The decoder. Each layer is split at attention (`pre_attention`, `post_attention`) so prefill
    and decode share every other line, and so a piecewise runner can cut the step at attention."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_model_len: int,
        tp: TPGroup | None = None,
        device: torch.device | str | None = None,
        attention_backend: str = "sdpa",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.max_model_len = max_model_len
        self.embed = ReplicatedParameter([cfg.vocab_size, cfg.hidden_size], cfg.dtype, device)
        self.layers = nn.ModuleList(Block(cfg, self.tp, device) for _ in range(cfg.num_layers))
        self.norm = ReplicatedParameter([cfg.hidden_size], cfg.dtype, device)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            # Vocab-parallel: each rank computes logits for its share of the (padded) vocabulary.
            self.lm_head = ColumnParallelLinear(
                cfg.hidden_size,
                [self.tp.shard_padded(cfg.vocab_size)],
                False,
                self.tp,
                cfg.dtype,
                device,
                gather_output=True,
            )
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(cfg))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(cfg.dtype).to(device), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(cfg.dtype).to(device), persistent=False)
        self.attention_backend = make_backend(attention_backend, self.embed.weight.device)
        self.lora: LoraSlots | None = None  # None: no LoRA, and no cost

    def enable_lora(self, max_loras: int, max_rank: int, targets: tuple[str, ...] = tuple(TARGETS)) -> LoraSlots:
        """Allocate adapter slots once, on the layers `targets` name (they keep their addresses); a
        call's rows then name a slot in its `adapters` argument (0: no adapter). Before any graph is
        captured on this model: the slots move each adapted weight into a new, taller tensor."""
        self.lora = LoraSlots(self, max_loras, max_rank, targets)
        return self.lora

    def _lora_batch(self, adapters: torch.Tensor | None) -> LoraBatch | None:
        return None if self.lora is None or adapters is None else self.lora.batch(adapters)

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].attn.num_kv_heads

    def make_kv_cache(self, num_slots: int, num_pages: int | None = None, page_size: int = 16) -> KVCache:
        """A paged cache with block-table rows for num_slots sequences; by default pages enough for
        every slot to reach max_model_len (plus the scratch page)."""
        if num_pages is None:
            num_pages = 1 + num_slots * pages_needed(self.max_model_len, page_size)
        return KVCache(
            self.cfg.num_layers,
            num_pages,
            page_size,
            num_slots,
            self.max_model_len,
            self.num_local_kv_heads,
            self.cfg.head_dim,
            self.cfg.dtype,
            self.embed.weight.device,
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token position takes in this rank's cache, all layers."""
        return 2 * self.cfg.num_layers * self.num_local_kv_heads * self.cfg.head_dim * self.cfg.dtype.itemsize

    def checkpoint_map(self) -> dict[str, tuple[nn.Module, str, int]]:
        """HF tensor name -> (our module, "weight" | "bias", part index within a fused layer)."""
        m: dict[str, tuple[nn.Module, str, int]] = {"model.embed_tokens.weight": (self.embed, "weight", 0)}
        m["model.norm.weight"] = (self.norm, "weight", 0)
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, "weight", 0)
        for i, block in enumerate(self.layers):
            p = f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = (block.input_norm, "weight", 0)
            m[p + "post_attention_layernorm.weight"] = (block.post_attn_norm, "weight", 0)
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                m[p + f"self_attn.{name}.weight"] = (block.attn.qkv, "weight", part)
                if self.cfg.qkv_bias:
                    m[p + f"self_attn.{name}.bias"] = (block.attn.qkv, "bias", part)
            m[p + "self_attn.o_proj.weight"] = (block.attn.o, "weight", 0)
            if self.cfg.o_bias:
                m[p + "self_attn.o_proj.bias"] = (block.attn.o, "bias", 0)
            m[p + "mlp.gate_proj.weight"] = (block.mlp.gate_up, "weight", 0)
            m[p + "mlp.up_proj.weight"] = (block.mlp.gate_up, "weight", 1)
            m[p + "mlp.down_proj.weight"] = (block.mlp.down, "weight", 0)
        return m

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits: rounded to bf16 (steps of 0.125 near 25), a real model's top two tokens tie
        often enough to change greedy answers."""
        h = rms_norm(h, self.norm.weight, self.cfg.rms_norm_eps)
        if self.lm_head is None:
            return fp32_linear(h, self.embed.weight)
        return self.tp.all_gather_last_dim(fp32_linear(h, self.lm_head.weight))[..., : self.cfg.vocab_size]

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Hidden states and the rope cos/sin rows for these tokens."""
        return F.embedding(tokens, self.embed.weight), self.rope_cos[positions], self.rope_sin[positions]

    def pre_attention(self, i: int, h, cos, sin, write_index: torch.Tensor, cache: KVCache, lora=None):
        """Layer i up to attention: norm, QKV, rope; stores this step's K/V (at the cache's
        `write_index` of each token); returns q, k, v. `lora`: the call's LoraBatch, or None."""
        return self.layers[i].attention_inputs(h, cos, sin, write_index, *cache.layer(i), lora)

    def post_attention(self, i: int, h: torch.Tensor, attn: torch.Tensor, lora=None) -> torch.Tensor:
        """Layer i after attention: output projection, residual, MLP, residual."""
        h, mlp_out = self.layers[i].residuals(h, attn, lora)
        return h + mlp_out

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        cache: KVCache,
        adapters: torch.Tensor | None = None,
        parts: DecodeParts | None = None,
    ) -> torch.Tensor:
        """One token per row: tokens/positions/slot_ids of shape (rows,) -> logits (rows, vocab).
        Each row attends to its own slot's pages, positions 0..position (inclusive, windowed if set).
        `adapters` (rows,) names each row's LoRA slot; None runs the plain model. `parts` runs the
        step's `decode_start`, `decode_layer` (once per layer) and `decode_end`: this model's own
        (None), or their compiled forms (`compiled_step.py` compiles one layer for all layers)."""
        parts = self if parts is None else parts
        h, delta, cos, sin, index, plan = parts.decode_start(tokens, positions, slot_ids, cache)
        for i, block in enumerate(self.layers):
            h, delta = parts.decode_layer(
                block, h, delta, cos, sin, index, *cache.layer(i), cache, slot_ids, plan, adapters
            )
        return parts.decode_end(h, delta)

    def decode_start(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, cache: KVCache):
        """What every layer of a decode step reads: hidden states, a zero residual delta (see
        `decode_layer`), rope rows, where each row's K/V goes, and the attention backend's plan."""
        h, cos, sin = self.embed_tokens(tokens, positions)
        plan = self.attention_backend.prepare(cache, positions, self.cfg.sliding_window)
        return h, torch.zeros_like(h), cos, sin, cache.write_index(slot_ids, positions), plan

    def decode_layer(
        self,
        block: Block,
        h: torch.Tensor,
        delta: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        cache: KVCache,
        slot_ids: torch.Tensor,
        plan: object,
        adapters: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of the decode step, from the layer before's two residual terms (h + delta) to
        its own: the MLP's output stays unadded, so the sum runs with the next layer's norm (one
        kernel, as in a graph of the whole step) though each layer is compiled apart."""
        h, lora = h + delta, self._lora_batch(adapters)
        q, _, _ = block.attention_inputs(h, cos, sin, index, k_pages, v_pages, lora)
        attn = self.attention_backend(q, k_pages, v_pages, cache, slot_ids, plan, self.cfg.sliding_window)
        return block.residuals(h, attn, lora)

    def decode_end(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The last layer's residual sum and the logits."""
        return self.logits(h + delta)

    def prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        seq_lens: list[int],
        cache: KVCache,
        adapters: torch.Tensor | None = None,
        context_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """Prompts packed end to end (tokens of shape (sum(seq_lens),)); returns the logits of each
        prompt's last token, (len(seq_lens), vocab). Attention is causal within each prompt: one
        call for all prompts where the device allows (`prefill_attention.py`). `context_lens`:
        per prompt, the positions before its first token here, whose K/V its pages already hold (a
        cached prefix): its tokens attend to those too, read back from the cache."""
        h, cos, sin = self.embed_tokens(tokens, positions)
        attention = PrefillAttention(cache, slot_ids, positions, seq_lens, context_lens, self.cfg.sliding_window, h)
        index = cache.write_index(slot_ids, positions)
        lora = self._lora_batch(adapters)
        for i in range(len(self.layers)):
            q, k, v = self.pre_attention(i, h, cos, sin, index, cache, lora)
            h = self.post_attention(i, h, attention(i, q, k, v), lora)
        return self.logits(h[last_tokens(seq_lens, h.device)])
