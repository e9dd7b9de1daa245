"""Incremental detokenization with the default (byte-level) tokenizer: streamed text equals the full
decode, multi-byte characters are never split, and stop strings cut the text exactly."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import pytest

import workers.serving.detokenizer
from app.openai_protocol import STOP_MAX_CHARS
from tests.unit.engine_fixtures import load_tiny
from workers.modeling.token_bytes import token_bytes
from workers.serving.detokenizer import IncrementalDetokenizer, StopMatcher

MIXED = "Hi é€中😀 ok, ünïcödé ∑ 𝄞 end"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return load_tiny(tmp_path_factory).tokenizer


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], bool]:
    """Feed chunks until a stop string hits; returns the pieces handed out and whether it hit."""
    pieces = []
    for chunk in chunks:
        text, hit = detok.add(chunk)
        pieces.append(text)
        if hit:
            return pieces, True
    pieces.append(detok.flush()[0])
    return pieces, False


def test_byte_tokenizer_splits_multibyte_characters(tokenizer):
    """Precondition of the tests below: each UTF-8 byte is its own token, so a multi-byte character
    always spans several tokens."""
    ids = enc(tokenizer, MIXED)
    assert len(ids) == len(MIXED.encode())
    assert len(ids) > len(MIXED)


def test_token_by_token_equals_full_decode_without_replacement_chars(tokenizer):
    """Feeding one token at a time, the pieces concatenate to the full decode; no piece ever holds
    U+FFFD (a half character); a piece appears exactly when a character completes."""
    ids = enc(tokenizer, MIXED)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for i, t in enumerate(ids):
        text, hit = detok.add([t])
        assert not hit
        assert "\ufffd" not in text
        complete = tokenizer.decode(ids[: i + 1])
        if not complete.endswith("\ufffd"):
            assert "".join(pieces) + text == complete  # nothing held back once a character is whole
        pieces.append(text)
    assert detok.flush() == ("", False)
    assert "".join(pieces) == tokenizer.decode(ids) == MIXED


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_equals_full_decode(tokenizer, seed):
    """Any split of the ids into chunks streams the same text as decoding them all at once."""
    rng = random.Random(seed)
    ids = enc(tokenizer, MIXED * 2)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 5)  # empty chunks too (steps that brought no token for this request)
        chunks.append(ids[i : i + n])
        i += n
    pieces, hit = stream(IncrementalDetokenizer(tokenizer), chunks)
    assert not hit
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MIXED * 2


@pytest.mark.parametrize("seed", range(8))
def test_arbitrary_bytes_and_specials_equal_full_decode(tokenizer, seed):
    """Whatever a model emits (invalid UTF-8, stray continuation bytes, special tokens), the streamed
    text plus the final flush equals tokenizer.decode(all ids, skip_special_tokens=True)."""
    rng = random.Random(100 + seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) if rng.random() < 0.1 else rng.randrange(128, 256) for _ in range(60)]
    ids += enc(tokenizer, "tail€")[: rng.randint(1, 6)]  # maybe end mid-character
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t])[0] for t in ids]
    pieces.append(detok.flush()[0])
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tokenizer):
    """BOS/EOS/chat tokens in the stream produce no text."""
    ids = [*enc(tokenizer, "ab"), tokenizer.eos_token_id, tokenizer.bos_token_id, *enc(tokenizer, "c")]
    pieces, _ = stream(IncrementalDetokenizer(tokenizer), [[t] for t in ids])
    assert "".join(pieces) == "abc"


def test_flush_emits_incomplete_character_at_end(tokenizer):
    """A stream that ends mid-character is flushed as the tokenizer would decode it (U+FFFD), not
    silently dropped."""
    ids = enc(tokenizer, "x€")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t])[0] for t in ids] == ["x", "", ""]
    assert detok.flush() == (tokenizer.decode(ids)[1:], False) == ("\ufffd", False)


def test_a_stream_cut_short_keeps_an_incomplete_character_back(tokenizer):
    """A stream aborted mid-generation (a swap's drain timeout) ended with U+FFFD where the whole
    generation has a character whose bytes were split across tokens; text held back for a stop
    string is still released."""
    detok = IncrementalDetokenizer(tokenizer, stop=("yz",))
    assert [detok.add([t])[0] for t in enc(tokenizer, "xy€")[:-1]] == ["x", "", "", ""]
    assert detok.flush(cut_short=True) == ("y", False)


# ---------------------------------------------------------------- stop strings


def test_stop_string_cuts_text_before_it(tokenizer):
    """Text is cut right before the stop string; the call that completes it reports the hit."""
    detok = IncrementalDetokenizer(tokenizer, stop=("world",))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, "Hello world and more")])
    assert hit
    assert "".join(pieces) == "Hello "
    assert len(pieces) == len("Hello world")  # it stopped at the token that completed "world"


def test_stop_inside_one_chunk(tokenizer):
    """A stop string wholly inside one addition cuts there, dropping what follows it."""
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert detok.add(enc(tokenizer, "abc STOP def")) == ("abc ", True)


def test_partial_stop_prefix_is_held_back(tokenizer):
    """A tail that could still become a stop string is not emitted early; once it can no longer
    match, it is released."""
    detok = IncrementalDetokenizer(tokenizer, stop=("abc",))
    assert detok.add(enc(tokenizer, "xa")) == ("x", False)
    assert detok.add(enc(tokenizer, "b")) == ("", False)
    assert detok.add(enc(tokenizer, "d")) == ("abd", False)
    assert detok.add(enc(tokenizer, "ab")) == ("", False)
    assert detok.flush() == ("ab", False)  # the stream ended without a stop: the held tail is released


def test_stop_spanning_two_additions(tokenizer):
    """A stop string whose first half arrived in one step and second half in the next is found, and
    the text before it that was held back is not lost."""
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert detok.add(enc(tokenizer, "foo ST")) == ("foo ", False)
    assert detok.add(enc(tokenizer, "OP bar")) == ("", True)
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert detok.add(enc(tokenizer, "foo S")) == ("foo ", False)
    assert detok.add(enc(tokenizer, "xSTO")) == ("Sx", False)
    assert detok.add(enc(tokenizer, "P!")) == ("", True)


def test_overlapping_stop_prefix(tokenizer):
    """With stop 'aab' and text 'aaab', the first 'a' is emitted and the stop found after it."""
    detok = IncrementalDetokenizer(tokenizer, stop=("aab",))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, "aaab")])
    assert hit and "".join(pieces) == "a"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    """With several stop strings, the text is cut at the one that starts first."""
    detok = IncrementalDetokenizer(tokenizer, stop=("END", "x"))
    assert detok.add(enc(tokenizer, "abc END x")) == ("abc ", True)
    detok = IncrementalDetokenizer(tokenizer, stop=("END", "c E"))
    assert detok.add(enc(tokenizer, "abc END")) == ("ab", True)


def test_stop_at_start_emits_nothing(tokenizer):
    """A completion that begins with the stop string yields no text."""
    detok = IncrementalDetokenizer(tokenizer, stop=("<<",))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, "<<rest")])
    assert hit and "".join(pieces) == ""


def test_multibyte_stop_string(tokenizer):
    """A stop string made of multi-byte characters is matched once its bytes complete."""
    detok = IncrementalDetokenizer(tokenizer, stop=("€中",))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, "price: 5€中 more")])
    assert hit and "".join(pieces) == "price: 5"
    assert all("\ufffd" not in p for p in pieces)


def test_no_stop_flush_returns_the_rest(tokenizer):
    """Without a stop string match, streamed pieces plus flush give the whole text, including a
    trailing proper prefix of a stop string."""
    text = "one two thr"
    detok = IncrementalDetokenizer(tokenizer, stop=("three", "zzz"))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, text)])
    assert not hit
    assert pieces[-1] == "thr"  # held back until the end, then flushed
    assert "".join(pieces) == text


def random_chunks(rng: random.Random, ids: list[int], most: int = 4) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def reference(tokenizer, text: str, chunks: list[list[int]], stops: tuple[str, ...]) -> tuple[str, bool]:
    """After the first chunk whose arrival makes some stop string appear in the text so far, that text
    cut at the earliest such occurrence (or, with no stop, the whole text)."""
    seen = []
    for chunk in chunks:
        seen += chunk
        so_far = tokenizer.decode(seen).rstrip("\ufffd")  # whole characters only
        found = [so_far.find(s) for s in stops if s in so_far]
        if found:
            return so_far[: min(found)], True
    return text, False


@pytest.mark.parametrize("seed", range(20))
def test_stop_random_chunks_match_reference(tokenizer, seed):
    """For random text, stop strings taken from it and chunkings, the streamed output equals the
    reference."""
    rng = random.Random(seed)
    alphabet = "ab é€"
    text = "".join(rng.choice(alphabet) for _ in range(80))
    stops = tuple({text[i : i + rng.randint(1, 4)] for i in rng.sample(range(70), rng.randint(0, 3))} | {"zz"})
    chunks = random_chunks(rng, enc(tokenizer, text))
    pieces, hit = stream(IncrementalDetokenizer(tokenizer, stop=stops), chunks)
    assert (("".join(pieces)), hit) == reference(tokenizer, text, chunks, stops)


@pytest.mark.parametrize("seed", range(30))
def test_self_overlapping_stops_match_reference(tokenizer, seed):
    """On a two-letter alphabet (stop strings overlapping themselves and each other, long partial
    matches that fail late), random stop strings that may or may not occur stream as the reference
    says, and no piece ever holds text from the stop string on."""
    rng = random.Random(1000 + seed)
    text = "".join(rng.choice("aab€") for _ in range(120))
    stops = tuple({"".join(rng.choice("aab€") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))})
    chunks = random_chunks(rng, enc(tokenizer, text), most=6)
    pieces, hit = stream(IncrementalDetokenizer(tokenizer, stop=stops), chunks)
    expected, expected_hit = reference(tokenizer, text, chunks, stops)
    assert ("".join(pieces), hit) == (expected, expected_hit)
    assert not any(s in "".join(pieces) for s in stops)


def test_later_ending_stop_that_starts_earlier_wins_within_one_addition(tokenizer):
    """Within one addition, a stop string that ends after another but starts before it is the cut;
    fed token by token, the one completed first cuts (its addition is the first with a stop)."""
    stops = ("abcd", "bc")
    assert IncrementalDetokenizer(tokenizer, stop=stops).add(enc(tokenizer, "xabcd!")) == ("x", True)
    pieces, hit = stream(IncrementalDetokenizer(tokenizer, stop=stops), [[t] for t in enc(tokenizer, "xabcd!")])
    assert hit and "".join(pieces) == "xa"


def test_self_overlapping_stop_found_after_a_late_mismatch(tokenizer):
    """'aabaaab' in 'aabaabaaab' starts at 3: the mismatch at the sixth character releases only the
    first 'aab', the tail 'aab' still beginning a match, which then completes."""
    detok = IncrementalDetokenizer(tokenizer, stop=("aabaaab",))
    pieces, hit = stream(detok, [[t] for t in enc(tokenizer, "aabaabaaab tail")])
    assert hit
    assert pieces == ["", "", "", "", "", "aab", "", "", "", ""]


def test_held_back_multibyte_prefix_released_when_it_cannot_match(tokenizer):
    """A held-back tail of multi-byte characters comes out whole, with the character that broke the
    match, and never as half a character."""
    detok = IncrementalDetokenizer(tokenizer, stop=("€中!",))
    pieces = [detok.add([t])[0] for t in enc(tokenizer, "5€中?")]
    assert "".join(pieces) == "5€中?"
    assert [p for p in pieces if p] == ["5", "€中?"]
    assert detok.flush() == ("", False)


def test_nothing_is_handed_out_after_a_stop(tokenizer):
    """Once a stop string is hit, later additions and flush return nothing, whatever they bring."""
    detok = IncrementalDetokenizer(tokenizer, stop=("##",))
    assert detok.add(enc(tokenizer, "ok ## gone")) == ("ok ", True)
    assert detok.add(enc(tokenizer, "more")) == ("", True)
    assert detok.flush() == ("", True)


@pytest.mark.parametrize("seed", range(10))
def test_stop_matcher_state_is_longest_prefix_ending_the_text(seed):
    """The automaton's state after each character equals the naive definition: the longest prefix of
    the stop string that ends the text so far (a full match reported, not kept as the state)."""
    rng = random.Random(seed)
    stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
    text = "".join(rng.choice("ab") for _ in range(200))
    matcher = StopMatcher(stop)
    for i in range(len(text)):
        hit = matcher.feed(text[i])
        seen = text[: i + 1]
        assert hit == seen.endswith(stop)
        longest = max(n for n in range(len(stop)) if seen.endswith(stop[:n]))
        assert matcher.state == longest


def lines_run_in_detokenizer(fn: Callable[[], object]) -> int:
    """How many Python lines of workers/serving/detokenizer.py run during fn(): the detokenizer's own work,
    counted instead of timed (the tokenizer's decode is not counted)."""
    target = workers.serving.detokenizer.__file__
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != target:
            return None
        count += event == "line"
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize(
    ("text", "short", "long"),
    [
        ("The quick brown fox; " * 200, "QQ", "Q" * STOP_MAX_CHARS),  # never a prefix
        ("ab" * 2000, "ac", "ab" * (STOP_MAX_CHARS // 2 - 1) + "ac"),  # a long partial match, always
    ],
    ids=["no-prefix", "partial-matches"],
)
def test_stop_string_work_per_token_is_bounded(tokenizer, text, short, long):
    """The work per token grows neither with the stop string's length (up to the cap) nor with the
    text already generated: fed token by token, a stop at the cap costs about what a 2-character one
    does, and twice the text about twice the work."""
    ids = enc(tokenizer, text[:2000])

    def work(stop: str, n: int) -> int:
        return lines_run_in_detokenizer(
            lambda: stream(IncrementalDetokenizer(tokenizer, stop=(stop,)), [[t] for t in ids[:n]])
        )

    at_cap = work(long, 1000)
    assert at_cap <= 1.5 * work(short, 1000)
    assert work(long, 2000) <= 2.2 * at_cap


# -- reads of several tokens (add_tokens, what a replica's stream calls) ------------------------------


def one_at_a_time(detok: IncrementalDetokenizer, read: list[int]) -> tuple[int, str, bool]:
    """A read fed token by token, none counted past the one that completes a stop string."""
    text = ""
    for n, token in enumerate(read, 1):
        piece, hit = detok.add([token])
        text += piece
        if hit:
            return n, text, True
    return len(read), text, False


def random_case(tokenizer, seed: int) -> tuple[tuple[str, ...], list[list[int]]]:
    """Stop strings and reads over an alphabet of 1-, 3- and 4-byte characters (a read often ends
    inside one): some stop strings occur, some hit mid-read, some never."""
    rng = random.Random(3000 + seed)
    alphabet = "aab €中😀"
    text = "".join(rng.choice(alphabet) for _ in range(100))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))})
    return stops, random_chunks(rng, enc(tokenizer, text), most=12)


