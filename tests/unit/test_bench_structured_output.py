"""The structured-output benchmark on CPU, with a two-layer model of the 1B's vocabulary: a batch
whose rows end before their first token is an error naming where the rows are, not a wait that
never ends (on the GPU machine a stuck run gave no output until it was killed)."""

from __future__ import annotations

import argparse

import pytest

from bench import structured_output
from workers.modeling import synthetic

pytestmark = pytest.mark.timeout(120)
SMALL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synthetic.BENCH_CONFIGS, "small", {**synthetic.BENCH_CONFIGS["1b"], **SMALL})
        tokenizer = structured_output.load_tokenizer(None)
        args = argparse.Namespace(
            config="small", device="cpu", mode="eager", batch_sizes=[8], steps=4, tokenizer=None, max_model_len=256
        )
        yield structured_output.bench_engine(args, tokenizer, structured_output.PROMPT_LEN + 32), tokenizer


def test_a_constrained_batch_is_timed(bench):
    engine, tokenizer = bench
    schema = structured_output.canonical_schema(structured_output.SCHEMAS["records"])
    out = structured_output.batch_tpot(engine, tokenizer, 8, schema, steps=4, warmup=1, seed=0, detail=False)
    assert out["tpot_ms_median"] > 0
    # 4 steps: p90 is the slowest, and their mean lies between half their median and the slowest
    assert out["tpot_ms_median"] / 2 <= out["tpot_ms_mean"] <= out["tpot_ms_p90"]


def test_rows_that_end_before_their_first_token_are_an_error_saying_where_they_are(bench):
    engine, tokenizer = bench
    with pytest.raises(RuntimeError, match=r"'ended error': 8.*'without a first token': 8") as raised:
        structured_output.batch_tpot(engine, tokenizer, 8, '{"type":"strin"}', steps=4, warmup=1, seed=0, detail=False)
    assert "strin" in str(raised.value)
    assert "'free slots': 8" in str(raised.value)  # what admission saw: every slot free again
