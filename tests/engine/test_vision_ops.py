"""The vision towers' replaced modules compute what transformers' do (vision_ops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2VLConfig
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from common.engine.models.vision_ops import PatchProduct, QuickGELUInPlace, lighten


@pytest.mark.parametrize("bias", [False, True])  # Qwen2-VL and Qwen2.5-VL: none; Qwen3-VL: a bias
def test_patch_product_is_the_convolution(bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 48, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias)
    rows = torch.randn(37, 3 * 2 * 14 * 14)  # as the processor flattens each patch: C, T, H, W
    with torch.no_grad():
        want = conv(rows.view(-1, 3, 2, 14, 14)).view(-1, 48)
        got = PatchProduct(conv)(rows)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_patch_product_refuses_overlapping_kernels() -> None:
    with pytest.raises(ValueError, match="kernel is its stride"):
        PatchProduct(nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(1, 7, 7)))


def test_quick_gelu_in_place_gives_the_same_bits() -> None:
    x = torch.randn(64, 300) * 4
    want = QuickGELUActivation()(x)
    with torch.no_grad():
        got = QuickGELUInPlace()(x.clone())
    assert torch.equal(got, want)


def test_quick_gelu_keeps_its_input_when_gradients_are_kept() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    kept = x.detach().clone()
    out = QuickGELUInPlace()(x)
    out.sum().backward()
    assert torch.equal(x.detach(), kept)
    assert x.grad is not None


def test_lighten_keeps_names_and_outputs() -> None:
    """A whole Qwen2-VL tower: the same parameter names (checkpoints load as before), the same
    features to float32 rounding."""
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        vision_config={"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 32, "mlp_ratio": 2}
    ).vision_config
    config._attn_implementation = "sdpa"
    tower = Qwen2VisionTransformerPretrainedModel(config).eval()
    grid = torch.tensor([[1, 4, 6]])
    patches = torch.randn(24, 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = tower(patches, grid_thw=grid).pooler_output
        names = list(tower.state_dict())
        lighten(tower)
        got = tower(patches, grid_thw=grid).pooler_output
    assert isinstance(tower.patch_embed, PatchProduct)
    assert not any(type(m) is QuickGELUActivation for m in tower.modules())
    assert list(tower.state_dict()) == names
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
