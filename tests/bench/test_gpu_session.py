"""bench/gpu_session.sh, the one entry a GPU session runs, rehearsed on the CPU as the session runs
it: the offline bundle (built here for this Python, as `trident bundle` builds it for the GPU
machine's) installed with no index, then bench/gpu_check.py in `check` mode — its measurements, then
its contract tests one file at a time in what is left of the deadline — with the session's files
where the device tool fetches them ($OUT)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import whole_run
from tests.test_bundle import index_reachable
from trident.bundle.build import build

REPO = Path(__file__).resolve().parents[2]


@whole_run
def test_the_gpu_session_installs_its_bundle_and_checks_within_its_time(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    if not index_reachable():
        pytest.skip("pip cannot reach its package index from here: the bundle is built where it can")
    build(tmp_path / "bundle", platform.python_version())
    out = tmp_path / "out"
    env = {
        **os.environ,
        # `python3` is this interpreter, as it is the image's on the GPU machine.
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TRIDENT_BUNDLE": str(tmp_path / "bundle"),
        "TRIDENT_BUNDLE_SITE": str(tmp_path / "site"),
        "OUT": str(out),
        "GPU_SESSION_FLAGS": f"--cpu --models {tiny_model_dir.parent}",
    }
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_session.sh"), "check", "280"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=330,
    )  # fmt: skip
    log = (out / "gpu_session.log").read_text()
    assert run.returncode == 0, log[-3000:]
    assert "gpu_session: done in" in log and "status 0" in log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["ok"] and result["cpu_mode"], json.dumps(result)[-3000:]
    files = result["contract_tests"]["files"]
    # On the CPU: the engine's contracts run their CPU cases; CUDA IPC and the compiled kernels skip.
    engine = files["tests/engine/test_gpu_contracts.py"]
    assert engine["ok"] and engine["tests"] > engine["skipped"] > 0
    cuda = files["tests/substrate/test_transfer_cuda.py"]
    assert cuda["ok"] and cuda["tests"] == cuda["skipped"] > 0
    # The bundle's servers and modules were the ones on the path.
    assert (tmp_path / "site" / "bin" / "nats-server").exists()