@pytest.mark.parametrize("seed", range(40))
def test_a_read_counts_and_cuts_as_token_by_token(tokenizer, seed):
    """Whatever the read holds, add_tokens hands out the text, the stop hit and the number of tokens
    that count that feeding the same tokens one at a time does; and so does the flush. After a hit
    nothing more counts."""
    stops, reads = random_case(tokenizer, seed)
    whole, single = IncrementalDetokenizer(tokenizer, stops), IncrementalDetokenizer(tokenizer, stops)
    for read in reads:
        got = whole.add_tokens(read)
        assert got == one_at_a_time(single, read), (stops, read)
        if got[2]:
            assert whole.add_tokens(read) == (0, "", True)
            break
    assert whole.flush() == single.flush()


def test_the_random_reads_cut_mid_read_and_end_inside_characters(tokenizer):
    """The cases above hold what add_tokens must go token by token for: stop strings completed by a
    token before the last of a read, and reads that end inside a character."""
    cut_mid_read = split = 0
    for seed in range(40):
        stops, reads = random_case(tokenizer, seed)
        detok, sent = IncrementalDetokenizer(tokenizer, stops), []
        for read in reads:
            sent += read
            split += tokenizer.decode(sent).endswith("\ufffd")
            kept, _, hit = detok.add_tokens(read)
            if hit:
                cut_mid_read += kept < len(read)
                break
    assert cut_mid_read >= 10 and split >= 40, (cut_mid_read, split)


