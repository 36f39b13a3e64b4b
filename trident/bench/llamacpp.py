"""llama.cpp's server as a peer system of `trident bench compare`: our checkpoint converted to GGUF
(F32), served by `llama-server` with continuous batching, and checked against HF's greedy output.

`bash bench/third_party/llamacpp.sh` builds the server and the converter's interpreter once; the
paths below are where it puts them (TRIDENT_LLAMA_SERVER, TRIDENT_LLAMA_CONVERTER and
TRIDENT_LLAMA_PYTHON point elsewhere). Conversion runs once per checkpoint: the two GGUF files are
kept under `.trident/gguf/<name>-<fingerprint>/`.

How llama-server renders a prompt differs from HF in one token: it joins an image's marker and the
text after it with nothing between them, where the checkpoint's template puts a newline (`USER:
<image>\\ntext`). That is llama.cpp's prompt for every request it serves, so it is what it is
measured with; the parity check gives HF the same prompt (`USER: <image>text ASSISTANT:`) so that
the two compute the same thing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from trident.bench import deployments
from trident.bench.oracle import hf_model_inputs

LLAMACPP = "llama.cpp"
MARKER = re.compile(r"<__media_[^>]*__>")  # where llama-server's rendered prompt has an image
THIRD_PARTY = deployments.REPO / "bench" / "third_party"
SETUP = "bash bench/third_party/llamacpp.sh"


def _path(env: str, default: Path) -> Path:
    return Path(os.environ.get(env) or default)


def server_binary() -> Path:
    return _path("TRIDENT_LLAMA_SERVER", THIRD_PARTY / ".llama.cpp/server/llama.cpp/build/bin/llama-server")


def batched_bench_binary() -> Path:
    """llama.cpp's batched decode benchmark, built beside the server (bench/decode_speed.py)."""
    return _path("TRIDENT_LLAMA_BATCHED_BENCH", server_binary().parent / "llama-batched-bench")


def converter_dir() -> Path:
    return _path("TRIDENT_LLAMA_CONVERTER", THIRD_PARTY / ".llama.cpp/converter")


def converter_python() -> Path:
    return _path("TRIDENT_LLAMA_PYTHON", THIRD_PARTY / ".venv-llamacpp/bin/python")


def fingerprint(model_dir: Path) -> str:
    """What identifies a checkpoint's contents cheaply: its JSON files and its weights' names and sizes."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix == ".json":
            h.update(path.name.encode() + path.read_bytes())
        elif path.suffix == ".safetensors":
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Gguf:
    model: Path
    mmproj: Path


def converted(model_dir: Path, cache: Path = Path(".trident/gguf")) -> Gguf:
    """The checkpoint as llama.cpp's two GGUF files, converting it the first time (RuntimeError with
    the converter's output if it refuses)."""
    model_dir = Path(model_dir).resolve()
    out = Path(cache).resolve() / f"{model_dir.name}-{fingerprint(model_dir)}"
    files = Gguf(out / "model-f32.gguf", out / "mmproj-f32.gguf")
    if files.model.exists() and files.mmproj.exists():
        return files
    python, converter = converter_python(), converter_dir()
    if not python.exists() or not (converter / "convert_hf_to_gguf.py").exists():
        raise RuntimeError(f"llama.cpp's converter is not set up ({python}, {converter}): run `{SETUP}`")
    tmp = out.with_name(out.name + ".tmp")
    script = THIRD_PARTY / "llamacpp_convert.py"
    run = subprocess.run(
        [str(python), str(script), str(model_dir), str(tmp), "--converter", str(converter)],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"converting {model_dir} to GGUF failed:\n{run.stderr[-3000:]}")
    tmp.replace(out)
    return files


