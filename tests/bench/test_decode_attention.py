"""bench/decode_attention.py: each way a decode reads its context, timed on the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_attention.py"


@whole_run
def test_every_way_is_timed_and_two_runs_where_there_is_a_second_run(tiny_model_dir: Path) -> None:
    _, result = run_bench(
        SCRIPT, "--model", str(tiny_model_dir), "--batches", "1,3", "--contexts", "40,400", "--rounds",
        "2", timeout=600,
    )  # fmt: skip
    assert len(result["matmul_gflops"]) == 2
    cells = {(r["batch"], r["context"]): r for r in result["rows"]}
    assert set(cells) == {(1, 40), (1, 400), (3, 40), (3, 400)}
    for (_, context), row in cells.items():
        ways = {"in_place_ms", "gathered_ms", "batched_ms"} | ({"two_runs_ms"} if context >= 256 else set())
        assert ways <= set(row) and all(row[w] > 0 for w in ways)
        assert "two_runs_ms" in row or context < 256
        assert row["in_place_over_batched"] > 0
