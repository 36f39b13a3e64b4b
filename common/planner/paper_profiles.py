"""GPU-like profiles derived from the papers, for planning where no GPU measured its own.

Each stage is modelled as a fixed cost per iteration plus a cost per unit of work, with the constants
chosen so throughput saturates where seed 000 Figure 3 says it does (LLaVA-1.5-7B; encode near 6
images per batch, prefill with a single 1024-token request, decode near 512 requests at 1024 tokens of
context) on the hardware of its testbed (NVIDIA H20: about 148 dense bf16 TFLOP/s, 4 TB/s, 141 GB):

- per-token LLM compute: 2 × 7 B FLOP at ~100 TFLOP/s effective → 0.14 ms;
- decode reads each context token's KV (32 layers × 2 × 4096 × 2 B = 512 KiB) at 4 TB/s → 0.125 µs;
- fixed cost of an LLM iteration (weights read, launches) 15 ms: with 1024-token contexts decode
  reaches 90 % of its asymptotic throughput near batch 512, and a 1024-token prefill is 90 % busy;
- vision tower: 2 × 0.3 B FLOP × 577 tokens per 336 px image → 3.5 ms an image, fixed cost 2.3 ms
  (throughput reaches 90 % of its asymptote at 6 images);
- KV memory: 0.9 × (141 GB − 15 GB of weights) / 512 KiB ≈ 216 k tokens per instance;
- transfers: 000 §5.4 reports features moved in ≤ 2 ms and KV in ≤ 8 ms (p95) for TextCaps
  requests (~700 tokens, 350 MB of KV): ~50 GB/s with 1 ms of fixed cost.

These are derivations, not measurements: docs/planner.md says how results change with a measured profile.
"""

from __future__ import annotations

from pathlib import Path

from common.planner.profiles import ProfileError, ProfileSet, StageCurves, TransferModel

_IMAGES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
_CONTEXTS = (128, 512, 1024, 2048, 4096)


def _llava_7b_h20() -> ProfileSet:
    fixed, per_token, per_context_token = 15e-3, 0.14e-3, 0.125e-6
    enc_fixed, per_image = 2.3e-3, 3.5e-3
    kv_bytes = 32 * 2 * 4096 * 2
    kv_tokens = int(0.9 * (141e9 - 15e9) / kv_bytes)
    curves = StageCurves(
        encode=tuple((n, enc_fixed + per_image * n) for n in _IMAGES),
        prefill=tuple((t, fixed + per_token * t) for t in _TOKENS),
        decode=tuple(
            (b, c, fixed + b * (per_token + c * per_context_token)) for b in _BATCHES for c in _CONTEXTS
        ),
        num_kv_blocks=kv_tokens // 16,
        block_size=16,
        kv_bytes_per_token=kv_bytes,
        feature_bytes_per_image_token=4096 * 2,
        max_num_seqs=1024,
        max_images=64,
        max_tokens=16384,
        tokens_per_image=576,  # a 336 px image; LLaVA-NeXT's up-to-five tiles cost up to five
    )
    return ProfileSet(
        curves, TransferModel(latency=1e-3, bandwidth=50e9, hop=1e-3), source="paper:llava-1.5-7b"
    )


_PAPER = {"llava-1.5-7b": _llava_7b_h20}


def paper_profiles(model: str) -> ProfileSet:
    try:
        return _PAPER[model]()
    except KeyError:
        raise ProfileError(f"no paper profile for {model!r}; known: {sorted(_PAPER)}") from None


def profiles_from(spec: str | Path) -> ProfileSet:
    """`paper:<model>` for the papers' GPU-like profiles, else a JSON file written by ProfileSet.save."""
    text = str(spec)
    if text.startswith("paper:"):
        return paper_profiles(text.removeprefix("paper:"))
    return ProfileSet.load(spec)
