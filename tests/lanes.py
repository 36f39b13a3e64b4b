"""`make test` runs the suite in two lanes side by side (`pytest -n 2 --dist loadscope`, with the
scheduler below in place of loadscope's): each lane is one xdist worker's, its tests in collection
order.

Run one after another, the suite keeps about half a core busy: most of its time is spent waiting
— on processes starting, heartbeats lapsing, containers building, streams timed to SLOs — so two
lanes on two cores take little more than the longer one alone. The lanes are balanced from what
the suite took when it last recorded itself (tests/durations.json, written by `--store-durations`:
each test's seconds, setup and teardown included, and the shared deployments each module used).
A module is never split (its module fixtures start once), and modules that share a deployment
(tests/helpers/deployments.py) go to one lane together, or each lane would start its own copy.
(xdist's own `loadgroup` cannot say this under pytest 9: the group it appends to a test's id is lost.)

A test the file does not know yet counts UNKNOWN_SECONDS (more under tests/services and
tests/docker, where each module starts deployments) until the next recording.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "durations.json"
LANES = 2
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
            "(tests/lanes.py balances the lanes of `make test` with them)",
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


def assign(nodeids: Iterable[str], recorded: Recorded, lanes: int = LANES) -> dict[str, int]:
    """Each module's lane: groups of modules (joined by a shared deployment) placed heaviest first,
    each on the lane with the least so far (ties: the first such group, the lowest lane)."""
    weight: dict[str, float] = {}
    for nodeid in nodeids:
        module = module_of(nodeid)
        weight[module] = weight.get(module, 0.0) + seconds(nodeid, recorded)
    parent = {m: m for m in weight}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    by_deployment: dict[str, str] = {}
    for module in weight:
        for name in recorded.shares.get(module, ()):
            if name in by_deployment:
                parent[root(module)] = root(by_deployment[name])
            else:
                by_deployment[name] = module
    groups: dict[str, list[str]] = {}
    for module in weight:  # collection order within a group, and groups by their first module
        groups.setdefault(root(module), []).append(module)
    order = sorted(groups.values(), key=lambda ms: -sum(weight[m] for m in ms))
    load, lane_of = [0.0] * lanes, {}
    for members in order:
        lane = min(range(lanes), key=lambda i: (load[i], i))
        load[lane] += sum(weight[m] for m in members)
        lane_of.update(dict.fromkeys(members, lane))
    return lane_of


def lane_scheduler(config, log):
    """xdist's loadscope scheduling with a test's lane as its scope: each lane goes to one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        lanes: dict[str, int] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.lanes is None:  # once every worker has collected: the same ids as theirs
                self.lanes = assign(self.collection, Recorded.load(), self.numnodes)
            return f"lane-{self.lanes.get(module_of(nodeid), 0)}"

    return LaneScheduling(config, log)
