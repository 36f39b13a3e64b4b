"""`trident bench serve` against a live tiny cluster: a short sweep gives a complete, well-formed
result (the last line of output, results.json, per-request records) and its plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers.probes import added, instances, scrape
from trident.cli.app import app


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_short_sweep_against_a_live_cluster(tiny_model_dir: Path, tmp_path: Path, e_p_d) -> None:
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_multi_turn_run_resends_its_history_and_the_prefill_instance_reuses_it(
    tmp_path: Path,
    tiny_model_dir: Path,
    e_p_d,
) -> None:
    prefill = instances(e_p_d, "prefill")[0]["http_address"]
    before = scrape(prefill)
    out = tmp_path / "turns"
    run = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--url", e_p_d.url, "--workload", "textcaps", "--rate", "1.5",
            "--duration", "4", "--ttft-slo", "10", "--tbt-slo", "1", "--max-output-tokens", "4",
            "--image-size", "96x96", "--out", str(out),
            "--turns", "3", "--system-prompt-tokens", "48", "--image-pool", "2", "--pool-share", "1",
            "--image-prob", "0.5", "--image-window", "2", "--checkpoint", str(tiny_model_dir),
        ],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    rate = json.loads(run.output.strip().splitlines()[-1])["rates"][0]
    assert rate["sent"] % 3 == 0 and rate["completed"] == rate["sent"] > 0, rate
    assert rate["ttft_p50_first_turns"] and rate["ttft_p50_later_turns"]
    records = [json.loads(line) for line in (out / "requests-1.5.jsonl").read_text().splitlines()]
    for first in range(0, len(records), 3):
        turns = records[first : first + 3]
        assert [r["turn"] for r in turns] == [0, 1, 2]
        prompts = [r["prompt_tokens"] for r in turns]
        # Each turn resends the one before it, its answer and a new message (one image, at most,
        # is dropped from what is resent: the window holds two turns' images).
        assert prompts[0] < prompts[1] and prompts[0] + 4 < prompts[2], prompts
    grew = added(before, scrape(prefill))
    # Every request's system prompt (three full blocks) and every later turn's history was cached,
    # and each answer's usage says how much of its prompt was (prompt_tokens_details.cached_tokens).
    hits = grew["trident_prefix_hit_tokens_total"]
    assert hits >= 48 * len(records) / 2, grew
    # Turn 1 resends turn 0 whole; turn 2 leaves out turn 0's image (the window), so from there on
    # its prompt differs from what was cached: the system prompt's blocks, at least, are found.
    assert all(r["cached_tokens"] >= r["prompt_tokens"] / 2 for r in records if r["turn"] == 1), records
    assert all(r["cached_tokens"] >= 32 for r in records if r["turn"] > 0), records
    assert 0 < sum(r["cached_tokens"] for r in records) <= hits  # a request counts its last admission
    assert rate["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    # What it reused against what it could have (trident/bench/reuse.py): the pool's two images are
    # encoded at most once each, and an unbounded cache would compute no more than the real one.
    reuse = rate["reuse"]
    assert reuse["images_sent"] == sum(len(r["images"]) for r in records) > 0
    assert reuse["encoder_runs"] <= reuse["new_images"] <= 2, reuse
    assert reuse["prompt_tokens"] == rate["prompt_tokens"]
    assert reuse["computed_tokens"] == rate["prompt_tokens"] - rate["cached_tokens"]
    assert 0 < reuse["ideal_computed_tokens"] <= reuse["computed_tokens"], reuse
