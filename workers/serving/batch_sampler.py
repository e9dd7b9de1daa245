"""The engine's sampler over a batch of sequences: penalties, logit_bias and the grammar masks of
structured outputs on the step's logits, the draw (`sampling_ops.sample`), then the logprobs asked for,
all outside the captured step.

Penalties need each sequence's token history, kept on the device with one row per sequence slot:
the counts of its generated tokens and a mask of its prompt's tokens. A row is filled when its
sequence is prefilled (again after a preemption, from its prompt and output so far) and each step's
drawn tokens are added by one scatter on the device, so no history crosses to the host per step.
Each part runs only when some row of the batch asks for it: a batch without penalties, logit_bias,
a schema or logprobs costs what sampling alone does.

A row with a grammar (`grammar.py`) draws only what it allows: its token bitmask is filled on the
host, copied over on a stream of its own, and applied after logit_bias (in place, one kernel on
CUDA), so the logprobs reported are those of the constrained distribution. Free rows of the batch
are not touched. The masks of a batch with AHEAD_MIN_ROWS rows under a grammar or more are filled
ahead (`fill_ahead`, which the engine calls once the step's tokens are taken): in the mask filler's
thread, one bitmask row per sequence slot, while the engine ends the step, prepares the next and the
device runs it; `sample` waits for that fill, fills now only what it did not cover (a sequence that
has just been prefilled, or moved to another slot), and sends them. Where the fill ran from the
replay's launch only, it lay on the step's critical path whenever it took longer than the device's
step (a batch of rows inside free JSON strings). A smaller batch's masks are filled now, after the
launch: they take tens of microseconds, less than handing them to the thread and back costs
(bench/results/mask_fill_placement_h200.md). Nothing on the step's path waits for the device: a
blocking copy there (an index tensor built on the device from a list) held the host until the step
ended, and then the device idled while each later kernel was launched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from workers.serving import grammar as grammar_module
from workers.serving.grammar import Grammar, MaskFiller
from workers.serving.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from workers.serving.sampling_ops import apply_penalties, apply_token_bitmask, on_device, sample, token_logprobs
from workers.serving.scheduler import Sequence, new_sequence

AHEAD_MIN_ROWS = 8  # rows under a grammar from which a batch's masks are filled ahead, in a thread

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
    """The token bitmasks of the sequences under a grammar, one row per sequence slot, and the
    indices of a batch's constrained rows and of their bitmask rows: filled on the host, sent in one
    copy, applied by one launch.

    One buffer on each side, laid out alike: the logits rows' indices, then their bitmask rows'
    (their slots), each with room for every slot rounded up to 4 ints, so what follows starts
    16-byte aligned, as every tensor of the kernel's warm-up was (Triton compiles apart for a pointer
    that is not); then one bitmask row per slot. A row is kept with the grammar whose mask it holds
    (`holder`): a sequence that has not moved since its row was filled needs no fill. On CUDA the
    host buffer is pinned and the copy (the indices and the bitmask rows up to the highest one used)
    runs on a stream of its own, so it overlaps the step the device is still running; the main
    stream waits for the copy only where the masks are applied. No step allocates: the buffers are
    sized for every slot once. The copy stream first waits for the work queued on the stream that
    allocated them: the caching allocator hands out memory freed on that stream at once, and a
    first copy run ahead of a kernel still writing it lost the masks of a batch's first tokens.
    """

    def __init__(self, num_slots: int, words: int, device: torch.device) -> None:
        self.words = words
        self.rows = 0
        self._span = -(-num_slots // 4) * 4
        self._offset = 2 * self._span
        self._size = 0  # ints the staged batch needs copied
        cuda = device.type == "cuda"
        self.on_host = torch.empty(self._offset + num_slots * words, dtype=torch.int32, pin_memory=cuda)
        self.on_device = torch.empty_like(self.on_host, device=device) if cuda else self.on_host
        self._indices = self.on_host[: self._offset].numpy()  # written from lists without a tensor each
        self.masks = self.on_host[self._offset :].view(num_slots, words)  # the host bitmask rows, by slot
        self.holder: list[Grammar | None] = [None] * num_slots
        self._stream = torch.cuda.Stream(device) if cuda else None
        if cuda:  # the device buffer may reuse a freed tensor's memory that work queued here still writes
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._sent = torch.cuda.Event() if cuda else None  # the last copy has read the host buffer
        self._read = torch.cuda.Event() if cuda else None  # the last launch has read the device buffer

    def writable(self) -> None:
        """Wait until the last copy has read the host buffer (done long ago: the last step's tokens
        were read after it)."""
        if self._sent is not None:
            self._sent.synchronize()

    def holds(self, grammar: Grammar, slot: int) -> bool:
        """Whether bitmask row `slot` holds this grammar's mask for the place it is at."""
        return grammar.filled == slot and self.holder[slot] is grammar

    def filled(self, grammars: list[tuple[Grammar, int]]) -> None:
        """Record that each (grammar, slot)'s bitmask row now holds that grammar's mask."""
        for grammar, slot in grammars:
            self.holder[slot] = grammar
            grammar.filled = slot

    def stage(self, rows: list[int], slots: list[int]) -> None:
        """Take these logits rows' indices and their bitmask rows' (their slots)."""
        self.writable()
        n = self.rows = len(rows)
        self._indices[:n] = rows
        self._indices[self._span : self._span + n] = slots
        self._size = self._offset + (max(slots) + 1) * self.words

    def send(self) -> None:
        """Copy what `stage` took and the bitmask rows it names to the device (no copy off CUDA)."""
        if self._stream is None:
            return
        size = self._size
        self._stream.wait_event(self._read)
        with torch.cuda.stream(self._stream):
            self.on_device[:size].copy_(self.on_host[:size], non_blocking=True)
        self._sent.record(self._stream)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the banned logits of the staged rows to -inf, in place."""
        rows = self.on_device[: self.rows]
        slots = self.on_device[self._span : self._span + self.rows]
        bitmask = self.on_device[self._offset :].view(-1, self.words)
        if self._sent is None:
            apply_token_bitmask(logits, rows, bitmask, slots)
            return
        stream = torch.cuda.current_stream(logits.device)
        stream.wait_event(self._sent)
        apply_token_bitmask(logits, rows, bitmask, slots)
        self._read.record(stream)


class DrawnLogprobs(NamedTuple):
    """The logprobs a draw computed for the rows that asked: (row, how many top tokens) per such
    row, then per such row its token's logprob followed by the top ones' and the top ones' ids."""

    wanted: list[tuple[int, int]]
    values: torch.Tensor
    ids: torch.Tensor


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, launched without waiting for the device
    (a CPU tensor is its own copy)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class Draw:
    """A step's drawn tokens, on the device (where the next step's inputs can take them before the
    host has) and on their way to the host. The copies are launched with the draw, so `read` waits
    for the draw alone, never for a step launched after it."""

    def __init__(self, tokens: torch.Tensor, logprobs: DrawnLogprobs | None) -> None:
        self.tokens = tokens
        self._tokens = _to_host(tokens)
        self._logprobs = (
            None
            if logprobs is None
            else logprobs._replace(values=_to_host(logprobs.values), ids=_to_host(logprobs.ids))
        )
        self._copied = None
        if tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def read(self) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """The tokens, and each token's logprobs for the rows that asked (None where none did);
        waits for the copies."""
        if self._copied is not None:
            self._copied.synchronize()
        tokens = self._tokens.tolist()
        if self._logprobs is None:
            return tokens, None
        out: list[TokenLogprob | None] = [None] * len(tokens)
        wanted, values, ids = self._logprobs
        for (i, k), row_values, row_ids in zip(wanted, values.tolist(), ids.tolist()):
            out[i] = TokenLogprob(row_values[0], list(zip(row_ids[:k], row_values[1 : k + 1])))
        return tokens, out


class BatchSampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_slots, vocab_size, device=device)  # fp32 counts: exact far past any length
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.masks = MaskFiller()
        self.bitmasks: BitmaskBuffers | None = None  # made by the first batch with a grammar
        self._ahead: list[tuple[Grammar, int]] | None = None  # the (grammar, slot)s a fill ahead fills

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
        did): `draw`, then its read."""
        return self.draw(logits, seqs).read()

    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> Draw:
        """Launch the draw of one token per sequence and the copies of what it drew to the host;
        returns without waiting for the device. Logprobs are of the logits as penalties and
        logit_bias left them, before temperature. The rows of `logits` under a grammar are changed
        in place: the caller reads them no more."""
        params = [s.params for s in seqs]
        constrained = self._send_masks(seqs)  # first: what the fill ahead left is filled while the device runs
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
        wanted = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        return Draw(tokens, self._logprobs(logits, tokens, wanted) if wanted else None)

    def _send_masks(self, seqs: list[Sequence]) -> bool:
        """Send the token bitmasks of the rows with a grammar to the device, those the fill ahead
        did not cover filled now; False where no row has one."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return False
        buffers = self._buffers(seqs[rows[0]].grammar.words)
        slots = [seqs[i].slot for i in rows]
        missing = [(seqs[i].grammar, seqs[i].slot) for i in rows if not buffers.holds(seqs[i].grammar, seqs[i].slot)]
        if missing:
            grammars, at = zip(*missing)
            buffers.writable()
            self.masks.fill(grammars, buffers.masks, at)
            buffers.filled(missing)
        buffers.stage(rows, slots)
        buffers.send()
        return True

    def fill_ahead(self, seqs: list[Sequence]) -> None:
        """Start filling the masks of these sequences' grammars (those still running, after their
        last token) in the mask filler's thread, each into its slot's bitmask row, where there are
        AHEAD_MIN_ROWS of them or more; returns at once. The next `sample` waits for it (or fills
        them itself). Nothing may touch these grammars until then."""
        ahead = [(s.grammar, s.slot) for s in seqs if s.grammar is not None and s.slot >= 0]
        if len(ahead) < AHEAD_MIN_ROWS:
            return
        if grammar_module.LINEAGES > 1:  # the pool gives each thread a run of neighbours: one lineage's rows together
            ahead.sort(key=lambda pair: pair[0].lineage)
        buffers = self._buffers(ahead[0][0].words)
        buffers.writable()
        self.masks.start([(g.matcher, slot) for g, slot in ahead], buffers.masks)
        self._ahead = ahead

    def mask_allowed(self, seq: Sequence, token: int) -> bool | None:
        """Whether the mask seq's last draw was made under allowed `token` (None: it drew under
        none): its slot's host bitmask row, which holds that mask until the next fill starts."""
        buffers = self.bitmasks
        if buffers is None or seq.slot < 0 or buffers.holder[seq.slot] is not seq.grammar:
            return None
        if token >= buffers.words * 32:
            return False
        return bool((int(buffers.masks[seq.slot, token // 32]) >> (token % 32)) & 1)

    @property
    def filling(self) -> bool:
        """Whether a fill ahead runs (or has ended unwaited for)."""
        return self._ahead is not None

    def settle(self) -> None:
        """Wait for the fill ahead, if one runs (then its grammars may be touched again)."""
        self.masks.wait()
        if self._ahead is not None:
            self.bitmasks.filled(self._ahead)
            self._ahead = None

    def _buffers(self, words: int) -> BitmaskBuffers:
        """The bitmask buffers (made by the first batch with a grammar), no fill running into them."""
        self.settle()
        if self.bitmasks is None or self.bitmasks.words != words:
            self.bitmasks = BitmaskBuffers(self.counts.shape[0], words, self.counts.device)
        return self.bitmasks

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
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[tuple[int, int]]) -> DrawnLogprobs:
        rows = [i for i, _ in wanted]
        index = on_device(rows, torch.int64, logits.device)
        chosen, top_values, top_ids = token_logprobs(logits[index], tokens[index], max(k for _, k in wanted))
        return DrawnLogprobs(wanted, torch.cat([chosen[:, None], top_values], dim=1), top_ids)
