"""bench/kv_overlap.py on the tiny checkpoint: both hand-offs run end to end over a real transfer
to a puller process, and the figures are what they say (the streamed run exposes no more than the
transfer after prefill takes, shares in [0, 1], the KV's bytes those of the prompt's blocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_overlap.py"


@pytest.mark.parametrize("backend", ["tcp", pytest.param("auto", marks=pytest.mark.slow)])
def test_the_overlap_bench_reports_hidden_shares_by_prompt_length(tiny_model_dir: Path, backend) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--lengths", "32,96",
         "--repeats", "2", "--group", "1", "--backend", backend],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["matmul_gflops"] > 0 and set(report["overlap"]) == {"32", "96"}
    sizes = []
    for row in report["overlap"].values():
        assert 0.0 <= row["hidden"]["min"] <= row["hidden"]["median"] <= row["hidden"]["max"] <= 1.0
        assert row["transfer_ms"]["median"] > 0 and row["exposed_ms"]["min"] >= 0
        assert row["step_ms"]["median"] > 0 and row["streamed_step_ms"]["median"] > 0
        sizes.append(row["kv_bytes"])
    assert 0 < sizes[0] < sizes[1]  # more prompt, more blocks
    assert "| prompt tokens |" in run.stdout
