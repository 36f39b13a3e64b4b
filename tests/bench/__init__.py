"""Tests of the benchmark instrument and of the scripts under bench/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_script(path: Path, name: str) -> ModuleType:
    """A script that is not a package module (bench/*.py), imported from its file."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(
    script: Path, *args: str, timeout: float = 300, **popen
) -> tuple[subprocess.CompletedProcess, dict]:
    """`script` run as a user runs it (its own interpreter, `args` on its command line); it must
    succeed, and its last line of output, one JSON object (every benchmark's contract), is parsed."""
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, **popen
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def whole_run(test):
    """Marks a test that runs a benchmark script whole on the CPU (tens of seconds): slow, and in CI's
    second step (`make test-extended`) rather than `make test`, which keeps the benchmarks' own
    contracts (their tables, their parsing, their units) and the product they measure."""
    return pytest.mark.slow(pytest.mark.extended(test))
