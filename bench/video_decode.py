"""What decoding and sampling a video costs, beside encoding the frames it yields (issue 29's goal:
decode + sample of a 30-second 720p clip at 2 fps costs less than encoding its frames).

    python bench/video_decode.py                   # 30 s of 1280x720 at 30 fps, sampled at 2 fps
    python bench/video_decode.py --seconds 10      # shorter

* decode: `common.video.decode_video` on the clip's bytes (H.264, written here by FFmpeg through
  PyAV: a moving texture, so the encoder has motion and detail to code), at `--fps`: the header,
  every packet counted without decoding, then the frames up to the last one sampled.
* encode: the vision tower of `--preset` (a random-weight checkpoint written once under
  .trident/models) on the sampled frames, as the encode stage runs them: each pair of frames is one
  temporal patch, which costs the tower what one image of the frame's size costs, so the frames
  go through as images of the size the Qwen-VL video processor resizes them to (at most
  768·28·28 pixels a frame). A small preset's tower is far cheaper than a 7B model's (675 M
  parameters), so the ratio here is the least favourable to decoding.

Each is the median of `--repeats` runs, with the spread; the single-thread matmul rate is printed
beside them. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from common.engine.loader import load_model
from common.engine.processor import RequestProcessor
from common.models import resolve_model
from common.video import VideoLimits, decode_video
from trident.bench.clips import encode_clip, moving_texture
from trident.bench.machine import single_thread_gflops

REPO = Path(__file__).resolve().parents[1]

VIDEO_MAX_PIXELS = 768 * 28 * 28  # the Qwen-VL video processors' per-frame bound
FACTOR = 28  # patch 14 × merge 2


def make_clip(seconds: float, fps: int, width: int, height: int) -> bytes:
    """A moving texture with detail at 1/8 of the frame's resolution: about the bitrate of camera
    footage, so the decoder works as hard as it would on it."""
    frames = moving_texture(int(seconds * fps), (width, height), seed=0, detail=8)
    return encode_clip(frames, fps, (width, height), options={"preset": "veryfast", "crf": "23"})


def video_size(height: int, width: int) -> tuple[int, int]:
    """The Qwen-VL video processors' resize: multiples of 28, at most VIDEO_MAX_PIXELS."""
    scale = min(1.0, (VIDEO_MAX_PIXELS / (height * width)) ** 0.5)
    return max(FACTOR, int(height * scale) // FACTOR * FACTOR), max(
        FACTOR, int(width * scale) // FACTOR * FACTOR
    )


def timed(fn, repeats: int) -> tuple[float, float, float, object]:
    samples, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples), max(samples), result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--source-fps", type=int, default=30)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--fps", type=float, default=2.0, help="frames sampled per second of video")
    parser.add_argument("--preset", default="small-qwen2-vl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def tower_inputs(preset: str, frames, height: int, width: int):
    """The preset's vision tower, the frames as its inputs (one picture per temporal patch, at the
    video processor's size), their tokens, and the size the tower runs on."""
    model_dir = resolve_model(preset, REPO / ".trident" / "models")
    processor = RequestProcessor(model_dir)
    model = load_model(model_dir, with_language=False)
    h, w = video_size(height, width)
    # The frames at the video processor's size: the preset's image bound (for its small tower's
    # pictures) would shrink them further.
    processor.images.size = {"shortest_edge": FACTOR * FACTOR, "longest_edge": VIDEO_MAX_PIXELS}
    pictures = [
        Image.fromarray(f).resize((w, h), Image.BICUBIC) for f in frames[::2]
    ]  # one per temporal patch
    images = processor.process(processor.image_token * len(pictures), pictures).images
    tokens = sum(img.num_tokens for img in images)
    _, grid_h, grid_w = images[0].grid_thw
    return model, images, tokens, f"{grid_w * 14}x{grid_h * 14}"  # what the tower ran on


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    width, height = map(int, args.size.split("x"))
    rate_before = single_thread_gflops()
    t0 = time.perf_counter()
    data = make_clip(args.seconds, args.source_fps, width, height)
    print(
        f"clip: {len(data) / 1e6:.1f} MB, {args.seconds:g} s of {args.size} at {args.source_fps} fps "
        f"(written in {time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    wanted = int(args.seconds * args.fps)
    limits = VideoLimits(max_frames=max(wanted, 2))
    dec, dec_lo, dec_hi, clip = timed(
        lambda: decode_video(data, limits, args.fps, max(wanted, 2)), args.repeats
    )
    frames = clip.frames  # type: ignore[attr-defined]
    model, images, tokens, ran_on = tower_inputs(args.preset, frames, height, width)

    def encode() -> None:
        with torch.inference_mode():
            model.encode(images, torch.device("cpu"), torch.float32)

    encode()  # warm
    enc, enc_lo, enc_hi, _ = timed(encode, args.repeats)
    rate_after = single_thread_gflops()
    decoded = f"decode + sample {len(frames)} frames of {clip.source_frames}"  # type: ignore[attr-defined]
    encoded = f"encode {len(images)} temporal patches of {ran_on} ({tokens} tokens), {args.preset}"
    lines = ["| step | median s | min–max s |", "| --- | ---: | ---: |"]
    for step, (median, low, high) in ((decoded, (dec, dec_lo, dec_hi)), (encoded, (enc, enc_lo, enc_hi))):
        lines.append(f"| {step} | {median:.3f} | {low:.3f}–{high:.3f} |")
    print("\n".join(lines))
    clip_figures = {"clip_bytes": len(data), "seconds": args.seconds, "size": args.size}
    print(
        json.dumps(
            {
                **clip_figures,
                "source_fps": args.source_fps,
                "sampled_frames": len(frames),
                "decode_s": round(dec, 4),
                "decode_min_s": round(dec_lo, 4),
                "decode_max_s": round(dec_hi, 4),
                "preset": args.preset,
                "temporal_patches": len(images),
                "tokens": tokens,
                "encode_s": round(enc, 4),
                "encode_min_s": round(enc_lo, 4),
                "encode_max_s": round(enc_hi, 4),
                "decode_over_encode": round(dec / enc, 3),
                "goal_decode_below_encode": dec < enc,
                "threads": args.threads,
                "matmul_gflops": [round(rate_before, 1), round(rate_after, 1)],
            }
        )
    )


if __name__ == "__main__":
    main()
