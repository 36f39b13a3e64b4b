"""bench/step_profile.py: a step's ops grouped, on the tiny checkpoint (the figures themselves are
docs/engine.md's, from small checkpoints)."""

from __future__ import annotations

from pathlib import Path

from tests.bench import load_script, run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"


def test_ops_fall_in_the_groups_the_table_names() -> None:
    script = load_script(SCRIPT, "step_profile")
    assert script.group_of("aten::mm") == "matmul"
    assert script.group_of("mkl::_mkl_linear") == "matmul"  # decode products from packed weights
    assert script.group_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert script.group_of("aten::index_select") == "kv gather/scatter"
    assert script.group_of("aten::rsqrt") == "norm"
    assert script.group_of("aten::silu") == "element-wise"
    assert script.group_of("aten::argmax") == "sampling"
    assert script.group_of("aten::lift_fresh") == "other"


@whole_run
def test_a_profile_of_prefill_and_decode_steps(tiny_model_dir: Path) -> None:
    _, result = run_bench(
        SCRIPT, "--model", str(tiny_model_dir), "--batches", "1,2", "--repeats", "1", "--context", "32",
        "--prompt", "16", timeout=300,
    )  # fmt: skip
    steps = {(s["phase"], s["batch"]): s for s in result["steps"]}
    assert set(steps) == {("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)}
    for s in steps.values():
        assert s["step_s"] > 0 and s["groups_s"]["matmul"] > 0 and s["groups_s"]["attention"] > 0
        assert "outside ops" in s["groups_s"] and len(s["top_ops_s"]) <= 8
