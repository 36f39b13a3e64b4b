"""The first thing to run on a GPU machine (issue 27, "a GPU check ready to run"): every part of the
engine's CUDA path that CPU tests can only rehearse, measured, into one JSON file.

    python bench/gpu_check.py [--out .trident/gpu_check.json] [--preset llava-1.5-7b]
    python bench/gpu_check.py --cpu [--preset tiny-llava]      # the same steps on the CPU (CI runs it)

Steps, each timed and recorded whether it passes or fails (one failing does not stop the rest):

1. `environment`: torch and CUDA versions, the device, whether flash-attn imports.
2. `contract_tests`: tests/engine/test_gpu_contracts.py — on a GPU with flash-attn its `needs_flash`
   tests run the real kernel against the reference, and the dual-stream test runs on CUDA streams.
3. `machine`: the device's memory bandwidth (a large device-to-device copy), host↔device bandwidth
   through pinned memory, and the dense matmul rate in the engine's dtype (bf16 on a GPU).
4. `engine`: the preset's checkpoint (written once, random weights; 7B shapes in bf16 by default)
   in an `Engine`: decode steps at batch 1, 8 and 32 (context 512) and a 2,048-token prefill, timed
   as the stage profiler times them. Decode steps are timed as the engine runs them (on a GPU:
   replayed from CUDA graphs, common/engine/decode_graphs.py) and again eagerly
   (`decode_ms_eager`). Decode at batch 1 reads every weight once, so its weight bytes over its
   time, against the measured bandwidth, is its share of the roofline (goal: ≥ 70 %); prefill's
   2·parameters·tokens FLOPs against the matmul rate is its share of the peak.
5. `decode_graphs`: eight greedy requests generated three ways — captured graphs, the same padded
   steps uncaptured, and the eager unpadded path — with the share of tokens each pair agrees on
   (captured against uncaptured must be 1.0: the graph replays that very step).
6. `decode_kernels`: one decode step at batch 1 (context 512), padded as its graph runs it but
   uncaptured, under torch.profiler: how many kernels it launches, their summed GPU time, and the
   names that take most of it. A replayed graph still runs every one of those kernels; its time
   beyond their sum is the gaps between them.
7. `kv`: one request's KV (2,048 tokens) exported from the paged cache as the prefill instance
   sends it and imported back, with the bytes and GB/s of each.

The script aims to finish in well
under 8 minutes on an H100 (the 7B checkpoint's first write is most of it). On `--cpu` it runs the
same code on the tiny checkpoint in seconds, which is how CI keeps it from rotting between GPU
sessions. The last line of output is the whole result as one JSON object.
"""

from __future__ import annotations

import argparse
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
from common.engine.engine import Engine
from common.engine.kv_cache import layer_groups
from common.engine.profiler import BudgetProfiler, synthetic_request
from common.engine.sampling import SamplingParams
from common.models import resolve_model
from trident.bench.machine import least_seconds

REPO = Path(__file__).resolve().parents[1]
DECODE_BATCHES = (1, 8, 32)
CONTEXT = 512
PREFILL_TOKENS = 2048


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The least wall seconds of `repeats` runs of `fn`, each until the device is done with it,
    after one warm-up run."""
    fn()
    sync(device)
    return least_seconds(lambda: (fn(), sync(device)), repeats)


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
    return info


def contract_tests(timeout: float) -> dict:
    """tests/engine/test_gpu_contracts.py in a subprocess; counts and the names of any failures."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
             "tests/engine/test_gpu_contracts.py"],
            cwd=REPO, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
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
    n_bytes = (64 if cpu else 2048) << 20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = seconds(lambda: dst.copy_(src), device)
    out = {"memory_gbps": round(2 * n_bytes / copy / 1e9, 1)}  # each byte read once and written once
    if device.type == "cuda":
        host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
        out["host_to_device_gbps"] = round(
            n_bytes / seconds(lambda: src.copy_(host, non_blocking=True), device) / 1e9, 1
        )
        out["device_to_host_gbps"] = round(
            n_bytes / seconds(lambda: host.copy_(src, non_blocking=True), device) / 1e9, 1
        )
    n = 1024 if cpu else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out["matmul_tflops"] = round(2 * n**3 / seconds(lambda: a @ b, device) / 1e12, 3)
    return out


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
    decode_1 = out["decode_ms"][1] / 1000
    out["decode_1_weight_gbps"] = round(weight_bytes / decode_1 / 1e9, 1)
    out["decode_1_of_memory_roofline"] = round(weight_bytes / decode_1 / 1e9 / measured["memory_gbps"], 3)
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


def decode_kernels(engine: Engine, top: int = 8) -> dict:
    """Kernels (on the CPU: ops) of one padded decode step at batch 1, their count and summed time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    req = synthetic_request(engine, "gpu-check-kernels", CONTEXT, 1)
    if engine.blocks.allocate(req.request_id, CONTEXT + 1) is None:
        return {"ok": False, "error": f"no room for {CONTEXT + 1} tokens of KV"}
    configured = engine.runner.graphs
    engine.runner.graphs = DecodeGraphs(engine.model, engine.cache, engine.max_model_len, capture=False)
    try:
        with torch.inference_mode():
            engine.runner.forward([], [req])  # warm: the bucket's buffers, lazy initialisation
            sync(engine.device)
            activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
            with profile(activities=[activity]) as prof:
                engine.runner.forward([], [req])
                sync(engine.device)
    finally:
        engine.runner.graphs = configured
        engine.blocks.free(req.request_id)
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
        out_s = seconds(lambda: engine.handoff.export_kv(rid, group_size), engine.device)

        def back() -> None:
            for g, buf in zip(groups, exported, strict=True):
                engine.cache.import_blocks(table, g, buf)

        in_s = seconds(back, engine.device)
        return {"tokens": PREFILL_TOKENS, "bytes": nbytes, "export_gbps": round(nbytes / out_s / 1e9, 2),
                "import_gbps": round(nbytes / in_s / 1e9, 2)}  # fmt: skip
    finally:
        blocks.free(rid)


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


def main() -> None:
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
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to rehearse on the CPU")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    preset = args.preset or ("tiny-llava" if args.cpu else "llava-1.5-7b")
    results: dict = {"preset": preset, "cpu_mode": args.cpu}
    step(results, "environment", lambda: environment(device), args.out)
    if not args.skip_tests:
        step(results, "contract_tests", lambda: contract_tests(timeout=240), args.out)
    step(results, "machine", lambda: machine(device, dtype, args.cpu), args.out)
    engine: list[Engine] = []

    def load() -> dict:
        # On the CPU the padded decode step runs uncaptured: the same code as the graphs, rehearsed.
        graphs = "eager" if args.cpu else "auto"
        config = EngineConfig(
            device=device.type, prefix_caching=False, adapt_budgets=False, decode_graphs=graphs
        )
        engine.append(Engine(resolve_model(preset, args.models), config))
        return {"kv_blocks": engine[0].blocks.num_blocks}

    step(results, "load", load, args.out)
    if engine and results["machine"]["ok"]:
        step(results, "engine", lambda: engine_steps(engine[0], results["machine"]), args.out)
    if engine:
        step(results, "decode_graphs", lambda: decode_graph_agreement(engine[0]), args.out)
        step(results, "decode_kernels", lambda: decode_kernels(engine[0]), args.out)
        step(results, "kv", lambda: kv_round_trip(engine[0]), args.out)
    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {args.out}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
