"""bench/gpu_serve.py, the whole deployment's GPU check: its CPU mode runs every step (each method's
real deployment, parity against HF, the sweep and the turns through the gateway, the baseline, the
Qwen-VL shapes) so the script a GPU session runs cannot rot between GPU sessions; its plan and its
deadline are checked on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import load_script, run_bench, whole_run
from tests.tiers import count_deployment
from trident.bench.steps import Steps

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_serve.py"
METHODS = {"e+p+d", "ep+d", "ed+p", "epd"}


@pytest.fixture(scope="module")
def check():
    return load_script(SCRIPT, "gpu_serve")


def test_on_a_gpu_it_checks_parity_under_every_method_and_sweeps_7b_shapes(check) -> None:
    runs = check.plan(cpu=False)
    parity = [r for r in runs if r.parity]
    assert {r.method for r in parity} == METHODS and {(r.preset, r.dtype) for r in parity} == {
        ("tiny-llava", "float32")
    }
    swept = {(r.preset, r.method, r.dtype) for r in runs if r.sweep and r.method}
    assert {("llava-1.5-7b", m, "bfloat16") for m in ("e+p+d", "ep+d", "epd")} <= swept
    assert any(r.preset == "qwen2-vl-7b" for r in runs)
    assert [r.preset for r in runs if r.method is None] == ["llava-1.5-7b"]  # the baseline
    on_cpu = check.plan(cpu=True)  # one deployment per method at most, each held against HF
    methods = [r.method for r in on_cpu if r.method]
    assert sorted(methods) == sorted(METHODS) and all(r.parity for r in on_cpu if r.method)


def test_a_step_past_the_deadline_is_skipped_and_a_failing_one_stops_nothing(tmp_path: Path) -> None:
    results: dict = {}
    steps = Steps(results, tmp_path / "out.json", deadline_s=60)

    def boom() -> dict:
        raise RuntimeError("no GPU")

    steps.run("fails", boom)
    steps.run("checked", lambda: {"failures": ["answers differ"]})
    steps.run("late", lambda: {"ran": True}, need=3600)
    steps.run("runs", lambda: {"ran": True})
    assert results["fails"]["ok"] is False and "no GPU" in results["fails"]["error"]
    assert results["checked"]["ok"] is False
    assert "skipped" in results["late"] and "ran" not in results["late"]
    assert results["runs"] == {"ok": True, "ran": True, "seconds": results["runs"]["seconds"]}
    assert json.loads((tmp_path / "out.json").read_text())["runs"]["ran"] is True


@whole_run
@pytest.mark.timeout(1000)
def test_the_gpu_serving_check_rehearses_every_step_on_the_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu_serve.json"
    _, printed = run_bench(
        SCRIPT, "--cpu", "--models", str(tiny_model_dir.parent), "--out", str(out), "--logs", str(tmp_path),
        "--deadline", "900", timeout=1000,
    )  # fmt: skip
    result = json.loads(out.read_text())
    for run in result["runs"].values():  # started by the script, where this run's count cannot see them
        count_deployment("peer server" if run["method"] is None else "trident up")
    assert result == printed and result["ok"], json.dumps(result)[-3000:]
    assert result["settings"]["TRIDENT_DEVICE"] == "cpu" and result["environment"]["device"] == "cpu"
    head = result["headline"]
    assert head["parity"] == dict.fromkeys(METHODS, True) and head["errors"] == head["hung"] == 0
    assert head["baseline_goodput"] is not None and not head["skipped"]
    for name, run in result["runs"].items():
        assert run["sweep"]["rates"] and run["sweep"]["rates"][0]["completed"] > 0, name
        if run["method"] is None:
            continue
        seen = run["observed"]
        assert seen["stages"]["ttft"]["count"] > 0 and set(seen["transfer_paths"].values()) <= {"ucx", "tcp"}
        memory = seen["processes"]
        assert {"gateway", "planner-1", "planner-jobs-1", "nats", "redis"} <= set(memory)
        assert all(p["rss_bytes"] > 0 and p["gpu_bytes"] is None for p in memory.values())
        decoders = [p for n, p in memory.items() if n.startswith(("decode", "worker"))]
        assert decoders and all(p["kv_cache_bytes"] > 0 for p in decoders)
        assert all(p["device_memory_reserved_bytes"] is None for p in memory.values())  # no GPU
    split = result["runs"]["tiny-llava e+p+d"]["observed"]["transfers"]
    assert split["pd"]["pulls"] > 0 and split["pd"]["bytes"] > 0 and split["ep"]["pulls"] > 0
    assert "turns" in result["runs"]["tiny-llava ep+d"]
