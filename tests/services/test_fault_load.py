"""The fault benchmark's load (trident/bench/fault_load.py) against a real deployment: with no
fault every request ends identical to HF `generate`'s answer, a wrong answer is told apart, and a
request the server refuses ends as an error with the server's message."""

from __future__ import annotations

import time

import pytest

from trident.bench.client import image_data_url
from trident.bench.fault_load import StreamingLoad
from trident.bench.oracle import Chat, hf_greedy

TOKENS = 24
CHATS = [Chat("Tell me a story."), Chat("What is in the picture?", (image_data_url(3, (96, 72)),))]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return hf_greedy(tiny_model_dir, CHATS, TOKENS)


def run(load: StreamingLoad, least: int = 4):
    """Load until at least `least` requests have been sent, then let them end."""
    load.start()
    deadline = time.monotonic() + 60
    while len(load.outcomes) < least and time.monotonic() < deadline:
        time.sleep(0.05)
    return load.stop()


def test_answers_without_a_fault_are_identical_to_hf(epd, expected):
    outcomes = run(StreamingLoad(epd.url, "tiny-llava", CHATS, expected, TOKENS, streams=2, deadline=30))
    assert len(outcomes) >= 4
    assert {o.status for o in outcomes} == {"identical"}, [(o.status, o.error) for o in outcomes]
    assert {o.chat for o in outcomes} == {0, 1}
    assert all(o.accepted and o.attempts == 1 and 0 < o.stall < 30 for o in outcomes)


def test_a_different_answer_is_told_apart(epd, expected):
    wrong = [expected[0] + " and more", expected[1]]
    outcomes = run(StreamingLoad(epd.url, "tiny-llava", CHATS, wrong, TOKENS, streams=1, deadline=30))
    assert {o.status for o in outcomes if o.chat == 0} == {"different"}
    assert {o.status for o in outcomes if o.chat == 1} == {"identical"}


def test_a_refused_request_ends_as_an_error_with_its_message(epd, expected):
    load = StreamingLoad(epd.url, "no-such-model", CHATS, expected, TOKENS, streams=1, deadline=30)
    outcomes = run(load, least=2)
    assert {o.status for o in outcomes} == {"error"}
    assert all(o.error.startswith("404: ") and "no-such-model" in o.error for o in outcomes)
    assert not any(o.accepted for o in outcomes)
