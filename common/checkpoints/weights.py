"""Deterministic random weights, generated one tensor at a time and written as (sharded) safetensors."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedConfig

from common.checkpoints.presets import AnyPreset, meta_model
from common.checkpoints.tokenizer import QwenVLSpecialIds, SpecialIds

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Scales chosen (and checked by tests/test_checkpoints*.py) so greedy decoding of the random model wanders
# over many tokens and the top-1/top-2 logit gap stays far above float32 noise:
LINEAR_GAIN = 1.75  # weight std = gain / sqrt(fan_in): a bit above 1, so layers mix tokens strongly
EMBED_STD = 1.0  # token embeddings at the same scale as the residual updates of the layers
# Tied: logits = E @ h and h still contains the current token's own row, so a large E makes every token
# predict itself (greedy output collapses to one repeated token); a small E lets the layers dominate h.
TIED_EMBED_STD = 0.1
LM_HEAD_GAIN = 5.0  # lm_head std = gain / sqrt(hidden): logit std ~5, top-1/top-2 gaps ~1
# LLaVA-NeXT's image_newline is a learned input vector that ends each row of image features: drawn like an
# untied token embedding, it is a distinct input, well clear of zero (HF initialises it at 1/sqrt(hidden)),
# though below the projected features around it (std ~6 in the tiny preset, ~15 in the small one).
IMAGE_NEWLINE_STD = EMBED_STD
NORM_NOISE = 0.1  # norm weights 1 +- this, so a loader that forgets a norm weight is caught by a comparison
BIAS_STD = 0.02  # small but non-zero, for the same reason


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and storage dtype of one tensor of the checkpoint."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in the file."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def tensor_specs(config: PreTrainedConfig, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor HF's state_dict() holds, in module order, minus tied duplicates (as save_pretrained)."""
    model = meta_model(config)
    specs: list[TensorSpec] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        # With tied embeddings lm_head.weight *is* embed_tokens.weight; HF stores it once, so do we.
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        specs.append(TensorSpec(name, tuple(tensor.shape), dtype))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """Generator seed for one tensor: depends only on (seed, name), never on iteration order."""
    # torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so (seed, name) is hashed down
    # to 32 bits rather than packed side by side, which would make every seed produce the same weights.
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _uniform(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    # Uniform draws in float64: rand() is built from raw integer bits and each op below is one IEEE-rounded
    # step, so the bytes do not depend on which SIMD kernel the CPU picks (randn's transform could).
    x = torch.rand(shape, generator=gen, dtype=torch.float64)
    return x.mul_(2.0).sub_(1.0).mul_(std * math.sqrt(3.0))


def _std_for(name: str, shape: tuple[int, ...], tied: bool) -> float:
    if name.endswith(".bias"):
        return BIAS_STD
    if name.endswith("embed_tokens.weight"):
        return TIED_EMBED_STD if tied else EMBED_STD
    if name.endswith("lm_head.weight"):
        return LM_HEAD_GAIN / math.sqrt(shape[1])
    if name.endswith(("class_embedding", "position_embedding.weight")):
        return 1.0
    if name.endswith("image_newline"):
        return IMAGE_NEWLINE_STD
    # Linear (out, in) and the patch Conv2d/Conv3d (out, c, [kt,] kh, kw): fan_in is all but the first dim.
    return LINEAR_GAIN / math.sqrt(math.prod(shape[1:]))


def make_tensor(
    spec: TensorSpec, seed: int, ids: SpecialIds | QwenVLSpecialIds, tied: bool = False
) -> torch.Tensor:
    """Generate one tensor from its own seeded generator, in float64, then cast to the storage dtype."""
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, spec.name))
    if len(spec.shape) == 1 and spec.name.endswith(".weight"):  # LayerNorm / RMSNorm scales
        values = _uniform(spec.shape, NORM_NOISE / math.sqrt(3.0), gen).add_(1.0)
    else:
        values = _uniform(spec.shape, _std_for(spec.name, spec.shape, tied), gen)
    if spec.name.endswith(("embed_tokens.weight", "lm_head.weight")):
        # Zero rows for ids past the tokenizer's vocab and for tokens that must never be generated: their
        # logit is exactly 0, far below the ~3-sigma winner, so greedy output always decodes to real text.
        values[ids.num_tokens :] = 0.0
        values[ids.dead_rows(lm_head=spec.name.endswith("lm_head.weight"))] = 0.0
    return values.to(spec.dtype).contiguous()


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy packing in module order, so each shard holds neighbouring layers and stays under the cap."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """HF's file naming: one model.safetensors, or model-0000i-of-0000n.safetensors plus an index."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(
    out_dir: Path,
    config: PreTrainedConfig,
    preset: AnyPreset,
    seed: int,
    ids: SpecialIds | QwenVLSpecialIds,
) -> list[str]:
    """Write the weights; at most one shard is in memory at a time. Returns the files written."""
    specs = tensor_specs(config, preset.torch_dtype)
    shards = plan_shards(specs, preset.max_shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    for shard, file_name in zip(shards, names, strict=True):
        tensors = {spec.name: make_tensor(spec, seed, ids, preset.tie_word_embeddings) for spec in shard}
        # "format": "pt" is the metadata HF's loader checks for before trusting a safetensors file.
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in tensors})
        del tensors
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / INDEX_FILE).write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        names.append(INDEX_FILE)
    return names
