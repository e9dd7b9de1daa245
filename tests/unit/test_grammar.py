"""Structured outputs below the engine: schemas compiled into grammars (`workers/serving/grammar.py`)
and the batch sampler applying their token masks. The byte-level tokenizer of the tiny model (one
token per byte, then specials) makes every allowed token readable; the logits are wider than its
vocabulary, as a padded one is."""

from __future__ import annotations

import json
import threading
import time
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field

from workers.modeling.synthetic import build_byte_tokenizer
from workers.serving import grammar as grammar_module
from workers.serving.batch_sampler import AHEAD_MIN_ROWS, BatchSampler
from workers.serving.grammar import GrammarCompiler, MaskFiller, fill_threads
from workers.serving.json_schema import JSON_OBJECT, InvalidSchema, canonical_schema, grammar_of
from workers.serving.sampling import LOGPROB_FLOOR, InvalidRequest, SamplingParams
from workers.serving.sampling_ops import apply_token_bitmask
from workers.serving.scheduler import new_sequence

TOKENIZER = build_byte_tokenizer()
EOS = TOKENIZER.eos_token_id
WIDTH = len(TOKENIZER) + 39  # the model's logits: a padded vocabulary
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["name", "role", "tags"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "Ada", "role": "admin", "tags": [1, 22]}'


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH)
    yield compiler
    compiler.close()


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def allowed(grammar, filler: MaskFiller | None = None) -> set[int]:
    bitmask = torch.zeros(1, grammar.words, dtype=torch.int32)
    (filler or MaskFiller()).fill([grammar], bitmask)
    logits = apply_token_bitmask(torch.zeros(1, WIDTH), torch.tensor([0]), bitmask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def texts(tokens: set[int]) -> set[str]:
    return {TOKENIZER.decode([t]) for t in tokens}


def person(compiler):
    return compiler.grammar(compiler.compile(canonical_schema(PERSON)).result())


# -- schemas and the compile cache ---------------------------------------------------------------


def test_the_canonical_schema_is_compact_and_keeps_key_order():
    """Property order is the order the object is written in: it is part of the key."""
    assert canonical_schema({"b": 1, "a": [1, 2]}) == '{"b":1,"a":[1,2]}'
    assert canonical_schema({"a": 1, "b": 2}) != canonical_schema({"b": 2, "a": 1})


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "format": "bogus"}, "Unknown format: bogus"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
    ],
)
def test_a_schema_that_cannot_be_compiled_says_why_without_a_tokenizer(schema, says):
    with pytest.raises(InvalidSchema, match="cannot be compiled") as info:
        grammar_of(canonical_schema(schema))
    assert says in str(info.value) and info.value.param == "response_format"
    assert isinstance(info.value, InvalidRequest)  # the serving layer's 400


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5},  # llguidance pinned it to 2**63 - 1
        {"type": "object", "properties": {"default": {"type": "integer", "minimum": -(10**20)}}},
        {"$defs": {"title": {"enum": [1, 2**60]}}, "$ref": "#/$defs/title"},
        {"const": 2**53 + 1},
        {"const": {"title": 2**60 + 1}},  # const and enum values are data: an annotation's name is a key there
        {"enum": [{"examples": 2**63 + 5}]},
        {"type": "integer", "minimum": 1e30, "maximum": 1e31},  # a float bound: llguidance gave 2**63 - 1
        {"type": ["integer", "null"], "exclusiveMaximum": -1e20},
        {"type": "object", "properties": {"const": {"type": "integer", "minimum": 1e30}}},  # a property's name
    ],
)
def test_a_number_the_grammar_engine_cannot_hold_is_refused_not_rounded(schema):
    with pytest.raises(InvalidSchema, match=r"beyond what the grammar engine holds exactly") as info:
        grammar_of(canonical_schema(schema))
    assert info.value.param == "response_format"