@pytest.mark.parametrize("seed", range(12))
def test_a_stream_read_in_batches_restores_anywhere(tokenizer, seed):
    """Cut a stream read with add_tokens after any read and restore a new detokenizer from its state:
    the rest hands out what the uninterrupted stream does (failover from a coalescing replica)."""
    stops, reads = random_case(tokenizer, seed)

    def rest(detok: IncrementalDetokenizer, reads: list[list[int]]) -> list[tuple[int, str, bool]]:
        out = []
        for read in reads:
            out.append(detok.add_tokens(read))
            if out[-1][2]:
                return out
        return [*out, (0, *detok.flush())]

    prompt = enc(tokenizer, random.Random(seed).choice(["Q: €", "中", "a b c d e f g"]))
    whole = rest(IncrementalDetokenizer(tokenizer, stops, prompt), reads)
    for cut in range(1, len(whole)):
        original = IncrementalDetokenizer(tokenizer, stops, prompt)
        for read in reads[:cut]:
            original.add_tokens(read)
        sent = [t for read in reads[:cut] for t in read]
        restored = IncrementalDetokenizer.restore(tokenizer, stops, prompt, sent, original.state())
        assert whole[:cut] + rest(restored, reads[cut:]) == whole, (seed, cut)


def straddling_tokenizer():
    """A byte-level BPE with one token that holds a whole character and the first byte of the next
    (" " and 0xE2, as SmolLM2's 'Ġâ'): text before such a token waits for the rest of that split
    character, so a stream that ends there hands it out only in `flush`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["Ġâ"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "â")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_a_stop_string_is_hit_at_the_token_that_completes_it_before_a_split_character():
    """'Hi' then the token of ' ' and half a character: the stop string ' ' is complete at that
    token, so it is hit there and counts 3 tokens, read one at a time or in reads, whatever comes
    after (it was hit only when the character completed, counting the tokens drawn past it, or
    only in `flush` when the stream ended there). Without a stop string the text waits for the
    rest of the character, as before."""
    tokenizer = straddling_tokenizer()
    ids = enc(tokenizer, "Hi") + [tokenizer.convert_tokens_to_ids("Ġâ")]
    assert len(ids) == 3 and tokenizer.decode(ids) == "Hi \ufffd"
    rest = enc(tokenizer, "€ ok")[1:]  # the character's other bytes, then more text
    detok = IncrementalDetokenizer(tokenizer, stop=(" ",))
    assert [detok.add_tokens([t]) for t in ids] == [(1, "H", False), (1, "i", False), (1, "", True)]
    assert detok.flush() == ("", True)
    for reads in ([ids + rest], [ids[:2], ids[2:] + rest], [ids[:1], ids[1:3], rest]):
        detok = IncrementalDetokenizer(tokenizer, stop=(" ",))
        counted, text = 0, ""
        for read in reads:
            n, piece, hit = detok.add_tokens(read)
            counted, text = counted + n, text + piece
            if hit:
                break
        assert (counted, text, hit) == (3, "Hi", True), reads
    without_stop = IncrementalDetokenizer(tokenizer, stop=("?",))
    assert "".join(without_stop.add([t])[0] for t in ids) + without_stop.flush()[0] == "Hi \ufffd"


@pytest.fixture(scope="module")
def other_kinds():
    from tests import tokenizer_kinds

    return {
        "sentencepiece": tokenizer_kinds.sentencepiece_style(),
        "unigram": tokenizer_kinds.unigram_with_cleanup(),
        "wordpiece": tokenizer_kinds.wordpiece_with_cleanup(),
    }


def test_a_completion_reads_on_from_its_prompt_with_a_sentencepiece_tokenizer(other_kinds):
    """Llama 2 and Mistral tokenizers mark a word's leading space on its token (`▁capital`) and drop
    it when a text starts there: the completion of "The" must read " capital ...", as the prompt
    and completion decode together, not "capital ..." (the prompt's tail starts the decode window)."""
    tok = other_kinds["sentencepiece"]
    ids = enc(tok, "The capital of France is Paris. 😀 I don't know")
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        whole, prefix = tok.decode(ids), tok.decode(prompt)
        assert whole.startswith(prefix)
        pieces, _ = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), [[t] for t in output])
        assert "".join(pieces) == whole[len(prefix) :], cut
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids=ids[:1]), [ids[1:]])[0]).startswith(" capital")


