"""Test helpers for prefills: random prompts, a packed prefill of them after cached contexts, and an
engine fed requests a few per step (staggered arrivals, some denied graphs)."""

from __future__ import annotations

import torch

from policies.dispatch import FallbackReason
from workers.model_runner.step_inputs import PrefillInputs
from workers.serving.sampling import SamplingParams


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def packed(prompts: list[list[int]], slots: list[int], contexts: list[int]) -> PrefillInputs:
    """Each prompt's tokens after its context (positions context .. len - 1) in its slot."""
    return PrefillInputs(
        [t for p, c in zip(prompts, contexts) for t in p[c:]],
        [i for p, c in zip(prompts, contexts) for i in range(c, len(p))],
        [s for p, s, c in zip(prompts, slots, contexts) for _ in range(c, len(p))],
        [0] * sum(len(p) - c for p, c in zip(prompts, contexts)),
        [len(p) - c for p, c in zip(prompts, contexts)],
    )


def run_staggered(
    engine, prompts: list[list[int]], params: list[SamplingParams], per_step: int, denied: frozenset[int] = frozenset()
) -> list[list[int]]:
    """Requests arriving `per_step` a step (those in `denied` without graph permission), stepped to
    completion; returns each one's output tokens."""
    seqs, pending, steps = [], list(enumerate(prompts)), 0
    while pending or engine.has_work():
        for i, prompt in pending[:per_step]:
            reason = FallbackReason.TENANT_DISABLED if i in denied else None
            seqs.append(engine.add_request(prompt, params[i], graph_denial=reason))
        pending = pending[per_step:]
        engine.step()
        steps += 1
        assert steps < 5_000, "the engine does not finish"
    return [s.output_ids for s in seqs]
