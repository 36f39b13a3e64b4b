"""Deterministic random-weight LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints in Hugging
Face format (see `write_checkpoint`)."""

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
