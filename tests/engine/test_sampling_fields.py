"""The sampling fields vLLM offers, through the engine, against HF transformers' `generate` on the
same float32 checkpoints: neutral values change no greedy answer; logprobs are HF's log-softmax of
its logits (the first token's, made by the prefill, included); penalties, logit_bias and
min_tokens give HF's greedy answer under its own processors; n choices are prefilled once."""

from __future__ import annotations

import pytest
import torch

from common.checkpoints import write_checkpoint
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling import SamplingParams
from common.protocol.sampling import choice_seed
from services.gateway.api_models import ChatCompletionRequest
from tests.helpers.engine import QUESTIONS, check_mixed_batch, hf_inputs, until_eos
from tests.helpers.images import make_image

PRESETS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
TOLERANCE = 1e-4  # nats: both run float32 on the CPU, only summation order differs
NEUTRAL_BODY = {
    "model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0, "n": 1,
    "logprobs": False, "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "seed": 5,
}  # fmt: skip


@pytest.fixture(scope="module", params=PRESETS)
def family(request, tmp_path_factory):
    return _family(request, tmp_path_factory)


# A family whose prompts place images by index, and one by M-RoPE; each with a question whose greedy
# answer the penalties change (random weights: under most questions a repetition penalty above 1
# changes nothing in 12 tokens, and the test would not show that it is applied as HF applies it).
PENALISED = {
    "tiny-llava": "Tell me a long story about a boat",
    "tiny-qwen2.5-vl": "Say it again: the boat, the boat",
}


@pytest.fixture(scope="module", params=sorted(PENALISED))
def two_families(request, tmp_path_factory):
    return (*_family(request, tmp_path_factory), PENALISED[request.param])


def _family(request, tmp_path_factory) -> tuple[Engine, object]:
    """A tiny checkpoint of a family: our engine on it (shared by the module's tests of the family,
    checked whole after them) and HF's own model."""
    from transformers import AutoModelForImageTextToText

    model_dir = write_checkpoint(tmp_path_factory.mktemp("fields") / request.param, request.param, seed=0)
    engine = Engine(model_dir, EngineConfig())
    request.addfinalizer(engine.check_integrity)
    return engine, AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def hf_run(engine: Engine, model, prompt: str, images: list, max_tokens: int, **generate) -> tuple:
    """HF's greedy ids (cut after the first eos, as ours stop) and the logits of each step."""
    processed = engine.processor.process(prompt, images)
    ids = torch.as_tensor([processed.token_ids])
    with torch.no_grad():
        out = model.generate(
            **hf_inputs(processed, engine.processor.image_token_id, ids), max_new_tokens=max_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True, **generate,
        )  # fmt: skip
    new = until_eos(model, out.sequences[0, ids.shape[1] :].tolist())
    return new, [step[0] for step in out.logits[: len(new)]]


def test_neutral_values_keep_every_greedy_answer_hfs(make_engine, hf_generate, images, monkeypatch):
    """Eight mixed requests, each with every new field sent at its neutral value, as a client sends
    them to the gateway, and read as the gateway reads them."""
    engine = make_engine()
    original = engine.add_request

    def neutral(prompt, imgs, params):
        body = ChatCompletionRequest.model_validate({**NEUTRAL_BODY, "max_tokens": params.max_tokens})
        made = body.sampling_params(16, vocab_size=engine.model.config.text_config.vocab_size)
        assert made.logprobs is None and not made.logit_bias and made.n == 1
        return original(prompt, imgs, made)

    monkeypatch.setattr(engine, "add_request", neutral)
    check_mixed_batch(engine, hf_generate, QUESTIONS, images, stride=2)


