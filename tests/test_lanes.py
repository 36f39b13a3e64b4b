"""The lanes of `make test` (tests/lanes.py) come from recorded durations, keep each module whole and
the modules that share a deployment together; the run counts the deployments it starts
(tests/tiers.py)."""

from __future__ import annotations

import pytest

from tests.lanes import DURATIONS, Recorded, assign
from tests.tiers import deployment_kind


def ids(module: str, *names_and_seconds: tuple[str, float]) -> dict[str, float]:
    return {f"tests/x/{module}.py::{name}": s for name, s in names_and_seconds}


def test_heaviest_first_each_on_the_lighter_lane():
    tests = {**ids("test_a", ("t1", 6), ("t2", 4)), **ids("test_b", ("t", 6)), **ids("test_c", ("t", 5))}
    tests |= ids("test_d", ("t", 1))
    lanes = assign(tests, Recorded(tests))
    load = [sum(s for t, s in tests.items() if lanes[t.split("::")[0]] == k) for k in (0, 1)]
    assert sorted(load) == [11, 11]
    assert lanes["tests/x/test_a.py"] != lanes["tests/x/test_b.py"]


def test_modules_that_share_a_deployment_share_a_lane():
    tests = {**ids("test_a", ("t", 10)), **ids("test_b", ("t", 9)), **ids("test_c", ("t", 1))}
    shares = {"tests/x/test_a.py": ["tiny-llava e+p+d"], "tests/x/test_b.py": ["tiny-llava e+p+d"]}
    lanes = assign(tests, Recorded(tests, shares))
    assert lanes["tests/x/test_a.py"] == lanes["tests/x/test_b.py"] != lanes["tests/x/test_c.py"]


def test_an_unrecorded_test_counts_its_folders_default():
    recorded = Recorded(ids("test_a", ("t", 12)))
    new = ["tests/services/test_new.py::t1", "tests/services/test_new.py::t2", "tests/x/test_a.py::t"]
    lanes = assign(new, recorded)  # 2 x 10 s against 12 s: apart
    assert lanes["tests/services/test_new.py"] != lanes["tests/x/test_a.py"]


def test_a_recording_replaces_what_it_measured_and_forgets_deleted_modules(tmp_path):
    old = Recorded({"tests/test_lanes.py::gone_test": 1.0, "tests/no_such_module.py::t": 3.0}, {})
    new = old.merged({"tests/test_lanes.py::other": 2.345}, {"tests/test_lanes.py": {"b", "a"}})
    assert new.tests == {"tests/test_lanes.py::gone_test": 1.0, "tests/test_lanes.py::other": 2.35}
    assert new.shares == {"tests/test_lanes.py": ["a", "b"]}
    new.save(tmp_path / "d.json")
    assert Recorded.load(tmp_path / "d.json") == new


def test_the_recorded_suite_splits_into_lanes_within_ten_percent():
    recorded = Recorded.load(DURATIONS)
    if not recorded.tests:
        pytest.skip("no durations recorded yet (make test-durations)")
    lanes = assign(recorded.tests, recorded)
    load = [sum(s for t, s in recorded.tests.items() if lanes[t.split("::")[0]] == k) for k in (0, 1)]
    assert max(load) <= 1.1 * min(load), load


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