def test_big_integers_in_annotations_and_exact_ones_compile():
    grammar_of(canonical_schema({"type": "integer", "default": 10**30, "examples": [10**40]}))
    grammar_of(canonical_schema({"type": "integer", "minimum": -(2**53), "maximum": 2**53}))
    grammar_of(canonical_schema({"type": "number", "minimum": 1.5e10}))
    grammar_of(canonical_schema({"type": "integer", "maximum": 1e18}))


def optional_properties(n: int, required: int = 0) -> dict:
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[:required]}


@pytest.mark.parametrize(
    "schema",
    [
        optional_properties(499),
        {"type": "array", "items": optional_properties(900, required=300)},
        {"type": "object", "properties": {"a": optional_properties(600)}},
    ],
)
def test_an_object_with_more_optional_properties_than_the_parser_takes_is_refused(compiler, schema):
    """llguidance's parser fails on such an object's first token, after admission (a stream got 200
    and then an error event): the ingress's check refuses it, naming the count."""
    with pytest.raises(InvalidSchema, match=r"optional properties, more than the grammar engine parses") as info:
        grammar_of(canonical_schema(schema))
    assert info.value.param == "response_format"


def test_an_object_with_498_optional_properties_or_many_required_ones_takes_its_first_tokens(compiler):
    """The limit is where the parser's rows overflow: 498 optional properties take `{` and a key's first letter
    (the schemas of 499 and 500 passed the check, compiled, and failed at the first token)."""
    for schema in (optional_properties(498), optional_properties(3000, required=2600)):
        grammar = compiler.grammar(compiler.compile(canonical_schema(schema)).result(timeout=60))
        assert all(grammar.accept(t) for t in ids('{"p')), grammar.error


def test_a_schema_no_document_satisfies_fails_its_compile_not_its_sequence(compiler):
    """A `$ref` to itself passes the tokenizer-free check; the compile's first mask finds it."""
    grammar_of(canonical_schema({"$ref": "#"}))
    with pytest.raises(InvalidSchema, match="no document satisfies the JSON schema"):
        compiler.compile(canonical_schema({"$ref": "#"})).result()


def test_pydantic_discriminated_unions_compile():
    """Pydantic writes them as oneOf, which is enforced as anyOf (their alternatives exclude each other)."""

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")

    schema = Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    grammar_of(canonical_schema(schema))


def test_compiles_are_cached_by_schema_and_evicted_least_recent_first():
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH, cache_size=2)
    try:
        a, b, c = (canonical_schema({"type": t}) for t in ("integer", "string", "boolean"))
        first = compiler.compile(a)
        assert compiler.compile(a) is first
        compiler.compile(b)
        compiler.compile(a)  # a is now the most recent: b goes first
        compiler.compile(c)
        assert compiler.compile(a) is first and compiler.compile(b).result() is not None
        bad = compiler.compile(canonical_schema({"type": "strin"}))
        with pytest.raises(InvalidSchema, match="strin"):
            bad.result()
    finally:
        compiler.close()


# -- one sequence's grammar ----------------------------------------------------------------------


def test_a_document_is_walked_token_by_token_and_ends_when_complete(compiler):
    grammar = person(compiler)
    assert texts(allowed(grammar)) == {"{"}
    tokens = ids(DOCUMENT)
    for n, token in enumerate(tokens):
        assert token in allowed(grammar), (n, TOKENIZER.decode(tokens[:n]))
        assert not grammar.done
        assert grammar.accept(token)
    assert grammar.done  # nothing may follow the closing brace


def test_the_enum_and_the_length_limits_narrow_the_mask(compiler):
    grammar = person(compiler)
    grammar.replay(ids('{"name": "Adalov'))  # six characters: the string must close
    assert texts(allowed(grammar)) == {'"'}
    grammar = person(compiler)
    grammar.replay(ids('{"name": "A", "role": "'))
    assert texts(allowed(grammar)) == {"a", "u"}
    grammar = person(compiler)
    grammar.replay(ids('{"name": "A", "role": "user", "tags": [1, 2'))
    assert texts(allowed(grammar)) == set("0123456789]")  # a third item would pass maxItems


