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
host first, while the device may still be running the replayed step (every later part waits for
it), then copied over and applied after logit_bias, so the logprobs reported are those of the
constrained distribution. Free rows of the batch are not touched.
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


class BatchSampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_slots, vocab_size, device=device)  # fp32 counts: exact far past any length
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.masks = MaskFiller()
        self._bitmask: torch.Tensor | None = None  # the host's token bitmasks, one row per constrained row

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
        did). Logprobs are of the logits as penalties and logit_bias left them, before temperature."""
        params = [s.params for s in seqs]
        masks = self._grammar_masks(seqs, logits.device)  # first: the host works while the device runs the step
        logits = logits.float()
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:  # their rows and slots
            index = torch.tensor([penalized, [seqs[i].slot for i in penalized]], device=logits.device)
            logits = self._penalize(logits, index, [params[i] for i in penalized])
        if any(p.logit_bias for p in params):
            logits = self._bias(logits, params)
        if masks is not None:
            logits = apply_token_bitmask(logits, *masks)
        tokens = sample(logits, params, [s.seed for s in seqs], [len(s.output_ids) for s in seqs])
        if penalized:
            self._record(index, tokens)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = self._logprobs(logits, tokens, params, wanted) if wanted else None
        return tokens.tolist(), logprobs

    def _grammar_masks(self, seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...] | None:
        """(rows, their token bitmasks on the device) of the rows with a grammar; None without any."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        grammars = [seqs[i].grammar for i in rows]
        words = grammars[0].words
        if self._bitmask is None or self._bitmask.shape[1] != words:
            slots = self.counts.shape[0]
            self._bitmask = torch.empty(slots, words, dtype=torch.int32, pin_memory=device.type == "cuda")
        host = self._bitmask[: len(rows)]
        self.masks.fill(grammars, host)
        # pinned: the copy runs behind the step; the buffer is filled again only after this step's tokens are read
        return torch.tensor(rows, device=device), host.to(device, non_blocking=True)

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
        presence, frequency, repetition = torch.tensor(values, device=logits.device).T
        rows, slots = index
        penalized = apply_penalties(
            logits[rows], self.counts[slots], self.in_prompt[slots], presence, frequency, repetition
        )
        return logits.index_put((rows,), penalized)

    @staticmethod
    def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
        rows, ids, biases = zip(*entries)
        index = torch.tensor([rows, ids], device=logits.device)
        return logits.index_put((index[0], index[1]), torch.tensor(biases, device=logits.device), accumulate=True)

    def _record(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the drawn tokens of the penalized rows in their slots' history (a token that ends
        its sequence is counted too: nothing reads that row before the slot's next sequence refills it)."""
        rows, slots = index
        self.counts.index_put_((slots, tokens[rows]), torch.ones(len(rows), device=tokens.device), accumulate=True)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], rows: list[int]
    ) -> list[TokenLogprob | None]:
        index = torch.tensor(rows, device=logits.device)
        chosen, top_values, top_ids = token_logprobs(
            logits[index], tokens[index], max(params[i].logprobs for i in rows)
        )
        values = torch.cat([chosen[:, None], top_values], dim=1).tolist()
        out: list[TokenLogprob | None] = [None] * len(params)
        for i, row_values, ids in zip(rows, values, top_ids.tolist()):
            k = params[i].logprobs
            out[i] = TokenLogprob(row_values[0], list(zip(ids[:k], row_values[1 : k + 1])))
        return out
