"""Penalties, logit_bias and logprobs: the tensor math against a plain reference, and the batch
sampler's per-slot token history (filled at prefill, counted on after each draw) against the
sequences' own tokens."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from workers.serving import batch_sampler
from workers.serving.batch_sampler import BatchSampler
from workers.serving.sampling import LOGPROB_FLOOR, InvalidRequest, SamplingParams, choice_seed
from workers.serving.sampling_ops import apply_penalties, sample, token_logprobs
from workers.serving.scheduler import Sequence, new_sequence

V = 300  # vocabulary of the synthetic logits
SLOTS = 8


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], presence: float, frequency: float, repetition: float
) -> list[float]:
    """The formulas, token by token in float64: HF's repetition penalty over every token seen, then
    OpenAI's `logit - count * frequency - (count > 0) * presence` over the generated ones."""
    out = [float(x) for x in logits]
    counts = Counter(output)
    for token in set(prompt) | set(counts):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in counts.items():
        out[token] -= count * frequency + presence
    return out


def random_history(rng: random.Random) -> tuple[list[int], list[int]]:
    """A prompt and an output with repeats (a few tokens drawn often), as real text has."""
    common = [rng.randrange(V) for _ in range(6)]
    prompt = [rng.choice(common) if rng.random() < 0.5 else rng.randrange(V) for _ in range(rng.randint(1, 40))]
    output = [rng.choice(common) if rng.random() < 0.6 else rng.randrange(V) for _ in range(rng.randint(0, 60))]
    return prompt, output


def seq_with(prompt: list[int], output: list[int], params: SamplingParams, slot: int) -> Sequence:
    seq = new_sequence(prompt, params)
    seq.output_ids = list(output)
    seq.slot = slot
    return seq


# ---------------------------------------------------------------- validation and seeds


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(presence_penalty=2.01),
        dict(presence_penalty=-2.5),
        dict(frequency_penalty=float("nan")),
        dict(frequency_penalty=3),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=float("inf")),
        dict(logit_bias=((5, 100.5),)),
        dict(logit_bias=((-1, 1.0),)),
        dict(logit_bias=((2.0, 1.0),)),
        dict(logit_bias=tuple((i, 1.0) for i in range(301))),
        dict(logprobs=21),
        dict(logprobs=-1),
    ],
)
def test_invalid_penalty_bias_and_logprob_params_rejected(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_boundary_penalty_params_accepted():
    SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        logit_bias=((0, -100.0), (7, 100.0)),
        logprobs=20,
    )
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(repetition_penalty=1.2).penalized and SamplingParams(presence_penalty=-0.1).penalized
    assert not SamplingParams(logit_bias=((1, 5.0),), logprobs=3).penalized


def test_choice_seeds():
    """Choice 0 keeps the request's seed (so n = 1 is what it always was); the others' seeds are
    distinct, the same on every call, and fit the sampler's int64."""
    for seed in (0, 42, -7, 2**63 - 1, -(2**63)):
        seeds = [choice_seed(seed, i) for i in range(16)]
        assert seeds[0] == seed
        assert len(set(seeds)) == 16 and seeds == [choice_seed(seed, i) for i in range(16)]
        assert all(0 <= s < 2**63 for s in seeds[1:])
        SamplingParams(seed=seeds[5])
    assert choice_seed(1, 1) != choice_seed(2, 1)


# ---------------------------------------------------------------- the math


