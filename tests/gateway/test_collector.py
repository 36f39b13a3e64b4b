"""The collector puts a request's outputs back in order, whatever the network did to them: out of
order, repeated, overlapping, or lost — a lost output is read back from the output stream."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from common.bus import EventStream
from common.errors import APIError
from common.protocol import OUTPUT_KINDS, ErrorOutput, FinalOutput, TokenDelta, Usage
from services.gateway.collector import GAP_WAIT, SILENCE_FIRST, OutputCollector

TOKENS = [101, 202, 303, 404, 505, 606]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def delta(index: int, *ids: int) -> TokenDelta:
    return TokenDelta(request_id="r", index=index, token_ids=ids)


def final(n: int = len(TOKENS)) -> FinalOutput:
    usage = Usage(prompt_tokens=3, completion_tokens=n)
    return FinalOutput(request_id="r", finish_reason="length", usage=usage, num_outputs=n)


def collector(tokenizer, stored=(), reconnects=None, deadline=10.0, keepalive=None):
    stream = EventStream(OUTPUT_KINDS, None)

    async def refill():
        return list(stored)

    made = OutputCollector(
        stream, tokenizer, (), deadline=time.perf_counter() + deadline, arrival=time.perf_counter(),
        keepalive=keepalive, refill=refill, reconnects=reconnects,
    )  # fmt: skip
    return made, stream


async def drain(made: OutputCollector) -> list[int]:
    ids = []
    async for piece in made.pieces():
        ids += piece.token_ids
    return ids


async def test_out_of_order_repeated_and_overlapping_outputs_come_out_once_in_order(tokenizer):
    made, stream = collector(tokenizer)
    for msg in [
        delta(2, 303),
        delta(0, 101),
        delta(0, 101),
        delta(1, 202, 303, 404),
        final(),
        delta(4, 505, 606),
    ]:
        stream.deliver(msg)
    assert await drain(made) == TOKENS
    assert made.refills == 0 and made.complete
    assert made.outcome.completion_tokens == len(TOKENS)


async def test_a_lost_output_is_read_back_once_the_hole_has_stayed_open(tokenizer):
    stored = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, stored)
    for msg in [delta(0, 101), delta(1, 202), delta(3, 404), delta(4, 505), delta(5, 606), final()]:
        stream.deliver(msg)  # index 2 lost on the way
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.refills == 1 and GAP_WAIT <= time.perf_counter() - started < GAP_WAIT + 1


async def test_a_lost_final_is_read_back_after_a_silence(tokenizer):
    stored = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, stored)
    for i, t in enumerate(TOKENS):
        stream.deliver(delta(i, t))  # every token, but the final never comes
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.refills == 1 and SILENCE_FIRST <= time.perf_counter() - started < SILENCE_FIRST + 1


async def test_a_reconnect_reads_back_at_once(tokenizer):
    reconnects = [0]
    stored = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, stored, reconnects=lambda: reconnects[0])
    stream.deliver(delta(0, 101))
    reconnects[0] += 1  # NATS came back: whatever was in flight may be gone
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.refills == 1 and time.perf_counter() - started < GAP_WAIT


async def test_an_error_output_or_the_deadline_ends_it_with_an_api_error(tokenizer):
    made, stream = collector(tokenizer)
    stream.deliver(ErrorOutput(request_id="r", code="service_unavailable", message="features gone"))
    with pytest.raises(APIError) as err:
        await drain(made)
    assert err.value.status == 503
    made, _ = collector(tokenizer, deadline=0.3)
    with pytest.raises(APIError) as err:
        await drain(made)
    assert err.value.status == 504


async def test_silence_yields_keep_alive_pieces(tokenizer):
    made, stream = collector(tokenizer, keepalive=0.1)
    pieces = made.pieces()
    first = await anext(pieces)
    assert first.keepalive and not first.token_ids
    stream.deliver(delta(0, 101))
    assert (await anext(pieces)).token_ids == [101]
    await asyncio.sleep(0)
