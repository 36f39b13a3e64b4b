"""Deterministic random-weight LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints in Hugging
Face format (see `write_checkpoint`).

The names below load on first use: the preset table (what `trident` lists as its choices) imports no
transformers, and the writer, which does, loads only when a checkpoint is written or checked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.lazy import lazy_names

if TYPE_CHECKING:
    from common.checkpoints.presets import (
        PRESETS,
        AnyPreset,
        LlavaNextPreset,
        Preset,
        Qwen2_5VLPreset,
        Qwen2VLPreset,
        Qwen3VLPreset,
        QwenVLPreset,
        build_config,
        build_qwen_vl_config,
        count_parameters,
        get_preset,
    )
    from common.checkpoints.writer import CheckpointExistsError, is_checkpoint_dir, write_checkpoint

__all__ = [
    "PRESETS",
    "AnyPreset",
    "CheckpointExistsError",
    "LlavaNextPreset",
    "Preset",
    "Qwen2VLPreset",
    "Qwen2_5VLPreset",
    "Qwen3VLPreset",
    "QwenVLPreset",
    "build_config",
    "build_qwen_vl_config",
    "count_parameters",
    "get_preset",
    "is_checkpoint_dir",
    "write_checkpoint",
]


_WRITER = ("CheckpointExistsError", "is_checkpoint_dir", "write_checkpoint")  # the rest: presets
__getattr__ = lazy_names(
    __name__,
    {name: f"common.checkpoints.{'writer' if name in _WRITER else 'presets'}" for name in __all__},
)
