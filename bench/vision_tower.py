"""The encode stage's vision tower as Trident runs it against the same tower as transformers builds it.

    python bench/vision_tower.py [--preset small-qwen2-vl | --model DIR] [--sizes 336x336,448x448]
                                 [--rounds 5] [--repeats 3] [--threads 1]

Trident builds each family's tower from transformers' modules and then replaces a few of them with
ones that compute the same model faster (common/engine/models/vision_ops.py). This times both
towers, loaded with the checkpoint's weights, encoding one picture of each size as a request's
image reaches the encode stage (through the checkpoint's processor): each figure is the least of
`--repeats` calls, and rounds alternate which tower goes first. A table of medians [min-max], the
ratio round by round, and the largest difference between the two towers' features relative to
their largest magnitude; the matmul rate beside it; one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from PIL import Image

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.models import resolve_model
from common.roles import Role
from trident.bench.machine import least_seconds, single_thread_gflops

TOWER_ATTRS = ("visual", "vision_tower")  # Qwen-VL's encoder holds its tower as `visual`, LLaVA's otherwise


def picture(size: str):
    w, h = (int(v) for v in size.lower().split("x"))
    return Image.fromarray(np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


class Towers:
    """The engine's vision tower (Trident's) and a copy of it in transformers' own modules, with
    the same weights, each run through the engine's encode."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.vision = engine.model.vision
        self.attr = next(a for a in TOWER_ATTRS if hasattr(self.vision, a))
        ours = getattr(self.vision, self.attr)
        plain = type(ours)(ours.config).eval()  # transformers' modules throughout
        plain.load_state_dict(ours.state_dict())
        self.by_name = {"trident": ours, "transformers": plain}
        self.dtype = next(ours.parameters()).dtype

    def encode(self, name: str, image) -> torch.Tensor:
        setattr(self.vision, self.attr, self.by_name[name])
        try:
            return self.engine.model.encode([image], self.engine.device, self.dtype)[0]
        finally:
            setattr(self.vision, self.attr, self.by_name["trident"])

    def measure(self, size: str, rounds: int, repeats: int) -> dict:
        """One picture of `size`: each tower's encode timed over `rounds` (order alternating), and how
        far Trident's features are from transformers'."""
        processor = self.engine.processor
        image = processor.process(processor.image_token, [picture(size)]).images[0]
        want, got = self.encode("transformers", image), self.encode("trident", image)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        times: dict[str, list[float]] = {name: [] for name in self.by_name}
        for r in range(rounds):
            order = list(self.by_name) if r % 2 == 0 else list(reversed(self.by_name))
            for name in order:
                times[name].append(least_seconds(lambda n=name, i=image: self.encode(n, i), repeats) * 1e3)
        ratio = [a / b for a, b in zip(times["trident"], times["transformers"], strict=True)]
        row = {"size": size, "image_tokens": int(got.shape[0]), "max_rel_diff": rel}
        for name, ms in times.items():
            row[name] = {
                "median_ms": round(statistics.median(ms), 2),
                "min_ms": round(min(ms), 2),
                "max_ms": round(max(ms), 2),
            }
        row["trident_over_transformers"] = round(statistics.median(ratio), 3)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-qwen2-vl")
    ap.add_argument("--model", help="a checkpoint directory (instead of --preset)")
    ap.add_argument("--sizes", default="336x336,448x448")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gflops = [single_thread_gflops()]
    engine = Engine(
        resolve_model(args.model or args.preset),
        EngineConfig(roles=frozenset({Role.ENCODE}), num_threads=args.threads),
    )
    towers = Towers(engine)
    rows = [towers.measure(size, args.rounds, args.repeats) for size in args.sizes.split(",")]
    gflops.append(single_thread_gflops())
    model_type = engine.model.config.model_type
    print(
        f"{model_type}, one picture an encode, {args.threads} thread(s), "
        f"medians of {args.rounds} rounds [min-max]"
    )
    print(
        "| size | image tokens | Trident (ms) | transformers (ms) | Trident / transformers | max rel diff |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        cells = [f"{row[n]['median_ms']} [{row[n]['min_ms']}-{row[n]['max_ms']}]" for n in towers.by_name]
        print(
            f"| {row['size']} | {row['image_tokens']} | {cells[0]} | {cells[1]} | "
            f"{row['trident_over_transformers']}x | {row['max_rel_diff']:.1e} |"
        )
    print(f"machine: single-thread fp32 matmul {gflops[0]:.1f} GFLOP/s before, {gflops[1]:.1f} after")
    figures = {"model": model_type, "threads": args.threads, "rounds": args.rounds}
    print(json.dumps({**figures, "rows": rows, "matmul_gflops": gflops}))


if __name__ == "__main__":
    main()
