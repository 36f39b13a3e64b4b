"""LLaVA-NeXT (LLaVA-1.6): LLaVA-1.5's CLIP tower and projector run over an image's tiles — a
downscaled base tile, then the tiles of the image resized to its best "pinpoint" resolution — and
the tiles' features are stitched back into one grid, cut to the image's aspect ratio (the padding
dropped), with a learned newline at the end of each row. So an image's token count follows its
size and aspect: the processor counts them the same way when it expands `<image>`.

The grid arithmetic is transformers' own (`get_anyres_image_grid_shape`, `unpad_image`, the
functions the HF model and processor share), so tiles, unpadding and counts cannot drift from the
checkpoint's processor.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    unpad_image,
)

from common.engine.models.llava import LlavaModel, VisionEncoder
from common.engine.request import ImageInput


class AnyResVisionEncoder(VisionEncoder):
    """Tiles of several images → one feature tensor per image, [its tokens, text_hidden]."""

    def __init__(self, vision_config, text_dim: int, config) -> None:
        super().__init__(vision_config, text_dim, config)
        self.image_newline = nn.Parameter(torch.empty(text_dim))
        self.pinpoints = config.image_grid_pinpoints
        self.tile = vision_config.image_size
        self.side = vision_config.image_size // vision_config.patch_size  # patches along a tile

    @torch.no_grad()
    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        tiles = torch.cat([img.pixel_values for img in images]).to(device, dtype)
        per_tile = self(tiles)  # [all tiles, patches, hidden]
        out, start = [], 0
        for img in images:
            n = img.pixel_values.shape[0]
            out.append(self._stitch(per_tile[start : start + n], img.image_size))
            start += n
        return out

    def _stitch(self, tiles: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """[1 + rows·cols tiles, patches, hidden] → base tile's patches, then the grid row by row,
        unpadded, each row ending in the newline."""
        base, grid = tiles[0], tiles[1:]
        if not len(grid):
            return torch.cat([base, self.image_newline[None].to(base)])
        rows, cols = get_anyres_image_grid_shape(image_size, self.pinpoints, self.tile)
        hidden = grid.shape[-1]
        # [rows, cols, side, side, hidden] → [hidden, rows·side, cols·side]: one picture of patches.
        picture = grid.view(rows, cols, self.side, self.side, hidden).permute(4, 0, 2, 1, 3)
        picture = unpad_image(picture.reshape(hidden, rows * self.side, cols * self.side), image_size)
        newline = self.image_newline[:, None, None].expand(hidden, picture.shape[1], 1).to(picture)
        rows_out = torch.cat([picture, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([base, rows_out])


class LlavaNextModel(LlavaModel):
    """LLaVA-1.5's parts with the any-resolution vision side."""

    vision_encoder = AnyResVisionEncoder

    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        return self.vision.encode(images, device, dtype)
