"""The sampler: parameter validation, greedy, counter-based seeded noise, top-k / top-p, temperature."""

from __future__ import annotations

import math
import random

import pytest
import torch

from workers.serving.sampling import InvalidRequest, SamplingParams
from workers.serving.sampling_ops import MASK32, filter_top_k_top_p, gumbel_noise, sample

V = 200  # vocabulary of the synthetic logits


def one(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    return sample(logits[None], [params], [seed], [step]).item()


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9]),
    )


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Reference: the smallest set of highest-probability tokens whose mass is >= p (float64)."""
    values, order = probs.double().sort(descending=True)
    mass = values.cumsum(0)
    size = int((mass < p).sum().item()) + 1
    return set(order[:size].tolist())


def top_k_set(logits: torch.Tensor, k: int) -> set[int]:
    return set(logits.topk(k).indices.tolist())


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(max_tokens=2.5),
        dict(max_tokens="8"),
        dict(temperature=-0.1),
        dict(temperature=100.5),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=-0.2),
        dict(top_p=1.01),
        dict(top_p=float("nan")),
        dict(top_k=-1),
        dict(top_k=2.0),
        dict(seed=1.5),
        dict(seed="7"),
        dict(seed=2**63),
        dict(seed=-(2**63) - 1),
        dict(stop=("",)),
        dict(stop=("ok", "")),
    ],
)
def test_invalid_params_rejected(kwargs):
    """Every out-of-range sampling parameter is an InvalidRequest (a 400), never a later crash;
    seeds must fit the sampler's int64 (a larger one used to kill the engine step)."""
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_boundary_params_accepted():
    """The documented ends of each range are valid."""
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    SamplingParams(temperature=100.0, top_p=1e-6, top_k=1, seed=2**63 - 1, stop=("x",))
    SamplingParams(seed=-(2**63))
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_extreme_seeds_sample_without_error():
    """Seeds at both ends of the accepted range reach the sampler and draw a valid token."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 3
    out = sample(logits, params, [2**63 - 1, -(2**63), -1], [0, 5, 2**20])
    assert out.shape == (3,) and ((0 <= out) & (out < V)).all()


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    """temperature=0 rows return the argmax, whatever top-k/top-p/seed say, alone or mixed with
    sampled rows."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=g) * 3
    greedy = [SamplingParams(temperature=0.0, top_k=k, top_p=p) for k, p in [(0, 1.0), (3, 0.5)] * 8]
    assert sample(logits, greedy, list(range(16)), [0] * 16).tolist() == logits.argmax(-1).tolist()
    mixed = [greedy[i] if i % 2 else SamplingParams(temperature=2.0) for i in range(16)]
    out = sample(logits, mixed, list(range(16)), [0] * 16)
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    # the sampled rows really sample (high temperature): they are not all the argmax
    assert out[0::2].tolist() != logits[0::2].argmax(-1).tolist()


def test_greedy_accepts_half_precision_logits():
    """Logits in bf16 (a bf16 model) are sampled in fp32 and the greedy pick is the argmax."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 4, [0] * 4, [0] * 4)
    assert out.tolist() == logits.float().argmax(-1).tolist()


# ---------------------------------------------------------------- seeded reproducibility


def test_seeded_row_independent_of_batch_mates():
    """A row's token depends only on its logits, params, seed and step: sampled alone or at any
    position of batches with other random rows, params, seeds and steps, it draws the same token."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    changed_by_seed = 0
    for trial in range(300):
        logits = torch.randn(V, generator=g) * rng.choice([1.0, 3.0])
        params = SamplingParams(
            temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 0.95])
        )
        seed, step = rng.getrandbits(63), rng.randrange(0, 5000)
        alone = one(logits, params, seed, step)
        changed_by_seed += alone != one(logits, params, seed ^ 1, step)
        for _ in range(2):
            n = rng.randrange(2, 9)
            pos = rng.randrange(n)
            batch = torch.randn(n, V, generator=g) * 2
            batch[pos] = logits
            plist = [random_params(rng) for _ in range(n)]
            plist[pos] = params
            seeds = [rng.getrandbits(63) for _ in range(n)]
            seeds[pos] = seed
            steps = [rng.randrange(0, 5000) for _ in range(n)]
            steps[pos] = step
            assert sample(batch, plist, seeds, steps)[pos].item() == alone, (trial, n, pos)
    assert changed_by_seed > 100  # the seed matters: the check above is not comparing constants


