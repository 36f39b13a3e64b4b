"""Text requests' TBT while a long clip prefills beside them, paced and not (issue 29's goal: while a
2,000-token video prefills, concurrent text requests' TBT p90 stays within 1.5× of their TBT
without it).

    python bench/video_fairness.py                    # small-qwen2-vl, 4 text requests, a 2,048-token clip
    python bench/video_fairness.py --repeats 5

One instance that prefills and decodes (`PD`, as E+PD and EPD run them), in this process, with the
clip's features made beforehand by an encode-only engine (as E hands them over). Each run:

1. `--decoders` text requests prefill and then decode; `--baseline-steps` decode-only steps give
   their TBT without the clip (each step is one token of each: a step's time is their TBT);
2. the clip's request arrives and prefills in chunks of at most τt (`--token-budget`) tokens; the
   steps until its first token give the text requests' TBT while it prefills (p90, mean, and the
   longest: a step that carried a chunk), and the clip's own time to its first token.

Two arms alternate run by run: `paced` (`--stretch`, by default EngineConfig's `tbt_stretch`:
common/engine/pacing.py, its pacer learning from scratch each run) and `unpaced` (τt alone). The
figures are medians over `--repeats` runs with their spread, the single-thread matmul rate beside
them; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.pacing import Pacer
from common.engine.sampling import SamplingParams
from common.models import resolve_model
from common.roles import Role
from common.stats import quantile
from common.video import Clip
from trident.bench.machine import single_thread_gflops

REPO = Path(__file__).resolve().parents[1]
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def chat(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def make_clip(frames: int, size: int) -> Clip:
    """`frames` random frames of size×size at 2 fps (the pixels do not change what a step costs)."""
    pixels = np.random.default_rng(0).integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    return Clip(
        frames=pixels,
        indices=list(range(frames)),
        timestamps=[i / 2 for i in range(frames)],
        sample_fps=2.0,
        source_fps=2.0,
        duration_s=frames / 2,
        source_frames=frames,
        codec="raw",
    )


def clip_prompt(encoder: Engine, decoder: Engine, clip: Clip):
    """The clip's processed prompt for `decoder`, its features made by `encoder` (E's hand-off)."""
    text = chat(VIDEO + "Describe what happens.")
    made = encoder.add_request(
        encoder.processor.process(text, [], [clip]), params=SamplingParams(max_tokens=1)
    )
    while encoder.has_unfinished():
        encoder.step()
    processed = decoder.processor.process(text, [], [clip])
    for item, done in zip(processed.images, made.images, strict=True):
        item.features, item.pixel_values = done.features, None
    return processed


def one_run(engine: Engine, processed, args, stretch: float | None, run: int) -> dict:
    s = engine.scheduler
    s.pacer = Pacer(stretch) if stretch else None
    long_steps = args.baseline_steps + 4 * math.ceil(len(processed.token_ids) / engine.config.block_size)
    params = SamplingParams(max_tokens=long_steps, ignore_eos=True)
    texts = [
        engine.add_request(chat(f"Question {run}.{i}: tell a story."), params=params)
        for i in range(args.decoders)
    ]
    while any(not r.output_token_ids for r in texts):
        engine.step()
    baseline = []
    for _ in range(args.baseline_steps):
        t0 = time.perf_counter()
        engine.step()
        baseline.append(time.perf_counter() - t0)
    clip = engine.add_request(processed, params=SamplingParams(max_tokens=1), request_id=f"clip-{run}")
    arrived, during = time.perf_counter(), []
    while not clip.output_token_ids:
        t0 = time.perf_counter()
        engine.step()
        during.append(time.perf_counter() - t0)
    clip_ttft = time.perf_counter() - arrived
    if any(r.output_token_ids and len(r.output_token_ids) >= long_steps for r in texts):
        raise SystemExit("a text request ended while the clip prefilled: raise its max_tokens")
    for r in texts:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    base_p90, during_p90 = quantile(baseline, 0.9), quantile(during, 0.9)
    return {
        "tbt_p90_without_s": base_p90,
        "tbt_p90_during_s": during_p90,
        "ratio": during_p90 / base_p90,
        "tbt_mean_ratio": statistics.fmean(during) / statistics.fmean(baseline),
        "tbt_max_during_s": max(during),
        "clip_ttft_s": clip_ttft,
        "steps_during": len(during),
    }


def summary(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


# The table's columns after the arm: each run's figure, its scale to print, its format.
COLUMNS = (
    ("tbt_p90_without_s", 1e3, ".0f"), ("tbt_p90_during_s", 1e3, ".0f"), ("ratio", 1, ".2f"),
    ("tbt_mean_ratio", 1, ".2f"), ("tbt_max_during_s", 1e3, ".0f"), ("clip_ttft_s", 1, ".2f"),
    ("steps_during", 1, ".0f"),
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen2-vl")
    parser.add_argument("--decoders", type=int, default=4, help="text requests decoding beside the clip")
    parser.add_argument("--clip-tokens", type=int, default=2000, help="at least this many clip tokens")
    parser.add_argument("--frame-size", type=int, default=448)
    parser.add_argument("--token-budget", type=int, default=512, help="τt")
    parser.add_argument("--stretch", type=float, default=EngineConfig.tbt_stretch, help="the paced arm's")
    parser.add_argument("--baseline-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def pd_instance(args: argparse.Namespace):
    """A PD engine, and the clip's prompt for it with the features an encoder made."""
    model_dir = resolve_model(args.preset, REPO / ".trident" / "models")
    encoder = Engine(model_dir, EngineConfig(roles=frozenset({Role.ENCODE}), num_threads=args.threads))
    per_patch = (
        encoder.processor.process(chat(VIDEO), [], [make_clip(2, args.frame_size)]).images[0].num_tokens
    )
    clip = make_clip(2 * math.ceil(args.clip_tokens / per_patch), args.frame_size)
    config = EngineConfig(
        roles=frozenset({Role.PREFILL, Role.DECODE}),
        token_budget=args.token_budget,
        prefix_caching=False,
        num_threads=args.threads,
        kv_cache_bytes=512 << 20,
    )
    engine = Engine(model_dir, config)
    return engine, clip_prompt(encoder, engine, clip)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rate_before = single_thread_gflops()
    engine, processed = pd_instance(args)
    clip_tokens = sum(i.num_tokens for i in processed.images)
    one_run(engine, processed, args, None, -1)  # warm: first steps of every shape
    arms: dict[str, list[dict]] = {"paced": [], "unpaced": []}
    for run in range(args.repeats):
        for arm, stretch in (("paced", args.stretch), ("unpaced", None)):
            arms[arm].append(one_run(engine, processed, args, stretch, run))
    rate_after = single_thread_gflops()
    print(
        f"{args.preset}, PD instance, τt {args.token_budget}, {args.decoders} text requests decoding, "
        f"a clip of {clip_tokens} tokens ({len(processed.token_ids)} in its prompt); median (min–max) of "
        f"{args.repeats} runs"
    )
    result = table(arms)
    figures = {
        "preset": args.preset,
        "decoders": args.decoders,
        "clip_tokens": clip_tokens,
        "token_budget": args.token_budget,
        "stretch": args.stretch,
        "repeats": args.repeats,
        **result,
        "goal_paced_ratio_within_1_5": result["paced_ratio"] <= 1.5,
        "threads": args.threads,
        "matmul_gflops": [round(rate_before, 1), round(rate_after, 1)],
    }
    print(json.dumps(figures))


def table(arms: dict[str, list[dict]]) -> dict:
    """The arms' table printed; each figure's median and range, by arm."""
    lines = [
        "| arm | text TBT p90 without clip ms | during its prefill ms | p90 ratio | mean ratio "
        "| max during ms | clip TTFT s | steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    result: dict = {}
    for arm, runs in arms.items():
        cells = []
        for key, scale, fmt in COLUMNS:
            med, lo, hi = (v * scale for v in summary(runs, key))
            cells.append(f"{med:{fmt}} ({lo:{fmt}}–{hi:{fmt}})")
            result[f"{arm}_{key}"] = round(med / scale, 4)
            result[f"{arm}_{key}_range"] = [round(lo / scale, 4), round(hi / scale, 4)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
