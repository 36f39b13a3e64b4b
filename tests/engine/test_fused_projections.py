"""Stacked projections (models/llama.py `fuse_projections`, what the loader does on a GPU): every
family's checkpoint, fused in place on the CPU, gives the tokens it gave unfused — the stacked
products compute the same dot products — through prefill, chunking and padded decode steps."""

from __future__ import annotations

import pytest

from common.checkpoints import write_checkpoint
from common.engine.sampling import SamplingParams
from tests.helpers.engine import engines
from tests.helpers.images import make_image

PRESETS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


@pytest.fixture(scope="module", params=PRESETS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fused") / request.param, request.param, seed=0)


@pytest.mark.parametrize("decode_graphs", ["off", "eager"])
def test_fused_projections_give_the_unfused_tokens(model_dir, decode_graphs):
    with engines(model_dir) as build:
        # No prefix cache: the second pass computes every token again. Chunks cut through images.
        engine = build(token_budget=48, decode_graphs=decode_graphs, prefix_caching=False)
        lm = engine.model.language_model
        assert hasattr(lm.layers[0].self_attn, "q_proj"), "a CPU engine keeps the projections apart"
        prompts = [engine.chat_prompt(f"Question {i}: what do you see?", i % 3) for i in range(6)]
        images = [[make_image(5 * i + k) for k in range(i % 3)] for i in range(6)]
        params = SamplingParams(max_tokens=12)
        apart = [c.token_ids for c in engine.generate(prompts, images, params)]
        lm.fuse_projections()
        attn, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
        assert attn.qkv_proj.weight.shape[0] == (attn.heads + 2 * attn.kv_heads) * attn.head_dim
        assert [c.token_ids for c in engine.generate(prompts, images, params)] == apart
