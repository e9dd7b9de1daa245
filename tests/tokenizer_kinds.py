"""Small tokenizers of the kinds other tools make, trained in milliseconds with the `tokenizers`
library and wrapped as transformers does: SentencePiece-style BPE with byte fallback (Llama 2 and
Mistral's decoder: `▁` to space, `<0xNN>` bytes, the first space stripped), Unigram with
transformers' clean-up of spaces, and WordPiece whose own decoder cleans up."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The capital of France is Paris. Is it ? He said no . I don't know , can't it ?",
    "Prices: 5€ and 10£, naïve café résumé. 中文测试：你好，世界。 Emoji 😀 👍🏽 🚀",
    "def foo(x):\n    return x + 1  # code\nLine one\r\nLine two",
] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """BPE over `▁`-joined words with a token per byte for the rest, decoded as Llama 2's is."""
    words = Tokenizer(models.BPE(unk_token="<unk>"))
    words.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    words.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False))
    trained = json.loads(words.to_str())["model"]
    vocab = {**{s: i for i, s in enumerate(SPECIALS)}, **{f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)}}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = words.normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def unigram_with_cleanup() -> PreTrainedTokenizerFast:
    """A Unigram (T5-like) tokenizer whose transformers decode cleans up spaces ("it ?" -> "it?")."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(
        CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=True
    )


def wordpiece_with_cleanup() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer whose Rust decoder itself cleans up spaces ("don ' t" -> "don't")."""
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=True
    )
