"""Load a local HF-format checkpoint into our model, by path, never from a hub.

The family comes from `config.json` (`model_type`, `architectures`):
- LLaVA-1.5 (`llava`: CLIP + Llama) and LLaVA-NeXT (`llava_next`: the same over any-resolution
  tiles, Vicuna or Mistral). Both weight layouts load: transformers 5's
  (`model.language_model.*`, `lm_head.*`) and the older one of the public llava-hf checkpoints
  (`language_model.model.*`, `language_model.lm_head.*`).
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`). Both layouts load:
  transformers 5's (`model.language_model.*`, `model.visual.*`) and the older releases'
  (`model.*`, `visual.*`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.engine.models import VisionLanguageModel
from common.engine.models.llama import tied_embeddings
from common.engine.models.llava import LlavaModel
from common.engine.models.llava_next import LlavaNextModel
from common.engine.models.qwen_vl import QwenVLModel


class CheckpointError(ValueError):
    """A model directory that cannot be served; the message names what is missing or unsupported."""


@dataclass(frozen=True)
class Family:
    name: str  # as a person says it
    model_type: str  # config.json's
    architectures: frozenset[str]
    model: type
    prefixes: tuple[tuple[str, str], ...]  # (checkpoint prefix, our module prefix): first match wins


# transformers 5's layout (`model.language_model.*`, `model.visual.*`) and the one of the public
# Qwen2-VL and Qwen2.5-VL releases (`model.*`, `visual.*`).
_QWEN_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "vision.visual."),
    ("visual.", "vision.visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model."),
)
_LLAVA_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
    ("model.image_newline", "vision.image_newline"),  # LLaVA-NeXT
    ("image_newline", "vision.image_newline"),
)
FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "LLaVA-1.5", "llava", frozenset({"LlavaForConditionalGeneration"}), LlavaModel, _LLAVA_PREFIXES
        ),
        Family(
            "LLaVA-NeXT", "llava_next", frozenset({"LlavaNextForConditionalGeneration"}), LlavaNextModel,
            _LLAVA_PREFIXES,
        ),
        *(
            Family(name, model_type, frozenset({arch}), QwenVLModel, _QWEN_PREFIXES)
            for name, model_type, arch in (
                ("Qwen2-VL", "qwen2_vl", "Qwen2VLForConditionalGeneration"),
                ("Qwen2.5-VL", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
                ("Qwen3-VL", "qwen3_vl", "Qwen3VLForConditionalGeneration"),
            )
        ),
    )
}  # fmt: skip
SUPPORTED_ARCHITECTURES = frozenset().union(*(f.architectures for f in FAMILIES.values()))
SUPPORTED_TEXT_MODELS = {"llama", "mistral"}  # LLaVA's language model (Vicuna, Mistral)
SUPPORTED_VISION_MODELS = {"clip_vision_model"}  # LLaVA's vision tower


def supported() -> str:
    return "; ".join(f"{f.name} (model_type {f.model_type!r})" for f in FAMILIES.values())


def map_weight_name(name: str, family: str = "llava") -> str | None:
    """Checkpoint tensor name → our parameter name; None for tensors we do not use."""
    for src, dst in FAMILIES[family].prefixes:
        if name.startswith(src):
            # Older transformers nested CLIP's modules one level deeper (`vision_model.`).
            return (dst + name[len(src) :]).replace("vision_tower.vision_model.", "vision_tower.")
    return None


def load_config(model_dir: Path):
    """Read and validate config.json; errors name the file and the unsupported value."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json; is it an HF-format checkpoint?")
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{model_dir}/config.json is not valid JSON: {exc}") from exc
    archs = set(raw.get("architectures") or [])
    family = FAMILIES.get(raw.get("model_type"))
    if family is None or (archs and not archs & family.architectures):
        found = sorted(archs) or raw.get("model_type")
        raise CheckpointError(
            f"unsupported architecture {found!r} in {model_dir}/config.json; supported: {supported()}"
        )
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if family.model_type in ("llava", "llava_next"):
        if config.text_config.model_type not in SUPPORTED_TEXT_MODELS:
            raise CheckpointError(
                f"unsupported text model {config.text_config.model_type!r}; supported: llama, mistral"
            )
        if getattr(config.text_config, "sliding_window", None):
            raise CheckpointError(f"{model_dir}: sliding-window attention is not supported")
        if config.vision_config.model_type not in SUPPORTED_VISION_MODELS:
            raise CheckpointError(
                f"unsupported vision model {config.vision_config.model_type!r}; supported: CLIP"
            )
    elif getattr(config.text_config, "use_sliding_window", False):
        raise CheckpointError(f"{model_dir}: sliding-window attention is not supported")
    return config


def family_of(config) -> str:
    return config.model_type


def rope_tables(text_config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for the config's RoPE type (default, linear, llama3, yarn, ...)."""
    params = getattr(text_config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise CheckpointError("dynamic RoPE scaling is not supported (it changes with sequence length)")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
        dim = (
            getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads
        )
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](text_config, "cpu")


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir} has no *.safetensors weights (.bin checkpoints are not supported)"
        )
    return files


def load_model(
    model_dir: str | Path,
    with_vision: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    with_language: bool = True,
) -> VisionLanguageModel:
    """Build the parts of the model an instance needs and fill them from the safetensors files."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    family = family_of(config)
    inv_freq, scaling = rope_tables(config.text_config)
    with torch.device("meta"):
        model = FAMILIES[family].model(config, inv_freq, scaling, with_vision, with_language)
    params = dict(model.named_parameters(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                ours = map_weight_name(name, family)
                if ours in params:
                    state[ours] = f.get_tensor(name).to(dtype)
    tied = tied_embeddings(config) and with_language
    if tied:
        state.pop("language_model.lm_head.weight", None)
        params.pop("language_model.lm_head.weight", None)
    missing = sorted(set(params) - set(state))
    if missing:
        raise CheckpointError(f"{model_dir} is missing {len(missing)} weights, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    # Buffers (rotary inv_freq, CLIP position ids) were built on the meta device: rebuild them.
    if with_language:
        model.language_model.rotary.inv_freq = inv_freq.float()
        if torch.device(device).type == "cuda":  # fewer kernels a step; on a CPU it does not pay
            model.language_model.fuse_projections()
    if model.vision is not None and family in ("llava", "llava_next"):
        emb = model.vision.vision_tower.embeddings
        emb.position_ids = torch.arange(emb.num_positions).expand(1, -1)
    return model.to(device).eval()
