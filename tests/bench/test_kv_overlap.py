"""bench/kv_overlap.py on the tiny checkpoint: both hand-offs run end to end over a real transfer
to a puller process, and the figures are what they say: hidden shares at most 1 (below 0 when the
streamed run exposed more than the transfer after prefill took, as a noisy run of a tiny model's
2 ms transfers can), and the KV's bytes growing with the prompt's blocks."""

from __future__ import annotations

from pathlib import Path

from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_overlap.py"


@whole_run
def test_the_overlap_bench_reports_hidden_shares_by_prompt_length(tiny_model_dir: Path) -> None:
    """Over TCP (the UCX path of a reserved handle: tests/substrate/test_transfer_reserved.py)."""
    run, report = run_bench(
        SCRIPT, "--model", str(tiny_model_dir), "--lengths", "32,96", "--repeats", "1", "--group", "1",
        "--backend", "tcp", timeout=300,
    )  # fmt: skip
    assert report["matmul_gflops"] > 0 and set(report["overlap"]) == {"32", "96"}
    sizes = []
    for row in report["overlap"].values():
        assert row["hidden"]["min"] <= row["hidden"]["median"] <= row["hidden"]["max"] <= 1.0
        assert row["transfer_ms"]["median"] > 0 and row["exposed_ms"]["min"] >= 0
        assert row["step_ms"]["median"] > 0 and row["streamed_step_ms"]["median"] > 0
        sizes.append(row["kv_bytes"])
    assert 0 < sizes[0] < sizes[1]  # more prompt, more blocks
    assert "| prompt tokens |" in run.stdout