def test_eos_is_allowed_only_where_the_grammar_may_end(compiler):
    """A top-level integer may end after any digit, so it is accepting without being done."""
    grammar = compiler.grammar(compiler.compile(canonical_schema({"type": "integer"})).result())
    assert EOS not in allowed(grammar)
    assert grammar.accept(ids("4")[0])
    assert EOS in allowed(grammar) and not grammar.done
    assert grammar.accept(EOS) and grammar.done


def test_special_and_padded_tokens_are_never_allowed(compiler):
    grammar = compiler.grammar(compiler.compile(JSON_OBJECT).result())
    grammar.replay(ids('{"a": "'))  # inside a string: printable bytes and UTF-8 lead bytes
    inside = allowed(grammar)
    specials = set(TOKENIZER.all_special_ids) | set(TOKENIZER.convert_tokens_to_ids(["<|system|>", "<|user|>"]))
    assert len(inside) > 100 and not inside & specials
    assert max(inside) < len(TOKENIZER)  # the padded columns past the tokenizer's


def test_the_masks_cover_the_tokenizers_ids_not_the_padded_logits(compiler):
    assert compiler.mask_words == -(-len(TOKENIZER) // 32) < -(-WIDTH // 32)


def test_replay_restores_the_state_and_refuses_tokens_the_schema_forbids(compiler):
    walked, replayed = person(compiler), person(compiler)
    prefix = ids(DOCUMENT)[:20]
    for token in prefix:
        walked.accept(token)
    replayed.replay(prefix)
    assert allowed(replayed) == allowed(walked)
    with pytest.raises(InvalidRequest, match="do not fit its schema"):
        person(compiler).replay(ids('{"nope": 1}'))


def test_each_sequence_gets_a_grammar_of_its_own(compiler):
    compiled = compiler.compile(canonical_schema(PERSON)).result()
    one, two = compiler.grammar(compiled), compiler.grammar(compiled)
    one.replay(ids('{"name": "'))
    assert texts(allowed(two)) == {"{"}


def test_a_fill_runs_on_one_thread_below_8_cores_and_on_half_of_them_up_to_8():
    assert [fill_threads(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == [1, 1, 1, 1, 4, 6, 8, 8]


@pytest.fixture
def three_lineages(monkeypatch):
    """A schema compiled on a host of 3 fill threads, and 3 lineages: (compiler, its CompiledSchema),
    every lineage compiled."""
    monkeypatch.setattr(grammar_module, "LINEAGES", 3)
    monkeypatch.setattr(grammar_module, "FILL_THREADS", 3)
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH)
    compiled = compiler.compile(canonical_schema(PERSON)).result()
    deadline = time.monotonic() + 30
    while len(compiled.matchers) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield compiler, compiled
    compiler.close()


def test_a_schema_is_compiled_into_lineages_that_sequences_copy_in_turn(three_lineages):
    """On a host of FILL_THREADS > 1, copies of one llguidance matcher share their parser state (a
    pool filled them one after another): a schema compiles into LINEAGES matchers apart, the
    first before any sequence starts, and sequences copy them in turn."""
    compiler, compiled = three_lineages
    assert len({id(m) for m in compiled.matchers}) == 3
    grammars = [compiler.grammar(compiled) for _ in range(7)]
    assert [g.lineage for g in grammars] == [0, 1, 2, 0, 1, 2, 0]
    grammars[0].replay(ids('{"name": "'))  # a copy's place is its own, whatever its lineage
    assert texts(allowed(grammars[3])) == {"{"} and texts(allowed(grammars[1])) == {"{"}


def test_a_requests_compile_never_waits_behind_other_schemas_lineages(monkeypatch):
    """The lineages after the first shared the request compiles' threads: four schemas' lineages
    (31 compiles each on 16 cores) held all four, and the next request's schema waited for them. A
    schema evicted from the cache meanwhile is not compiled further."""
    monkeypatch.setattr(grammar_module, "LINEAGES", 3)
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH, cache_size=5)
    held, release, compiled_once = threading.Event(), threading.Event(), set()
    compile_one = compiler._matcher

    def matcher(schema: str):
        if schema in compiled_once:  # a lineage after the first: held until released
            held.set()
            release.wait(30)
        compiled_once.add(schema)
        return compile_one(schema)

    compiler._matcher = matcher
    schemas = [canonical_schema({**PERSON, "title": f"s{i}"}) for i in range(6)]
    firsts = [compiler.compile(schemas[0])]
    assert len(firsts[0].result(30).matchers) == 1 and held.wait(30)  # its second lineage is compiling
    firsts += [compiler.compile(s) for s in schemas[1:4]]
    assert all(len(f.result(30).matchers) == 1 for f in firsts)  # their lineages wait in the background
    started = time.monotonic()
    assert compiler.compile(schemas[4]).result(10).matchers  # not behind the four schemas' lineages
    assert time.monotonic() - started < 10
    last = compiler.compile(schemas[5]).result(30)  # evicts schemas[0], whose second lineage is held
    release.set()
    deadline = time.monotonic() + 30
    while len(last.matchers) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(last.matchers) == 3
    assert len(firsts[0].result().matchers) == 2  # the one compiling when it was evicted, no more
    compiler.close()


def held_lineages(compiler: GrammarCompiler) -> tuple[threading.Event, list[str]]:
    """The compiler's background lineage compiles held until the event is set; the schemas of the
    compiles that ran (held or not), in order."""
    release, compiled, compile_one = threading.Event(), [], compiler._matcher

    def matcher(schema: str):
        if threading.current_thread().name.startswith("graphserve-grammar-lineages"):
            release.wait(30)
        compiled.append(schema)
        return compile_one(schema)

    compiler._matcher = matcher
    return release, compiled


def wait_for(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_an_evicted_schema_asked_for_again_compiles_lineages_only_for_its_new_compile(monkeypatch):
    """The lineage loop ran while the schema's text was cached: evicted and asked for again (a new
    compile), the old compile, which no sequence copies, got every lineage, ahead of the new one's."""
    monkeypatch.setattr(grammar_module, "LINEAGES", 4)
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH, cache_size=1)
    release, _ = held_lineages(compiler)
    a, b = canonical_schema(PERSON), canonical_schema({**PERSON, "title": "b"})
    old = compiler.compile(a).result(30)
    compiler.compile(b).result(30)  # evicts the first compile of a
    new = compiler.compile(a).result(30)
    release.set()
    assert new is not old and wait_for(lambda: len(new.matchers) == 4)
    assert len(old.matchers) <= 2  # at most the one compiling when it was evicted
    compiler.close()


def test_a_closed_compiler_starts_no_other_lineage(monkeypatch):
    """After a model swap the old engine's compiler is closed; its lineage loop went on compiling
    every lineage for the old tokenizer (31 on 16 cores) beside the new model's gate and traffic."""
    monkeypatch.setattr(grammar_module, "LINEAGES", 8)
    compiler = GrammarCompiler(TOKENIZER, (EOS,), WIDTH)
    release, compiled = held_lineages(compiler)
    schema = canonical_schema(PERSON)
    first = compiler.compile(schema).result(30)
    assert wait_for(lambda: len(compiled) == 1)  # the first lineage; the second is held
    compiler.close()
    release.set()
    compiler._background.shutdown(wait=True)  # its thread has ended: nothing compiles after this
    assert len(first.matchers) <= 2 and len(compiled) <= 2


def test_a_pooled_fill_ahead_over_lineages_fills_what_a_fill_now_does(three_lineages):
    compiler, compiled = three_lineages
    sampler = BatchSampler(12, WIDTH, torch.device("cpu"))
    seqs = []
    for n in range(9):
        seq = new_sequence([1], SamplingParams(max_tokens=64, json_schema=canonical_schema(PERSON)))
        seq.slot, seq.grammar = 11 - n, compiler.grammar(compiled)
        seq.grammar.replay(ids(DOCUMENT)[: 4 * n])
        seqs.append(seq)
    sampler.fill_ahead(seqs)
    sampler.settle()
    ahead = sampler.bitmasks.masks.clone()
    now = torch.zeros_like(ahead)
    MaskFiller().fill([s.grammar for s in seqs], now, [s.slot for s in seqs])
    assert torch.equal(ahead[3:], now[3:]) and ahead[3:].any(dim=1).all()
    assert all(sampler.bitmasks.holds(s.grammar, s.slot) for s in seqs)


# -- the sampler applying the masks --------------------------------------------------------------


def apply_reference(logits: torch.Tensor, allowed_ids: set[int]) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    index = torch.tensor(sorted(allowed_ids))
    out[index] = logits[index]
    return out


def test_apply_token_bitmask_bans_what_the_bitmask_leaves_out_and_only_in_its_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    bitmask = torch.tensor([[0b1010, -(1 << 31)]], dtype=torch.int32)  # tokens 1, 3 and 63; 64+ past the mask
    out = apply_token_bitmask(logits.clone(), torch.tensor([1]), bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.equal(out[1], apply_reference(logits[1], {1, 3, 63}))


SAMPLING = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.8, top_p=0.9, seed=3),
    dict(temperature=1.2, top_k=5, seed=11),
    dict(temperature=0.7, top_p=0.5, top_k=40, logprobs=5, presence_penalty=0.5, logit_bias=((65, 100.0),)),
]


