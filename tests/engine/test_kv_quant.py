"""INT8 KV on the prefill→decode wire (common/engine/kv_quant.py): the error bound it states, its
wire size, a decode engine fed unpacked KV against one fed the native buffers."""

from __future__ import annotations

import pytest
import torch

from common.engine import kv_quant
from common.engine.sampling import SamplingParams
from common.protocol import KvGroup, KvLocation
from common.protocol.tensors import int8_kv_nbytes
from common.roles import Role
from tests.helpers.engine import engines
from tests.helpers.images import make_image

SHAPE = (4, 2, 3, 16, 2, 8)  # layers, k|v, blocks, block size, kv heads, head dim


def kv_buffer(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random KV whose scale differs by head and block, with one outlier and one all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=gen) * torch.tensor([1.0, 30.0])[None, None, None, None, :, None]
    x[1, 0, 2, 5, 0, 3] = 500.0
    x[2, 1, 1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_half_a_scale_step(dtype):
    buf = kv_buffer(dtype)
    packed = kv_quant.pack(buf)
    assert packed.dtype == torch.uint8 and packed.numel() == int8_kv_nbytes(SHAPE)
    back = kv_quant.unpack(packed, SHAPE, dtype)
    assert back.dtype == dtype and back.shape == buf.shape
    _, scales = kv_quant.quantize(buf)
    bound = scales[:, :, :, None, :, None] / 2
    # plus the target dtype's rounding of the dequantised value
    bound = bound + buf.float().abs() * torch.finfo(dtype).eps
    assert bool(((back.float() - buf.float()).abs() <= bound * 1.0001).all())
    assert torch.equal(back[2, 1, 1], torch.zeros_like(back[2, 1, 1]))  # a zero block stays zero
    # The outlier coarsens only its own (layer, k|v, block, head): its neighbours keep their step.
    assert scales[1, 0, 2, 0] > 10 * scales[1, 0, 1, 0]


def test_wire_size_is_about_half_of_bfloat16_and_a_quarter_of_float32():
    values = torch.Size(SHAPE).numel()
    assert int8_kv_nbytes(SHAPE) == values + 4 * 4 * 2 * 3 * 2
    seven_b = (4, 2, 33, 16, 32, 128)  # a 4-layer group of llava-1.5-7b, 528 tokens
    assert int8_kv_nbytes(seven_b) / (2 * torch.Size(seven_b).numel()) < 0.51


def test_unpack_refuses_a_buffer_of_the_wrong_size():
    packed = kv_quant.pack(kv_buffer(torch.float32))
    with pytest.raises(ValueError, match="uint8 bytes"):
        kv_quant.unpack(packed[:-4], SHAPE, torch.float32)
    with pytest.raises(ValueError, match="uint8 bytes"):
        kv_quant.unpack(packed.view(torch.int8), SHAPE, torch.float32)


def test_location_references_the_packed_buffers():
    group = KvGroup(layer_start=0, layer_end=4, handle="h", shape=SHAPE)
    kw = {"owner": "p", "address": "a", "groups": (group,), "num_tokens": 40, "block_size": 16}
    (native,) = KvLocation(**kw, dtype="bfloat16").refs()
    (int8,) = KvLocation(**kw, dtype="bfloat16", wire="int8").refs()
    assert (native.shape, native.dtype) == (SHAPE, "bfloat16")
    assert (int8.shape, int8.dtype) == ((int8_kv_nbytes(SHAPE),), "uint8")


def test_decoding_from_int8_kv_stays_close_to_the_native_kv(tiny_model_dir):
    """Eight requests (some with images) prefilled once; two decode engines import the same KV, one
    as exported, one through pack → unpack. Their first decode step's logits differ by what the
    quantisation error makes (bench/kv_int8.py measures it over 100 prompts a family): a small
    fraction of the logits' spread, where a misplaced scale or value would scramble them."""
    with engines(tiny_model_dir) as build:
        prefill = build(roles=frozenset({Role.ENCODE, Role.PREFILL}))
        params = SamplingParams(max_tokens=8)
        reqs = []
        for i in range(8):
            prompt = prefill.chat_prompt(f"Question {i}: what is there?", i % 3)
            reqs.append(prefill.add_request(prompt, [make_image(10 * i + k) for k in range(i % 3)], params))
        while prefill.has_unfinished():
            prefill.step()
        logits = {}
        for wire in ("native", "int8"):
            decoder = build(roles=frozenset({Role.DECODE}))
            for req in reqs:
                kv = prefill.handoff.export_kv(req.request_id, 2)
                if wire == "int8":
                    kv = [kv_quant.unpack(kv_quant.pack(b), tuple(b.shape), b.dtype) for b in kv]
                decoder.handoff.add_prefilled(
                    req.request_id, req.prompt_token_ids, req.output_token_ids, params, kv, req.rope_delta
                )
            with torch.inference_mode():
                logits[wire] = decoder.runner.forward(
                    [], [decoder.requests[r.request_id] for r in reqs]
                ).logits
            for req in reqs:
                decoder.abort(req.request_id)
        for req in reqs:
            prefill.abort(req.request_id)
        spread = float(logits["native"].std())
        diff = (logits["int8"] - logits["native"]).abs()
        assert float(diff.max()) < 0.25 * spread and float(diff.mean()) < 0.02 * spread, (diff.max(), spread)
        agree = (logits["int8"].argmax(-1) == logits["native"].argmax(-1)).float().mean()
        assert agree >= 0.75
