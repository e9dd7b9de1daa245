"""bench/mask_cost.py walks every case's document through its grammar and counts a bounded
string's characters left right (a benchmark no test runs breaks unseen)."""

from __future__ import annotations

import pytest

from bench.mask_cost import LONG_NAME, by_characters_left, cases, mask_costs
from workers.modeling.synthetic import build_byte_tokenizer
from workers.serving.grammar import GrammarCompiler

TOKENIZER = build_byte_tokenizer()  # one token a character: the counts below are exact


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOKENIZER, (TOKENIZER.eos_token_id,), len(TOKENIZER))
    yield compiler
    compiler.close()


@pytest.mark.parametrize("case", list(cases()))
def test_every_document_is_taken_token_by_token_by_its_schema(compiler, case):
    schema, text = cases()[case]
    costs = mask_costs(compiler, schema, text, TOKENIZER, repeats=1)
    assert len(costs) == len(TOKENIZER(text, add_special_tokens=False)["input_ids"])
    assert all(cost > 0 for cost in costs)


def test_the_characters_left_count_down_from_the_bound_to_the_closing_quote(compiler):
    inside = by_characters_left(compiler, TOKENIZER, repeats=1)
    assert [r["characters_left"] for r in inside] == list(range(80, 80 - len(LONG_NAME) - 1, -1))
    assert "".join(r["token"] for r in inside) == LONG_NAME + '"'
