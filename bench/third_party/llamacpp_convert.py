"""A LLaVA-1.5 or Qwen2-VL checkpoint in HF format as the two GGUF files llama.cpp's server loads, in F32.

    python bench/third_party/llamacpp_convert.py MODEL_DIR OUT_DIR --converter LLAMA_CPP_SOURCE

Run by the converter's own interpreter (bench/third_party/setup.sh builds it: torch, transformers,
sentencepiece and the `gguf` package of the same llama.cpp source). Writes OUT_DIR/model-f32.gguf
(the Llama language model) and OUT_DIR/mmproj-f32.gguf (the CLIP tower and the projector).

The language model goes through llama.cpp's own `convert_hf_to_gguf.py`, with one change: that
script names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed test string, and
only knows released models' hashes. Our checkpoints' tokenizers are trained byte-level BPE with
GPT-2's pre-tokenizer (tokenizer.json: a bare `ByteLevel`, `use_regex` true, no prefix space),
which llama.cpp implements as "gpt-2"; this script reads tokenizer.json, says "gpt-2" for exactly
that pre-tokenizer, and refuses any other.

A LLaVA-1.5 vision side is written here: llama.cpp's current converter only converts
Pixtral-style LLaVA towers, and its legacy CLIP script stores the projector and patch embedding in
F16. This writes every tensor in F32 under the names and keys llama.cpp's CLIP loader reads
(`clip.*` metadata, the `v.*` tower, the `mm.0`/`mm.2` projector), with the feature layer HF's
`vision_feature_layer` selects. A Qwen2-VL vision side goes through the converter's `--mmproj`,
which expects the released checkpoints' key names (`visual.*`); transformers 5 writes
`model.visual.*`, so the prefix is taken off as the converter reads the keys. (The tiny Qwen
preset's 2-layer tower does not convert: the converter maps the merger's `mlp.2` as a block
index, and a tower has to have more than 2 blocks for that name to exist; small-qwen2-vl has 6.)
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def pre_tokenizer_name(model_dir: Path) -> str:
    """llama.cpp's name for the checkpoint's pre-tokenizer; ValueError for one it may not match."""
    spec = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer")
    if spec != GPT2_PRE_TOKENIZER:
        raise ValueError(
            f"pre-tokenizer {spec} is not GPT-2's byte-level split; no llama.cpp name is known for it"
        )
    return "gpt-2"


def run_converter(model_dir: Path, out: Path, converter: Path, *extra: str) -> None:
    """llama.cpp's `convert_hf_to_gguf.py` on the checkpoint, F32, told the pre-tokenizer's name,
    and reading the vision tower of transformers 5's Qwen2-VL layout (`model.visual.*`), where
    it only knows the released checkpoints' (`visual.*`)."""
    sys.path.insert(0, str(converter))
    from conversion import base, qwenvl  # llama.cpp's converter package

    name = pre_tokenizer_name(model_dir)
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: name
    released = qwenvl.Qwen2VLVisionModel.filter_tensors.__func__

    def filter_tensors(cls, item):
        key, load = item
        return released(cls, (key.removeprefix("model.") if key.startswith("model.visual.") else key, load))

    qwenvl.Qwen2VLVisionModel.filter_tensors = classmethod(filter_tensors)
    script = converter / "convert_hf_to_gguf.py"
    argv = sys.argv
    sys.argv = [str(script), str(model_dir), "--outtype", "f32", "--outfile", str(out), *extra]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


def feature_layer(config: dict) -> int:
    """HF's `vision_feature_layer` (an index into hidden_states, negative from the end) as the number
    of encoder layers whose output the projector takes."""
    layers = config["vision_config"]["num_hidden_layers"]
    index = config.get("vision_feature_layer", -2)
    if not isinstance(index, int):
        raise ValueError(f"vision_feature_layer {index!r}: only one layer is supported")
    return index if index >= 0 else layers + 1 + index


def vision_tensors(model_dir: Path) -> dict[str, object]:
    """The tower's and projector's tensors (float32 numpy arrays) under llama.cpp's CLIP names."""
    from safetensors.numpy import load_file

    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    weights = {}
    for name in files:
        weights.update(load_file(str(model_dir / name)))
    renames = {
        "embeddings.class_embedding": "v.class_embd",
        "embeddings.patch_embedding.weight": "v.patch_embd.weight",
        "embeddings.position_embedding.weight": "v.position_embd.weight",
        "pre_layrnorm.weight": "v.pre_ln.weight",
        "pre_layrnorm.bias": "v.pre_ln.bias",
    }
    parts = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2",
        "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
    }  # fmt: skip
    out = {}
    for key, value in weights.items():
        name = None
        # transformers 5 drops `vision_model.` from the tower's keys; earlier releases have it.
        for prefix in (
            "model.vision_tower.",
            "model.vision_tower.vision_model.",
            "vision_tower.vision_model.",
        ):
            if key.startswith(prefix):
                rest = key.removeprefix(prefix)
                if rest in renames:
                    name = renames[rest]
                elif rest.startswith("encoder.layers."):
                    layer, module = rest.removeprefix("encoder.layers.").split(".", 1)
                    module, kind = module.rsplit(".", 1)
                    name = f"v.blk.{layer}.{parts[module]}.{kind}"
        for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
            if key.startswith(prefix):
                layer, kind = key.removeprefix(prefix).split(".")
                name = f"mm.{ {'linear_1': 0, 'linear_2': 2}[layer] }.{kind}"
        if name is not None:
            out[name] = value.astype("float32")
    return out


def convert_vision(model_dir: Path, out: Path) -> None:
    """The CLIP tower and projector as llama.cpp's mmproj file (module docstring)."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llava":
        raise ValueError(f"model_type {config.get('model_type')!r}: only LLaVA-1.5 checkpoints convert")
    vision = config["vision_config"]
    processor = json.loads((model_dir / "processor_config.json").read_text())
    images = processor.get("image_processor", processor)
    if config.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError("llama.cpp's LLaVA projector is GELU; this checkpoint's is not")
    tensors = vision_tensors(model_dir)
    writer = gguf.GGUFWriter(str(out), arch="clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_name(model_dir.name)
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.projection_dim", tensors["mm.2.weight"].shape[0])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-5))
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_array("clip.vision.feature_layer", [feature_layer(config)])
    writer.add_array("clip.vision.image_mean", list(images["image_mean"]))
    writer.add_array("clip.vision.image_std", list(images["image_std"]))
    writer.add_bool("clip.use_gelu", vision.get("hidden_act") == "gelu")  # else CLIP's quick GELU
    for name, value in sorted(tensors.items()):
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument(
        "--converter", type=Path, required=True, help="a llama.cpp source tree (convert_hf_to_gguf.py)"
    )
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(args.converter / "gguf-py"))  # the gguf package of the same llama.cpp
    model_type = json.loads((args.model_dir / "config.json").read_text()).get("model_type")
    mmproj = args.out_dir / "mmproj-f32.gguf"
    if model_type == "llava":
        convert_vision(args.model_dir, mmproj)
    elif model_type == "qwen2_vl":
        run_converter(args.model_dir, mmproj, args.converter, "--mmproj")
    else:
        sys.exit(f"model_type {model_type!r}: only LLaVA-1.5 and Qwen2-VL checkpoints convert")
    run_converter(args.model_dir, args.out_dir / "model-f32.gguf", args.converter)


if __name__ == "__main__":
    main()
