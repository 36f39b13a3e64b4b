"""What the sampling fields cost a decode step (issue 48): the same requests stepped to the end four
ways — greedy, and sampled (temperature, top-p, a seed), each without and with every field on
(logprobs and top-5, logit_bias, the three penalties, min_tokens; min_p when sampled) — and each
run's time between tokens: the median of its decode-only steps, whole (schedule, forward, sampler,
outputs). bench/engine.py's `--sampling-fields` runs it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from common.engine.engine import Engine
from common.protocol import SamplingParams

SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 5}
FIELDS = {
    "logprobs": 5, "logit_bias": ((13, 2.0), (29, -100.0), (100, 1.5)), "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.2,
}  # fmt: skip
MODES = {
    "greedy": {},
    "greedy_fields": FIELDS,
    "sampled": SAMPLED,
    "sampled_fields": {**SAMPLED, **FIELDS, "min_p": 0.05},
}


def decode_steps(
    engine: Engine, prompts: Sequence[tuple[str, object]], params: SamplingParams
) -> list[float]:
    """Seconds of each decode-only step while the prompts (text, image) run to the end together."""
    seconds: list[float] = []
    engine.on_step = lambda batch, s: seconds.append(s) if not (batch.prefills or batch.encodes) else None
    try:
        for text, image in prompts:
            engine.add_request(text, [image], params)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.on_step = None
    return seconds


def tbt_by_mode(
    engine: Engine, prompts: Sequence[tuple[str, object]], max_tokens: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Per mode: the median decode step (ms) over `rounds` interleaved rounds, and the steps timed."""
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, fields in MODES.items():
            min_tokens = {"min_tokens": max_tokens} if mode.endswith("fields") else {}
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields, **min_tokens)
            started = time.perf_counter()
            steps[mode] += decode_steps(engine, prompts, params)
            print(f"  {mode}: {time.perf_counter() - started:.2f}s")
    return {
        mode: {"tbt_ms": round(statistics.median(s) * 1e3, 2), "steps": len(s)} for mode, s in steps.items()
    }
