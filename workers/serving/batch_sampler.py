"""The engine's sampler over a batch of sequences: penalties, logit_bias and the grammar masks of
structured outputs on the step's logits, the draw (`sampling.sample`), then the logprobs asked for,
all outside the captured step.

Penalties need each sequence's token history, kept on the device with one row per sequence slot:
the counts of its generated tokens and a mask of its prompt's tokens. A row is filled when its
sequence is prefilled (again after a preemption, from its prompt and output so far) and each step's
drawn tokens are added by one scatter on the device, so no history crosses to the host per step.
Each part runs only when some row of the batch asks for it: a batch without penalties, logit_bias,
a schema or logprobs costs what sampling alone does.

A row with a grammar (`grammar.py`) draws only what it allows: its token bitmask is filled on the
host first, while the device still runs the replayed step, copied over on a stream of its own, and
applied after logit_bias (in place, one kernel on CUDA), so the logprobs reported are those of the
constrained distribution. Free rows of the batch are not touched. Nothing on that path waits for
the device: a blocking copy there (an index tensor built on the device from a list) held the host
until the step ended, and then the device idled while each later kernel was launched.
"""

from __future__ import annotations

import torch

from workers.serving.grammar import MaskFiller
from workers.serving.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    apply_token_bitmask,
    on_device,
    sample,
    token_logprobs,
)
from workers.serving.scheduler import Sequence, new_sequence

# Every part at once: what warm-up runs (a process's first use of each loads kernels) and what the
# KV pool's sizing measures the peak memory of.
EVERY_PART = SamplingParams(
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias=((0, 1.0),),
    logprobs=MAX_LOGPROBS,
)


