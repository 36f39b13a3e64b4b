"""`trident plan`: the planner offline, on a trace file (the same `plan()` the service runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from common.planner.trace import write_trace
from common.planner.types import METHOD_KINDS
from common.planner.workloads import generate


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    from trident.cli.app import app

    return app


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "pope.jsonl"
    write_trace(path, generate("pope", rate=4.0, num_requests=60, seed=5))
    return path


def _plan(app: typer.Typer, *args: str):
    return CliRunner().invoke(app, ["plan", "--ttft-slo", "0.5", "--tbt-slo", "0.1", *args])


def test_json_is_the_last_line(app: typer.Typer, trace_file: Path) -> None:
    result = _plan(app, "--trace", str(trace_file), "--instances", "3", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout.strip().splitlines()[-1])
    assert body["method"] in METHOD_KINDS and sum(body["replicas"].values()) == 3
    simulated = [c["goodput"] for c in body["candidates"] if not c["pruned"]]
    assert simulated and body["goodput"] == max(simulated)
    assert all(c["bound"] < body["goodput"] for c in body["candidates"] if c["pruned"])
    assert body["inputs"]["profiles"] == "paper:llava-1.5-7b"  # the default
    assert body["inputs"]["requests"] == 60


def test_table(app: typer.Typer, trace_file: Path, tmp_path: Path) -> None:
    from common.planner.paper_profiles import profiles_from

    profile = tmp_path / "profiles.json"
    profiles_from("paper:llava-1.5-7b").save(profile)
    result = _plan(app, "--trace", str(trace_file), "--instances", "3", "--profile", str(profile))
    assert result.exit_code == 0, result.output
    assert "plan: " in result.stdout and "req/s" in result.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"arrival": 0, "prompt_tokens": "many", "output_tokens": 3}\n', "bad.jsonl:1: prompt_tokens"),
        ('{"arrival": 0, "prompt_tokens": 9, "output_tokens": 3}\n{"arrival": 1}\n', "bad.jsonl:2: missing"),
        ("not json\n", "bad.jsonl:1:"),
    ],
)
def test_bad_trace_exits_2(app: typer.Typer, tmp_path: Path, content: str, message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = _plan(app, "--trace", str(bad), "--instances", "3")
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_usage_errors_exit_2(app: typer.Typer, trace_file: Path, tmp_path: Path) -> None:
    for args, message in [
        (["--trace", str(tmp_path / "missing.jsonl"), "--instances", "3"], "does not exist"),
        (["--trace", str(trace_file), "--instances", "2"], "--instances"),
        (["--trace", str(trace_file), "--instances", "3", "--profile", "paper:gpt-9"], "no paper profile"),
        (
            ["--trace", str(trace_file), "--instances", "3", "--profile", str(tmp_path / "p.json")],
            "cannot read",
        ),
    ]:
        result = _plan(app, *args)
        assert result.exit_code == 2, (args, result.output)
        # typer boxes usage errors and wraps them to the terminal's width
        assert message in re.sub(r"[\s│]+", " ", result.output), (args, result.output)


def test_rate_finds_the_fewest_instances_that_serve_it(app: typer.Typer, trace_file: Path) -> None:
    result = _plan(app, "--trace", str(trace_file), "--rate", "60", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout.strip().splitlines()[-1])
    n = body["recommended_instances"]
    tried = {int(k): g for k, g in body["tried"].items()}
    assert sum(body["replicas"].values()) == n and body["goodput"] >= 60 == body["rate"]
    assert tried[n] >= 60 and (n == 3 or tried[n - 1] < 60)  # one fewer falls short: the fewest
    one_fewer = _plan(app, "--trace", str(trace_file), "--instances", str(n - 1), "--json")
    assert json.loads(one_fewer.stdout.strip().splitlines()[-1])["goodput"] < 60
    # The continuous planner's recommendation, from the same code: every kind's count.
    capacity = body["capacity"]
    assert capacity["instances"] == n and sum(capacity["desired"].values()) == n
    assert {k: v for k, v in capacity["desired"].items() if v} == body["replicas"]


def test_rate_out_of_reach_and_both_or_neither_are_errors(app: typer.Typer, trace_file: Path) -> None:
    far = _plan(app, "--trace", str(trace_file), "--rate", "1000", "--max-instances", "8")
    assert far.exit_code == 1 and "needs more than fits within the limits" in far.output
    poor = _plan(app, "--trace", str(trace_file), "--rate", "1000", "--budget", "4")
    assert poor.exit_code == 1 and "within a budget of 4 cores" in poor.output
    for bad in (
        ["--min-replicas", "x=1"],
        ["--max-replicas", "d=-2"],
        ["--min-replicas", "d=3", "--max-replicas", "d=2"],
    ):
        refused = _plan(app, "--trace", str(trace_file), "--rate", "5", *bad)
        assert refused.exit_code == 2 and "error:" in refused.output, (bad, refused.output)
    free = _plan(app, "--trace", str(trace_file), "--rate", "5", "--instance-cost", "0")
    assert free.exit_code == 2 and "--instance-cost" in free.output  # not silently 1
    for args in ([], ["--rate", "5", "--instances", "4"]):
        both = _plan(app, "--trace", str(trace_file), *args)
        assert both.exit_code == 2 and "--instances" in both.output


def test_a_trace_header_s_profiles_and_service_calibration_are_what_it_is_planned_with(
    app: typer.Typer, tmp_path: Path
) -> None:
    """A trace from a deployment's planner (GET /plan/trace) carries its profiles and calibration:
    offline, `trident plan` plans with them unless told otherwise; slower steps in service plan a
    lower goodput."""
    from common.planner.paper_profiles import profiles_from

    profiles = profiles_from("paper:llava-1.5-7b").to_dict()
    calibration = {
        "factors": {"prefill": 3.0, "decode": 3.0, "encode": 3.0},
        "jitter": 0.0,
        "steps": {},
        "budgets": {},
    }
    entries = generate("pope", rate=4.0, num_requests=60, seed=5)
    path = tmp_path / "served.jsonl"
    write_trace(path, entries, meta={"profiles": profiles, "calibration": calibration})

    def planned(*args: str) -> dict:
        result = _plan(app, "--trace", str(path), "--instances", "3", "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    calibrated, raw = planned(), planned("--no-calibration")
    assert calibrated["inputs"]["profiles"].startswith("the trace's header, calibrated from service")
    assert "decode ×3" in calibrated["inputs"]["profiles"]
    assert raw["inputs"]["profiles"] == "the trace's header"
    assert calibrated["goodput"] < 0.6 * raw["goodput"]
    assert planned("--profile", "paper:llava-1.5-7b")["inputs"]["profiles"] == "paper:llava-1.5-7b"

    bad = tmp_path / "bad.jsonl"
    write_trace(bad, entries, meta={"profiles": profiles, "calibration": {"factors": {}}})
    result = _plan(app, "--trace", str(bad), "--instances", "3")
    assert result.exit_code == 2 and "calibration are malformed" in result.output
