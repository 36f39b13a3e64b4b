"""A prefill and a decode step's time against llama.cpp's: same checkpoint, same weights' precision
(F32), same threads, one run (issue 27's per-token goals).

    python bench/step_speed.py [--preset small-llava | --model DIR] [--threads 1] [--batches 1,8]
                               [--context 512] [--rounds 3] [--repeats 3] [--no-llamacpp]
                               [--kv-cache-dtype float16]

Each round times, one after another on the same machine, for each batch size B:

* Trident's engine with its weights packed for decode (TRIDENT_PACKED_WEIGHTS=auto, the default),
  and the same engine without (off): a prefill step of B prompts of `--context` tokens, and a
  decode step of B sequences whose next token sits at position `--context`, each the least of
  `--repeats` steps (common/engine/profiler.py, as a worker profiles itself at start); with
  `--kv-cache-dtype`, a third engine, packed, whose KV cache is in that dtype (TRIDENT_KV_CACHE_DTYPE);
* llama.cpp's `llama-batched-bench` on the checkpoint converted to GGUF (F32), when built
  (`bash bench/third_party/llamacpp.sh`): B prompts of `--context` tokens prefilled (in batches
  of 2,048 tokens, 512 a micro-batch: its defaults), then 16 decode steps of B tokens each; its
  decode step is their time over 16. Once with its KV cache as it ships (f16), once in f32, as
  Trident's.

A table of medians [min-max] over the rounds, each system over Trident's packed engine round by
round, and prefill's rate as a share of the machine's matmul rate (the decoder layers' FLOPs: 2 per
weight per token); then one JSON object on the last line. The matmul rate is one thread's fp32 GEMM,
before and after, times the threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.profiler import BudgetProfiler
from common.models import resolve_model
from trident.bench import llamacpp
from trident.bench.machine import single_thread_gflops

REPO = Path(__file__).resolve().parents[1]
LLAMA_STEPS = 16  # decode steps llama-batched-bench times per batch size
LLAMA_KV = ("f16", "f32")  # llama.cpp's KV cache as it ships, and as Trident keeps it
PHASES = ("prefill", "decode")
BASE = "trident packed=auto"

Samples = dict[str, dict[str, dict[int, list[float]]]]  # system → phase → batch → seconds, a round each


def trident_steps(engine: Engine, batch: int, context: int, repeats: int) -> dict[str, float]:
    """{phase: the least seconds of `repeats` steps}; a fresh profiler, so nothing is reused."""
    timer = BudgetProfiler(engine, repeats=repeats)
    return {
        "prefill": timer.prefill_latency(batch * context, seqs=batch),
        "decode": timer.decode_latency(batch, context),
    }


@dataclass(frozen=True)
class LlamaBench:
    """llama.cpp's llama-batched-bench on the converted checkpoint, with `threads` threads."""

    binary: Path
    gguf: Path
    threads: int


def llama_steps(bench: LlamaBench, batches: list[int], context: int, kv: str) -> dict[int, dict[str, float]]:
    """{batch: {phase: seconds a step}} from one llama-batched-bench run, its KV cache in `kv`."""
    binary, gguf, threads = bench.binary, bench.gguf, bench.threads
    argv = [
        str(binary), "-m", str(gguf), "-c", str(max(batches) * (context + LLAMA_STEPS) + 64),
        "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(LLAMA_STEPS),
        "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
        "-ctk", kv, "-ctv", kv, "--output-format", "jsonl",
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    lines = (run.stdout + run.stderr).splitlines()
    rows = [json.loads(line) for line in lines if line.startswith('{"n_kv_max"')]
    if run.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
    return {row["pl"]: {"prefill": row["t_pp"], "decode": row["t_tg"] / row["tg"]} for row in rows}


def config(threads: int, packed: str, kv_cache_dtype: str | None = None) -> EngineConfig:
    """As bench/step_profile.py's engine: 1 GiB of KV holds batches of 32 at a few thousand tokens."""
    return EngineConfig(
        num_threads=threads,
        prefix_caching=False,
        adapt_budgets=False,
        kv_cache_bytes=1 << 30,
        packed_weights=packed,
        kv_cache_dtype=kv_cache_dtype,
    )


def layer_weights(engine: Engine) -> int:
    """Weights a token multiplies in the decoder layers (the LM head runs once a sequence)."""
    return sum(
        p.numel() for name, p in engine.model.language_model.layers.named_parameters() if "proj" in name
    )


def summary(samples: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(samples) * 1e3, 2),
        "min_ms": round(min(samples) * 1e3, 2),
        "max_ms": round(max(samples) * 1e3, 2),
    }


def ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of round-by-round ratios: each round's two figures were measured minutes apart."""
    return round(statistics.median(x / y for x, y in zip(ours, theirs, strict=True)), 3)


