"""bench/step_speed.py: Trident's decode step with and without packed weights, and llama.cpp's
where it is built (bench/third_party/llamacpp.sh; not in CI), on the tiny checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import run_bench, whole_run
from trident.bench import llamacpp

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_speed.py"


def run(tiny_model_dir: Path, *extra: str, cwd: Path | None = None) -> dict:
    return run_bench(
        SCRIPT, "--model", str(tiny_model_dir), "--batches", "1,4", "--context", "48", "--rounds", "2",
        "--repeats", "1", *extra, timeout=600, cwd=cwd,
    )[1]  # fmt: skip


@whole_run
def test_both_engines_and_a_half_precision_kv_cache_are_timed_at_each_batch(tiny_model_dir: Path) -> None:
    """One run: the packed and the unpacked engine, and a half-precision KV cache as a third."""
    result = run(tiny_model_dir, "--no-llamacpp", "--kv-cache-dtype", "float16")
    assert set(result["steps"]) == {"trident packed=auto", "trident packed=off", "trident kv=f16"}
    for by_phase in result["steps"].values():
        assert set(by_phase) == {"prefill", "decode"}
        for by_batch in by_phase.values():
            assert set(by_batch) == {"1", "4"}
            for cell in by_batch.values():
                assert 0 < cell["min_ms"] <= cell["median_ms"] <= cell["max_ms"]
    over = result["trident_over"]["trident packed=off"]
    assert result["packed_bytes"] > 0 and set(over["decode"]) == set(over["prefill"]) == {"1", "4"}
    assert set(result["trident_over"]["trident kv=f16"]["decode"]) == {"1", "4"}
    assert all(r > 0 for r in result["prefill_matmul_share"]["trident packed=auto"].values())


@whole_run
def test_without_llama_cpp_built_it_says_how_to_build_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRIDENT_LLAMA_BATCHED_BENCH": str(tmp_path / "none")},
    )  # fmt: skip
    assert done.returncode != 0 and "bench/third_party/llamacpp.sh" in done.stderr


@pytest.mark.skipif(
    not (llamacpp.batched_bench_binary().exists() and llamacpp.converter_python().exists()),
    reason="llama.cpp is not built here (bash bench/third_party/llamacpp.sh)",
)
@whole_run
def test_llama_cpp_is_timed_beside_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = run(tiny_model_dir, cwd=tmp_path)  # the GGUF cache goes under ./.trident
    for kv in ("f16", "f32"):
        for steps in result["steps"][f"llama.cpp kv={kv}"].values():
            assert set(steps) == {"1", "4"} and all(c["median_ms"] > 0 for c in steps.values())
