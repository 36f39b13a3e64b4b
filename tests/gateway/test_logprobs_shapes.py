"""Log-probabilities as the gateway answers them: each token's exact bytes under a byte-level BPE
tokenizer and a SentencePiece byte-fallback one, OpenAI's chat and completions shapes, and a
request's choices merged as their outputs come (a piece with logprobs wins over a copy without)."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.bus import EventStream
from common.errors import APIError
from common.protocol import OUTPUT_KINDS, ErrorOutput, FinalOutput, TokenDelta, TokenLogprob, Usage
from services.gateway.choices import Choices
from services.gateway.collector import OutputCollector
from services.gateway.logprobs import TokenText, chat_content, completion_logprobs

TEXT = "Héllo wörld, 日本 — ok"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A real `tokenizers` BPE with Llama's decoder (▁ for space, <0xNN> byte fallback)."""
    vocab = {"<unk>": 0, "▁H": 1, "ello": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_a_tokens_bytes_join_into_the_text_byte_level(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    text_of = TokenText(tokenizer)
    assert text_of.byte_level
    assert b"".join(bytes(text_of(t)[1]) for t in ids) == TEXT.encode()
    pieces = [text_of(t)[0] for t in ids]
    assert "\ufffd" in "".join(pieces)  # a character split over tokens: its parts are not text


def test_a_tokens_bytes_join_into_the_text_sentencepiece():
    tok = sentencepiece_like()
    text_of = TokenText(tok)
    assert not text_of.byte_level
    assert text_of(1) == (" H", list(b" H"))  # ▁ is a space
    e9 = 3 + 0xE9  # <0xE9>
    assert text_of(e9) == ("\ufffd", [0xE9])
    assert bytes(text_of(3 + 0xC3)[1] + text_of(3 + 0xA9)[1]).decode() == "é"


def test_chat_and_completion_shapes(tokenizer):
    text_of = TokenText(tokenizer)
    ids = tokenizer(" boat ride", add_special_tokens=False)["input_ids"]
    lps = [
        TokenLogprob(logprob=-0.5, top=((ids[0], -0.5), (7, -1.25))),
        None,
        *[TokenLogprob(logprob=-1.0)] * (len(ids) - 2),
    ]
    content = chat_content(text_of, ids, lps)
    assert len(content) == len(ids) - 1  # a token whose logprobs are not known is left out
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == -0.5 and first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.25]
    assert first["top_logprobs"][0]["token"] == first["token"]
    shaped = completion_logprobs(text_of, ids, lps, offset=10)
    assert "".join(shaped["tokens"]) == " boat ride"
    assert shaped["token_logprobs"][:2] == [-0.5, None]
    assert shaped["text_offset"][0] == 10
    assert shaped["text_offset"][1] == 10 + len(shaped["tokens"][0])
    assert shaped["top_logprobs"][0] == {text_of(ids[0])[0]: -0.5, text_of(7)[0]: -1.25}


def collector(tokenizer, rid: str) -> tuple[OutputCollector, EventStream]:
    stream = EventStream(OUTPUT_KINDS, None)
    made = OutputCollector(
        stream, tokenizer, (), deadline=time.perf_counter() + 10, arrival=time.perf_counter()
    )
    return made, stream


def final(n: int) -> FinalOutput:
    usage = Usage(prompt_tokens=3, completion_tokens=n)
    return FinalOutput(request_id="r", finish_reason="length", usage=usage, num_outputs=n)


async def test_choices_merge_with_their_index_and_end_one_by_one(tokenizer):
    (a, sa), (b, sb) = collector(tokenizer, "r"), collector(tokenizer, "r-n1")
    lp = TokenLogprob(logprob=-0.1)
    sb.deliver(TokenDelta(request_id="r-n1", index=0, token_ids=(202, 203), logprobs=(lp, lp)))
    sb.deliver(final(2))
    # Behind a hole: a copy without logprobs (said again by an instance that did not know them), one with.
    sa.deliver(TokenDelta(request_id="r", index=1, token_ids=(104,)))
    sa.deliver(TokenDelta(request_id="r", index=1, token_ids=(104,), logprobs=(lp,)))
    sa.deliver(TokenDelta(request_id="r", index=0, token_ids=(101,), logprobs=(lp,)))
    sa.deliver(final(2))
    got = [c async for c in Choices([a, b]).pieces()]
    ends = [c.index for c in got if c.piece is None]
    assert sorted(ends) == [0, 1] and a.complete and b.complete
    tokens = {i: [t for c in got if c.index == i and c.piece for t in c.piece.token_ids] for i in (0, 1)}
    assert tokens == {0: [101, 104], 1: [202, 203]}
    logprobs = [lp for c in got if c.index == 0 and c.piece for lp in c.piece.logprobs]
    assert logprobs == [lp, lp]


async def test_a_choices_error_ends_the_merged_stream(tokenizer):
    (a, _), (b, sb) = collector(tokenizer, "r"), collector(tokenizer, "r-n1")
    sb.deliver(ErrorOutput(request_id="r-n1", code="service_unavailable", message="gone"))
    with pytest.raises(APIError, match="gone"):
        async for _ in Choices([a, b]).pieces():
            pass


async def test_the_merged_stream_keeps_itself_alive(tokenizer):
    (a, _), (b, _) = collector(tokenizer, "r"), collector(tokenizer, "r-n1")
    pieces = Choices([a, b], keepalive=0.05).pieces()
    first = await anext(pieces)
    assert first.piece is not None and first.piece.keepalive
    await pieces.aclose()
