"""INT8 KV on the prefill→decode wire (issue 27): how far it moves what decode computes.

    python bench/kv_int8.py [--presets small-llava,small-qwen2-vl] [--prompts 100] [--max-tokens 32]
                            [--threads 2] [--compare int8|bf16|int8,bf16]

For each preset, `--prompts` requests (a third with no image, a third with one, a third with two;
questions from a fixed list) are prefilled once by a prefill engine. Decode engines import the
same KV — as exported (`native`), or packed to INT8 and back (common/engine/kv_quant.py) — and
generate `--max-tokens` greedy tokens each (eos ignored, so every answer has them all). With
`--compare bf16` the KV is rounded to bfloat16 instead of INT8: the yardstick of a perturbation
every GPU deployment already lives with. Reported per preset:

- `first_logit_max_abs_diff`: the largest |Δ| between the native and the quantised decoder's
  logits at the first decode step (only the imported KV differs), with the logits' std for scale;
- `token_agreement`: the share of positions where the quantised decoder, fed the native answer so
  far (teacher-forced), picks the native answer's next token — the KV's effect on each choice;
- `free_running_agreement` and `identical_answers`: the same decoder left to its own tokens: after
  one different choice the answers go different ways, and every later position counts against it;
- `logit_max_abs_diff` and `logit_median_max_abs_diff`: over the teacher-forced positions, the
  largest |Δ| between the two decoders' logits, and the median of each position's largest;
- `by_margin`: the teacher-forced positions binned by the native decoder's gap between its top two
  logits (the room a perturbation has before it changes the choice): each bin's share of the
  positions and its agreement; `flipped_max_margin`: the widest gap at which a choice still changed;
- `wire_bytes` and `native_bytes`: what the KV of all requests takes on the wire each way.

The last line is one JSON object. Random-weight checkpoints (the only ones here) are not trained
models: their logit gaps are what the weights' scales make them — small-llava's top two logits are
often within the error that rounding KV to bfloat16 makes — so this measures the quantisation
against this engine's numbers, not a real model's quality.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.engine import Engine, EngineConfig, kv_quant
from common.engine.sampling import SamplingParams
from common.models import resolve_model
from common.roles import Role
from trident.bench.machine import single_thread_gflops

QUESTIONS = [
    "What is in the picture?",
    "Describe the scene in detail.",
    "Count the objects and name their colours.",
    "Tell me a short story about what you see.",
    "Which object is nearest to the camera, and why?",
]


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


def first_logits(engine: Engine, ids: list[str]) -> torch.Tensor:
    """Logits of every request's first decode step (the engine's own runner, nothing sampled)."""
    reqs = [engine.requests[i] for i in ids]
    return engine.runner.forward([], reqs).logits


def bf16_round_trip(buf: torch.Tensor) -> tuple[torch.Tensor, int]:
    return buf.to(torch.bfloat16).to(buf.dtype), buf.numel() * 2


def int8_round_trip(buf: torch.Tensor) -> tuple[torch.Tensor, int]:
    packed = kv_quant.pack(buf)
    return kv_quant.unpack(packed, tuple(buf.shape), buf.dtype), packed.numel()


MARGIN_BINS = (0.0, 0.25, 0.5, 1.0, 2.0)  # top-two logit gaps: [0, 0.25), ..., [2, inf)


def recorded_logits(decoder: Engine) -> dict[str, list[torch.Tensor]]:
    """From now on, each request's logits at every step the decoder's runner computes, in order."""
    rows: dict[str, list[torch.Tensor]] = {}
    forward = decoder.runner.forward

    def recording(*args, **kwargs):
        result = forward(*args, **kwargs)
        for req, row in zip(result.sampled, result.logits if result.sampled else (), strict=True):
            rows.setdefault(req.request_id, []).append(row.clone())
        return result

    decoder.runner.forward = recording
    return rows


def by_margin(native: torch.Tensor, forced: torch.Tensor, agreed: torch.Tensor) -> dict:
    """Positions binned by the native top-two gap: each bin's share and agreement; the widest gap
    at which a choice changed. `native`/`forced` [positions, vocab], `agreed` [positions] bool."""
    top2 = native.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    bins = {}
    edges = (*MARGIN_BINS, float("inf"))
    for lo, hi in itertools.pairwise(edges):
        inside = (gap >= lo) & (gap < hi)
        n = int(inside.sum())
        label = f"{lo:g}-{hi:g}" if hi != float("inf") else f">={lo:g}"
        bins[label] = {
            "share": round(n / len(gap), 4),
            "agreement": round(float(agreed[inside].float().mean()), 4) if n else None,
        }
    flipped = gap[~agreed]
    diff = (forced - native).abs().amax(dim=-1)
    return {
        "logit_max_abs_diff": round(float(diff.max()), 5),
        "logit_median_max_abs_diff": round(float(diff.median()), 5),
        "by_margin": bins,
        "flipped_max_margin": round(float(flipped.max()), 5) if len(flipped) else None,
    }


def decode(decoder: Engine, ids: list[str], forced: dict[str, list[int]] | None = None) -> dict[str, list]:
    """Each request's decoded tokens. With `forced` (each request's whole native answer), teacher
    forcing: each step's choice is recorded as whether it matched the native token at that
    position, and the native token then replaces it, so the next step sees the native answer."""
    got: dict[str, list] = {i: [] for i in ids}
    while decoder.has_unfinished():
        for o in decoder.step():
            if forced is None:
                got[o.request_id] += o.new_token_ids
                continue
            want = forced[o.request_id][len(got[o.request_id]) + 1]  # 0 is the prefill's token
            got[o.request_id].append(o.new_token_ids[-1] == want)
            if o.request_id in decoder.requests:  # still running: its next step feeds this token
                decoder.requests[o.request_id].output_token_ids[-1] = want
    return got


@dataclass(frozen=True)
class Decoders:
    """How each way's decoder is built: the model, the engines' settings, the requests' sampling,
    layers per exported group, and what the KV is rounded through on the wire."""

    model: Path
    config: dict
    params: SamplingParams
    group: int
    round_trip: Callable[[torch.Tensor], tuple[torch.Tensor, int]]

    def prefill(self, prompts: int) -> tuple[Engine, list]:
        """An EP engine that has prefilled `prompts` requests (0, 1 or 2 images each)."""
        prefill = Engine(
            self.model, EngineConfig(roles=frozenset({Role.ENCODE, Role.PREFILL}), **self.config)
        )
        reqs = []
        for i in range(prompts):
            n = i % 3
            prompt = prefill.chat_prompt(QUESTIONS[i % len(QUESTIONS)] + f" ({i})", n)
            reqs.append(prefill.add_request(prompt, [image(7 * i + k) for k in range(n)], self.params))
        while prefill.has_unfinished():
            prefill.step()
        return prefill, reqs

    def decoder(self, prefill: Engine, reqs: list, rounded: bool) -> tuple[Engine, int, int]:
        """A decoder holding every request's exported KV, `rounded` through the wire or as it is; and
        the KV's bytes, native and on the wire (0 when not rounded)."""
        decoder = Engine(self.model, EngineConfig(roles=frozenset({Role.DECODE}), **self.config))
        native_bytes = wire_bytes = 0
        for req in reqs:
            kv = prefill.handoff.export_kv(req.request_id, self.group)
            if rounded:
                native_bytes += sum(b.numel() * b.element_size() for b in kv)
                trips = [self.round_trip(b) for b in kv]
                wire_bytes += sum(n for _, n in trips)
                kv = [t for t, _ in trips]
            decoder.handoff.add_prefilled(
                req.request_id, req.prompt_token_ids, req.output_token_ids, self.params, kv, req.rope_delta
            )
        return decoder, native_bytes, wire_bytes


