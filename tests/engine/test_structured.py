"""Structured output in the engine: under a grammar, random-weight models (which pick among the
allowed tokens at random) answer with JSON that parses and validates, greedy and sampled, with
images; the mask allows exactly the tokens the grammar accepts; a request taken over mid-answer
rebuilds its grammar from the tokens it emitted and goes on as if it had not moved; a grammar is
compiled once however many requests use it."""

from __future__ import annotations

import json

import pytest
import torch

from common.checkpoints import write_checkpoint
from common.engine import AdmissionError, Engine, EngineConfig
from common.engine.sampling import SamplingParams
from tests.helpers.images import make_image
from tests.helpers.schemas import MAX_TOKENS, SCHEMAS, grammar, valid

# LLaVA's answers go through the stage rigs too (tests/stages/test_structured.py): slow tier here.
PRESETS = ["tiny-qwen2.5-vl", pytest.param("tiny-llava", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=PRESETS)
def engine(request, tmp_path_factory) -> Engine:
    model = write_checkpoint(tmp_path_factory.mktemp("structured") / request.param, request.param, seed=0)
    return Engine(model, EngineConfig())


def answers(engine: Engine, asked: list[tuple[dict, int | None]]) -> list:
    """One answer per (schema, seed) (seed None: greedy), each with an image of its own, in one batch."""
    prompt = engine.chat_prompt("Extract the fields as JSON", 1)
    reqs = []
    for i, (schema, seed) in enumerate(asked):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            grammar=grammar(schema),
            temperature=0.0 if seed is None else 1.0,
            seed=seed,
        )
        reqs.append(engine.add_request(prompt, [make_image(i % 3)], params))
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_every_answer_parses_and_validates(engine):
    """Each of the ten schemas greedy and sampled, side by side in one batch."""
    asked = [(schema, seed) for schema in SCHEMAS.values() for seed in (None, 1)]
    for (schema, _), req in zip(asked, answers(engine, asked), strict=True):
        assert req.finish_reason == "stop", (schema, req.finish_reason)
        valid(schema, json.loads(engine.tokenizer.decode(req.output_token_ids)))


def test_the_mask_is_the_matchers_bitmask_and_allows_only_what_the_grammar_accepts(engine):
    """Token by token over the whole vocabulary, at the start and mid-answer: the mask is bit t of
    the matcher's bitmask (32-bit little-endian words), every token it allows the grammar accepts,
    and masked logits leave only those finite."""
    width = engine.model.config.text_config.vocab_size
    state = engine.grammars.state(grammar(SCHEMAS["invoice"]))
    for step in range(8):
        allowed = state.allowed(width)
        words = state.matcher.compute_bitmask()
        bits = [bool(words[t // 8] >> (t % 8) & 1) if t // 8 < len(words) else False for t in range(width)]
        assert allowed.tolist() == bits, step
        assert allowed.any(), step
        for token in allowed.nonzero().flatten().tolist():
            assert state.matcher.deep_copy().try_consume_tokens([token]) == 1, (step, token)
        row = torch.randn(width)
        state.mask(row)
        assert torch.isinf(row[~allowed]).all() and torch.isfinite(row[allowed]).all()
        state.advance(int(row.argmax()))


def test_a_request_taken_over_mid_answer_goes_on_as_if_it_had_not_moved(engine):
    """What a decoder does after prefill's first token, or a replay after a decoder died: the
    request is admitted with the tokens emitted so far and its grammar rebuilt from them."""
    schema = SCHEMAS["line_items"]
    (whole,) = answers(engine, [(schema, None)])
    tokens = whole.output_token_ids
    prompt = engine.chat_prompt("Extract the fields as JSON", 1)
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=grammar(schema))
    for cut in (1, len(tokens) - 1):
        again = engine.add_request(prompt, [make_image(0)], params, output_token_ids=tokens[:cut])
        while engine.has_unfinished():
            engine.step()
        assert again.output_token_ids == tokens and again.finish_reason == "stop", cut


def test_tokens_outside_the_grammar_are_refused_at_admission(engine):
    prompt = engine.chat_prompt("Extract", 0)
    outside = engine.tokenizer.encode("hello", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, grammar=grammar(SCHEMAS["person"]))
    with pytest.raises(AdmissionError, match="do not fit"):
        engine.add_request(prompt, [], params, output_token_ids=outside)


def test_a_grammar_is_compiled_once_and_the_cache_is_bounded(engine):
    grammars = engine.grammars
    schema = {**SCHEMAS["label"], "title": "compiled once"}
    before = grammars.compiles
    prompt = engine.chat_prompt("Extract", 0)
    for seed in range(4):  # admitted, each with its own state, then dropped unrun
        params = SamplingParams(max_tokens=8, grammar=grammar(schema), temperature=1.0, seed=seed)
        req = engine.add_request(prompt, [], params)
        assert req.grammar is not None and not req.grammar.done
        engine.abort(req.request_id)
    assert grammars.compiles - before == 1
    capacity, grammars.capacity = grammars.capacity, 2
    try:
        before = grammars.compiles
        for n in range(3):  # three schemas not seen before
            grammars.state(grammar({**SCHEMAS["person"], "title": f"variant {n}"}))
        assert grammars.compiles - before == 3 and len(grammars._compiled) == 2
    finally:
        grammars.capacity = capacity


def test_the_mask_holds_over_the_sampling_fields_and_logprobs_stay_raw(engine):
    """The grammar masks each row after the processors (logits.py): n seeded choices, with a bias
    of +100 on a token the grammar forbids, penalties and min_p, each validate. Their logprobs are
    the raw distribution's: the first token's most likely are an unconstrained request's."""
    schema = SCHEMAS["invoice"]
    prompt, image = engine.chat_prompt("Extract the fields as JSON", 1), [make_image(0)]
    forbidden = engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    params = SamplingParams(
        max_tokens=MAX_TOKENS, grammar=grammar(schema), temperature=1.0, seed=5, n=3, logprobs=3,
        logit_bias=((forbidden, 100.0),), repetition_penalty=1.3, presence_penalty=0.5, min_p=0.05,
    )  # fmt: skip
    choices = engine.generate([prompt], [image], params)
    (plain,) = engine.generate([prompt], [image], SamplingParams(max_tokens=1, logprobs=3))
    assert len(choices) == 3
    for choice in choices:
        assert choice.finish_reason == "stop" and forbidden not in choice.token_ids
        valid(schema, json.loads(engine.tokenizer.decode(choice.token_ids)))
        first, want = choice.logprobs[0].top, plain.logprobs[0].top
        assert [t for t, _ in first] == [t for t, _ in want]
        assert [v for _, v in first] == pytest.approx([v for _, v in want], abs=1e-4)


def test_a_grammar_that_allows_only_the_end_outranks_min_tokens(engine):
    """min_tokens masks eos; once the grammar allows nothing but the end, the grammar wins: the
    answer ends there, whole and valid, short of min_tokens (not a row with no token left)."""
    schema = SCHEMAS["label"]
    prompt = engine.chat_prompt("Label the picture", 1)
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=grammar(schema), min_tokens=MAX_TOKENS)
    (done,) = engine.generate([prompt], [[make_image(1)]], params)
    assert done.finish_reason == "stop" and len(done.token_ids) < MAX_TOKENS
    valid(schema, json.loads(engine.tokenizer.decode(done.token_ids)))
