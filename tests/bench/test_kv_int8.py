"""bench/kv_int8.py on the tiny checkpoint, a few prompts: it runs, and its figures are what it
says they are (shares in [0, 1], the INT8 wire a quarter of float32, bf16's a half, the margin
table consistent with the whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench import run_bench, whole_run

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_int8.py"


SHARES = {"int8": 0.254, "bf16": 0.5}  # of the native wire bytes: INT8 with its scales, and bfloat16


@whole_run
def test_the_kv_int8_bench_reports_agreement_and_wire_bytes(tiny_model_dir: Path) -> None:
    _, report = run_bench(
        SCRIPT, "--presets", str(tiny_model_dir), "--prompts", "6", "--max-tokens", "5", "--threads",
        "1", "--compare", "int8,bf16", timeout=300,
    )  # fmt: skip
    assert [row["compare"] for row in report["results"]] == list(SHARES)
    for row in report["results"]:
        check(row, SHARES[row["compare"]])


def check(row: dict, share: float) -> None:
    """One comparison's figures: what they say they are, `share` the wire's part of the native bytes."""
    assert row["prompts"] == 6
    for key in ("token_agreement", "free_running_agreement", "identical_answers"):
        assert 0.0 <= row[key] <= 1.0, key
    assert row["first_logit_max_abs_diff"] > 0 and row["logit_std"] > 0
    assert row["wire_bytes"] < row["native_bytes"] and row["wire_over_native"] == pytest.approx(
        share, abs=0.01
    )
    # The margin table is the same positions cut by the native top-two gap: shares sum to one, the
    # bins' agreements average back to the whole, and no choice flips above the widest flipped gap.
    bins = row["by_margin"].values()
    assert sum(b["share"] for b in bins) == pytest.approx(1.0, abs=1e-3)
    weighted = sum(b["share"] * b["agreement"] for b in bins if b["agreement"] is not None)
    assert weighted == pytest.approx(row["token_agreement"], abs=2e-3)
    assert row["logit_max_abs_diff"] >= row["logit_median_max_abs_diff"] > 0
    assert (row["flipped_max_margin"] is None) == (row["token_agreement"] == 1.0)
    flipped = row["flipped_max_margin"]
    for label, b in row["by_margin"].items():
        low, _, high = label.removeprefix(">=").partition("-")
        if flipped is None or b["agreement"] is None:
            continue
        if float(low) > flipped:
            assert b["agreement"] == 1.0, label
        elif flipped < float(high or "inf"):  # the bin holding the widest flip has a flip
            assert b["agreement"] < 1.0, label