def batch(compiler, sampler: BatchSampler, constrained: list[bool], logprobs: int | None = None):
    seqs = []
    for slot, (kwargs, grammar) in enumerate(zip(SAMPLING * 2, constrained)):
        params = SamplingParams(**{**kwargs, "logprobs": kwargs.get("logprobs", logprobs)})
        seq = new_sequence(ids("Hi"), params)
        seq.output_ids = ids("ab")
        seq.slot = slot
        if grammar:
            seq.grammar = person(compiler)
            seq.grammar.replay(ids('{"name": "A", "role": "'))
        seqs.append(seq)
    sampler.admit(seqs)
    return seqs


@pytest.mark.parametrize("step", range(3))
def test_free_rows_of_a_mixed_batch_draw_bit_for_bit_what_they_draw_alone(compiler, step):
    g = torch.Generator().manual_seed(step)
    logits = torch.randn(len(SAMPLING) * 2, WIDTH, generator=g) * 3
    mixed = [i % 2 == 1 for i in range(len(SAMPLING) * 2)]
    free_sampler, mixed_sampler = (BatchSampler(16, WIDTH, torch.device("cpu")) for _ in range(2))
    free_tokens, free_logprobs = free_sampler.sample(logits, batch(compiler, free_sampler, [False] * 10, 3))
    mixed_tokens, mixed_logprobs = mixed_sampler.sample(logits, batch(compiler, mixed_sampler, mixed, 3))
    for i, constrained in enumerate(mixed):
        if constrained:
            assert TOKENIZER.decode([mixed_tokens[i]]) in {"a", "u"}, (i, SAMPLING[i % len(SAMPLING)])
        else:
            assert mixed_tokens[i] == free_tokens[i] and mixed_logprobs[i] == free_logprobs[i]


