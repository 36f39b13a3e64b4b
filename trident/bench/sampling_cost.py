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
from common.engine.sampling import draw
from common.protocol import SamplingParams

SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 5}
FIELDS = {
    "logprobs": 5, "logit_bias": ((13, 2.0), (29, -100.0), (100, 1.5)), "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.2,
}  # fmt: skip
SAMPLER_REPEATS = 10
MODES = {
    "greedy": {},
    "greedy_fields": FIELDS,
    "sampled": SAMPLED,
    "sampled_fields": {**SAMPLED, **FIELDS, "min_p": 0.05},
}


def decode_steps(
    engine: Engine, prompts: Sequence[tuple[str, object]], params: SamplingParams
) -> tuple[list[float], float]:
    """Seconds of each decode-only step while the prompts (text, image) run to the end together, and
    the least seconds the sampler took over the last such step's logits (`SAMPLER_REPEATS` draws, the
    requests' processors as they were then): the part of a step the fields can add to."""
    seconds: list[float] = []
    last: dict = {}
    engine.on_step = lambda batch, s: seconds.append(s) if not (batch.prefills or batch.encodes) else None
    run = engine.runner.run

    def keeping(batch):
        result = run(batch)
        if batch.decodes and not batch.prefills and result.logits is not None:
            last.update(logits=result.logits, reqs=list(result.sampled))
        return result

    engine.runner.run = keeping
    try:
        for text, image in prompts:
            engine.add_request(text, [image], params)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.on_step = None
        del engine.runner.run
    return seconds, _sampler_seconds(last["logits"], last["reqs"])


def _sampler_seconds(logits, reqs) -> float:
    samplers = [r.sampler for r in reqs]
    histories = [_History(r.prompt_token_ids, r.output_token_ids[:-1]) for r in reqs]  # as they were
    best = float("inf")
    for _ in range(SAMPLER_REPEATS):
        started = time.perf_counter()
        draw(logits, samplers, histories)
        best = min(best, time.perf_counter() - started)
    return best


class _History:
    def __init__(self, prompt: list[int], outputs: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids = prompt, outputs


def tbt_by_mode(
    engine: Engine, prompts: Sequence[tuple[str, object]], max_tokens: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Per mode: the median decode step (ms) over `rounds` interleaved rounds, and the steps timed."""
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    sampler: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, fields in MODES.items():
            min_tokens = {"min_tokens": max_tokens} if mode.endswith("fields") else {}
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields, **min_tokens)
            started = time.perf_counter()
            seconds, sampling = decode_steps(engine, prompts, params)
            steps[mode] += seconds
            sampler[mode].append(sampling)
            print(f"  {mode}: {time.perf_counter() - started:.2f}s")
    return {
        mode: {
            "tbt_ms": round(statistics.median(s) * 1e3, 2),
            "sampler_ms": round(min(sampler[mode]) * 1e3, 2),
            "steps": len(s),
        }
        for mode, s in steps.items()
    }
