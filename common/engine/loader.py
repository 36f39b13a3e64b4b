"""Load a local HF-format LLaVA-1.5-family checkpoint into our model, by path, never from a hub.

Both weight layouts are accepted: transformers 5's (`model.language_model.*`, `lm_head.*`) and the
older one of the public llava-hf checkpoints (`language_model.model.*`, `language_model.lm_head.*`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.engine.models.llava import LlavaModel

SUPPORTED_ARCHITECTURES = {"LlavaForConditionalGeneration"}
SUPPORTED_TEXT_MODELS = {"llama"}
SUPPORTED_VISION_MODELS = {"clip_vision_model"}


class CheckpointError(ValueError):
    """A model directory that cannot be served; the message names what is missing or unsupported."""


# (checkpoint prefix, our module prefix): first match wins.
_PREFIXES = [
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
]


def map_weight_name(name: str) -> str | None:
    """Checkpoint tensor name → our parameter name; None for tensors we do not use."""
    for src, dst in _PREFIXES:
        if name.startswith(src):
            # Older transformers nested CLIP's modules one level deeper (`vision_model.`).
            return (dst + name[len(src) :]).replace("vision_tower.vision_model.", "vision_tower.")
    return None


def load_config(model_dir: Path):
    """Read and validate config.json; errors name the file and the unsupported value."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json; is it an HF-format checkpoint?")
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{model_dir}/config.json is not valid JSON: {exc}") from exc
    archs = set(raw.get("architectures") or [])
    if raw.get("model_type") != "llava" or (archs and not archs & SUPPORTED_ARCHITECTURES):
        found = sorted(archs) or raw.get("model_type")
        raise CheckpointError(
            f"unsupported architecture {found!r} in {model_dir}/config.json; supported: LLaVA-1.5 "
            f"(model_type 'llava', {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.text_config.model_type not in SUPPORTED_TEXT_MODELS:
        raise CheckpointError(f"unsupported text model {config.text_config.model_type!r}; supported: llama")
    if config.vision_config.model_type not in SUPPORTED_VISION_MODELS:
        raise CheckpointError(
            f"unsupported vision model {config.vision_config.model_type!r}; supported: CLIP"
        )
    return config


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
) -> LlavaModel:
    """Build the parts of the model an instance needs and fill them from the safetensors files."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    inv_freq, scaling = rope_tables(config.text_config)
    with torch.device("meta"):
        model = LlavaModel(config, inv_freq, scaling, with_vision, with_language)
    params = dict(model.named_parameters(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                ours = map_weight_name(name)
                if ours in params:
                    state[ours] = f.get_tensor(name).to(dtype)
    tied = config.text_config.tie_word_embeddings and with_language
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
    if model.vision is not None:
        emb = model.vision.vision_tower.embeddings
        emb.position_ids = torch.arange(emb.num_positions).expand(1, -1)
    return model.to(device).eval()
