"""llama.cpp as a peer: the checkpoint's vision side written as llama.cpp's mmproj GGUF (read back and
held to the HF weights), the pre-tokenizer mapping, and the compare system. The server itself is
built by bench/third_party/llamacpp.sh, not in CI; the test that serves with it runs where it is
built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from common.stats import SLO
from tests.bench import load_script
from trident.bench import llamacpp
from trident.bench.compare import Comparison, System

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "third_party" / "llamacpp_convert.py"


def _convert_module():
    return load_script(SCRIPT, "llamacpp_convert")


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    weights = {}
    for path in model_dir.glob("*.safetensors"):
        weights.update(load_file(str(path)))
    return weights


def test_our_pre_tokenizer_is_gpt2s_and_any_other_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    convert = _convert_module()
    assert convert.pre_tokenizer_name(tiny_model_dir) == "gpt-2"
    other = tmp_path / "other"
    other.mkdir()
    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="Metaspace"):
        convert.pre_tokenizer_name(other)


def test_the_feature_layer_counts_encoder_layers_as_hf_indexes_hidden_states() -> None:
    convert = _convert_module()
    config = {"vision_config": {"num_hidden_layers": 6}, "vision_feature_layer": -2}
    assert convert.feature_layer(config) == 5  # hidden_states[-2]: the output of layer 5 of 6
    assert convert.feature_layer({**config, "vision_feature_layer": -1}) == 6
    assert convert.feature_layer({**config, "vision_feature_layer": 3}) == 3
    with pytest.raises(ValueError, match="only one layer"):
        convert.feature_layer({**config, "vision_feature_layer": [-2, -5]})


def test_the_mmproj_file_holds_every_tower_and_projector_weight_in_f32(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import gguf

    convert = _convert_module()
    out = tmp_path / "mmproj-f32.gguf"
    convert.convert_vision(tiny_model_dir, out)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    weights = _weights(tiny_model_dir)
    vision = {k: v for k, v in weights.items() if "vision_tower" in k or "multi_modal_projector" in k}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    layers = config["vision_config"]["num_hidden_layers"]
    # Every tower weight but the post-layernorm (LLaVA takes a hidden state before it) is written once.
    assert len(tensors) == len(vision) - 2
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    pairs = {
        "v.patch_embd.weight": "model.vision_tower.embeddings.patch_embedding.weight",
        "v.class_embd": "model.vision_tower.embeddings.class_embedding",
        f"v.blk.{layers - 1}.ffn_up.weight": f"model.vision_tower.encoder.layers.{layers - 1}.mlp.fc1.weight",
        "v.blk.0.attn_out.bias": "model.vision_tower.encoder.layers.0.self_attn.out_proj.bias",
        "mm.0.weight": "model.multi_modal_projector.linear_1.weight",
        "mm.2.bias": "model.multi_modal_projector.linear_2.bias",
    }
    for name, source in pairs.items():
        stored = np.asarray(tensors[name].data).reshape(weights[source].shape)
        np.testing.assert_array_equal(stored, weights[source], err_msg=name)

    def field(key: str):
        value = reader.fields[key]
        return value.contents() if hasattr(value, "contents") else value.parts[value.data[0]].tolist()

    assert field("clip.projector_type") == "mlp"
    assert field("clip.vision.feature_layer") == [layers - 1]
    assert field("clip.vision.image_size") == config["vision_config"]["image_size"]
    assert field("clip.use_gelu") is False  # CLIP's quick GELU


def test_a_checkpoint_that_is_not_llava_1_5_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    convert = _convert_module()
    other = tmp_path / "next"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava_next"}))
    with pytest.raises(ValueError, match="llava_next"):
        convert.convert_vision(other, tmp_path / "x.gguf")


def test_llama_cpp_is_a_peer_and_the_headline_gives_a_ratio_to_each_peer() -> None:
    assert System.parse("llama.cpp") == System("llama.cpp", peer=True)
    result = Comparison(SLO(2.0, 0.2), load={})

    class Run:
        def __init__(self, name: str, goodput: float) -> None:
            self.name, self.goodput, self.summaries = name, goodput, []

    result.results = [Run("ep+d", 2.0), Run("transformers-serve", 0.5), Run("llama.cpp", 4.0)]
    head = result.headline()
    assert head["best"] == "ep+d"
    assert head["peer"] == "llama.cpp" and head["ratio"] == 0.5  # the strongest peer
    assert head["ratios"] == {"transformers-serve": 4.0, "llama.cpp": 0.5}


def test_without_a_built_server_the_system_says_how_to_build_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("TRIDENT_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    with (
        pytest.raises(RuntimeError, match=r"bench/third_party/llamacpp\.sh"),
        llamacpp.llama_server(tiny_model_dir, port=1, log_dir=tmp_path),
    ):
        pass


@pytest.mark.skipif(
    not (llamacpp.server_binary().exists() and llamacpp.converter_python().exists()),
    reason="llama.cpp is not built here (bash bench/third_party/llamacpp.sh)",
)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_server_serves_the_same_model_as_hf(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from common.infra import free_port

    monkeypatch.chdir(tmp_path)  # the GGUF cache goes under ./.trident
    with llamacpp.llama_server(tiny_model_dir, port=free_port(), log_dir=tmp_path, slots=2) as served:
        agreements = llamacpp.greedy_parity(served.url, tiny_model_dir, llamacpp.PARITY_PROMPTS, tokens=16)
    for a in agreements:  # wherever they part, HF's two best tokens were within rounding of each other
        assert a.agreed == a.tokens or a.gap_at_split < 0.1 * a.median_gap, llamacpp.parity_note(agreements)
    assert sum(a.agreed == a.tokens for a in agreements) >= len(agreements) // 2, llamacpp.parity_note(
        agreements
    )


def test_hf_reference_inputs_for_qwen_carry_the_token_types_m_rope_needs(tmp_path: Path) -> None:
    """Without `mm_token_type_ids`, transformers' generate quietly gives a Qwen2-VL prompt's image
    tokens text positions (its forward refuses outright): the parity check then compared llama.cpp,
    which uses M-RoPE, against a different model and found every image prompt parting at token 0."""
    import torch
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    from common.checkpoints import write_checkpoint
    from common.engine.processor import RequestProcessor

    model_dir = write_checkpoint(tmp_path / "tiny-qwen2-vl", "tiny-qwen2-vl", seed=0)
    processor = RequestProcessor(model_dir)
    prompt = f"<|vision_start|>{processor.image_token}<|vision_end|>what is in the image"
    image = Image.new("RGB", (56, 56), (200, 40, 40))
    inputs = llamacpp._hf_inputs(processor, prompt, [image])
    image_tokens = inputs["input_ids"] == processor.image_token_id
    assert image_tokens.sum() > 1
    assert torch.equal(inputs["mm_token_type_ids"].bool(), image_tokens)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**inputs).logits  # raises where the token types are missing
    assert logits.shape[1] == inputs["input_ids"].shape[1]
