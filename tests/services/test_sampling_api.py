"""The sampling fields through a real deployment of each method, with the official openai client: n
seeded choices with logprobs are the same tokens under every method — one engine's, run alone —
streamed under their index; usage counts every choice; what stays refused says why."""

from __future__ import annotations

import functools

import openai
import pytest

from common.engine import Engine, EngineConfig
from common.protocol import SamplingParams
from tests.helpers.chat import client_for, user_message

QUESTION = "Tell me a story about the sea"
ASKED = dict(max_tokens=12, n=3, temperature=1.0, top_p=0.95, seed=21, logprobs=True, top_logprobs=2)
FIELDS = dict(presence_penalty=0.6, frequency_penalty=0.3, logit_bias={"9": -100, "40": 3})
EXTRA = dict(repetition_penalty=1.2, min_p=0.05, min_tokens=4)


@functools.cache
def expected(model_dir) -> tuple[list[str], list[list[float]]]:
    """One engine's answer alone: each choice's text and its tokens' log-probabilities."""
    engine = Engine(model_dir, EngineConfig())
    params = SamplingParams(
        max_tokens=12, n=3, temperature=1.0, top_p=0.95, seed=21, logprobs=2, presence_penalty=0.6,
        frequency_penalty=0.3, logit_bias=((9, -100.0), (40, 3.0)), repetition_penalty=1.2, min_p=0.05,
        min_tokens=4,
    )  # fmt: skip
    choices = engine.generate([engine.chat_prompt(QUESTION, 0)], params=params)
    texts = [engine.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in choices]
    return texts, [[lp.logprob for lp in c.logprobs] for c in choices]


def test_n_seeded_choices_with_every_field_are_the_same_under_every_method(cluster, tiny_model_dir):
    texts, logprobs = expected(tiny_model_dir)
    client = client_for(cluster)
    messages = user_message([], QUESTION)
    reply = client.chat.completions.create(
        model="tiny-llava", messages=messages, **ASKED, **FIELDS, extra_body=EXTRA
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == texts
    for choice, want in zip(reply.choices, logprobs, strict=True):
        got = [t.logprob for t in choice.logprobs.content]
        assert got == pytest.approx(want, abs=1e-4)
        assert all(len(t.top_logprobs) == 2 and bytes(t.bytes).decode(errors="replace") == t.token
                   for t in choice.logprobs.content)  # fmt: skip
    assert reply.usage.completion_tokens == sum(len(lp) for lp in logprobs)

    stream = client.chat.completions.create(
        model="tiny-llava", messages=messages, **ASKED, **FIELDS, extra_body=EXTRA, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    streamed, ended, usage = {}, [], None
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                ended.append(c.index)
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts and sorted(ended) == [0, 1, 2]
    assert usage.completion_tokens == reply.usage.completion_tokens


def test_completions_logprobs_and_what_stays_refused(cluster):
    client = client_for(cluster)
    reply = client.completions.create(
        model="tiny-llava", prompt="The boat", max_tokens=5, logprobs=3, n=2, temperature=0
    )
    first, second = reply.choices
    assert first.text == second.text  # greedy: the choices agree (their logprobs to float error)
    assert first.logprobs.token_logprobs == pytest.approx(second.logprobs.token_logprobs, abs=1e-4)
    assert len(first.logprobs.tokens) == 5 and first.logprobs.text_offset[0] == 0
    assert all(1 <= len(top) <= 3 for top in first.logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-llava", prompt="x", max_tokens=2, extra_body={"best_of": 2})
    error = caught.value.body.get("error", caught.value.body)
    assert error["param"] == "best_of" and "before the first token" in error["message"]
