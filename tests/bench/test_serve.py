"""`trident bench serve` against a live tiny cluster: a short sweep gives a complete, well-formed
result (the last line of output, results.json, per-request records) and its plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.services.conftest import e_p_d  # noqa: F401 - the shared E+P+D deployment, a fixture
from trident.cli.app import app


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_short_sweep_against_a_live_cluster(tiny_model_dir: Path, tmp_path: Path, e_p_d) -> None:  # noqa: F811
    out = tmp_path / "bench"
    run = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--url", e_p_d.url, "--workload", "mix", "--sweep", "2:4:2",
            "--duration", "4", "--ttft-slo", "5", "--tbt-slo", "0.5", "--max-output-tokens", "8",
            "--image-size", "96x96", "--out", str(out), "--name", "e+p+d",
        ],
    )  # fmt: skip
    # An SLO nothing meets: the sweep stops after its first rate, and goodput is 0.
    missed = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--url", e_p_d.url, "--sweep", "2:4:2", "--duration", "2",
            "--ttft-slo", "0.0001", "--tbt-slo", "0.5", "--max-output-tokens", "4",
            "--out", str(tmp_path / "missed"),
        ],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    result = json.loads(run.output.strip().splitlines()[-1])
    assert result["model"] == tiny_model_dir.name and result["name"] == "e+p+d"
    assert [r["rate"] for r in result["rates"]] == [2.0, 4.0]
    for r in result["rates"]:
        assert r["sent"] > 0 and r["completed"] == r["sent"], r
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] < 5
        assert r["attainment"] == 1.0  # SLOs of seconds on a tiny model at a few requests/s
    assert result["goodput"] == 4.0
    assert json.loads((out / "results.json").read_text())["goodput"] == 4.0
    records = [json.loads(line) for line in (out / "requests-2.jsonl").read_text().splitlines()]
    assert len(records) == result["rates"][0]["sent"]
    assert all(r["ok"] and r["output_tokens"] == 8 for r in records)  # ignore_eos fixes the length
    assert any(r["num_images"] for r in records) and any(not r["num_images"] for r in records)
    for plot in ("attainment.png", "latency_cdf.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert missed.exit_code == 0, missed.output
    missed_result = json.loads(missed.output.strip().splitlines()[-1])
    assert [r["rate"] for r in missed_result["rates"]] == [2.0]
    assert missed_result["rates"][0]["attainment"] == 0.0 and missed_result["goodput"] == 0.0


def test_bad_arguments_are_usage_errors_before_any_load() -> None:
    runner = CliRunner()
    base = [
        "bench",
        "serve",
        "--url",
        "http://127.0.0.1:9",
        "--duration",
        "1",
        "--ttft-slo",
        "1",
        "--tbt-slo",
        "1",
    ]
    for extra, message in (
        (["--rate", "1", "--sweep", "1:2:1"], "not both"),
        (["--sweep", "1-2"], "A:B:STEP"),
        (["--rate", "1", "--workload", "nope"], "unknown workload"),
        (["--rate", "1", "--image-size", "big"], "WxH"),
    ):
        run = runner.invoke(app, base + extra)
        assert run.exit_code == 2 and message in run.output, run.output
    run = runner.invoke(app, [*base, "--rate", "1"])  # nothing listens there
    assert run.exit_code == 2 and "cannot list models" in run.output
