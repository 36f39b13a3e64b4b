"""Where an engine step's time goes, op by op (issue 27, "where a step's time goes").

    python bench/step_profile.py [--preset small-llava | --model DIR] [--threads 1]
                                 [--batches 1,8,32] [--context 512] [--prompt 128] [--repeats 5]

For each batch size B, two steps of the language model on the engine's own runner, as the stage
profiler times them (common/engine/profiler.py: synthetic text requests, KV blocks held):

* prefill: B fresh prompts of `--prompt` tokens in one step (B·prompt tokens);
* decode: B sequences whose next token sits at position `--context`.

Each step is timed `--repeats` times without the profiler (the least is its time), then run under
torch.profiler as often again. The profile's self CPU time per op is averaged per step and grouped
(matmul, attention, KV gather/scatter, norms, element-wise, copies, sampling, other); what the step
took unprofiled beyond its ops' self time (as profiled) is Python and dispatch around them
("outside ops"; the profiler adds a little to each op, so this is a lower bound). Shares are of the
ops' time plus that. A table per step goes to stdout, then one JSON object
on the last line. The matmul rate beside it is one thread's fp32 GEMM, as every benchmark prints.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.profiler import BudgetProfiler
from common.models import resolve_model
from trident.bench.machine import single_thread_gflops

REPO = Path(__file__).resolve().parents[1]
# Op name fragments, first match wins: what each group of the table holds.
GROUPS = (
    ("attention", ("scaled_dot_product", "flash", "_efficient_attention", "softmax", "baddbmm", "bmm")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkl_linear")),
    ("kv gather/scatter", ("index", "gather", "scatter", "take", "masked")),
    ("norm", ("norm", "rsqrt", "aten::pow", "aten::mean", "aten::var")),
    ("copies", ("copy", "aten::to", "contiguous", "aten::cat", "aten::stack", "clone", "empty", "zeros")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "max")),
    (
        "element-wise",
        ("aten::add", "aten::mul", "aten::sub", "aten::div", "silu", "gelu", "neg", "exp", "sigmoid"),
    ),
)


def group_of(op: str) -> str:
    for group, fragments in GROUPS:
        if any(f in op for f in fragments):
            return group
    return "other"


def counted_forwards(engine: Engine) -> list[int]:
    """A one-item list counting the runner's forward calls from now on."""
    calls, forward = [0], engine.runner.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    engine.runner.forward = counting
    return calls


def step(engine: Engine, phase: str, batch: int, args: argparse.Namespace) -> float:
    """The least seconds of the step over `--repeats` runs (inf when its KV does not fit)."""
    timer = BudgetProfiler(engine, repeats=args.repeats)
    if phase == "decode":
        return timer.decode_latency(batch, args.context)
    return timer.prefill_latency(batch * args.prompt, seqs=batch)


def profiled(run: Callable[[], object], calls: list[int], seconds: float) -> dict:
    """`run` (a step's timing, as `step` does it) under the profiler: its ops' self CPU time per
    step (`calls` counts the forwards), by group and the top ones; what the step took unprofiled
    (`seconds`) beyond them is "outside ops"."""
    before = calls[0]
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    wall = time.perf_counter() - start
    steps = max(1, calls[0] - before)
    ops: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        ops[event.key] += event.self_cpu_time_total / 1e6 / steps
    groups: dict[str, float] = defaultdict(float)
    for op, op_seconds in ops.items():
        groups[group_of(op)] += op_seconds
    per_step = wall / steps
    groups["outside ops"] = max(0.0, seconds - sum(ops.values()))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    return {
        "profiled_step_s": round(per_step, 6),
        "groups_s": {g: round(s, 6) for g, s in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_ops_s": {op: round(s, 6) for op, s in top},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory (instead of --preset)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512, help="decode: the position of the next token")
    ap.add_argument("--prompt", type=int, default=128, help="prefill: tokens per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--packed-weights", choices=("auto", "off"), default="auto", help="TRIDENT_PACKED_WEIGHTS"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    before = single_thread_gflops()
    engine = Engine(
        resolve_model(args.model or args.preset, REPO / ".trident" / "models"),
        EngineConfig(
            num_threads=args.threads,
            prefix_caching=False,
            adapt_budgets=False,
            kv_cache_bytes=1 << 30,
            packed_weights=args.packed_weights,
        ),
    )
    calls = counted_forwards(engine)
    rows = []
    for phase in ("prefill", "decode"):
        for batch in (int(b) for b in args.batches.split(",")):
            seconds = step(engine, phase, batch, args)
            row = {"phase": phase, "batch": batch, "step_s": round(seconds, 6)}
            row |= profiled(lambda p=phase, b=batch: step(engine, p, b, args), calls, seconds)
            rows.append(row)
            tokens = batch * args.prompt if phase == "prefill" else batch
            print(
                f"{phase} batch {batch} ({tokens} tokens): {seconds * 1000:.1f} ms a step "
                f"({row['profiled_step_s'] * 1000:.1f} ms profiled)"
            )
            for group, s in row["groups_s"].items():
                print(f"    {group:18} {s * 1000:8.2f} ms  {s / sum(row['groups_s'].values()):6.1%}")
            print("    top ops: " + ", ".join(f"{op} {s * 1000:.2f}" for op, s in row["top_ops_s"].items()))
    after = single_thread_gflops()
    print(f"machine: single-thread fp32 matmul {before:.1f} GFLOP/s before, {after:.1f} after")
    config = engine.model.config
    summary = {
        "model": config.model_type,
        "threads": args.threads,
        "context": args.context,
        "prompt": args.prompt,
        "packed_bytes": engine.packed_bytes,
    }
    print(json.dumps({**summary, "steps": rows, "matmul_gflops": [before, after]}))


if __name__ == "__main__":
    main()