def test_same_seed_same_step_is_deterministic():
    """Re-running the same (logits, params, seed, step) always draws the same token."""
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 8
    seeds, steps = [11, 12, 13, 14, 15, 16, 17, 18], [0, 1, 2, 3, 4, 5, 6, 7]
    first = sample(logits, params, seeds, steps)
    for _ in range(3):
        assert torch.equal(sample(logits, params, seeds, steps), first)


def test_different_seeds_and_steps_draw_differently():
    """Over flat logits, different seeds (and different steps of one seed) spread over the
    vocabulary: the noise is not stuck or shared between requests."""
    logits = torch.zeros(V)
    params = SamplingParams(temperature=1.0)
    n = 400
    by_seed = sample(logits.expand(n, V), [params] * n, list(range(n)), [0] * n).tolist()
    by_step = sample(logits.expand(n, V), [params] * n, [42] * n, list(range(n))).tolist()
    big_seeds = [2**63 - 1 - i for i in range(n)]
    by_big_seed = sample(logits.expand(n, V), [params] * n, big_seeds, [0] * n).tolist()
    # uniform over 200 tokens, 400 draws: ~172 distinct expected; a broken hash gives a handful
    for draws in (by_seed, by_step, by_big_seed):
        assert len(set(draws)) > 140
        assert max(draws.count(t) for t in set(draws)) < 15


# ---------------------------------------------------------------- top-k / top-p


def test_top_k_bound():
    """Every sampled token lies in the row's top-k set, over many seeds; without top-k the same
    draws do leave that set (so the bound is the filter's doing)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(V, generator=g)
    n, k = 3000, 7
    allowed = top_k_set(logits, k)
    params = SamplingParams(temperature=1.5, top_k=k)
    drawn = sample(logits.expand(n, V), [params] * n, list(range(n)), [0] * n).tolist()
    assert set(drawn) <= allowed
    assert set(drawn) == allowed  # all k are reachable
    free = sample(logits.expand(n, V), [SamplingParams(temperature=1.5)] * n, list(range(n)), [0] * n)
    assert not set(free.tolist()) <= allowed


def test_top_k_larger_than_vocab_is_no_filter():
    """top_k >= vocab size keeps every token."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    out = filter_top_k_top_p(logits, torch.tensor([V + 10]), torch.tensor([1.0]))
    assert torch.isfinite(out).all()


def _top_p_case(seed: int, temperature: float):
    """Random logits and a p halfway between two cumulative masses, so the reference nucleus is
    unambiguous under rounding."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 2.5
    probs = (logits.double() / temperature).softmax(0)
    mass = probs.sort(descending=True).values.cumsum(0)
    k = 3 + seed % 10
    p = float((mass[k - 1] + mass[k]) / 2)
    return logits, p, probs


@pytest.mark.parametrize("seed,temperature", [(0, 1.0), (1, 0.6), (2, 1.7), (3, 1.0)])
def test_top_p_filter_is_smallest_nucleus(seed, temperature):
    """The kept set is exactly the smallest set of top tokens whose (temperature-scaled) mass >= p."""
    logits, p, probs = _top_p_case(seed, temperature)
    kept = filter_top_k_top_p((logits / temperature)[None], torch.tensor([0]), torch.tensor([p]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == nucleus(probs, p)
    # the kept logits are unchanged
    finite = torch.isfinite(kept)
    assert torch.equal(kept[finite], (logits / temperature)[finite])


@pytest.mark.parametrize("seed,temperature", [(4, 1.0), (5, 1.5)])
def test_top_p_bound_when_sampling(seed, temperature):
    """Every sampled token, over many seeds, is inside the reference nucleus; without top-p the
    same draws leave it."""
    logits, p, probs = _top_p_case(seed, temperature)
    ref = nucleus(probs, p)
    assert len(ref) < V
    n = 3000
    params = SamplingParams(temperature=temperature, top_p=p)
    drawn = sample(logits.expand(n, V), [params] * n, list(range(n)), [7] * n).tolist()
    assert set(drawn) <= ref
    free = sample(logits.expand(n, V), [SamplingParams(temperature=temperature)] * n, list(range(n)), [7] * n)
    assert not set(free.tolist()) <= ref


def test_top_p_tiny_keeps_only_the_top_token():
    """A tiny top_p keeps the single most likely token, so sampling becomes greedy."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(6))
    n = 500
    drawn = sample(logits.expand(n, V), [SamplingParams(top_p=1e-6)] * n, list(range(n)), [0] * n)
    assert set(drawn.tolist()) == {logits.argmax().item()}


