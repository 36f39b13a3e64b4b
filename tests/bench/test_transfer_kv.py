"""bench/transfer.py --kv on a small KV: every backend times both paths end to end between two
processes, into a decoder's shuffled blocks straight (as decode does) and through a buffer then
imported (as it did; the bench checks the blocks hold the bytes and that each pull took the path it
times), and the figures are what they say."""

from __future__ import annotations

from pathlib import Path

from common.transfer import ucx_available
from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "transfer.py"


@whole_run
def test_the_kv_bench_times_host_local_against_the_stream() -> None:
    run, report = run_bench(
        SCRIPT, "--kv", "--quick", "--kv-shape", "4,2,64", "--kv-tokens", "2048", "--kv-dtype", "float32",
        timeout=300,
    )  # fmt: skip
    # 4 layers x (K, V) x 2048 tokens x 2 heads x 64 x 4 bytes, in one group of 4 layers.
    assert report["kv_bytes"] == 4 * 2 * 2048 * 2 * 64 * 4 and report["device"] == "cpu"
    backends = ["tcp"] + (["ucx"] if ucx_available() else [])
    for backend in backends:
        stream, local = report[f"{backend}_stream_p50_ms"], report[f"{backend}_host_local_p50_ms"]
        assert stream > 0 and local > 0
        assert abs(report[f"{backend}_host_local_speedup"] - stream / local) < 0.02
        assert report[f"{backend}_stream_GBps"] > 0 and report[f"{backend}_host_local_GBps"] > 0
        for path in ("stream", "host_local"):
            name = f"{backend}_{path}"
            straight, buffered = report[f"{name}_p50_ms"], report[f"{name}_buffered_p50_ms"]
            assert abs(report[f"{backend}_{path}_into_blocks_speedup"] - buffered / straight) < 0.02
            # The old way imported on the caller's (the engine's) thread; the new one does not.
            assert 0 < report[f"{backend}_{path}_buffered_import_ms"] < buffered
    assert "| tcp | host_local | straight |" in run.stdout
    assert "| tcp | host_local | buffered, then imported |" in run.stdout
