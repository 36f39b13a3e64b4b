"""Deterministic random-weight LLaVA-1.5 and Qwen2-VL checkpoints in Hugging Face format (see
`write_checkpoint`)."""

from common.checkpoints.presets import (
    PRESETS,
    AnyPreset,
    Preset,
    Qwen2VLPreset,
    build_config,
    build_qwen2_vl_config,
    count_parameters,
    get_preset,
)
from common.checkpoints.writer import CheckpointExistsError, is_checkpoint_dir, write_checkpoint

__all__ = [
    "PRESETS",
    "AnyPreset",
    "CheckpointExistsError",
    "Preset",
    "Qwen2VLPreset",
    "build_config",
    "build_qwen2_vl_config",
    "count_parameters",
    "get_preset",
    "is_checkpoint_dir",
    "write_checkpoint",
]