@pytest.mark.parametrize("kind", ["unigram", "wordpiece"])
@pytest.mark.parametrize("seed", range(4))
def test_a_tokenizer_that_cleans_up_spaces_streams_every_character(other_kinds, kind, seed):
    """A clean-up rewrites text across tokens ("it ?" to "it?"), which a stream cannot take back: the
    stream is the decode without clean-up, whatever its reads (with it, characters went missing:
    "said no ." streamed as "said no ")."""
    tok = other_kinds[kind]
    ids = enc(tok, "Is it ? He said no . I don't know , can't it ? The capital")
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i : i + n])
        i += n
    expected = workers.serving.detokenizer.text_decoder(tok)(ids)
    assert expected.replace(" ", "") == tok.decode(ids).replace(" ", "")  # the same text, spaces aside
    assert "".join(stream(IncrementalDetokenizer(tok), chunks)[0]) == expected


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_each_tokens_bytes_join_into_the_text(other_kinds, tokenizer, kind):
    """A token's bytes (logprobs' `bytes`) are what it stands for: joined they are the text's UTF-8,
    spaces of SentencePiece's `▁` and `<0xNN>` byte tokens included (decoded alone, `▁world`
    lost its space and a piece of a character read as U+FFFD's bytes)."""

    tok = other_kinds["sentencepiece"] if kind == "sentencepiece" else tokenizer
    text = "The capital of France is Paris. 5€ 👍🏽 中文 don't"
    ids = enc(tok, text)
    joined = b"".join(token_bytes(tok)(t) for t in ids)
    assert joined.decode() == (" " + text if kind == "sentencepiece" else text)  # its first word's `▁`


