"""A decode step's time against llama.cpp's: same checkpoint, same weights' precision (F32), same
threads, one run (issue 27's per-token goal).

    python bench/decode_speed.py [--preset small-llava | --model DIR] [--threads 1] [--batches 1,8]
                                 [--context 512] [--rounds 3] [--repeats 3] [--no-llamacpp]

Each round times, one after another on the same machine:

* Trident's engine with its weights packed for decode (TRIDENT_PACKED_WEIGHTS=auto, the default),
  and the same engine without (off): one decode step of B sequences whose next token sits at
  position `--context`, the least of `--repeats` steps (common/engine/profiler.py, as a worker
  profiles itself at start);
* llama.cpp's `llama-batched-bench` on the checkpoint converted to GGUF (F32), when built
  (`bash bench/third_party/llamacpp.sh`): B sequences of `--context` prompt tokens, then 16 decode
  steps of B tokens each; its step is the decode time over 16. Once with its KV cache as it ships
  (f16) and once in f32, as Trident's.

A table of medians [min-max] over the rounds, then one JSON object on the last line. The matmul
rate beside it is one thread's fp32 GEMM, before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


def trident_step(engine: Engine, batch: int, context: int, repeats: int) -> float:
    """The least seconds of `repeats` decode steps (a fresh profiler: nothing cached between rounds)."""
    return BudgetProfiler(engine, repeats=repeats).decode_latency(batch, context)


def llama_steps(binary: Path, gguf: Path, batches: list[int], context: int, threads: int, kv: str) -> dict:
    """{batch: seconds a decode step} from one llama-batched-bench run."""
    argv = [
        str(binary), "-m", str(gguf), "-c", str(max(batches) * (context + LLAMA_STEPS) + 64),
        "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(LLAMA_STEPS),
        "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
        "-ctk", kv, "-ctv", kv, "--output-format", "jsonl",
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    rows = [
        json.loads(line) for line in (run.stdout + run.stderr).splitlines() if line.startswith('{"n_kv_max"')
    ]
    if run.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
    return {row["pl"]: row["t_tg"] / row["tg"] for row in rows}


def config(threads: int, kv_bytes: int, packed: str) -> EngineConfig:
    return EngineConfig(
        num_threads=threads, prefix_caching=False, adapt_budgets=False, kv_cache_bytes=kv_bytes,
        packed_weights=packed,
    )  # fmt: skip


def summary(samples: list[float]) -> dict:
    return {"median_ms": round(statistics.median(samples) * 1e3, 2),
            "min_ms": round(min(samples) * 1e3, 2), "max_ms": round(max(samples) * 1e3, 2)}  # fmt: skip


def ratio(ours: list[float], theirs: list[float]) -> list[float]:
    """Round by round: each round's two figures were measured minutes apart on the same machine."""
    return [x / y for x, y in zip(ours, theirs, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory (instead of --preset)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512, help="the position of each sequence's next token")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--repeats", type=int, default=3, help="decode steps a Trident measurement takes the least of"
    )
    ap.add_argument("--no-llamacpp", action="store_true", help="time Trident's two engines only")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = resolve_model(args.model or args.preset, REPO / ".trident" / "models")
    torch.set_num_threads(args.threads)
    before = single_thread_gflops()
    kv_bytes = max(256 << 20, 2 * max(batches) * (args.context + 32) * 16 << 10)
    engines = {mode: Engine(model_dir, config(args.threads, kv_bytes, mode)) for mode in ("auto", "off")}
    systems = {f"trident packed={mode}": engine for mode, engine in engines.items()}
    binary = llamacpp.batched_bench_binary()
    gguf = None
    if not args.no_llamacpp:
        if not binary.exists():
            raise SystemExit(
                f"llama-batched-bench is not built ({binary}): run `{llamacpp.SETUP}` or pass --no-llamacpp"
            )
        gguf = llamacpp.converted(model_dir).model
    samples: dict[str, dict[int, list[float]]] = {}
    for round_ in range(args.rounds):
        for name, engine in systems.items():
            for batch in batches:
                seconds = trident_step(engine, batch, args.context, args.repeats)
                samples.setdefault(name, {}).setdefault(batch, []).append(seconds)
        if gguf is not None:
            for kv in LLAMA_KV:
                for batch, seconds in llama_steps(
                    binary, gguf, batches, args.context, args.threads, kv
                ).items():
                    samples.setdefault(f"llama.cpp kv={kv}", {}).setdefault(batch, []).append(seconds)
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    after = single_thread_gflops()
    table = {name: {batch: summary(s) for batch, s in by_batch.items()} for name, by_batch in samples.items()}
    print(f"decode step at context {args.context}, {args.threads} thread(s), ms: median [min-max] of rounds")
    for name, by_batch in table.items():
        cells = "  ".join(
            f"B={b}: {r['median_ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}]" for b, r in by_batch.items()
        )
        print(f"  {name:22} {cells}")
    ratios = {}
    base = "trident packed=auto"
    for name in table:
        if name != base:
            ratios[name] = {
                b: round(statistics.median(ratio(samples[base][b], samples[name][b])), 3) for b in batches
            }
            print(f"  {base} / {name}: " + ", ".join(f"B={b} {r:.2f}x" for b, r in ratios[name].items()))
    print(f"machine: single-thread fp32 matmul {before:.1f} GFLOP/s before, {after:.1f} after")
    print(json.dumps({
        "model": model_dir.name, "threads": args.threads, "context": args.context, "rounds": args.rounds,
        "packed_bytes": engines["auto"].packed_bytes, "steps": table,
        "trident_over": ratios, "matmul_gflops": [round(before, 1), round(after, 1)],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
