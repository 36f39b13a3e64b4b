"""bench/gpu_check.py's CPU mode: the GPU check's every step on the tiny checkpoint, so the script a
GPU session runs first cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.engine.decoder_ops import REFERENCE_OPS
from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@whole_run
def test_the_gpu_check_rehearses_every_step_on_the_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    # A deadline the measurements alone outlast: the contract tests, last, are recorded as not run
    # (the GPU session's rehearsal, tests/bench/test_gpu_session.py, runs them).
    _, printed = run_bench(
        SCRIPT, "--cpu", "--deadline", "1", "--models", str(tiny_model_dir.parent), "--out", str(out),
        timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result == printed
    steps = [k for k, v in result.items() if isinstance(v, dict) and "ok" in v]
    assert steps[-1] == "contract_tests" and not result["ok"]
    assert all(result[k]["ok"] for k in steps[:-1]), result
    files = result["contract_tests"]["files"]
    assert list(files) == ["tests/substrate/test_transfer_cuda.py", "tests/engine/test_gpu_contracts.py",
                           "tests/engine/test_triton_kernels.py"]  # fmt: skip
    assert all("deadline" in f["not_run"] and not f["ok"] for f in files.values())
    assert result["preset"] == "tiny-llava" and result["environment"]["device"] == "cpu"
    assert result["machine"]["memory_gbps"] > 0 and result["machine"]["matmul_tflops"] > 0
    engine = result["engine"]
    assert set(engine["decode_ms"]) == {"1", "8", "32"} and all(v > 0 for v in engine["decode_ms"].values())
    assert engine["decode_1_of_memory_roofline"] > 0 and engine["prefill_of_matmul_peak"] > 0
    assert set(engine["decode_ms_eager"]) == {"1", "8", "32"}
    graphs = result["decode_graphs"]  # on the CPU: the padded step uncaptured, against the eager path
    assert not graphs["captured"] and graphs["buckets"] and graphs["tokens"] > 0
    assert graphs["configured_vs_padded"] == 1.0 and graphs["configured_vs_eager"] == 1.0
    kernels = result["decode_kernels"]  # on the CPU: aten ops of one padded decode step
    assert kernels["what"] == "cpu aten ops" and kernels["count"] > kernels["per_layer"] > 0
    assert kernels["sum_ms"] > 0 and kernels["top"][0]["count"] > 0
    assert result["kv"]["bytes"] > 0 and result["kv"]["export_gbps"] > 0 and result["kv"]["import_gbps"] > 0
    # The new decode path (on the CPU: the fused ops' references, decode attention through block
    # tables) against the old one: timed, counted, and token-identical in float32.
    assert result["kernels"]["ops"] == dict.fromkeys(REFERENCE_OPS.names, "reference")
    assert set(engine["decode_ms_old"]) == {"1", "8", "32"} and all(
        v > 0 for v in engine["decode_ms_old"].values()
    )
    goals = engine["goals"]
    assert goals["new"]["decode_32_over_1"] > 0 and goals["old"]["decode_1_of_memory_roofline"] > 0
    old = kernels["old"]
    assert old["count"] > 0 and old["count"] != kernels["count"] and kernels["fewer_per_step"] > 0
    moved = result["kv_transfer"]  # P→D between two processes, into a decoder's blocks (TCP only)
    assert moved["device"] == "cpu" and moved["goal_host_local_GBps"] == 400
    assert moved["tcp_host_local_GBps"] > 0 and moved["tcp_host_local_into_blocks_speedup"] > 0
    assert moved["goal_met"] == (moved["tcp_host_local_GBps"] >= 400)
    identity = result["inplace_identity"]
    assert identity["agreement"] == 1.0 and identity["tokens"] > 0 and identity["graphs"]
    assert identity["ops"]["paged_decode"] == "reference"


@whole_run
def test_without_a_gpu_it_says_how_to_rehearse() -> None:
    import torch

    if torch.cuda.is_available():
        return
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--cpu" in run.stderr
