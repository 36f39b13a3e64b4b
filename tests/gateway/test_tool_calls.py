"""An answer read for tool calls: whole, and streamed in any split of its text, to the same content,
names and arguments; text before a call is content, a call that does not parse stays text."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from services.gateway.tool_calls import CallStream, parse

TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 2}}}\n'
    '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
)


def streamed(text: str, cuts: list[int]) -> tuple[str | None, list[dict]]:
    """The answer fed in pieces cut at `cuts`, its deltas folded back as a client folds them."""
    stream, deltas, at = CallStream(), [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.flush()
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in part:
                assert call["id"] is None, "a call's id and name come once, first"
                call["id"], call["name"] = part["id"], part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    folded = [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())]
    return content or None, folded


def plain(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def test_a_whole_answer_is_its_content_and_calls():
    content, calls = parse(TWO_CALLS)
    assert content == "Let me look."
    assert plain(calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": {"n": 2}}'},
        {"name": "noop", "arguments": "{}"},
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": {"n": 2}}


def test_text_without_a_call_that_parses_is_all_content():
    not_a_call = 'a <tool_call>\n{"name": 3}\n</tool_call>'
    cut_off = '<tool_call>\n{"name": "f", "arguments": {"x": 1'  # max_tokens ended it mid-call
    for text in ("just words", not_a_call, cut_off):
        assert parse(text) == (text, [])
    assert streamed("just words", [3, 7]) == ("just words", [])
    assert streamed(not_a_call, [3, 7]) == ("a", [])  # its tag was taken for a call's, then dropped
    # Streamed, a call's head and fragments go out as they come: a cut-off call was already sent.
    assert streamed(cut_off, [3, 7]) == (None, [{"name": "f", "arguments": '{"x": 1'}])


@given(st.lists(st.integers(0, len(TWO_CALLS)), max_size=40))
def test_any_split_of_the_stream_folds_back_to_the_whole_answer(cuts):
    content, calls = parse(TWO_CALLS)
    assert streamed(TWO_CALLS, cuts) == (content, plain(calls))


@given(st.lists(st.integers(0, 60), max_size=20))
def test_a_streamed_call_alone_and_plain_text_alone(cuts):
    only_call = '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n</tool_call>'
    assert streamed(only_call, cuts) == (None, [{"name": "f", "arguments": '{"a": [1, {"b": "}"}]}'}])
    words = "no call here, only < and </tool and text"
    assert streamed(words, cuts) == (words, [])
