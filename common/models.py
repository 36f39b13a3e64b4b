"""What a `--model` option names: a checkpoint directory, or a preset written on first use.

One rule for every command that takes a model (`trident generate`, `up`, `bench compare`), so a
command in the docs runs as written in a fresh clone: `--model small-llava` writes the small-llava
checkpoint to `.trident/models/small-llava` the first time and reuses it after.

Outside `common.checkpoints`, whose import loads torch and transformers: a directory resolves
without them, so `trident up --model DIR` starts its processes as quickly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# Relative to the directory a command runs in, beside `trident up`'s logs and state.
MODELS_DIR = Path(".trident/models")
DEFAULT_PRESET = "tiny-llava"
SEED = 0  # a preset's checkpoint depends only on (preset, seed): every command writes the same bytes


class ModelError(ValueError):
    """`--model` names neither a directory nor a preset."""


def resolve_model(
    model: str | Path | None,
    models_dir: Path = MODELS_DIR,
    say: Callable[[str], None] = lambda line: None,
) -> Path:
    """The checkpoint directory `model` names: an existing directory as it is; a preset name (or None:
    tiny-llava) as `models_dir/<preset>`, written there first if it is not yet a complete checkpoint.

    A directory wins over a preset of the same name, so a checkpoint called `tiny-llava` in the
    working directory is served as it is.
    """
    name = DEFAULT_PRESET if model is None else str(model)
    if model is not None and Path(model).is_dir():
        return Path(model)
    from common.checkpoints import PRESETS, CheckpointExistsError, is_checkpoint_dir, write_checkpoint

    if name not in PRESETS:
        where = f"{model} is not a directory" if Path(name).exists() else f"{model} does not exist"
        raise ModelError(
            f"{where}: pass a checkpoint directory or a preset name ({', '.join(PRESETS)}), "
            f"which is written to {models_dir}/<preset> on first use"
        )
    target = models_dir / name
    if is_checkpoint_dir(target):
        return target
    say(f"writing the {name} checkpoint to {target} (once; later runs reuse it)")
    try:
        return write_checkpoint(target, name, seed=SEED)
    except (CheckpointExistsError, OSError):
        if is_checkpoint_dir(target):  # another command wrote it meanwhile
            return target
        raise