def test_a_constrained_row_reports_the_logprobs_of_the_constrained_distribution(compiler):
    """Only "a" (admin) and "u" (user) may follow: their probabilities sum to one, every other token
    reads as the floor, and the alternatives list the allowed ones first."""
    sampler = BatchSampler(16, WIDTH, torch.device("cpu"))
    (seq,) = batch(compiler, sampler, [True], logprobs=3)
    logits = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(5))
    logits[0, ids("{")[0]] = 50.0  # what the model wants most is not allowed
    (token,), (logprob,) = sampler.sample(logits, [seq])
    a, u = ids("a")[0], ids("u")[0]
    assert token in (a, u)
    top = dict(logprob.top)
    assert set(list(top)[:2]) == {a, u} and list(top.values())[2] == LOGPROB_FLOOR
    assert abs(sum(torch.tensor([top[a], top[u]]).exp().tolist()) - 1.0) < 1e-5
    assert logprob.logprob == top[token]


def test_the_sampler_fills_no_masks_for_a_batch_without_grammars(compiler, monkeypatch):
    sampler = BatchSampler(16, WIDTH, torch.device("cpu"))
    monkeypatch.setattr(sampler.masks, "fill", lambda *a: pytest.fail("filled a mask for a free batch"))
    sampler.sample(torch.randn(2, WIDTH), batch(compiler, sampler, [False, False]))
    assert sampler.bitmasks is None


