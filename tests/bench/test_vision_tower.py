"""bench/vision_tower.py: Trident's vision tower against transformers' own, on the tiny Qwen2-VL."""

from __future__ import annotations

from pathlib import Path

from common.checkpoints import write_checkpoint
from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vision_tower.py"


@whole_run
def test_both_towers_are_timed_and_agree(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "tiny-qwen2-vl", "tiny-qwen2-vl", seed=0)
    _, result = run_bench(
        SCRIPT, "--model", str(model), "--sizes", "56x56,112x84", "--rounds", "2", "--repeats", "1",
        timeout=600,
    )  # fmt: skip
    assert result["model"] == "qwen2_vl" and len(result["matmul_gflops"]) == 2
    assert [row["size"] for row in result["rows"]] == ["56x56", "112x84"]
    for row in result["rows"]:
        assert row["image_tokens"] > 0
        assert row["max_rel_diff"] < 1e-4  # the same model, to float32 rounding
        assert row["trident"]["median_ms"] > 0 and row["transformers"]["median_ms"] > 0
        assert row["trident_over_transformers"] > 0