class BitmaskBuffers:
    """The token bitmasks of a batch's rows under a grammar, and those rows' indices: filled on the
    host, sent in one copy, applied by one launch.

    One buffer on each side, laid out alike: the row indices (room for every slot, rounded up to 4
    so the bitmasks after them start 16-byte aligned, as every tensor of the kernel's warm-up was:
    Triton compiles apart for a pointer that is not), then one bitmask row per constrained row. On
    CUDA the host buffer is pinned and the copy runs on a stream of its own, so it overlaps the step
    the device is still running; the main stream waits for the copy only where the masks are
    applied. No step allocates: the buffers are sized for every slot once.
    """

    def __init__(self, num_slots: int, words: int, device: torch.device) -> None:
        self.words = words
        self.rows = 0
        self._offset = -(-num_slots // 4) * 4
        cuda = device.type == "cuda"
        self.on_host = torch.empty(self._offset + num_slots * words, dtype=torch.int32, pin_memory=cuda)
        self.on_device = torch.empty_like(self.on_host, device=device) if cuda else self.on_host
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._sent = torch.cuda.Event() if cuda else None  # the last copy has read the host buffer
        self._read = torch.cuda.Event() if cuda else None  # the last launch has read the device buffer

    def stage(self, rows: list[int]) -> torch.Tensor:
        """Take these logits rows' indices; returns the host bitmask rows to fill, one per index."""
        if self._sent is not None:
            self._sent.synchronize()  # done long ago: the last step's tokens were read after it
        self.rows = len(rows)
        self.on_host[: self.rows] = torch.tensor(rows, dtype=torch.int32)
        return self._bitmask(self.on_host)

    def send(self) -> None:
        """Copy what `stage` took and the bitmasks filled to the device (no copy off CUDA)."""
        if self._stream is None:
            return
        size = self._offset + self.rows * self.words
        self._stream.wait_event(self._read)
        with torch.cuda.stream(self._stream):
            self.on_device[:size].copy_(self.on_host[:size], non_blocking=True)
        self._sent.record(self._stream)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the banned logits of the staged rows to -inf, in place."""
        if self._sent is None:
            apply_token_bitmask(logits, self.on_device[: self.rows], self._bitmask(self.on_device))
            return
        stream = torch.cuda.current_stream(logits.device)
        stream.wait_event(self._sent)
        apply_token_bitmask(logits, self.on_device[: self.rows], self._bitmask(self.on_device))
        self._read.record(stream)

    def _bitmask(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self._offset : self._offset + self.rows * self.words].view(self.rows, self.words)


class BatchSampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_slots, vocab_size, device=device)  # fp32 counts: exact far past any length
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.masks = MaskFiller()
        self.bitmasks: BitmaskBuffers | None = None  # made by the first batch with a grammar

    @staticmethod
    def history_bytes(num_slots: int, vocab_size: int) -> int:
        """Device memory of the token history (what the KV pool's sizing leaves for it)."""
        return num_slots * vocab_size * (4 + 1)

    def admit(self, seqs: list[Sequence]) -> None:
        """Fill the history rows of the penalized sequences among those just given their slots."""
        for seq in seqs:
            if seq.params.penalized:
                self._load(seq)

    def _load(self, seq: Sequence) -> None:
        device = self.counts.device
        self.counts[seq.slot].zero_()
        self.in_prompt[seq.slot].zero_()
        self.in_prompt[seq.slot, torch.tensor(seq.prompt_ids, device=device)] = True
        if seq.output_ids:
            ids = torch.tensor(seq.output_ids, device=device)
            self.counts[seq.slot].index_add_(0, ids, torch.ones(len(ids), device=device))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """One token per sequence, and each token's logprobs for the rows that asked (None where none
        did). Logprobs are of the logits as penalties and logit_bias left them, before temperature.
        The rows of `logits` under a grammar are changed in place: the caller reads them no more."""
        params = [s.params for s in seqs]
        constrained = self._send_masks(seqs)  # first: the host fills them while the device runs the step
        logits = logits.float()
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:  # their rows and slots
            index = on_device([penalized, [seqs[i].slot for i in penalized]], torch.int64, logits.device)
            logits = self._penalize(logits, index, [params[i] for i in penalized])
        if any(p.logit_bias for p in params):
            logits = self._bias(logits, params)
        if constrained:
            self.bitmasks.apply(logits)
        tokens = sample(logits, params, [s.seed for s in seqs], [len(s.output_ids) for s in seqs])
        if penalized:
            self._record(index, tokens)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = self._logprobs(logits, tokens, params, wanted) if wanted else None
        return tokens.tolist(), logprobs

    def _send_masks(self, seqs: list[Sequence]) -> bool:
        """Fill the token bitmasks of the rows with a grammar and send them to the device; False
        where no row has one."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return False
        grammars = [seqs[i].grammar for i in rows]
        if self.bitmasks is None or self.bitmasks.words != grammars[0].words:
            self.bitmasks = BitmaskBuffers(self.counts.shape[0], grammars[0].words, self.counts.device)
        self.masks.fill(grammars, self.bitmasks.stage(rows))
        self.bitmasks.send()
        return True

    def probe(self, rows: int) -> list[Sequence]:
        """Sequences in slots 0 to rows - 1 asking for every part, their history loaded (the next
        sequence in each of those slots refills it)."""
        seqs = [new_sequence([0], EVERY_PART) for _ in range(rows)]
        for slot, seq in enumerate(seqs):
            seq.slot = slot
            self._load(seq)
        return seqs

    def _penalize(self, logits: torch.Tensor, index: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        values = [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params]
        presence, frequency, repetition = on_device(values, torch.float32, logits.device).T
        rows, slots = index
        penalized = apply_penalties(
            logits[rows], self.counts[slots], self.in_prompt[slots], presence, frequency, repetition
        )
        return logits.index_put((rows,), penalized)

    @staticmethod
    def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
        rows, ids, biases = zip(*entries)
        index = on_device([rows, ids], torch.int64, logits.device)
        return logits.index_put((index[0], index[1]), on_device(biases, torch.float32, logits.device), accumulate=True)

    def _record(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the drawn tokens of the penalized rows in their slots' history (a token that ends
        its sequence is counted too: nothing reads that row before the slot's next sequence refills it)."""
        rows, slots = index
        self.counts.index_put_((slots, tokens[rows]), torch.ones(len(rows), device=tokens.device), accumulate=True)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], rows: list[int]
    ) -> list[TokenLogprob | None]:
        index = on_device(rows, torch.int64, logits.device)
        chosen, top_values, top_ids = token_logprobs(
            logits[index], tokens[index], max(params[i].logprobs for i in rows)
        )
        values = torch.cat([chosen[:, None], top_values], dim=1).tolist()
        out: list[TokenLogprob | None] = [None] * len(params)
        for i, row_values, ids in zip(rows, values, top_ids.tolist()):
            k = params[i].logprobs
            out[i] = TokenLogprob(row_values[0], list(zip(ids[:k], row_values[1 : k + 1])))
        return out