def masked_beforehand(logits: torch.Tensor, seqs) -> torch.Tensor:
    """The logits with each constrained row's banned tokens at -inf already: what penalties and
    logit_bias then do leaves -inf as it is, so a free sampler's draw from them is the reference."""
    out = logits.clone()
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            out[i] = apply_reference(logits[i], allowed(seq.grammar))
    return out


@pytest.mark.parametrize("step", range(3))
def test_a_constrained_row_draws_and_reports_what_a_free_row_draws_from_logits_masked_beforehand(compiler, step):
    """Seeds, top-k/top-p, penalties, logit_bias and logprobs: the mask changes only which tokens
    may be drawn, so the draw is the one the same row makes from logits already masked."""
    g = torch.Generator().manual_seed(10 + step)
    logits = torch.randn(len(SAMPLING) * 2, WIDTH, generator=g) * 3
    mixed = [i % 3 != 1 for i in range(len(SAMPLING) * 2)]
    sampler, free_sampler = (BatchSampler(16, WIDTH, torch.device("cpu")) for _ in range(2))
    seqs = batch(compiler, sampler, mixed, logprobs=4)
    expected = free_sampler.sample(masked_beforehand(logits, seqs), batch(compiler, free_sampler, [False] * 10, 4))
    assert sampler.sample(logits, seqs) == expected


