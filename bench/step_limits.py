"""Does an EPD engine keep its steps under the latency limit its budgets were sized for?

    python bench/step_limits.py [--model DIR | --preset small-llava] [--rate 1.2] [--requests 60]
                                [--ttft-slo 2] [--tbt-slo 0.2] [--threads 1]

One engine with every role, profiled at start-up as a worker is (BudgetProfiler), serves
TextCaps-like requests (one 336 px image, up to 64 tokens) arriving as a Poisson process, alone on
the machine. It runs twice on the same arrivals: as shipped, where the images and tokens of one
step share the limit (images/τe + tokens/τt ≤ 1), and as Algorithm 1 reads, filling τe and τt
both. Each step is timed and classed by what it held (E encode, P prefill chunk, D decodes).
Prints a table per run and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.profiler import BudgetProfiler
from common.engine.sampling import SamplingParams
from common.stats import quantile


def serve(engine: Engine, arrivals: np.ndarray, images: list[Image.Image]) -> list[tuple[float, str]]:
    """Admit requests at their arrival times and step until all finish: (seconds, content) a step."""
    prompt = engine.chat_prompt("Write a short caption for this image, in one sentence.", 1)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    held = {}
    run = engine.runner.run

    def timed_run(batch):
        held["content"] = "E" * bool(batch.encodes) + "P" * bool(batch.prefills) + "D" * bool(batch.decodes)
        return run(batch)

    engine.runner.run = timed_run
    steps, admitted, start = [], 0, time.perf_counter()
    while admitted < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while admitted < len(arrivals) and arrivals[admitted] <= now:
            engine.add_request(prompt, [images[admitted]], params)
            admitted += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[admitted] - now))
            continue
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t, held["content"]))
    engine.runner.run = run
    return steps


def summary(steps: list[tuple[float, str]], limit: float) -> dict:
    by_content = collections.defaultdict(list)
    for seconds, content in steps:
        by_content[content].append(seconds)
    over = sum(s > limit for s, _ in steps)
    return {
        "steps": len(steps),
        "over_limit_pct": round(100 * over / len(steps), 2),
        "by_content": {
            k: {
                "n": len(v),
                "p50_ms": round(1e3 * quantile(v, 0.5), 1),
                "p90_ms": round(1e3 * quantile(v, 0.9), 1),
                "over": int(sum(s > limit for s in v)),
            }
            for k, v in sorted(by_content.items())
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory instead of a preset")
    ap.add_argument("--rate", type=float, default=1.2)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tbt-slo", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = args.model or Path(".trident/models") / args.preset
    if args.model is None and not is_checkpoint_dir(model):
        write_checkpoint(model, args.preset, seed=0)

    torch.set_num_threads(args.threads)
    # No feature cache: the second run sends the same images and must encode them again.
    config = EngineConfig(num_threads=args.threads, detokenize=False, feature_cache_bytes=0)
    engine = Engine(model, config)
    profile = BudgetProfiler(engine).profile(args.ttft_slo, args.tbt_slo, max_images=8, max_tokens=2048)
    engine.apply_profile(profile)
    limit = profile.latency_limit
    budgets = f"image budget {profile.image_budget}, token budget {profile.token_budget}"
    print(f"limit {limit * 1e3:.0f} ms, {budgets}")

    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests))
    images = [Image.fromarray(rng.integers(0, 256, (336, 336, 3), dtype=np.uint8)) for _ in arrivals]
    report = {
        "limit_ms": limit * 1e3,
        "image_budget": profile.image_budget,
        "token_budget": profile.token_budget,
    }
    for name, shared in (
        ("shared limit (as shipped)", True),
        ("both budgets filled (Algorithm 1 as read)", False),
    ):
        engine.scheduler.shared_limit = shared
        result = summary(serve(engine, arrivals, images), limit)
        report["shared" if shared else "both_filled"] = result
        print(f"\n{name}: {result['steps']} steps, {result['over_limit_pct']} % over the limit")
        for content, row in result["by_content"].items():
            times = f"p50 {row['p50_ms']:6.1f} ms  p90 {row['p90_ms']:6.1f} ms"
            print(f"  {content:4s} n={row['n']:4d}  {times}  over {row['over']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
