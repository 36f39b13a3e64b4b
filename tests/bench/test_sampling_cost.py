"""bench/engine.py --sampling-fields: the decode step's time greedy and sampled, each without and
with every sampling field, on the tiny checkpoint (a smoke run: the figures are its benchmarks')."""

from __future__ import annotations

from pathlib import Path

from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "engine.py"


@whole_run
def test_every_mode_is_timed_over_the_same_decode_steps(tiny_model_dir: Path) -> None:
    _, result = run_bench(
        SCRIPT, "--model", str(tiny_model_dir), "--sampling-fields", "--requests", "4", "--max-tokens", "6",
        "--repeats", "1", "--threads", "1", timeout=300,
    )  # fmt: skip
    assert set(result["tbt_ms"]) == {"greedy", "greedy_fields", "sampled", "sampled_fields"}
    assert all(ms > 0 for ms in result["tbt_ms"].values()) and result["batch"] == 4
    assert result["sampled_fields_over_sampled"] > 0 and set(result["sampler_ms"]) == set(result["tbt_ms"])