@pytest.mark.parametrize("num_images", [1])
def test_logprobs_are_hfs_log_softmax_and_leave_the_answer_as_it_is(family, num_images):
    engine, model = family
    prompt = engine.chat_prompt("Tell me a long story about a boat", num_images)
    images = [make_image(i, (96, 72)) for i in range(num_images)]
    plain, asked = (
        engine.generate([prompt], [images], SamplingParams(max_tokens=10, logprobs=k))[0] for k in (None, 5)
    )
    want, logits = hf_run(engine, model, prompt, images, 10)
    assert plain.token_ids == asked.token_ids == want and not plain.logprobs
    assert len(asked.logprobs) == len(want)
    for pos, (token, lp, row) in enumerate(zip(want, asked.logprobs, logits, strict=True)):
        theirs = row.float().log_softmax(-1)
        top = theirs.topk(5)
        assert abs(lp.logprob - theirs[token].item()) < TOLERANCE, f"position {pos}"
        assert [t for t, _ in lp.top] == top.indices.tolist(), f"position {pos}"
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=TOLERANCE)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"repetition_penalty": 0.3}, {"repetition_penalty": 0.3}),
        ({"logit_bias": "leader"}, {"sequence_bias": "leader"}),
        ({"min_tokens": 6, "logit_bias": "eos"}, {"min_new_tokens": 6, "sequence_bias": "eos"}),
        (
            {"repetition_penalty": 1.3, "min_tokens": 3, "logit_bias": "eos"},
            {"repetition_penalty": 1.3, "min_new_tokens": 3, "sequence_bias": "eos"},
        ),
    ],
    ids=["repetition", "repetition-below-1", "logit-bias", "min-tokens", "together"],
)
def test_greedy_under_penalties_bias_and_min_tokens_is_hfs(two_families, ours, theirs):
    """Each field against the transformers processor `generate` applies for it. "eos": eos's logit
    raised by 100, so that only min_tokens keeps the answer going; "leader": the answer's own
    second token lowered by 100 and another raised, so the bias changes the answer."""
    engine, model, question = two_families
    prompt = engine.chat_prompt(question, 1)
    images = [make_image(3, (96, 72))]
    free = engine.generate([prompt], [images], SamplingParams(max_tokens=12))[0].token_ids
    eos = next(iter(sorted(engine.eos_ids)))
    vocab = engine.model.config.text_config.vocab_size
    bias = {"eos": ((eos, 100.0),), "leader": ((free[1], -100.0), ((free[0] + 1) % vocab, 5.0))}
    params = {k: bias[v] if k == "logit_bias" else v for k, v in ours.items()}
    generate = {k: [[[t], b] for t, b in bias[v]] if k == "sequence_bias" else v for k, v in theirs.items()}
    got = engine.generate([prompt], [images], SamplingParams(max_tokens=12, **params))[0]
    want, _ = hf_run(engine, model, prompt, images, 12, **generate)
    assert got.token_ids == want
    assert got.token_ids != free  # the field changed the answer: the comparison says something


def test_n_choices_are_prefilled_once_and_each_draws_as_alone(make_engine):
    """n = 3: one prefill of the prompt; choice i answers as a request of its own seeded with
    choice_seed(seed, i); their blocks are shared while they run and all free after."""
    engine = make_engine()
    prompt = engine.chat_prompt("Tell me a long story about a boat", 1)
    image = [make_image(1)]
    computed = []
    engine.on_step = lambda batch, _: computed.append(batch.prefill_tokens)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, n=3, logprobs=2)
    shared = []
    step = engine.step

    def watching():
        out = step()
        tables = [engine.blocks.table(rid) for rid in engine.requests]
        if len(tables) == 3:
            shared.append(len(set(tables[0]) & set(tables[1]) & set(tables[2])))
        return out

    engine.step = watching
    choices = engine.generate([prompt], [image], params)
    prompt_len = choices[0].num_prompt_tokens
    assert sum(computed) == prompt_len  # the prompt computed once
    assert shared and shared[0] == prompt_len // engine.config.block_size  # its full blocks, shared
    engine.on_step, engine.step = None, step
    alone = [
        engine.generate([prompt], [image], params.model_copy(update={"n": 1, "seed": choice_seed(7, i)}))[0]
        for i in range(3)
    ]
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in choices}) == 3
    for ours, theirs in zip(choices, alone, strict=True):
        assert [lp.logprob for lp in ours.logprobs] == pytest.approx(
            [lp.logprob for lp in theirs.logprobs], abs=1e-4
        )
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_choices_without_a_free_block_prefill_from_the_prefix_cache(tiny_model_dir, make_engine):
    """A KV cache of two blocks: the choices find no block for the prompt's partial last block when
    the request forks, so each waits and prefills later, over the prefix cache; same answers."""
    probe = make_engine()
    prompt = probe.chat_prompt("Hi", 0)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    want = probe.generate([prompt], params=params)
    bytes_per_block = probe.kv_spec.bytes_per_block
    assert want[0].num_prompt_tokens + 6 <= 2 * probe.config.block_size
    engine = make_engine(kv_cache_bytes=2 * bytes_per_block)
    assert engine.blocks.num_blocks == 2
    got = engine.generate([prompt], params=params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.blocks.hit_tokens >= 2 * engine.config.block_size  # both copies found the full block
