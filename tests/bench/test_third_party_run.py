"""bench/third_party/run.py without the tools: the commands it builds, the result files it reads,
and the message when the venvs are missing (running the tools is bench/third_party's own job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench import load_script

RUN = Path(__file__).resolve().parents[2] / "bench" / "third_party" / "run.py"


@pytest.fixture(scope="module")
def run():
    return load_script(RUN, "third_party_run")


def args(run, *extra: str):
    base = ["--url", "http://127.0.0.1:8123", "--model-dir", "/m", "--rate", "2", "--num-prompts", "40"]
    return run.parse_args([*base, "--ttft-slo", "2", "--tbt-slo", "0.5", *extra])


def test_missing_venvs_say_to_run_setup(run, monkeypatch, tmp_path):
    monkeypatch.setattr(run, "VLLM", tmp_path / "nope" / "vllm")
    with pytest.raises(SystemExit, match=r"run bench/third_party/setup.sh"):
        run.check_venvs(["vllm"])


def test_both_tools_get_the_same_workload_and_slos_in_ms(run):
    a = args(run)
    vllm = " ".join(run.vllm_command(a, "tiny-llava", Path("/o")))
    aiperf = " ".join(run.aiperf_command(a, "tiny-llava", Path("/o")))
    for flag in ("--dataset-name random-mm", "--ignore-eos", "ttft:2000 tpot:500", "--burstiness 1"):
        assert flag in vllm
    assert "--random-mm-bucket-config {(256, 256, 1): 1.0}" in vllm
    for flag in ("--extra-inputs ignore_eos:true", "--image-batch-size 1", "--arrival-pattern poisson"):
        assert flag in aiperf
    assert "time_to_first_token:2000 inter_token_latency:500" in aiperf
    constant = args(run, "--arrival", "constant")
    assert "--burstiness inf" in " ".join(run.vllm_command(constant, "m", Path("/o")))
    assert "--arrival-pattern constant" in " ".join(run.aiperf_command(constant, "m", Path("/o")))


def test_result_files_are_summarised_alike(run):
    vllm = {
        "completed": 4, "failed": 0, "total_input_tokens": 400, "total_output_tokens": 128,
        "request_throughput": 1.9, "request_goodput": 1.5, "start_times": [0.0, 0.5, 1.0, 1.5],
        "p50_ttft_ms": 20.0, "p90_ttft_ms": 30.0, "p99_ttft_ms": 40.0, "p50_tpot_ms": 3.0,
    }  # fmt: skip
    aiperf = {
        "request_count": {"avg": 4.0}, "request_throughput": {"avg": 2.1}, "goodput": {"avg": 2.0},
        "time_to_first_token": {"p50": 21.0, "p90": 31.0}, "inter_token_latency": {"p50": 3.1},
        "inter_chunk_latency": {"p90": 6.0}, "usage_prompt_tokens": {"avg": 100.0}, "error_summary": [],
    }  # fmt: skip
    records = [{"metadata": {"request_start_ns": int(t * 1e9)}} for t in (0, 0.4, 0.8, 1.2)]
    v, a = run.vllm_summary(vllm), run.aiperf_summary(aiperf, records)
    assert v.keys() == a.keys()
    assert (v["arrival_rate"], v["prompt_tokens_mean"], v["goodput"], v["ttft_p90_ms"]) == (
        2.0,
        100.0,
        1.5,
        30.0,
    )
    assert (a["completed"], a["failed"], a["ttft_p50_ms"], a["tpot_p50_ms"], a["itl_p90_ms"]) == (
        4,
        0,
        21.0,
        3.1,
        6.0,
    )
    assert a["arrival_rate"] == pytest.approx(2.5)
    assert "ttft_p50_ms" in run.table({"vllm": v, "aiperf": a})


def test_our_client_replays_the_same_requests_as_a_trace(run, tmp_path):
    from common.planner.trace import read_trace, summary

    a = args(run, "--arrival", "constant")
    cmd = run.trident_command(a, "tiny-llava", tmp_path)
    assert cmd[1:3] == ["bench", "serve"] and "--every-rate" in cmd
    assert cmd[cmd.index("--ttft-slo") + 1] == "2.0" and cmd[cmd.index("--tbt-slo") + 1] == "0.5"
    entries = read_trace(cmd[cmd.index("--trace") + 1]).entries
    assert len(entries) == a.num_prompts
    s = summary(entries)
    assert s["rate"] == pytest.approx(a.rate) and s["images_per_request"] == 1
    assert {e.output_tokens for e in entries} == {a.output_len}
    assert {e.image_sizes for e in entries} == {((a.image_size, a.image_size),)}
