"""`make test` runs the suite in two lanes side by side (`pytest -n 2 --dist loadscope`, with the
scheduler below in place of loadscope's): each lane is one xdist worker's, its tests in collection
order.

Run one after another, the suite keeps about half a core busy: most of its time is spent waiting
— on processes starting, heartbeats lapsing, containers building, streams timed to SLOs — so two
lanes on two cores take little more than the longer one alone. Lanes are folders, never split
inside a module (module fixtures start once) and never across the deployments tests/services
shares (tests/services/shared.py): every test that can use a shared deployment is in lane `a`.
(xdist's own `loadgroup` cannot say this under pytest 9: the group it appends to a test's id is lost.)
"""

from __future__ import annotations

from pathlib import PurePosixPath

# Top-level folders of tests/ in lane `b`: none of them uses a shared deployment. Roughly half of
# the suite's time beside another lane (tests/docker alone is over half of it there); everything
# else is lane `a`.
LANE_B = ("docker", "engine", "gateway", "runtime", "stages", "substrate")
# And modules of lane `a`'s folders whose tests are mostly slow (they start deployments or
# workers): in lane `b` they even out the full suite's lanes (from one run's test times at stop 42:
# a 1091 s against b 858 s with them in `a`) and leave the fast tier's lanes as they were.
LANE_B_MODULES = (
    "planner/test_jobs.py",
    "planner/test_service.py",
    "bench/test_serve.py",
    "bench/test_deployments.py",
)


def lane_of(nodeid: str) -> str:
    """`a` or `b`, from a test's id (`tests/<folder>/<module>.py::<name>`)."""
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    if len(parts) < 3 or parts[0] != "tests":
        return "a"
    return "b" if parts[1] in LANE_B or "/".join(parts[1:]) in LANE_B_MODULES else "a"


def lane_scheduler(config, log):
    """xdist's loadscope scheduling with a test's lane as its scope: each lane goes to one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return LaneScheduling(config, log)
