"""`make test` runs the suite in two lanes side by side (`pytest -n 2 --dist loadscope`, with the
scheduler below in place of loadscope's): each lane is one xdist worker, fed units of work, the
heaviest waiting one first, whenever it runs low.

Run one after another, the suite keeps about half a core busy: most of its time is spent waiting
— on processes starting, heartbeats lapsing, containers building, streams timed to SLOs — so two
lanes on two cores take little more than half the suite. A unit is a module whole (its module
fixtures start once), with every module that shares a deployment with it (tests/helpers/
deployments.py), or each lane would start its own copy. (xdist's own `loadgroup` cannot say this
under pytest 9: the group it appends to a test's id is lost.) Units are weighed by what the suite
took when it last recorded itself (tests/durations.json, written by `--store-durations`: each
test's seconds, setup and teardown included, and the shared deployments each module used); a test
the file does not know yet counts UNKNOWN_SECONDS (more under tests/services and tests/docker,
where each module starts deployments). Heaviest first, the last units to go are the smallest, so
the lanes end within seconds of each other however far a run strays from the recording.

The tests marked `alone` (a time or memory bound that a lane beside them would move) are one unit
more, run last: once every lane is idle, all but one end, and the last runs them by itself.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "durations.json"
ALONE = "alone"  # the unit of the tests marked alone
UNKNOWN_SECONDS = {"services": 10.0, "docker": 30.0}  # by top-level folder; elsewhere DEFAULT_SECONDS
DEFAULT_SECONDS = 0.5


@dataclass
class Recorded:
    """What tests/durations.json holds: seconds by test id, and shared deployments by module path."""

    tests: dict[str, float] = field(default_factory=dict)
    shares: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = DURATIONS) -> Recorded:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(dict(data.get("tests", {})), dict(data.get("shares", {})))

    def merged(self, tests: Mapping[str, float], shares: Mapping[str, Iterable[str]]) -> Recorded:
        """This record with a run's measurements in place of the old ones; tests whose module is gone
        are dropped."""
        kept = {k: v for k, v in self.tests.items() if (TESTS.parent / module_of(k)).exists()}
        return Recorded(
            {**kept, **{k: round(v, 2) for k, v in tests.items()}},
            {**self.shares, **{m: sorted(set(names)) for m, names in shares.items()}},
        )

    def save(self, path: Path = DURATIONS) -> None:
        body = {
            "about": "seconds per test and shared deployments per module, from `pytest --store-durations` "
            "(tests/lanes.py weighs the units of work of `make test`'s lanes with them)",
            "tests": dict(sorted(self.tests.items())),
            "shares": dict(sorted(self.shares.items())),
        }
        path.write_text(json.dumps(body, indent=0, ensure_ascii=False) + "\n")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def seconds(nodeid: str, recorded: Recorded) -> float:
    if nodeid in recorded.tests:
        return recorded.tests[nodeid]
    parts = PurePosixPath(module_of(nodeid)).parts
    return UNKNOWN_SECONDS.get(parts[1], DEFAULT_SECONDS) if len(parts) > 2 else DEFAULT_SECONDS


def units(nodeids: Iterable[str], recorded: Recorded, alone: Collection[str] = ()) -> dict[str, str]:
    """Each test's unit of work: ALONE for the tests in `alone`; for the rest, its module's group
    (the module with every module a shared deployment joins it to, named by the first of them)."""
    nodeids = list(nodeids)
    modules = list(dict.fromkeys(module_of(n) for n in nodeids if n not in alone))
    parent = {m: m for m in modules}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    by_deployment: dict[str, str] = {}
    for module in modules:  # the first module of a group is its root: the name it goes by
        for name in recorded.shares.get(module, ()):
            if name not in by_deployment:
                by_deployment[name] = module
            elif (a := root(by_deployment[name])) != (b := root(module)):
                first, second = sorted((a, b), key=modules.index)
                parent[second] = first
    return {n: ALONE if n in alone else root(module_of(n)) for n in nodeids}


def weights(unit_of: Mapping[str, str], recorded: Recorded) -> dict[str, float]:
    """Each unit's recorded seconds."""
    weight: dict[str, float] = {}
    for nodeid, unit in unit_of.items():
        weight[unit] = weight.get(unit, 0.0) + seconds(nodeid, recorded)
    return weight


def alone_ids(items: Iterable[pytest.Item]) -> set[str]:
    return {item.nodeid for item in items if item.get_closest_marker("alone")}


def lane_scheduler(config, log, alone: Callable[[], Collection[str]]):
    """xdist's loadscope scheduling with units (above) as its scopes: the heaviest waiting unit to
    the lane that runs low, and the ALONE unit last, to one lane once the others have ended."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        unit_of: dict[str, str] | None = None
        weight: dict[str, float]

        def _split_scope(self, nodeid: str) -> str:
            if self.unit_of is None:  # once every worker has collected: the same ids as theirs
                recorded = Recorded.load()
                self.unit_of = units(self.collection, recorded, alone())
                self.weight = weights(self.unit_of, recorded)
            return self.unit_of[nodeid]

        def _assign_work_unit(self, node) -> None:  # what loadscope's _reschedule calls on a lane run low
            waiting = [u for u in self.workqueue if u != ALONE]
            if not waiting:
                self._run_alone()
                return
            self.workqueue.move_to_end(max(waiting, key=self.weight.__getitem__), last=False)
            super()._assign_work_unit(node)

        def remove_node(self, node):
            crashed = super().remove_node(node)
            if list(self.workqueue) == [ALONE]:
                self._run_alone()
            return crashed

        def _run_alone(self) -> None:
            """Once every lane waits with at most the last test it holds (a worker runs a test when
            the next one arrives, or it is told to end), all but the first are told to end; when
            they have, the ALONE unit goes to the first."""
            nodes = list(self.assigned_work)
            if not nodes or any(self._pending_of(self.assigned_work[n]) > 1 for n in nodes):
                return
            keep, *others = nodes
            for node in others:
                if not node.shutting_down:
                    node.shutdown()
            if not others:
                super()._assign_work_unit(keep)

    return LaneScheduling(config, log)


# -- as a plugin (tests/conftest.py loads it): the scheduler for `--dist loadscope`, and the ids of
# the tests marked alone, which only a worker knows (xdist's controller collects nothing), handed
# to it in a file each worker writes before it reports its collection.
_ALONE_FILE = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if config.getvalue("dist") == "loadscope" and not hasattr(config, "workerinput"):
        config.stash[_ALONE_FILE] = Path(tempfile.mkdtemp(prefix="trident-lanes-")) / "alone.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    if (path := config.stash.get(_ALONE_FILE, None)) is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    if (path := node.config.stash.get(_ALONE_FILE, None)) is not None:
        node.workerinput["alone_file"] = str(path)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports that it has collected
def pytest_collection_finish(session: pytest.Session) -> None:
    if path := getattr(session.config, "workerinput", {}).get("alone_file"):
        mine = Path(f"{path}.{session.config.workerinput['workerid']}")
        mine.write_text(json.dumps(sorted(alone_ids(session.items))))
        mine.replace(path)  # whole, whichever worker writes last: they collected the same tests


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    path = config.stash[_ALONE_FILE]
    return lane_scheduler(config, log, lambda: json.loads(path.read_text()) if path.exists() else [])
