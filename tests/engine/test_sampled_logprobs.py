"""Sampled output, for every family: at each of the first 8 sampled positions our top-5
log-probabilities (and which tokens hold them) are HF's, computed by HF's own model over the same
prompt, images and the tokens we sampled (teacher-forced). Greedy parity cannot see a difference
in the distribution below the top token; this can."""

from __future__ import annotations

import pytest
import torch

from common.checkpoints import write_checkpoint
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling import SamplingParams
from tests.helpers.engine import hf_inputs
from tests.helpers.images import make_image

PRESETS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
POSITIONS, TOP = 8, 5
TOLERANCE = 1e-4  # nats; both run float32 on the CPU, so only summation order differs


@pytest.fixture(scope="module", params=PRESETS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lp") / request.param, request.param, seed=0)


@pytest.mark.parametrize("num_images", [0, 1])
def test_top_logprobs_of_sampled_positions_match_hf(model_dir, num_images):
    from transformers import AutoModelForImageTextToText

    engine = Engine(model_dir, EngineConfig())
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(batch):
        result = run(batch)
        if result.logits is not None:
            seen.extend(result.logits.log_softmax(-1))
        return result

    engine.runner.run = recording
    images = [make_image(i, (96, 72)) for i in range(num_images)]
    prompt = engine.chat_prompt("Tell me a long story about a boat", num_images)
    params = SamplingParams(max_tokens=POSITIONS, temperature=1.0, seed=11, ignore_eos=True)
    (done,) = engine.generate([prompt], [images], params)
    assert len(done.token_ids) == POSITIONS and len(seen) == POSITIONS

    processed = engine.processor.process(prompt, images)
    ids = torch.as_tensor([processed.token_ids + done.token_ids])
    hf = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = hf(**hf_inputs(processed, engine.processor.image_token_id, ids)).logits[0]
    theirs = logits[len(processed.token_ids) - 1 : -1].float().log_softmax(-1)
    for pos, (ours, want) in enumerate(zip(seen, theirs, strict=True)):
        top = want.topk(TOP)
        assert ours.topk(TOP).indices.tolist() == top.indices.tolist(), f"position {pos}"
        assert torch.allclose(ours[top.indices], top.values, atol=TOLERANCE), f"position {pos}"