def test_penalties_match_the_reference():
    """Random logits (both signs), histories with repeats, penalties of both signs: every row equals
    the token-by-token reference."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    rows = 24
    logits = torch.randn(rows, V, generator=g) * 3
    histories = [random_history(rng) for _ in range(rows)]
    pens = [(rng.uniform(-2, 2), rng.uniform(-2, 2), rng.choice([0.5, 1.0, 1.3, 2.0])) for _ in range(rows)]
    counts = torch.zeros(rows, V)
    in_prompt = torch.zeros(rows, V, dtype=torch.bool)
    for i, (prompt, output) in enumerate(histories):
        in_prompt[i, prompt] = True
        for token in output:
            counts[i, token] += 1
    presence, frequency, repetition = torch.tensor(pens).T
    got = apply_penalties(logits, counts, in_prompt, presence, frequency, repetition)
    for i, ((prompt, output), (p, f, r)) in enumerate(zip(histories, pens)):
        ref = torch.tensor(reference_penalties(logits[i].tolist(), prompt, output, p, f, r), dtype=torch.float64)
        assert torch.allclose(got[i].double(), ref, rtol=1e-5, atol=1e-5), i
    changed = (got != logits).sum(dim=1)
    assert (changed > 0).all()  # every row had something to penalize


def test_neutral_penalties_change_nothing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    counts = torch.randint(0, 3, (4, V), generator=g).float()
    got = apply_penalties(logits, counts, counts > 1, torch.zeros(4), torch.zeros(4), torch.ones(4))
    assert torch.equal(got, logits)


def test_token_logprobs_are_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, V, generator=g) * 4
    tokens = torch.tensor([0, 7, 299, 3, 150])
    chosen, top_values, top_ids = token_logprobs(logits.bfloat16(), tokens, 6)
    ref = logits.bfloat16().float().log_softmax(-1)
    assert torch.allclose(chosen, ref[torch.arange(5), tokens])
    ref_top = ref.topk(6)
    assert torch.equal(top_ids, ref_top.indices) and torch.allclose(top_values, ref_top.values)
    assert (top_values[:, :-1] >= top_values[:, 1:]).all()
    assert token_logprobs(logits, tokens, 0)[1].shape == (5, 0)
    masked = logits.clone()
    masked[0, 0] = -math.inf
    assert token_logprobs(masked, tokens, 2)[0][0] == LOGPROB_FLOOR  # JSON has no -inf


# ---------------------------------------------------------------- the batch sampler


def penalized_params(rng: random.Random, **extra) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([0.7, 1.5, 2.0]),
        **extra,
    )


def test_batch_sampler_penalizes_each_row_from_its_own_history():
    """Penalized rows (history loaded at admission, then drawn tokens counted on) are drawn from the
    reference penalized logits, and report log_softmax of exactly those logits; greedy rows take
    their argmax. Plain rows in the same batch draw what sampling alone draws. Over several steps,
    the history counts each drawn token."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    sampler = BatchSampler(SLOTS, V, torch.device("cpu"))
    seqs = []
    for slot in range(SLOTS):
        prompt, output = random_history(rng)
        if slot % 3 == 2:
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), logprobs=3)
        else:
            params = penalized_params(rng, temperature=rng.choice([0.0, 0.8]), logprobs=3, seed=slot)
        seqs.append(seq_with(prompt, output, params, slot))
    sampler.admit(seqs)
    for step in range(4):
        logits = torch.randn(SLOTS, V, generator=g) * 3
        drawn, logprobs = sampler.sample(logits, seqs)
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.penalized:
                ref = reference_penalties(
                    logits[i].tolist(),
                    seq.prompt_ids,
                    seq.output_ids,
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                )
                ref = torch.tensor(ref, dtype=torch.float32)
            else:
                ref = logits[i]
            expected = sample(ref[None], [p], [seq.seed], [len(seq.output_ids)]).item()
            assert drawn[i] == expected, (step, i)
            assert logprobs[i].logprob == pytest.approx(ref.double().log_softmax(0)[drawn[i]].item(), abs=1e-4)
            assert [t for t, _ in logprobs[i].top] == ref.topk(3).indices.tolist()
            seq.output_ids.append(drawn[i])
        for seq in seqs:
            if seq.params.penalized:
                assert (
                    sampler.counts[seq.slot].tolist()
                    == torch.bincount(torch.tensor(seq.output_ids), minlength=V).float().tolist()
                )
                assert set(sampler.in_prompt[seq.slot].nonzero().flatten().tolist()) == set(seq.prompt_ids)


def test_penalties_change_greedy_picks():
    """A strong repetition penalty moves a greedy row off the token it keeps repeating."""
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.5
    sampler = BatchSampler(1, V, torch.device("cpu"))
    plain = seq_with([1], [5, 5], SamplingParams(temperature=0.0), 0)
    assert sampler.sample(logits, [plain])[0] == [5]
    penalized = seq_with([1], [5, 5], SamplingParams(temperature=0.0, repetition_penalty=1.5), 0)
    sampler.admit([penalized])
    assert sampler.sample(logits, [penalized])[0] == [6]  # 2.0 / 1.5 < 1.5


