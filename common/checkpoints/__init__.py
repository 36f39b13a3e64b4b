"""Deterministic random-weight LLaVA-1.5 checkpoints in Hugging Face format (see `write_checkpoint`)."""

from common.checkpoints.presets import PRESETS, Preset, build_config, count_parameters, get_preset
from common.checkpoints.writer import CheckpointExistsError, is_checkpoint_dir, write_checkpoint

__all__ = [
    "PRESETS",
    "CheckpointExistsError",
    "Preset",
    "build_config",
    "count_parameters",
    "get_preset",
    "is_checkpoint_dir",
    "write_checkpoint",
]
