"""Assemble a complete HF-format checkpoint directory (config, weights, tokenizer, processor files)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from transformers import GenerationConfig

from common.checkpoints.presets import (
    AnyPreset,
    Preset,
    QwenVLPreset,
    build_config,
    build_qwen_vl_config,
    count_parameters,
    get_preset,
)
from common.checkpoints.tokenizer import (
    IMAGE,
    QwenVLSpecialIds,
    SpecialIds,
    build_processor,
    build_qwen_vl_image_processor,
    build_qwen_vl_tokenizer,
    build_tokenizer,
    read_package_text,
)
from common.checkpoints.weights import write_weights

# Provenance file; also how an existing directory is recognised as one of ours before it is replaced.
MANIFEST_FILE = "trident_checkpoint.json"
# The manifest's "format" for each model family (Preset.family); any of them marks a directory as ours.
FORMATS = {
    "llava": "trident-llava",
    "llava_next": "trident-llava-next",
    "qwen2_vl": "trident-qwen2-vl",
    "qwen2_5_vl": "trident-qwen2.5-vl",
    "qwen3_vl": "trident-qwen3-vl",
}
# Every Qwen-VL family formats a chat the same way, images included (<|vision_start|><|image_pad|>...).
QWEN_VL_CHAT_TEMPLATE = "qwen2_vl_chat_template.jinja"


class CheckpointExistsError(FileExistsError):
    """The target directory is not empty; raised instead of silently mixing files into it."""

    def __init__(self, message: str, replaceable: bool = False) -> None:
        super().__init__(message)
        # True when the directory holds one of our checkpoints, which `overwrite=True` would replace.
        self.replaceable = replaceable


def is_checkpoint_dir(path: str | Path) -> bool:
    """True if `path` holds a checkpoint written by this package (and so may be replaced as a whole)."""
    manifest = Path(path) / MANIFEST_FILE
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") in FORMATS.values()
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _dump_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer_files(out_dir: Path, preset: Preset) -> SpecialIds:
    tokenizer, ids = build_tokenizer(preset)
    build_processor(preset, tokenizer).save_pretrained(str(out_dir))
    # transformers 5 no longer writes special_tokens_map.json; older readers (and humans) still look for it.
    _dump_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "additional_special_tokens": [IMAGE],
        },
    )
    return ids


def _apply_default_modes(directory: Path) -> None:
    # mkdtemp makes the directory 0700 and safetensors writes its files 0600; give them the modes a plain
    # mkdir/open would, so a checkpoint written by one user can be read by the serving processes of another.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _update_json(path: Path, **fields: object) -> None:
    _dump_json(path, {**json.loads(path.read_text(encoding="utf-8")), **fields})


def _write_llava(out_dir: Path, preset: Preset, seed: int) -> tuple[SpecialIds, list[str]]:
    ids = _write_tokenizer_files(out_dir, preset)
    config = build_config(preset, bos_id=ids.bos, eos_id=ids.eos, pad_id=ids.pad, image_id=ids.image)
    config.save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=ids.bos, eos_token_id=ids.eos, pad_token_id=ids.pad).save_pretrained(
        str(out_dir)
    )
    return ids, write_weights(out_dir, config, preset, seed, ids)


def _write_qwen_vl(out_dir: Path, preset: QwenVLPreset, seed: int) -> tuple[QwenVLSpecialIds, list[str]]:
    # The files of a Qwen-VL release: tokenizer.json + tokenizer_config.json, preprocessor_config.json,
    # chat_template.json (the template also in tokenizer_config.json, so a bare tokenizer can apply it).
    tokenizer, ids = build_qwen_vl_tokenizer(preset)
    tokenizer.save_pretrained(str(out_dir))
    template = read_package_text(QWEN_VL_CHAT_TEMPLATE)
    release_keys = {"processor_class": preset.processor_class}
    _update_json(out_dir / "tokenizer_config.json", chat_template=template, **release_keys)
    _dump_json(out_dir / "chat_template.json", {"chat_template": template})
    build_qwen_vl_image_processor(preset).save_pretrained(str(out_dir))
    # transformers 5 saves the pixel bounds only as size.{shortest,longest}_edge; Qwen2(.5)-VL releases
    # (and older readers) name them min_pixels / max_pixels too. Loading gives both the same values.
    if preset.pixel_bound_keys:
        release_keys |= {"min_pixels": preset.min_pixels, "max_pixels": preset.max_pixels}
    _update_json(out_dir / "preprocessor_config.json", **release_keys)
    config = build_qwen_vl_config(
        preset,
        pad_id=ids.pad,
        eos_id=ids.eos,
        image_id=ids.image,
        video_id=ids.video,
        vision_start_id=ids.vision_start,
        vision_end_id=ids.vision_end,
    )
    config.save_pretrained(str(out_dir))
    # As Qwen's releases: either <|im_end|> (end of turn) or <|endoftext|> ends generation.
    GenerationConfig(
        bos_token_id=ids.pad, eos_token_id=[ids.eos, ids.pad], pad_token_id=ids.pad
    ).save_pretrained(str(out_dir))
    return ids, write_weights(out_dir, config, preset, seed, ids)


def _write_all(out_dir: Path, preset: AnyPreset, seed: int) -> None:
    if isinstance(preset, QwenVLPreset):
        ids, files = _write_qwen_vl(out_dir, preset, seed)
    else:
        ids, files = _write_llava(out_dir, preset, seed)
    _dump_json(
        out_dir / MANIFEST_FILE,
        {
            "format": FORMATS[preset.family],
            "preset": preset.name,
            "seed": seed,
            "num_parameters": count_parameters(preset),
            "tokenizer_size": ids.num_tokens,
            "vocab_size": preset.vocab_size,
            "dtype": preset.dtype,
            "weight_files": files,
        },
    )


def write_checkpoint(
    out_dir: str | Path, preset: str | AnyPreset = "tiny-llava", seed: int = 0, *, overwrite: bool = False
) -> Path:
    """Write a complete random-weight checkpoint (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL or Qwen3-VL) to
    `out_dir`; return the directory.

    The bytes depend only on (preset, seed); `preset` is a name from PRESETS or a custom Preset,
    LlavaNextPreset or QwenVLPreset subclass instance, whose family picks the architecture and the files
    written. A non-empty `out_dir` is refused unless it is a checkpoint of ours and `overwrite` is set; the
    new one is built beside it and swapped in, so no half-written directory ever looks complete.
    """
    spec = get_preset(preset) if isinstance(preset, str) else preset
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    target = Path(out_dir).absolute()
    if target.exists() and not target.is_dir():
        raise CheckpointExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not is_checkpoint_dir(target):
            raise CheckpointExistsError(f"{target} is not empty and does not hold a trident checkpoint")
        if not overwrite:
            raise CheckpointExistsError(f"{target} already holds a checkpoint", replaceable=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _write_all(staging, spec, seed)
        _apply_default_modes(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
