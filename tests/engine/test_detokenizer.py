"""Streamed text pieces: their concatenation is the full decode, they never split a character,
and a stop string is never streamed — with the project's byte-level BPE tokenizer and with a
SentencePiece-style one (LLaVA-1.5's Llama tokenizer drops the first token's leading space)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.engine.detokenizer import IncrementalDetokenizer

TEXT = "the cat sat on the mat today. Café crème 🙂 — naïve 日本 ok, and then the dog ran home."


@pytest.fixture(scope="module")
def byte_bpe(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def metaspace():
    """A small BPE with Llama's Metaspace pre-tokenizer and decoder, trained here on TEXT."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def stream(tokenizer, ids, stop=(), chunks=1):
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detok.add(ids[i : i + chunks]) for i in range(0, len(ids), chunks)]
    return [*pieces, detok.flush()], detok


def full(tokenizer, ids, stop=()):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [at for s in stop if (at := text.find(s)) != -1]
    return text[: min(cuts)] if cuts else text


@pytest.mark.parametrize("which", ["byte_bpe", "metaspace"])
def test_streamed_pieces_concatenate_to_the_full_decode_and_never_split_utf8(request, which):
    tok = request.getfixturevalue(which)
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    if which == "byte_bpe":
        assert len(ids) > len(TEXT) / 2, "multi-byte characters should span several byte-level tokens"


@pytest.mark.parametrize("which", ["byte_bpe", "metaspace"])
def test_random_ids_in_any_chunking_stream_to_the_full_decode(request, which):
    """What a random-weight model emits: any ids, including stray UTF-8 bytes and special tokens."""
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    for trial in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 80))]
        stop = (tok.decode(ids[5:7], skip_special_tokens=True),) if trial % 3 == 0 else ()
        stop = tuple(s for s in stop if s)
        pieces, _ = stream(tok, ids, stop, chunks=1 + trial % 4)
        assert "".join(pieces) == full(tok, ids, stop), (ids, stop)


def test_stop_string_truncates_at_the_earliest_stop_and_is_never_streamed(byte_bpe):
    ids = byte_bpe.encode("the cat sat on the mat today", add_special_tokens=False)
    pieces, detok = stream(byte_bpe, ids, stop=("mat", "on the"))
    assert "".join(pieces) == "the cat sat "
    assert detok.stopped
    assert not any("on" in p for p in pieces)


def test_each_step_decodes_a_window_not_the_whole_output(byte_bpe):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return byte_bpe.decode(ids, **kw)

    ids = byte_bpe.encode(TEXT * 8, add_special_tokens=False)
    pieces, _ = stream(Counting(), ids)
    assert "".join(pieces) == byte_bpe.decode(ids)
    assert max(calls) < 16, "a step decoded far more than its new ids and their context"
