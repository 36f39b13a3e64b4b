"""The model families the engine serves, each an `nn.Module` with the same few parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from common.engine.models.llama import LlamaForCausalLM
    from common.engine.request import ImageInput


class VisionLanguageModel(Protocol):
    """What the runner and the engine use of a model: its config, the LLM (None on an encode-only
    instance), the vision side (None without encode), and how images become features."""

    config: object
    image_token_id: int
    mrope: bool  # positions are [3, tokens] (Qwen2-VL's M-RoPE), not [tokens]
    language_model: LlamaForCausalLM | None
    vision: nn.Module | None

    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]: ...
