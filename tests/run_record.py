"""What a run records of itself (a plugin of tests/conftest.py): the deployments it started and the
machine's speed, printed at its end (the suite's budget is 40 deployments a full run); with
`--store-durations`, each test's seconds and the shared deployments each module used, written to
tests/durations.json, from which tests/lanes.py weighs the next runs' units of work; and, in each
unit, which of its tests are still to come, so that a shared deployment stops after the last one
that needs it (tests/helpers/deployments.py)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

import pytest

from tests.helpers.deployments import REGISTRY
from tests.lanes import Recorded, alone_ids, units
from tests.tiers import DEPLOY_EVENT, START_EVENT, deployment_kind
from trident.bench.machine import single_thread_gflops

STARTED: Counter[str] = Counter()  # deployments by kind, in this process (or, on the controller, all)
SECONDS: Counter[str] = Counter()  # test id -> setup + call + teardown
SHARES: dict[str, set[str]] = {}  # module -> shared deployments it used, from every lane
_last_start: list[list[str]] = []  # the argv of the last process a cluster started
LANE_ENDS: dict[str, float] = {}  # worker -> seconds from the run's start to its lane's end
MATMUL: dict[str, float] = {}  # single-thread fp32 GFLOP/s at the "start" and the "end" of the run
_began = time.monotonic()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations", action="store_true",
        help="write each test's seconds and each module's shared deployments to tests/durations.json",
    )  # fmt: skip


@pytest.hookimpl(trylast=True)  # after the fast tier's guard (tests/conftest.py): a start it refuses
def pytest_configure(config: pytest.Config) -> None:  # raises before this hook counts it
    sys.addaudithook(_count)


def _count(event: str, args: tuple) -> None:
    if event == DEPLOY_EVENT:
        STARTED[args[0]] += 1
    elif event == START_EVENT:
        _last_start[:] = [[str(a) for a in args[0]]]
    elif event == "subprocess.Popen" and not isinstance(args[1], str | bytes):
        argv = [str(a) for a in args[1]]
        if _last_start and argv == _last_start[0]:  # a cluster's process, started plainly
            return
        if kind := deployment_kind(argv):
            STARTED[kind] += 1


def _lanes_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.getplugin("dsession") is not None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Each lane measures the machine itself: the lanes' controller would import torch for it (a second
    before the lanes can start), and it is idle while they run."""
    if not _lanes_controller(session.config):
        MATMUL["start"] = single_thread_gflops()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each test's unit, as the controller makes them (tests/lanes.py, from the same ids): what is
    still to come after a test, in its lane, is what comes after it in its unit (the rest of the
    session in a run without lanes)."""
    items = session.items
    laned = os.environ.get("PYTEST_XDIST_WORKER") and session.config.getoption("dist", "no") == "loadscope"
    unit_of = units([i.nodeid for i in items], Recorded.load(), alone_ids(items)) if laned else {}
    unit = [unit_of.get(i.nodeid, "") for i in items]
    index = {id(item): n for n, item in enumerate(items)}

    def later(item: pytest.Item) -> list[pytest.Item]:
        n = index.get(id(item))
        if n is None:
            return []
        return [x for x, u in zip(items[n + 1 :], unit[n + 1 :], strict=True) if u == unit[n]]

    REGISTRY.later = later


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    REGISTRY.current = item
    return (yield)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module, names in REGISTRY.used_by.items():
        SHARES.setdefault(module, set()).update(names)
    config = session.config
    if not _lanes_controller(config):
        MATMUL["end"] = single_thread_gflops()
    if hasattr(config, "workeroutput"):  # a lane: the controller sums and writes
        config.workeroutput["matmul"] = dict(MATMUL)
        config.workeroutput["deployments"] = dict(STARTED)
        config.workeroutput["shares"] = {m: sorted(n) for m, n in SHARES.items()}
        return
    if config.getoption("store_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        Recorded.load().merged(SECONDS, SHARES).save()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    worker = getattr(getattr(node, "gateway", None), "id", f"lane {len(LANE_ENDS)}")
    LANE_ENDS[worker] = time.monotonic() - _began
    STARTED.update(output.get("deployments", {}))
    measured = output.get("matmul", {})  # the run's start from the first lane to end, its end from the last
    MATMUL.setdefault("start", measured.get("start", float("nan")))
    MATMUL["end"] = measured.get("end", float("nan"))
    for module, names in output.get("shares", {}).items():
        SHARES.setdefault(module, set()).update(names)


def pytest_terminal_summary(terminalreporter) -> None:
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(STARTED.items()))
    terminalreporter.write_line(f"deployments: {sum(STARTED.values())} started ({kinds or 'none'})")
    if len(LANE_ENDS) > 1:  # how even the lanes came out: the run waits for the last
        ends = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(LANE_ENDS.items()))
        terminalreporter.write_line(f"lanes ended: {ends}")
    # This machine's speed varies from run to run (and with what else runs): a time means little alone.
    start, end = (MATMUL.get(k, float("nan")) for k in ("start", "end"))
    terminalreporter.write_line(
        f"machine: single-thread fp32 matmul {start:.1f} GFLOP/s at the start, "
        f"{end:.1f} at the end; {time.monotonic() - _began:.0f} s of pytest"
    )
