"""The logits processors and min_p against transformers' own processors on the same logits (and
presence/frequency against OpenAI's definition, which transformers does not implement)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from common.engine.logits import RequestSampler
from common.engine.sampling import warp
from common.protocol import SamplingParams

VOCAB = 300
EOS = frozenset({7, 11})


class History:
    """A request's tokens as a processor reads them."""

    def __init__(self, prompt: list[int], outputs: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids = prompt, outputs


def processed(params: SamplingParams, logits: torch.Tensor, history: History) -> torch.Tensor:
    row = logits.clone()
    RequestSampler.build(params, EOS).process(row, history)
    return row


def case(seed: int) -> tuple[torch.Tensor, History]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 4
    prompt = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    outputs = torch.randint(0, VOCAB, (25,), generator=gen).tolist()
    return logits, History(prompt, outputs)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty, seed):
    logits, history = case(seed)
    ids = torch.as_tensor([history.prompt_token_ids + history.output_token_ids])
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[None].clone())[0]
    ours = processed(SamplingParams(repetition_penalty=penalty), logits, history)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("frequency", "presence"), [(0.5, 0.0), (0.0, 1.5), (-0.7, 0.3), (2.0, -2.0)])
def test_presence_and_frequency_are_openais_over_the_output_alone(frequency, presence):
    logits, history = case(4)
    counts = Counter(history.output_token_ids)
    want = logits.clone()
    for token, count in counts.items():  # OpenAI: mu[j] -= c[j] * frequency + float(c[j] > 0) * presence
        want[token] -= count * frequency + presence
    ours = processed(SamplingParams(frequency_penalty=frequency, presence_penalty=presence), logits, history)
    assert torch.allclose(ours, want, atol=1e-6)
    prompt_only = [t for t in history.prompt_token_ids if t not in counts]
    assert prompt_only and torch.equal(ours[prompt_only], logits[prompt_only])  # the prompt is not counted


def test_penalties_follow_tokens_added_after_the_first_call_and_rebuild_from_a_history():
    """State is a cache of the request's tokens: a processor made for a resumed request (its tokens
    so far given at once) applies exactly what one that saw them one by one does."""
    logits, history = case(5)
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.2)
    stepwise = RequestSampler.build(params, EOS)
    grown = History(history.prompt_token_ids, [])
    for token in history.output_token_ids:
        stepwise.process(logits.clone(), grown)
        grown.output_token_ids.append(token)
    row = logits.clone()
    stepwise.process(row, grown)
    assert torch.equal(row, processed(params, logits, history))


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens():
    logits, history = case(6)
    bias = ((3, 100.0), (17, -100.0), (250, 2.5), (VOCAB + 5, 1.0))  # an id past the row is ignored
    theirs = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias[:3]])
    want = theirs(torch.as_tensor([history.prompt_token_ids]), logits[None].clone())[0]
    assert torch.allclose(processed(SamplingParams(logit_bias=bias), logits, history), want)


@pytest.mark.parametrize("min_tokens", [1, 25, 26])
def test_min_tokens_masks_eos_and_stop_ids_until_reached_as_transformers(min_tokens):
    logits, history = case(7)  # 25 outputs so far
    ids = torch.as_tensor([history.prompt_token_ids + history.output_token_ids])
    prompt = len(history.prompt_token_ids)
    theirs = MinNewTokensLengthLogitsProcessor(prompt, min_tokens, [*EOS, 42])(ids, logits[None].clone())[0]
    params = SamplingParams(min_tokens=min_tokens, max_tokens=64, stop_token_ids=(42,))
    assert torch.equal(processed(params, logits, history), theirs)
    ignoring = processed(params.model_copy(update={"ignore_eos": True}), logits, history)
    assert torch.isfinite(ignoring[sorted(EOS)]).all()  # eos is no ender when ignored


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature):
    logits, _ = case(8)
    scaled = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    theirs = MinPLogitsWarper(min_p)(None, scaled)[0]
    ours = warp(logits, SamplingParams(temperature=temperature, min_p=min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = torch.isfinite(theirs)
    assert torch.allclose(ours[kept].softmax(-1), theirs[kept].double().softmax(-1), atol=1e-6)


def test_neutral_values_make_no_processor():
    neutral = SamplingParams(
        logit_bias=(), repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
        min_p=0.0, logprobs=None, n=1,
    )  # fmt: skip
    assert RequestSampler.build(neutral, EOS).processors == []
