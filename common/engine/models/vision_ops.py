"""Two of transformers' vision-tower modules replaced by ones that compute the same thing faster,
once a tower is built (`lighten`). Measured on a 1,024-patch image through small-qwen2-vl's tower,
one thread (docs/engine.md, "The vision towers"):

- Qwen-VL's patch embedding is a Conv3d whose kernel is its stride, and each input row is exactly
  one kernel's worth of pixels (channels × frames × height × width, as the processor flattens
  them). Such a convolution is one matrix product of the rows with the flattened kernel; CPU
  convolution took 37 ms for what the product does in 5. It sums in another order: features agree
  to float32 rounding (about 1e-6 relative), not bit for bit.
- QuickGELU (`x · sigmoid(1.702 · x)`, CLIP's and Qwen2-VL's MLP activation) makes two full-size
  temporaries a call; under `no_grad` it can overwrite its input, which nothing else reads, and
  give the same bits with one (6.4 → 4.5 ms at 1,024 × 1,536).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import QuickGELUActivation


class PatchProduct(nn.Module):
    """A patch embedding as one product: rows of one patch's pixels each → [rows, embed_dim]. Keeps
    the convolution as `proj`, so checkpoints load into it by the same names."""

    def __init__(self, proj: nn.Conv3d) -> None:
        super().__init__()
        if proj.kernel_size != proj.stride or any(proj.padding) or proj.groups != 1:
            raise ValueError("a patch embedding is one product only when its kernel is its stride")
        self.proj = proj

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        rows = patches.reshape(-1, weight[0].numel()).to(weight.dtype)
        return F.linear(rows, weight.flatten(1), self.proj.bias)


class QuickGELUInPlace(nn.Module):
    """x · sigmoid(1.702 · x), written into x when no gradient is kept (the same bits as out of place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return x * torch.sigmoid(1.702 * x)
        return x.mul_(torch.mul(x, 1.702).sigmoid_())


def lighten(tower: nn.Module) -> None:
    """Swap the tower's Qwen-VL patch embedding (a `patch_embed` holding a Conv3d `proj`) and its
    QuickGELU activations for the modules above; whatever else it holds is left as it is."""
    embed = getattr(tower, "patch_embed", None)
    if embed is not None and isinstance(getattr(embed, "proj", None), nn.Conv3d):
        tower.patch_embed = PatchProduct(embed.proj)
    for parent in list(tower.modules()):
        for name, child in parent.named_children():
            if type(child) is QuickGELUActivation:
                setattr(parent, name, QuickGELUInPlace())