def test_a_top_p_that_rounds_to_zero_in_fp32_keeps_the_top_token():
    """1e-300 is a valid top_p (in (0, 1]) that fp32 holds as 0: it cut every token, and the draw
    of a row of -inf was token 0."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7))
    drawn = sample(logits.expand(8, V), [SamplingParams(top_p=1e-300)] * 8, list(range(8)), [0] * 8)
    assert set(drawn.tolist()) == {logits.argmax().item()}


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-6])
def test_a_temperature_too_small_to_divide_by_draws_greedily(temperature):
    """1e-39 is a valid temperature (in [0, 2]) that fp32 logits divided by it turn into infinities:
    the draw was the first token with a positive logit."""
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(8)) * 3
    params = [SamplingParams(temperature=temperature, top_p=0.9)] * 8
    assert sample(logits, params, list(range(8)), [0] * 8).tolist() == logits.argmax(-1).tolist()


def test_top_k_then_top_p():
    """Top-k is applied first, then top-p over the renormalised top-k mass: the kept set equals
    that reference, and sampled tokens stay in it."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(V, generator=g) * 1.5
    k = 12
    top_vals, top_idx = logits.topk(k)
    renorm = top_vals.double().softmax(0)  # sorted descending already
    mass = renorm.cumsum(0)
    p = float((mass[4] + mass[5]) / 2)  # the nucleus within the top-k is its first 6 tokens
    ref = set(top_idx[:6].tolist())
    # sanity: top-p on the full distribution would keep a different (larger) set
    assert nucleus(logits.softmax(0), p) != ref
    kept = filter_top_k_top_p(logits[None], torch.tensor([k]), torch.tensor([p]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == ref
    n = 2000
    params = SamplingParams(temperature=1.0, top_k=k, top_p=p)
    drawn = sample(logits.expand(n, V), [params] * n, list(range(n)), [0] * n).tolist()
    assert set(drawn) == ref


def test_filter_rows_are_independent():
    """In a batch, each row is filtered with its own top-k / top-p (0 / 1.0 = off)."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, V, generator=g)
    out = filter_top_k_top_p(logits, torch.tensor([5, 0, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(out[0]).sum() == 5
    assert torch.isfinite(out[1]).all()
    assert set(torch.isfinite(out[2]).nonzero().flatten().tolist()) == nucleus(logits[2].softmax(0), 0.5)


# ---------------------------------------------------------------- distribution


def _empirical(logits: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    vocab = logits.shape[0]
    drawn = sample(logits.expand(n, vocab), [params] * n, list(range(n)), [3] * n)
    return torch.bincount(drawn, minlength=vocab).double() / n


LOGITS8 = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_softmax_with_temperature(temperature):
    """Seeded Gumbel-max draws follow softmax(logits / T): 20000 draws, max abs error < 0.02,
    while the distribution at a different temperature is clearly distinguishable."""
    emp = _empirical(LOGITS8, SamplingParams(temperature=temperature))
    ref = (LOGITS8.double() / temperature).softmax(0)
    assert (emp - ref).abs().max() < 0.02
    other = (LOGITS8.double() / (temperature * 1.6)).softmax(0)
    assert (emp - other).abs().max() > 0.04


def test_distribution_matches_filtered_softmax():
    """With top-k and top-p, draws follow the renormalised softmax over the kept tokens."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.8)
    scaled = LOGITS8.double() / 0.8
    kept = filter_top_k_top_p(scaled.float()[None], torch.tensor([5]), torch.tensor([0.8]))[0]
    ref = torch.where(torch.isfinite(kept), scaled, torch.tensor(-math.inf, dtype=torch.float64)).softmax(0)
    assert 1 < int(torch.isfinite(kept).sum()) < 5
    emp = _empirical(LOGITS8, params)
    assert (emp - ref).abs().max() < 0.02


# ---------------------------------------------------------------- the noise itself


def _mix32_ref(x: int) -> int:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def _gumbel_ref(seed: int, step: int, vocab: int) -> list[float]:
    """The documented hash with Python's unbounded ints: no int64 overflow can hide here."""
    key = _mix32_ref((seed & MASK32) ^ _mix32_ref(((step * 0x9E3779B1) & MASK32) ^ (seed >> 32)))
    out = []
    for t in range(vocab):
        bits = _mix32_ref(key ^ _mix32_ref(t))
        u = ((bits >> 8) + 0.5) / (1 << 24)
        out.append(-math.log(-math.log(u)))
    return out


SEEDS_NEAR_2_63 = [2**63 - 1, 2**63 - 2, 2**63 - 1 - 2**32, 2**62 + 12345, 2**32, 2**32 - 1, 1, 0]


def test_gumbel_noise_matches_reference_hash_near_2_63():
    """For seeds up to 2**63 - 1 the int64 tensor hash equals the exact-integer reference: nothing
    overflows or wraps, for large steps too."""
    vocab = 64
    for seed in SEEDS_NEAR_2_63:
        for step in (0, 1, 2**20 + 3):
            got = gumbel_noise(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
            assert torch.allclose(
                got.double(), torch.tensor(_gumbel_ref(seed, step, vocab), dtype=torch.float64), atol=1e-4
            ), (seed, step)


def test_gumbel_noise_depends_only_on_seed_and_step():
    """A row's noise is identical alone and inside any batch (including seeds near 2**63), and
    changes with either the seed or the step."""
    vocab = 100
    seeds = torch.tensor(SEEDS_NEAR_2_63)
    steps = torch.tensor([0, 3, 3, 9, 0, 1, 2, 5])
    batch = gumbel_noise(seeds, steps, vocab)
    for i in range(len(seeds)):
        alone = gumbel_noise(seeds[i : i + 1], steps[i : i + 1], vocab)[0]
        assert torch.equal(alone, batch[i])
    reordered = gumbel_noise(seeds.flip(0), steps.flip(0), vocab)
    assert torch.equal(reordered, batch.flip(0))
    # all rows differ from each other (neighbouring big seeds included)
    for i in range(len(seeds)):
        for j in range(i + 1, len(seeds)):
            assert not torch.equal(batch[i], batch[j])
    again = gumbel_noise(seeds, steps + 1, vocab)
    assert all(not torch.equal(again[i], batch[i]) for i in range(len(seeds)))


def test_gumbel_noise_statistics():
    """The noise is standard Gumbel: mean ~ Euler's gamma (0.5772), variance ~ pi^2 / 6, finite."""
    noise = gumbel_noise(torch.arange(200), torch.zeros(200, dtype=torch.int64), 500).double()
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772) < 0.02
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.05


def test_noise_of_the_top_uniform_is_finite_and_never_draws_a_filtered_token():
    """Seed 47657's noise at step 0 is drawn from the top uniform for token 144 of a 261-token
    vocabulary ((2**24 - 0.5) / 2**24, which fp32 rounds to 1.0): it is finite, so with top_k=1 the
    draw is still the top token, not token 144 filtered to -inf (-inf + inf was NaN, and argmax
    took it)."""
    seed, token, vocab = 47657, 144, 261
    reference = _gumbel_ref(seed, 0, vocab)  # exact integers, float64: its uniform stays below 1
    assert reference[token] == max(reference) and reference[token] > 16
    noise = gumbel_noise(torch.tensor([seed]), torch.tensor([0]), vocab)[0]
    assert torch.isfinite(noise).all() and noise.argmax().item() == token
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    logits[token] = logits.min() - 1.0  # far from the top: top_k=1 filters it out
    top = logits.argmax().item()
    assert one(logits, SamplingParams(temperature=1.0, top_k=1), seed, 0) == top
    assert one(logits, SamplingParams(temperature=1.0, top_p=1e-6), seed, 0) == top