def byte_tokens(tok, *values: int) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in values])


@pytest.mark.parametrize("seed", range(6))
def test_byte_fallback_text_does_not_depend_on_how_reads_split_the_tokens(other_kinds, seed):
    """Llama 2's ByteFallback decoder turns a byte run holding invalid UTF-8 into one U+FFFD per
    byte, the run's valid characters included: "O", "K", a lone lead byte, " the" streamed as
    "OK\ufffd the" a token per read and as "\ufffd\ufffd\ufffd the" in one read, so a stop string
    could be hit under one load and missed under another. Each run now decodes as UTF-8 with
    the standard replacement, whatever the reads (stop strings included)."""
    tok = other_kinds["sentencepiece"]
    rng = random.Random(seed)
    words = enc(tok, "The capital of France is Paris.")
    output = []
    for _ in range(40):
        kind = rng.random()
        if kind < 0.4:
            output.append(rng.choice(words))
        else:  # a byte: a valid character's, or a stray or cut one
            char = rng.choice(["O", "é", "€", "😀"]).encode()
            output += byte_tokens(tok, *(char if kind < 0.8 else char[: rng.randint(1, max(1, len(char) - 1))]))
    prompt = enc(tok, "I like 😀")  # ends in byte tokens: the prompt's bytes must not join the output's
    expected = b"".join(token_bytes(tok)(t) for t in output).decode(errors="replace")
    for stop in ((), ("\ufffd t",), ("K\ufffd",)):
        results = set()
        for reads in ([1] * len(output), [len(output)], [rng.randint(1, 5) for _ in output]):
            detok, text, i = IncrementalDetokenizer(tok, stop, prompt), "", 0
            for n in reads:
                if i >= len(output):
                    break
                counted, piece, hit = detok.add_tokens(output[i : i + n])
                text, i = text + piece, i + counted
                if hit:
                    break
            else:
                text += detok.flush()[0]
            results.add((text, i))
        assert len(results) == 1, (stop, results)
        if not stop:
            assert results == {(expected, len(output))}


def test_a_prompt_that_ends_in_a_real_replacement_character_keeps_its_decode_context(other_kinds):
    """A prompt whose text ends in U+FFFD (a character, not a cut one) lost its decode window:
    the completion's first word lost its space ("Hello \ufffd" + "the capital")."""
    tok = other_kinds["sentencepiece"]
    output = enc(tok, "the capital")  # `▁the`, `▁capital`
    for prompt_text in ("Hello ?", "Hello \ufffd"):
        detok = IncrementalDetokenizer(tok, prompt_ids=enc(tok, prompt_text))
        assert detok.add_tokens(output)[1] + detok.flush()[0] == " the capital", prompt_text
    cut = enc(tok, "Hello ") + byte_tokens(tok, 0xE2, 0x82)  # a prompt cut inside "€": the window starts after it
    detok = IncrementalDetokenizer(tok, prompt_ids=cut)
    assert detok.add_tokens(byte_tokens(tok, 0xAC) + output)[1] + detok.flush()[0] == "\ufffd the capital"
