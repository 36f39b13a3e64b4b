"""What structured output costs a decode step: the grammar's token mask (common/engine/grammar.py)
at every sampled token, as time between tokens (TBT) at a batch of `--batch` requests.

    python bench/grammar_tbt.py [--preset small-llava] [--batch 8] [--steps 48] [--rounds 3] [--threads 2]

Each round runs the same `--batch` requests (one image each) twice on one engine: free, and under
a JSON schema grammar (a list of bounded integers long enough that no answer ends before
`--steps` tokens), in turn. Only steps in which all the batch decodes (no encode or prefill in
them) are timed. Reported: the median step each way and their ratio within each round
(`measured_overhead_pct`: on a shared machine whole rounds run several times slower than others,
so this moves by tens of percent either way), and the grammar's own time per step, timed apart —
the mask's one call in the sampler plus the advances with the sampled tokens — against the free
step (`overhead_pct`): the rest of a masked step is the same work. The goal (issue 48) is an
overhead of at most 10 % at batch 8 on small-llava. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from PIL import Image

from common.engine import Engine, EngineConfig
from common.engine import sampling as sampler
from common.engine.grammar import GrammarState
from common.engine.sampling import SamplingParams
from common.models import resolve_model
from services.gateway.api_structured import ResponseFormat
from services.gateway.structured import response_grammar
from trident.bench.machine import single_thread_gflops

GOAL_PCT = 10.0


def long_list_grammar(items: int) -> str:
    schema = {
        "type": "object",
        "properties": {"values": {"type": "array", "minItems": items, "maxItems": items,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
        "required": ["values"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "values", "schema": schema, "strict": True}}
    return response_grammar(ResponseFormat.model_validate(fmt))


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8))


class GrammarClock:
    """Times what a grammar adds to a step: the sampler's one call of the mask (the batch's rows),
    and each request's advance with its sampled token."""

    def __init__(self) -> None:
        self.mask: list[float] = []
        self.advance = 0.0
        self._mask, self._advance = sampler.mask_rows, GrammarState.advance

    def __enter__(self) -> GrammarClock:
        mask, advance = self._mask, self._advance

        def timed_mask(logits, states) -> None:
            started = time.perf_counter()
            mask(logits, states)
            self.mask.append(time.perf_counter() - started)

        def timed_advance(state, token: int) -> None:
            started = time.perf_counter()
            advance(state, token)
            self.advance += time.perf_counter() - started

        sampler.mask_rows, GrammarState.advance = timed_mask, timed_advance
        return self

    def __exit__(self, *_) -> None:
        sampler.mask_rows, GrammarState.advance = self._mask, self._advance

    def per_step_ms(self) -> float:
        """The median mask call plus the mean advances of one step, in ms."""
        return 1e3 * (statistics.median(self.mask) + self.advance / max(1, len(self.mask)))


def decode_steps(engine: Engine, batch: int, params: SamplingParams) -> list[float]:
    """Seconds of each step in which all `batch` requests decoded."""
    times: list[float] = []

    def timed(step, seconds: float) -> None:
        if len(step.decodes) == batch and not step.encodes and not step.prefills:
            times.append(seconds)

    engine.on_step = timed
    prompt = engine.chat_prompt("List the values you see, as JSON", 1)
    for i in range(batch):
        engine.add_request(prompt, [image(i)], params)
    while engine.has_unfinished():
        engine.step()
    engine.on_step = None
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    # As a worker runs it: no text made in the engine (the gateway makes it), no prefix cache across rounds.
    config = EngineConfig(num_threads=args.threads, prefix_caching=False, detokenize=False)
    engine = Engine(resolve_model(args.preset), config)
    grammar = long_list_grammar(args.steps)  # at least two tokens an item: never done within --steps
    free = SamplingParams(max_tokens=args.steps, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.steps, grammar=grammar)
    decode_steps(engine, args.batch, free)  # warm-up: first-touch allocations, lazy tokenizer build
    decode_steps(engine, args.batch, bound)
    plain, masked, ratios = [], [], []
    with GrammarClock() as grammar_clock:
        for r in range(args.rounds):
            free_steps = decode_steps(engine, args.batch, free)
            masked_steps = decode_steps(engine, args.batch, bound)
            plain += free_steps
            masked += masked_steps
            ratios.append(statistics.median(masked_steps) / statistics.median(free_steps))
            print(f"round {r + 1}: median step {1e3 * statistics.median(free_steps):.2f} ms free, "
                  f"{1e3 * statistics.median(masked_steps):.2f} ms masked")  # fmt: skip
    # A busy machine moves whole rounds: the ratio within each round, then its median, is the figure.
    tbt_plain, tbt_masked = statistics.median(plain) * 1e3, statistics.median(masked) * 1e3
    grammar_ms = grammar_clock.per_step_ms()
    # The grammar's own time against the free step: the rest of a masked step is the same work.
    overhead = 100 * grammar_ms / tbt_plain
    measured = 100 * (statistics.median(ratios) - 1)
    print(
        f"{args.preset}, batch {args.batch}: TBT {tbt_plain:.2f} ms free, {tbt_masked:.2f} ms masked "
        f"({measured:+.1f} % within rounds); the grammar's own time {grammar_ms:.3f} ms a step "
        f"({overhead:.2f} % of the free step)"
    )
    print(json.dumps({
        "preset": args.preset, "batch": args.batch, "steps_timed": [len(plain), len(masked)],
        "tbt_free_ms": round(tbt_plain, 3), "tbt_grammar_ms": round(tbt_masked, 3),
        "measured_overhead_pct": round(measured, 2), "grammar_ms_per_step": round(grammar_ms, 3),
        "overhead_pct": round(overhead, 2), "goal_pct": GOAL_PCT, "goal_met": overhead <= GOAL_PCT,
        "matmul_gflops": round(single_thread_gflops(), 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
