"""The lanes of `make test` (tests/lanes.py) take units of work weighed by recorded durations, each
module whole with the modules that share a deployment, and the alone tests last, by themselves; the
run counts the deployments it starts (tests/tiers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lanes import ALONE, DURATIONS, Recorded, units, weights
from tests.tiers import deployment_kind

REPO = Path(__file__).resolve().parents[1]


def ids(module: str, *names_and_seconds: tuple[str, float]) -> dict[str, float]:
    return {f"tests/x/{module}.py::{name}": s for name, s in names_and_seconds}


def test_a_unit_is_a_module_whole_and_the_alone_tests_one_more():
    tests = {**ids("test_a", ("t1", 6), ("t2", 4)), **ids("test_b", ("t", 6), ("slow", 30))}
    unit_of = units(tests, Recorded(tests), alone={"tests/x/test_b.py::slow"})
    assert unit_of == {
        "tests/x/test_a.py::t1": "tests/x/test_a.py",
        "tests/x/test_a.py::t2": "tests/x/test_a.py",
        "tests/x/test_b.py::t": "tests/x/test_b.py",
        "tests/x/test_b.py::slow": ALONE,
    }
    assert weights(unit_of, Recorded(tests)) == {"tests/x/test_a.py": 10, "tests/x/test_b.py": 6, ALONE: 30}


def test_modules_that_share_a_deployment_are_one_unit_named_by_the_first():
    tests = {**ids("test_a", ("t", 10)), **ids("test_b", ("t", 9)), **ids("test_c", ("t", 1))}
    tests |= ids("test_d", ("t", 2))
    shares = {
        "tests/x/test_b.py": ["e+p+d"],
        "tests/x/test_c.py": ["epd"],
        "tests/x/test_d.py": ["e+p+d", "epd"],
    }
    unit_of = units(tests, Recorded(tests, shares))
    assert set(unit_of.values()) == {"tests/x/test_a.py", "tests/x/test_b.py"}
    assert weights(unit_of, Recorded(tests, shares)) == {"tests/x/test_a.py": 10, "tests/x/test_b.py": 12}


def test_an_unrecorded_test_counts_its_folders_default():
    new = ["tests/services/test_new.py::t1", "tests/services/test_new.py::t2", "tests/x/test_a.py::t"]
    assert weights(units(new, Recorded()), Recorded()) == {
        "tests/services/test_new.py": 20,
        "tests/x/test_a.py": 0.5,
    }


def test_a_recording_replaces_what_it_measured_and_forgets_deleted_modules(tmp_path):
    old = Recorded({"tests/test_lanes.py::gone_test": 1.0, "tests/no_such_module.py::t": 3.0}, {})
    new = old.merged({"tests/test_lanes.py::other": 2.345}, {"tests/test_lanes.py": {"b", "a"}})
    assert new.tests == {"tests/test_lanes.py::gone_test": 1.0, "tests/test_lanes.py::other": 2.35}
    assert new.shares == {"tests/test_lanes.py": ["a", "b"]}
    new.save(tmp_path / "d.json")
    assert Recorded.load(tmp_path / "d.json") == new


def test_no_recorded_unit_outweighs_a_tenth_of_the_suite():
    """Heaviest first, two lanes end within the last unit's time of each other: a unit of over a
    tenth of the suite would leave them apart at the end, whatever the order."""
    recorded = Recorded.load(DURATIONS)
    if not recorded.tests:
        pytest.skip("no durations recorded yet (make test-durations)")
    weight = weights(units(recorded.tests, recorded), recorded)
    heaviest = max(weight, key=weight.__getitem__)
    assert weight[heaviest] <= 0.1 * sum(weight.values()), (heaviest, weight[heaviest])


# A suite of its own, run by pytest in two lanes: which lane ran each test, and when each lane ended.
LANE_SUITE = {
    "conftest.py": """
import os, time
from pathlib import Path
import pytest

pytest_plugins = ["tests.lanes"]
LOG = Path(os.environ["LANE_LOG"])

def note(*words):
    with LOG.open("a") as f:
        f.write(" ".join([os.environ.get("PYTEST_XDIST_WORKER", "-"), *words]) + "\\n")

@pytest.fixture(autouse=True)
def each(request):
    note("ran", request.node.nodeid)
    yield

@pytest.hookimpl(tryfirst=True)  # before xdist reports the lane's end to the controller
def pytest_sessionfinish(session):
    note("ended")
""",
    "test_many.py": """
import os, time
from pathlib import Path

def test_0():
    \"\"\"The other lane ends meanwhile: the alone test must not start while this lane runs.\"\"\"
    log, deadline = Path(os.environ["LANE_LOG"]), time.monotonic() + 1
    while time.monotonic() < deadline:
        assert "test_solo.py" not in log.read_text()
        time.sleep(0.05)
"""
    + "\n".join(f"def test_{i}(): pass" for i in range(1, 12)),
    "test_few.py": "def test_one(): pass\ndef test_two(): pass\n",
    "test_solo.py": """
import os
from pathlib import Path
import pytest

@pytest.mark.alone
def test_runs_after_every_other_lane_ended():
    lines = Path(os.environ["LANE_LOG"]).read_text().splitlines()
    me = os.environ["PYTEST_XDIST_WORKER"]
    others = {line.split()[0] for line in lines} - {me}
    assert others and all(f"{w} ended" in lines for w in others), lines
""",
}


def test_the_alone_tests_run_last_in_one_lane_once_the_others_have_ended(tmp_path):
    for name, text in LANE_SUITE.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: by itself\n")
    log = tmp_path / "lanes.log"
    env = {**os.environ, "LANE_LOG": str(log), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = log.read_text().splitlines()
    ran = [line.split()[2] for line in lines if line.split()[1] == "ran"]
    assert len(ran) == len(set(ran)) == 15
    assert ran[-1].endswith("test_solo.py::test_runs_after_every_other_lane_ended")
    assert {line.split()[0] for line in lines if line.split()[1] == "ran"} == {"gw0", "gw1"}


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["/v/bin/trident", "up", "-f", "compose.yaml"], "trident up"),
        (["python", "-c", "import typer; from trident.cli.up import up; typer.run(up)", "--file",
          "/t/compose.test.yaml"], "trident up (stand-ins)"),
        (["python", "-m", "celery", "--app=services.planner.jobs", "worker"], "service process"),
        (["python", "-m", "services.worker.probe", "/ready"], None),
        (["/v/bin/transformers", "serve", "--port", "1"], "peer server"),
        (["docker", "compose", "up", "-d"], None),  # counted by the stack fixture
        (["python", "-m", "pytest"], None),
    ],
)  # fmt: skip
def test_what_a_started_process_adds_to_the_deployments(argv, kind):
    assert deployment_kind(argv) == kind
