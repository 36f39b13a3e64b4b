"""Weights packed for decode-sized products (common/engine/packed.py): the packed product is the
plain one to float32 rounding, the swap keeps the model's parameters (tied embeddings included),
and an engine packs exactly where it pays — a CPU, float32, an instance that decodes. HF parity
with packing on is tests/engine/test_parity*.py (the default engine packs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.engine.config import EngineConfig
from common.engine.packed import PACKED_ROWS, PackedLinear, pack_projections, packing_available
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import engines
from tests.helpers.images import make_image

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no MKL packed GEMM")


@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_product_is_the_plain_one(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    with torch.no_grad():
        for rows in (1, 2, 7, PACKED_ROWS, PACKED_ROWS + 1, 200):
            x = torch.randn(rows, 96)
            want = F.linear(x, linear.weight, linear.bias)
            got = packed(x)
            assert got.shape == want.shape
            if rows == 1 or rows > PACKED_ROWS:  # the plain kernel itself
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randn(3, 5, 96)  # leading dimensions fold into rows, as F.linear's do
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_only_a_float32_cpu_linear_is_packed():
    linear = nn.Linear(8, 8).to(torch.float64)
    with pytest.raises(ValueError, match="float32 CPU"):
        PackedLinear(linear)


def test_packing_swaps_every_projection_and_keeps_the_parameters(tiny_model_dir):
    with engines(tiny_model_dir) as build:
        engine = build(packed_weights="off")
        lm = engine.model.language_model
        names = dict(lm.named_parameters(remove_duplicate=False))
        tied = lm.lm_head.weight is lm.embed_tokens.weight
        linears = [m for m in lm.modules() if type(m) is nn.Linear]
        added = pack_projections(lm)
        assert added == sum(m.weight.numel() * 4 for m in linears)
        assert not any(type(m) is nn.Linear for m in lm.modules())
        assert isinstance(lm.layers[0].mlp.down_proj, PackedLinear) and isinstance(lm.lm_head, PackedLinear)
        after = dict(lm.named_parameters(remove_duplicate=False))
        assert after.keys() == names.keys() and all(after[k] is names[k] for k in names)
        assert (lm.lm_head.weight is lm.embed_tokens.weight) == tied


@pytest.mark.parametrize(
    ("overrides", "packs"),
    [
        ({}, True),  # the default: a CPU, float32, every role
        ({"roles": frozenset({Role.DECODE})}, True),
        ({"roles": frozenset({Role.PREFILL})}, False),  # prefill's products are hundreds of rows
        ({"roles": frozenset({Role.ENCODE, Role.PREFILL})}, False),
        ({"packed_weights": "off"}, False),
        ({"dtype": "bfloat16"}, False),  # MKL's packed GEMM is float32's
    ],
)
def test_an_engine_packs_where_it_decodes_in_float32(tiny_model_dir, overrides, packs):
    with engines(tiny_model_dir) as build:
        engine = build(**overrides)
        head = engine.model.language_model.lm_head
        assert isinstance(head, PackedLinear) == packs
        assert (engine.packed_bytes > 0) == packs


def test_an_engine_without_mkl_runs_unpacked(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("common.engine.build.packing_available", lambda: False)
    with engines(tiny_model_dir) as build:
        engine = build()
        assert engine.packed_bytes == 0 and type(engine.model.language_model.lm_head) is nn.Linear


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="packed_weights must be one of auto, off"):
        EngineConfig(packed_weights="on")


def test_packed_and_unpacked_engines_answer_alike(tiny_model_dir):
    """Eight requests decoding together (products of 2-8 rows), with images and different lengths."""
    with engines(tiny_model_dir) as build:
        answers = []
        for mode in ("auto", "off"):
            engine = build(packed_weights=mode, prefix_caching=False)
            prompts = [engine.chat_prompt(f"Question {i}: what is here?", i % 2) for i in range(8)]
            images = [[make_image(i)] * (i % 2) for i in range(8)]
            params = SamplingParams(max_tokens=16, ignore_eos=True)
            answers.append([c.token_ids for c in engine.generate(prompts, images, params)])
        assert answers[0] == answers[1]