def test_a_slot_reused_starts_from_its_new_sequence_history():
    """A slot's history is refilled when a new sequence (or a preempted one, with its output so
    far) is admitted there: nothing of the previous owner's counts remains."""
    sampler = BatchSampler(2, V, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    first = seq_with([1, 2], [9, 9, 9], params, 1)
    sampler.admit([first])
    sampler.sample(torch.zeros(1, V), [first])
    resumed = seq_with([3], [4, 4], params, 1)
    sampler.admit([resumed])
    assert sampler.counts[1].nonzero().flatten().tolist() == [4] and sampler.counts[1, 4] == 2
    assert sampler.in_prompt[1].nonzero().flatten().tolist() == [3]


def test_logit_bias_bans_and_forces():
    """-100 on the greedy token moves the greedy pick to the runner-up; +100 on any token makes
    every sampled draw (many seeds, temperature 1) that token and its logprob ~0."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, V, generator=g) * 2
    top2 = logits[0].topk(2).indices.tolist()
    sampler = BatchSampler(1, V, torch.device("cpu"))
    banned = seq_with([1], [], SamplingParams(temperature=0.0, logit_bias=((top2[0], -100.0),)), 0)
    assert sampler.sample(logits, [banned])[0] == [top2[1]]
    target = int(logits[0].argmin())
    n = 200
    forced = [
        seq_with([1], [], SamplingParams(temperature=1.0, seed=s, logit_bias=((target, 100.0),), logprobs=1), 0)
        for s in range(n)
    ]
    drawn, logprobs = sampler.sample(logits.expand(n, V), forced)
    assert drawn == [target] * n
    assert all(lp.logprob > -1e-3 and lp.top[0][0] == target for lp in logprobs)
    free = [seq_with([1], [], SamplingParams(temperature=1.0, seed=s), 0) for s in range(n)]
    assert target not in sampler.sample(logits.expand(n, V), free)[0]


def test_rows_without_penalties_bias_or_logprobs_skip_that_work(monkeypatch):
    """A plain batch never reaches the penalty, bias or logprob code, and returns no logprobs."""

    def refuse(*args, **kwargs):
        raise AssertionError("ran for a batch that did not ask for it")

    monkeypatch.setattr(batch_sampler, "apply_penalties", refuse)
    monkeypatch.setattr(batch_sampler, "token_logprobs", refuse)
    monkeypatch.setattr(BatchSampler, "_bias", refuse)
    sampler = BatchSampler(4, V, torch.device("cpu"))
    seqs = [seq_with([1], [], SamplingParams(temperature=t, seed=i), i) for i, t in enumerate([0.0, 1.0, 0.5, 0.0])]
    sampler.admit(seqs)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    drawn, logprobs = sampler.sample(logits, seqs)
    assert logprobs is None
    assert drawn == sample(logits, [s.params for s in seqs], [s.seed for s in seqs], [0] * 4).tolist()
    assert not sampler.counts.any() and not sampler.in_prompt.any()


def test_penalized_seeded_row_is_the_same_alone_or_batched():
    """The counter-based property holds with penalties: a penalized, biased, seeded row draws the
    same token at any position of any batch."""
    rng = random.Random(6)
    g = torch.Generator().manual_seed(6)
    prompt, output = random_history(rng)
    params = penalized_params(rng, temperature=1.0, seed=99, logit_bias=((3, 2.0),))
    row = torch.randn(V, generator=g) * 2
    alone = BatchSampler(1, V, torch.device("cpu"))
    seq = seq_with(prompt, output, params, 0)
    alone.admit([seq])
    expected = alone.sample(row[None], [seq])[0][0]
    for trial in range(10):
        n = rng.randint(2, SLOTS)
        pos = rng.randrange(n)
        sampler = BatchSampler(SLOTS, V, torch.device("cpu"))
        mates = [seq_with(*random_history(rng), penalized_params(rng, temperature=1.0, seed=i), i) for i in range(n)]
        mates[pos] = seq_with(prompt, output, params, pos)
        sampler.admit(mates)
        logits = torch.randn(n, V, generator=g) * 2
        logits[pos] = row
        assert sampler.sample(logits, mates)[0][pos] == expected, trial