def test_the_mask_buffers_are_kept_across_steps_and_a_smaller_batch_bans_only_in_its_rows(compiler):
    sampler = BatchSampler(16, WIDTH, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    sampler.sample(torch.randn(10, WIDTH, generator=g), batch(compiler, sampler, [True] * 10))
    buffers = sampler.bitmasks
    seqs = batch(compiler, sampler, [False, False, True, False])
    logits = torch.randn(4, WIDTH, generator=g)
    before = logits.clone()
    sampler.sample(logits, seqs)
    assert sampler.bitmasks is buffers
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    assert torch.equal(logits[2], apply_reference(before[2], allowed(seqs[2].grammar)))


def test_a_fill_ahead_in_the_fillers_thread_fills_what_a_fill_now_does(compiler):
    grammars = [person(compiler) for _ in range(5)]
    for n, grammar in enumerate(grammars):
        grammar.replay(ids(DOCUMENT)[: 5 * n])
    rows = [4, 0, 6, 2, 1]
    now, ahead = MaskFiller(), MaskFiller()
    a = torch.zeros(8, grammars[0].words, dtype=torch.int32)
    b = torch.zeros_like(a)
    now.fill(grammars, a, rows)
    ahead.start([(g.matcher, r) for g, r in zip(grammars, rows)], b)
    ahead.wait()
    assert torch.equal(a, b) and not a[[3, 5, 7]].any() and a[rows].any(dim=1).all()


def test_a_fill_ahead_that_fails_raises_where_it_is_waited_for(compiler):
    grammar = person(compiler)
    filler = MaskFiller()
    filler.start([(grammar.matcher, 0)], torch.zeros(1, grammar.words + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="Invalid buffer size"):
        filler.wait()
    filler.wait()  # raised once
    bitmask = torch.zeros(1, grammar.words, dtype=torch.int32)
    filler.start([(grammar.matcher, 0)], bitmask)
    filler.wait()
    assert texts(allowed(grammar)) == {"{"} and bitmask.any()


def test_a_fill_ahead_is_used_where_its_sequence_has_not_moved_and_redone_where_it_has(compiler, monkeypatch):
    """A mask filled ahead into a slot's row serves its sequence while that sequence is still in
    the slot and at the same place in its grammar; one that took a token since, moved to another
    slot, or whose row another sequence's mask has since taken, is filled again."""
    sampler, free_sampler = (BatchSampler(16, WIDTH, torch.device("cpu")) for _ in range(2))
    filled = []
    fill = sampler.masks.fill
    monkeypatch.setattr(
        sampler.masks, "fill", lambda g, bitmask, rows: (filled.append(list(rows)), fill(g, bitmask, rows))
    )
    gen = torch.Generator().manual_seed(7)

    def check(seqs):
        sampler.settle()  # the reference reads the grammars: not while the fill ahead holds them
        sampler.admit(seqs)  # penalized rows: the history of their tokens so far, as the reference's
        logits = torch.randn(len(seqs), WIDTH, generator=gen) * 3
        free = batch(compiler, free_sampler, [False] * len(seqs))
        expected = free_sampler.sample(masked_beforehand(logits, seqs), free)
        assert sampler.sample(logits, seqs) == expected

    seqs = batch(compiler, sampler, [True] * AHEAD_MIN_ROWS)
    sampler.fill_ahead(seqs)
    check(seqs)
    assert filled == []
    seqs[1].slot = 9  # preempted, then admitted again into another slot
    seqs[2].grammar.accept(ids("a")[0])  # took a token with no fill ahead since
    (newcomer,) = batch(compiler, sampler, [True])
    newcomer.slot = 3
    check([newcomer])  # slot 3's row now holds the newcomer's mask
    assert filled == [[3]]
    check(seqs)
    assert filled == [[3], [9, 2, 3]]
    sampler.fill_ahead(seqs)
    check(seqs)
    assert len(filled) == 2


def test_a_batch_with_few_constrained_rows_fills_its_masks_at_the_draw_not_ahead(compiler, monkeypatch):
    """Below AHEAD_MIN_ROWS rows under a grammar no fill ahead starts: the draw fills every mask
    itself, and draws what a free sampler draws from logits masked beforehand."""
    sampler, free_sampler = (BatchSampler(16, WIDTH, torch.device("cpu")) for _ in range(2))
    started, filled = [], []
    fill = sampler.masks.fill
    monkeypatch.setattr(sampler.masks, "start", lambda pairs, bitmask: started.append(pairs))
    monkeypatch.setattr(
        sampler.masks, "fill", lambda g, bitmask, rows: (filled.append(list(rows)), fill(g, bitmask, rows))
    )
    mixed = [i < AHEAD_MIN_ROWS - 1 for i in range(len(SAMPLING) * 2)]
    seqs = batch(compiler, sampler, mixed)
    logits = torch.randn(len(seqs), WIDTH, generator=torch.Generator().manual_seed(3)) * 3
    sampler.fill_ahead(seqs)
    expected = free_sampler.sample(masked_beforehand(logits, seqs), batch(compiler, free_sampler, [False] * 10))
    assert started == []
    assert sampler.sample(logits, seqs) == expected
    assert filled == [list(range(AHEAD_MIN_ROWS - 1))]
