"""bench/process_profile.py's accounting: CPU by process tree from /proc, py-spy's raw profiles,
and a TTFT split into the intervals between a request's stage marks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "process_profile.py"


@pytest.fixture(scope="module")
def profile():
    return load_script(SCRIPT, "process_profile")


def test_a_process_counts_the_cpu_of_its_children(profile):
    """A parent that only waits on a child that spins: the parent's tree holds the child's CPU."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"]
    )
    try:
        deadline = time.monotonic() + 30
        seen = 0.0
        while parent.poll() is None and time.monotonic() < deadline:
            found = profile.cpu_by_process({"parent": parent.pid, "self": os.getpid()}, skip={os.getpid()})
            seen = max(seen, found["parent"]["cpu_s"])
            assert found["self"]["cpu_s"] == 0.0  # skipped: counted nowhere
            time.sleep(0.05)
        assert seen >= 0.3
        gone = profile.cpu_by_process({"gone": parent.pid})["gone"]
        assert gone["cpu_s"] == 0.0 and gone["threads"] == 0  # exited: counts nothing
    finally:
        parent.kill()
        parent.wait()


def test_own_time_is_each_innermost_frame_share_of_the_samples(profile, tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (a.py:1);step (b.py:2) 30\nmain (a.py:1);wait (c.py:3) 10\nmain (a.py:1);step (b.py:2) 10\n"
    )
    assert profile.own_time(raw) == [("step (b.py:2)", 0.8), ("wait (c.py:3)", 0.2)]
    assert profile.own_time(tmp_path / "missing.txt") == []


def record(arrival: float, ttft: float, **marks: float):
    stages = {"arrival": arrival, **{k: arrival + v for k, v in marks.items()}}
    return SimpleNamespace(arrival=arrival, ttft=ttft, stages=stages, num_images=1, prompt_tokens=100)


def test_a_ttft_splits_into_its_marks_intervals_and_the_gateways_rest(profile):
    r = record(10.0, 0.5, encode_queued=0.01, encode_started=0.02, encode_ended=0.12, prefill_started=0.13,
               prefill_ended=0.40, first_token=0.41, end=2.0)  # fmt: skip
    split = profile.intervals(r.stages, r.ttft)
    assert split["encode_started→encode_ended"] == pytest.approx(100.0)
    assert split["prefill_started→prefill_ended"] == pytest.approx(270.0)
    assert split["gateway"] == pytest.approx(90.0)  # 500 ms at the gateway, 410 between its marks
    assert not any(k.split("→")[-1] == "end" for k in split)  # TTFT's path only


def test_an_outlier_shows_the_interval_that_holds_its_time(profile):
    normal = dict(encode_queued=0.01, encode_started=0.02, encode_ended=0.12, prefill_started=0.13,
                  prefill_ended=0.33, first_token=0.34)  # fmt: skip
    records = [record(float(i), 0.36, **normal) for i in range(9)]
    slow = {**normal, "prefill_started": 1.43, "prefill_ended": 1.63, "first_token": 1.64}  # waited 1.3 s
    records.append(record(8.5, 1.66, **slow))
    found = profile.outliers(records)
    assert found["median_ttft_ms"] == pytest.approx(360.0)
    (only,) = found["outliers"]
    assert only["ttft_ms"] == pytest.approx(1660.0)
    assert only["intervals"]["encode_ended→prefill_started"] == pytest.approx(1310.0)
    assert found["median"]["encode_ended→prefill_started"] == pytest.approx(10.0)
    assert only["arrived_in_the_second_before"] == 1  # the request at 8.0
