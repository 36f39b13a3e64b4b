"""The sampling fields vLLM offers, as the gateway reads them: each reaches the engine's
SamplingParams; what stays refused says why."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.errors import APIError, explain
from services.gateway.api_models import ChatCompletionRequest, CompletionRequest


def chat(**kw):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}
    )


def test_every_field_reaches_the_engine():
    body = chat(
        n=3, logprobs=True, top_logprobs=5, logit_bias={"7": -100, "12": 2.5}, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.3, min_p=0.1, min_tokens=4, seed=9, max_tokens=20,
    )  # fmt: skip
    p = body.sampling_params(16, vocab_size=1024)
    assert (p.n, p.logprobs, p.logit_bias) == (3, 5, ((7, -100.0), (12, 2.5)))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert (p.min_p, p.min_tokens, p.seed, p.max_tokens) == (0.1, 4, 9, 20)
    assert chat(logprobs=True).sampling_params(16).logprobs == 0  # the chosen token's alone
    assert chat(logprobs=False, top_logprobs=0).sampling_params(16).logprobs is None
    text = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 3})
    assert text.sampling_params(16).logprobs == 3


def test_a_logit_bias_id_past_the_vocabulary_and_min_tokens_past_max_tokens_are_refused():
    with pytest.raises(APIError) as caught:
        chat(logit_bias={"1024": 1}).sampling_params(16, vocab_size=1024)
    assert caught.value.param == "logit_bias" and "[0, 1024)" in caught.value.message
    with pytest.raises(APIError) as caught:
        chat(min_tokens=17).sampling_params(16)
    assert caught.value.param == "min_tokens" and "max_tokens (16)" in caught.value.message


@pytest.mark.parametrize(
    ("change", "param", "why"),
    [
        ({"best_of": 2}, "best_of", "must generate all of them before the first token"),
        ({"use_beam_search": True}, "use_beam_search", "token by token"),
        ({"length_penalty": 2.0}, "length_penalty", "applies to beam search"),
    ],
)
def test_what_stays_refused_says_why(change, param, why):
    with pytest.raises(ValidationError) as caught:
        chat(**change)
    error = explain(caught.value.errors())
    assert error.param == param and why in error.message