def measure(args: argparse.Namespace, batches: list[int], model_dir: Path) -> tuple[Samples, Engine]:
    engines = {f"trident packed={m}": Engine(model_dir, config(args.threads, m)) for m in ("auto", "off")}
    if args.kv_cache_dtype:
        short = {"float16": "f16", "bfloat16": "bf16"}[args.kv_cache_dtype]
        engines[f"trident kv={short}"] = Engine(model_dir, config(args.threads, "auto", args.kv_cache_dtype))
    binary, gguf = llamacpp.batched_bench_binary(), None
    if not args.no_llamacpp:
        gguf = llamacpp.converted(model_dir).model
    samples: Samples = {}

    def add(system: str, batch: int, steps: dict[str, float]) -> None:
        for phase, seconds in steps.items():
            samples.setdefault(system, {}).setdefault(phase, {}).setdefault(batch, []).append(seconds)

    names = list(engines)
    for round_ in range(args.rounds):
        first = round_ % len(names)  # the engines take turns going first
        for name in names[first:] + names[:first]:
            engine = engines[name]
            for batch in batches:
                add(name, batch, trident_steps(engine, batch, args.context, args.repeats))
        for kv in LLAMA_KV if gguf is not None else ():
            bench = LlamaBench(binary, gguf, args.threads)
            for batch, steps in llama_steps(bench, batches, args.context, kv).items():
                add(f"llama.cpp kv={kv}", batch, steps)
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    return samples, engines[BASE]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory (instead of --preset)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens; decode's next position")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="steps a Trident measurement takes the least of")
    ap.add_argument("--no-llamacpp", action="store_true", help="time Trident's engines only")
    ap.add_argument(
        "--kv-cache-dtype",
        choices=("float16", "bfloat16"),
        help="also time an engine with its KV cache in it",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if not args.no_llamacpp and not (binary := llamacpp.batched_bench_binary()).exists():  # before any work
        raise SystemExit(
            f"llama-batched-bench is not built ({binary}): run `{llamacpp.SETUP}` or pass --no-llamacpp"
        )
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = resolve_model(args.model or args.preset, REPO / ".trident" / "models")
    torch.set_num_threads(args.threads)
    before = single_thread_gflops()
    samples, engine = measure(args, batches, model_dir)
    after = single_thread_gflops()
    rate = statistics.mean((before, after)) * args.threads * 1e9
    flops = 2 * layer_weights(engine) * args.context
    table = {
        name: {phase: {b: summary(s) for b, s in by_batch.items()} for phase, by_batch in by_phase.items()}
        for name, by_phase in samples.items()
    }
    over = {
        name: {
            phase: {b: ratio(samples[BASE][phase][b], s) for b, s in by_batch.items()}
            for phase, by_batch in by_phase.items()
        }
        for name, by_phase in samples.items()
        if name != BASE
    }
    share = {
        name: {b: round(flops * b / (statistics.median(s) * rate), 3) for b, s in by_phase["prefill"].items()}
        for name, by_phase in samples.items()
    }
    print_tables(args, table, over, share)
    print(f"machine: single-thread fp32 matmul {before:.1f} GFLOP/s before, {after:.1f} after")
    print(
        json.dumps(
            {
                "model": model_dir.name,
                "threads": args.threads,
                "context": args.context,
                "rounds": args.rounds,
                "packed_bytes": engine.packed_bytes,
                "steps": table,
                "trident_over": over,
                "prefill_matmul_share": share,
                "matmul_gflops": [round(before, 1), round(after, 1)],
            }
        )
    )


def print_tables(args: argparse.Namespace, table: dict, over: dict, share: dict) -> None:
    """Each engine's step times by phase and batch, Trident's ratio to each other, and the prefill's
    share of the matmul rate."""
    heading = f"context {args.context}, {args.threads} thread(s); ms a step, median [min-max] of rounds"
    print(heading)
    for phase in PHASES:
        for name, by_phase in table.items():
            cells = "  ".join(
                f"B={b}: {c['median_ms']:.1f} [{c['min_ms']:.1f}-{c['max_ms']:.1f}]"
                for b, c in by_phase[phase].items()
            )
            print(f"  {phase:8} {name:22} {cells}")
    for name, by_phase in over.items():
        for phase, by_batch in by_phase.items():
            print(f"  {BASE} / {name}, {phase}: " + ", ".join(f"B={b} {r:.2f}x" for b, r in by_batch.items()))
    for name, by_batch in share.items():
        print(f"  prefill at {name}: " + ", ".join(f"B={b} {r:.0%} of matmul" for b, r in by_batch.items()))


if __name__ == "__main__":
    main()