def measure(preset: str, prompts: int, max_tokens: int, compare: str = "int8", group: int = 4) -> dict:
    config = {
        "prefix_caching": False,
        "kv_cache_bytes": 2 << 30,
        "max_num_seqs": prompts,
        "detokenize": False,
    }
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    round_trip = int8_round_trip if compare == "int8" else bf16_round_trip
    build = Decoders(resolve_model(preset), config, params, group, round_trip)
    prefill, reqs = build.prefill(prompts)
    ids = [r.request_id for r in reqs]
    out: dict = {"preset": preset, "compare": compare, "prompts": prompts, "max_tokens": max_tokens}
    native_bytes = wire_bytes = 0
    answers: dict[str, dict[str, list]] = {}
    logits: dict[str, torch.Tensor] = {}
    steps: dict[str, dict[str, list[torch.Tensor]]] = {}  # native and forced: each step's logits
    for way in ("native", "forced", "free"):
        decoder, native, wire = build.decoder(prefill, reqs, rounded=way != "native")
        native_bytes, wire_bytes = native_bytes + native, wire_bytes + wire
        if way != "forced":
            with torch.inference_mode():
                logits[way] = first_logits(decoder, ids)
        forced = None
        if way == "forced":  # along the native answer: the prefill's token, then the decoded ones
            forced = {r.request_id: r.output_token_ids[:1] + answers["native"][r.request_id] for r in reqs}
        if way != "free":
            steps[way] = recorded_logits(decoder)
        answers[way] = decode(decoder, ids, forced)
    positions = prompts * (max_tokens - 1)  # the decoded ones; the prefill's first token is shared
    native, free = answers["native"], answers["free"]
    assert all(len(native[i]) == max_tokens - 1 for i in ids)
    same = sum(x == y for i in ids for x, y in zip(native[i], free[i], strict=True))
    margins = by_margin(
        torch.stack([row for i in ids for row in steps["native"][i]]),
        torch.stack([row for i in ids for row in steps["forced"][i]]),
        torch.tensor([m for i in ids for m in answers["forced"][i]]),
    )
    return (
        out
        | margins
        | {
            "first_logit_max_abs_diff": round(float((logits["native"] - logits["free"]).abs().max()), 5),
            "logit_std": round(float(logits["native"].std()), 3),
            "token_agreement": round(sum(sum(m) for m in answers["forced"].values()) / positions, 4),
            "free_running_agreement": round(same / positions, 4),
            "identical_answers": round(sum(native[i] == free[i] for i in ids) / prompts, 4),
            "native_bytes": native_bytes // 2,  # counted for the forced and the free decoder alike
            "wire_bytes": wire_bytes // 2,
            "wire_over_native": round(wire_bytes / native_bytes, 4),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small-llava,small-qwen2-vl")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--compare", default="int8", help="what the KV is rounded to: int8, bf16, or both (int8,bf16)"
    )
    args = ap.parse_args()
    compares = args.compare.split(",")
    if unknown := set(compares) - {"int8", "bf16"}:
        ap.error(f"--compare takes int8 and bf16, not {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    start, gflops = time.monotonic(), single_thread_gflops()
    rows = []
    for preset, compare in itertools.product(args.presets.split(","), compares):
        rows.append(measure(preset, args.prompts, args.max_tokens, compare))
        r = rows[-1]
        print(
            f"{preset} ({compare}): first-step max |Δlogit| {r['first_logit_max_abs_diff']} "
            f"(logit std {r['logit_std']}), "
            f"tokens {r['token_agreement']:.1%} (teacher-forced), {r['free_running_agreement']:.1%} (free), "
            f"identical answers {r['identical_answers']:.1%}, wire {r['wire_over_native']:.1%} of native",
            flush=True,
        )
        bins = ", ".join(
            f"{label}: {b['share']:.1%} of positions, {b['agreement']:.1%} agree"
            for label, b in r["by_margin"].items()
            if b["agreement"] is not None
        )
        print(f"  by native top-two gap: {bins}; widest gap flipped: {r['flipped_max_margin']}", flush=True)
    print(f"machine: single-thread fp32 matmul {gflops:.1f} GFLOP/s; {time.monotonic() - start:.0f} s")
    print(json.dumps({"matmul_gflops": round(gflops, 1), "results": rows}))


if __name__ == "__main__":
    main()
