"""Seeded sampling and stop conditions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.engine.processor import InputError
from common.engine.sampling import SamplingParams, make_generator, sample


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1)
    a = [sample(logits, [p] * 3, [make_generator(7 + i) for i in range(3)]) for _ in range(2)]
    assert a[0] == a[1]
    draws = {tuple(sample(logits, [p] * 3, [make_generator(s)] * 3)) for s in range(20)}
    assert len(draws) > 1


def test_a_seeded_draw_depends_on_the_seed_and_the_token_index_alone():
    """Instances that sample one request in turn (prefill the first token, decode the rest) draw
    what one instance would: the generator for token i is made from (seed, i), not carried along."""
    logits = torch.zeros(1, 1000)  # uniform: any token can come
    p = SamplingParams(temperature=1.0, seed=3)

    def draw(seed, index):
        return sample(logits, [p], [make_generator(seed, index)])[0]

    assert [draw(3, i) for i in range(8)] == [draw(3, i) for i in range(8)]
    assert len({draw(3, i) for i in range(8)}) > 1  # the index matters
    assert [draw(3, i) for i in range(8)] != [draw(4, i) for i in range(8)]  # so does the seed
    assert make_generator(None, 5) is None


def test_top_k_and_top_p_restrict_the_choices():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    for seed in range(30):
        (t,) = sample(logits, [SamplingParams(temperature=2.0, top_k=2)], [make_generator(seed)])
        assert t in (0, 1)
        (t,) = sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [make_generator(seed)])
        assert t == 0  # token 0 alone holds more than half the mass


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.floats(0.0, 2.0, exclude_min=True) | st.sampled_from([5e-324, 1e-300, 1e-30]),
    top_p=st.floats(0.0, 1.0, exclude_min=True) | st.sampled_from([5e-324, 4e-235, 1e-46]),
    top_k=st.integers(0, 2**31 - 1) | st.sampled_from([1, 2]),
    scale=st.sampled_from([1.0, 1e4, 1e30]),
)
def test_any_admitted_parameters_draw_a_token(temperature, top_p, top_k, scale):
    """Every value the API admits draws a token, never a NaN distribution (an error there killed
    the engine thread, and with it every request on the instance); a temperature or top_p near 0
    comes down to the best token."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 3.0 - 1e-3, 1.0]]) * scale
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    (t,) = sample(logits, [p], [make_generator(0)])
    assert 0 <= t < 5
    if temperature < 1e-30 or top_p < 1e-30 or top_k == 1:
        assert t == 1


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [9.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_engine_sampled_output_reproducible_with_seed(make_engine):
    engine = make_engine()
    prompt = engine.chat_prompt("Say something", 0)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=42)
    first, second = engine.generate([prompt, prompt], params=params)
    assert first.token_ids == second.token_ids
    other = engine.generate([prompt], params=SamplingParams(max_tokens=12, temperature=0.8, seed=43))[0]
    assert other.token_ids != first.token_ids


def test_engine_stops_on_stop_string(make_engine):
    engine = make_engine()
    prompt = engine.chat_prompt("Describe", 0)
    free = engine.generate([prompt], params=SamplingParams(max_tokens=20))[0]
    stop = free.text[5:8]
    assert stop.strip(), f"need a visible stop string, got {free.text!r}"
    got = engine.generate([prompt], params=SamplingParams(max_tokens=20, stop=(stop,)))[0]
    assert got.finish_reason == "stop" and got.text == free.text[: free.text.index(stop)]
    assert len(got.token_ids) < len(free.token_ids)


def test_stop_token_ids_and_length(make_engine):
    engine = make_engine()
    prompt = engine.chat_prompt("Describe", 0)
    free = engine.generate([prompt], params=SamplingParams(max_tokens=10))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    got = engine.generate(
        [prompt], params=SamplingParams(max_tokens=10, stop_token_ids=(free.token_ids[3],))
    )[0]
    assert (
        got.finish_reason == "stop"
        and got.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[3]) + 1]
    )


def test_image_that_cannot_be_decoded_is_an_input_error(make_engine):
    engine = make_engine()
    with pytest.raises(InputError, match="cannot decode image"):
        engine.add_request(engine.chat_prompt("x", 1), [b"definitely not an image"])


def test_engine_without_text_detokenises_only_for_stop_strings(make_engine):
    """Services turn text off (the gateway makes it); stop strings must still stop generation."""
    engine = make_engine(detokenize=False)
    prompt = engine.chat_prompt("Describe", 0)
    free = engine.generate([prompt], params=SamplingParams(max_tokens=20))[0]
    assert free.text == "" and len(free.token_ids) == 20
    text = engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = text[5:8]
    got = engine.generate([prompt], params=SamplingParams(max_tokens=20, stop=(stop,)))[0]
    assert got.finish_reason == "stop" and got.text == text[: text.index(stop)]


@settings(max_examples=100, deadline=None)
@given(
    vocab=st.sampled_from([3, 64, 65, 1000, 32064]),
    scale=st.sampled_from([0.01, 1.0, 3.0, 30.0]),
    top_p=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    seed=st.integers(0, 2**16),
)
@example(vocab=32064, scale=30.0, top_p=0.9999999999999998, seed=0)  # the sum rounded past top_p: 256 kept
def test_top_p_among_the_most_likely_keeps_what_a_full_sort_keeps(vocab, scale, top_p, seed):
    """_top_p looks among the k most likely tokens, k growing: the tokens it keeps, and their
    probabilities, are those of the smallest prefix of the whole sorted vocabulary reaching top_p."""
    from common.engine.sampling import _top_p

    probs = torch.softmax(
        torch.randn(vocab, generator=torch.Generator().manual_seed(seed)).double() * scale, -1
    )
    ordered, order = probs.sort(descending=True)
    drop = ordered.cumsum(0) - ordered >= top_p
    drop[0] = False
    want = torch.zeros_like(probs).scatter_(0, order, ordered.masked_fill(drop, 0.0))
    assert torch.equal(_top_p(probs, top_p), want)
