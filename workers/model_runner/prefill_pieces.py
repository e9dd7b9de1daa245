"""The prefill cut at attention, on static buffers: what prefill graphs capture for a bucket of
token counts (`graphs/prefill_graphs.py`) and, run without graphs, their eager twin.

Why: below a few thousand tokens an eager prefill is bound by kernel launches, ~35 a layer, about
11 ms on the 1B shape whatever its token count (`bench/results/prefill_shapes_h200.md`), and every
running stream waits for it. Attention depends on each prompt's length and cached context, known
on the host per call, so it stays eager; everything between two attention calls (norms,
projections, rope, the KV write, the MLP, the residuals) is per token and of fixed shape once the
tokens are padded to a bucket, so it is captured: L + 1 pieces for L layers.

Each piece reads and writes the static buffers in place (the step's inputs, rope rows and write
positions, the hidden state, q/k/v and the attention output), so a bucket's graphs keep one set
of activations alive, not one per piece. Padding tokens sit in the scratch slot at position 0:
their K/V go to the scratch page, attention never reads them (its offsets cover the real tokens
only), and every other operation is per token. LoRA prefills run the plain way (`runner.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.kv.kv_cache import KVCache
from workers.kv.prefill_attention import PrefillAttention
from workers.model_runner.pinned_copy import PinnedCopy
from workers.model_runner.step_inputs import PrefillInputs
from workers.modeling.model import LlamaModel, last_tokens


class PrefillPieces:
    def __init__(self, model: LlamaModel, cache: KVCache, max_tokens: int) -> None:
        self.model = model
        self.cache = cache
        device, dtype = model.embed.weight.device, model.cfg.dtype
        attn = model.layers[0].attn
        self.inputs = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)  # tokens, positions, slots
        self._copy = PinnedCopy(self.inputs)
        self.index = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # where each token's K/V go

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(max_tokens, *shape, dtype=dtype, device=device)

        self.cos, self.sin = buffer(model.cfg.head_dim), buffer(model.cfg.head_dim)
        self.hidden = buffer(model.cfg.hidden_size)
        self.q = buffer(attn.num_heads, attn.head_dim)
        self.k, self.v = buffer(attn.num_kv_heads, attn.head_dim), buffer(attn.num_kv_heads, attn.head_dim)
        self.attn_out = buffer(attn.num_heads * attn.head_dim)

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    def load(self, batch: PrefillInputs, bucket: int) -> None:
        """Copy the batch's tokens into the static inputs; tokens past them, up to `bucket`, pad to
        the scratch slot at position 0."""
        self._copy.fill(batch[:3], bucket, (0, 0, self.cache.scratch_slot))

    def piece(self, i: int, bucket: int) -> None:
        """Piece i on the first `bucket` tokens: 0 is the embedding and layer 0 up to attention; then
        layer i - 1 after attention and layer i up to it; the last, the last layer after attention."""
        m, n = self.model, bucket
        tokens, positions, slots = self.inputs[:, :n]
        if i == 0:
            h, cos, sin = m.embed_tokens(tokens, positions)
            self.cos[:n].copy_(cos)
            self.sin[:n].copy_(sin)
            self.index[:n].copy_(self.cache.write_index(slots, positions))
        else:
            h = m.post_attention(i - 1, self.hidden[:n], self.attn_out[:n])
        if i < len(m.layers):
            q, k, v = m.pre_attention(i, h, self.cos[:n], self.sin[:n], self.index[:n], self.cache)
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
        self.hidden[:n].copy_(h)

    def attention(self, batch: PrefillInputs) -> PrefillAttention:
        """The batch's attention, set up once for every layer (over its real tokens only)."""
        n = len(batch.tokens)
        window = self.model.cfg.sliding_window
        positions, slots = self.inputs[1, :n], self.inputs[2, :n]
        return PrefillAttention(self.cache, slots, positions, batch.lens, batch.context_lens, window, self.q)

    def attend(self, layer: int, attention: PrefillAttention, n: int) -> None:
        """Layer's attention for the first n (real) tokens, eager, into the static output."""
        self.attn_out[:n].copy_(attention(layer, self.q[:n], self.k[:n], self.v[:n]))

    def logits(self, batch: PrefillInputs) -> torch.Tensor:
        """Logits of each sequence's last token, from the hidden state the last piece left."""
        return self.model.logits(self.hidden[last_tokens(batch.lens, self.hidden.device)])

    def run(self, batch: PrefillInputs, bucket: int, piece: Callable[[int], None] | None = None) -> torch.Tensor:
        """The whole prefill on static inputs of `bucket` tokens: each piece by `piece(i)` (a graph's
        replay), or eager (the twin of the graphs) without it; attention eager between them."""
        piece = piece or (lambda i: self.piece(i, bucket))
        n = len(batch.tokens)
        self.load(batch, bucket)
        attention = self.attention(batch)
        for i in range(self.num_pieces):
            piece(i)
            if i < len(self.model.layers):
                self.attend(i, attention, n)
        return self.logits(batch)