@contextlib.contextmanager
def llama_server(
    model_dir: Path,
    *,
    port: int,
    log_dir: Path,
    slots: int = 8,
    slot_context: int = 4096,  # a four-turn chat with LLaVA images reaches ~3,200 tokens
    threads: int | None = None,
) -> Iterator[deployments.Served]:
    """`llama-server` on the converted checkpoint until the block ends: `slots` requests decode
    together (continuous batching), each with up to `slot_context` tokens; `threads` defaults to
    every core, as llama.cpp's own default does."""
    binary = server_binary()
    if not binary.exists():
        raise RuntimeError(f"llama-server is not built ({binary}): run `{SETUP}`")
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    gguf = converted(model_dir)
    argv = [
        str(binary), "-m", str(gguf.model), "--mmproj", str(gguf.mmproj),
        "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--cont-batching",
        "--threads", str(threads or os.cpu_count() or 1),
        "--alias", Path(model_dir).resolve().name, "--no-webui",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = log_dir / "llama-server.log"
    model = Path(model_dir).resolve().name
    peer = deployments.PeerServer(argv, log, url, warm_model=model)
    with deployments.peer_server(peer) as proc:
        yield deployments.Served(LLAMACPP, LLAMACPP, url, model, proc.pid, log)


# -- does it serve the same model? -----------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """One prompt: how many of the first `tokens` greedy tokens llama.cpp and HF share, and where they
    part, how far apart HF's two best logits were there (a near tie flips on rounding alone)."""

    images: int
    agreed: int
    tokens: int
    gap_at_split: float | None  # HF's top-1 minus top-2 logit where they part
    median_gap: float  # the same over every step of HF's answer


def greedy_parity(
    url: str, model_dir: Path, prompts: Sequence[tuple[str, int]], tokens: int = 32
) -> list[Agreement]:
    """Each (text, number of images) prompt answered greedily by the server at `url` and by HF
    `generate` on the prompt the server renders (its /apply-template, each image's marker put back
    as the family's placeholder; module docstring). The images are random, of a size neither side
    resizes: LLaVA-1.5's tower size, 224 pixels (8 × 28) for Qwen2-VL."""
    import numpy as np
    from transformers import AutoModelForImageTextToText

    from common.engine.processor import RequestProcessor

    # The checkpoint's own processor as Trident loads it: for Qwen-VL, transformers' processor
    # wants a video processor that needs torchvision, which a CPU install does not have.
    processor = RequestProcessor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    qwen = model.config.model_type == "qwen2_vl"
    side = 224 if qwen else model.config.vision_config.image_size
    # What each image's marker stands for in HF's prompt: mtmd wraps a Qwen2-VL image in its
    # vision start and end tokens, and a LLaVA one in nothing.
    placeholder = f"<|vision_start|>{processor.image_token}<|vision_end|>" if qwen else processor.image_token
    out = []
    for k, (text, count) in enumerate(prompts):
        images, urls = _random_images(1000 + k, count, side)
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        parts.append({"type": "text", "text": text})
        messages = [{"role": "user", "content": parts}]
        rendered = httpx.post(
            f"{url}/apply-template", json={"messages": messages}, timeout=60, trust_env=False
        )
        rendered.raise_for_status()
        prompt = MARKER.sub(lambda _: placeholder, rendered.json()["prompt"])
        ids, gaps = _hf_greedy(model, _hf_inputs(processor, prompt, images), tokens)
        served = _served_greedy(url, messages, tokens)
        # The longest run of HF's tokens whose text the served answer starts with (a token that ends
        # inside a UTF-8 character decodes to U+FFFD on both sides, so that is left off).
        prefixes = [processor.tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(tokens + 1)]
        agreed = max(n for n, p in enumerate(prefixes) if served.startswith(p.rstrip("\ufffd")))
        split = gaps[agreed] if agreed < tokens else None
        out.append(Agreement(count, agreed, tokens, split, float(np.median(gaps))))
    return out


def _random_images(seed: int, count: int, side: int) -> tuple[list, list[str]]:
    """`count` random square images of `side` pixels, and each as a PNG data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]
    urls = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return images, urls


def _hf_greedy(model, inputs: dict, tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy answer of exactly `tokens` tokens, and at each step the gap between its two best
    logits."""
    import torch

    with torch.no_grad():
        gen = model.generate(
            **inputs,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids = gen.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, [float(s[0].topk(2).values.diff().abs()) for s in gen.scores]


def _served_greedy(url: str, messages: list[dict], tokens: int) -> str:
    """The server's greedy answer of exactly `tokens` tokens, its prompt cache off."""
    body = {
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, trust_env=False)
    answer.raise_for_status()
    return answer.json()["choices"][0]["message"]["content"]


def _hf_inputs(processor, prompt: str, images: list) -> dict:
    """What HF `generate` takes for `prompt` (one image marker per image) and `images`."""
    import torch

    if processor.hf is not None:  # LLaVA: its HF processor as it is
        return dict(processor.hf(text=prompt, images=images or None, return_tensors="pt"))
    # Qwen-VL: Trident's processor, and HF's inputs as the oracle builds them — the token types
    # included, without which transformers' generate gives image tokens plain text positions in
    # place of M-RoPE's and answers differently (it does not say so).
    processed = processor.process(prompt, images)  # each pad expanded to its grid
    ids = torch.tensor([processed.token_ids])
    return hf_model_inputs(processed.images, ids, torch.ones_like(ids), processor.image_token_id)


PARITY_PROMPTS = (
    ("describe the picture", 0),
    ("what is in the image", 1),
    ("the cat sat on the mat with a red", 0),
    ("a small blue image shows", 1),
    ("what", 1),
    ("tell me a story about a cat", 0),
)


def parity_note(agreements: Sequence[Agreement]) -> str:
    whole = sum(a.agreed == a.tokens for a in agreements)
    tokens = agreements[0].tokens
    text = f"greedy parity with HF: {whole} of {len(agreements)} prompts agree on all {tokens} tokens"
    splits = [a for a in agreements if a.agreed < a.tokens]
    if splits:
        text += "; the others part at " + ", ".join(
            f"token {a.agreed} ({a.images} image(s); HF's top-2 logit gap there {a.gap_at_split:.3f}, "
            f"median {a.median_gap:.2f})"
            for a in splits
        )
    return text
