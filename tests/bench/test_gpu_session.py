"""bench/gpu_session.sh, the one entry a GPU session runs, rehearsed on the CPU as the session runs
it: the offline bundle (built here for this Python, as `trident bundle` builds it for the GPU
machine's) installed with no index, then `check` (bench/gpu_check.py: its measurements, then its
contract tests one file at a time in what is left of the deadline) and `serve` (bench/gpu_serve.py:
the whole deployment from the bundle's packages and servers), each with the session's files where
the device tool fetches them ($OUT)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import whole_run
from tests.helpers.package_index import index_reachable
from tests.tiers import count_deployment
from trident.bundle.build import build

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not index_reachable():
        pytest.skip("pip cannot reach its package index from here: the bundle is built where it can")
    folder = tmp_path_factory.mktemp("gpu-session") / "bundle"
    build(folder, platform.python_version())
    return folder


def session(mode: str, seconds: int, bundle: Path, models: Path, tmp_path: Path) -> Path:
    """`bench/gpu_session.sh MODE SECONDS` as the device runs it, `--cpu`; its $OUT folder."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        # `python3` is this interpreter, as it is the image's on the GPU machine.
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TRIDENT_BUNDLE": str(bundle),
        "TRIDENT_BUNDLE_SITE": str(tmp_path / "site"),
        "OUT": str(out),
        "GPU_SESSION_FLAGS": f"--cpu --models {models}",
    }
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_session.sh"), mode, str(seconds)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds + 60,
    )  # fmt: skip
    log = (out / "gpu_session.log").read_text()
    assert run.returncode == 0 and "status 0" in log, log[-3000:]
    assert (tmp_path / "site" / "bin" / "nats-server").exists()  # the bundle's servers, installed
    return out


@whole_run
def test_check_installs_the_bundle_measures_then_runs_the_contract_tests(
    bundle: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = session("check", 280, bundle, tiny_model_dir.parent, tmp_path)
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["ok"] and result["cpu_mode"], json.dumps(result)[-3000:]
    files = result["contract_tests"]["files"]
    # On the CPU: the engine's contracts run their CPU cases; CUDA IPC and the compiled kernels skip.
    engine = files["tests/engine/test_gpu_contracts.py"]
    assert engine["ok"] and engine["tests"] > engine["skipped"] > 0
    cuda = files["tests/substrate/test_transfer_cuda.py"]
    assert cuda["ok"] and cuda["tests"] == cuda["skipped"] > 0


@whole_run
@pytest.mark.timeout(600)
def test_serve_runs_the_whole_deployment_from_the_bundle(
    bundle: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = session("serve", 400, bundle, tiny_model_dir.parent, tmp_path)
    result = json.loads((out / "gpu_serve.json").read_text())
    for run in result["runs"].values():  # started by the script, where this run's count cannot see them
        count_deployment("peer server" if run["method"] is None else "trident up")
    assert result["ok"], json.dumps(result)[-3000:]
    assert result["headline"]["errors"] == result["headline"]["hung"] == 0
    assert (out / "gpu_serve_logs.txt").exists()
