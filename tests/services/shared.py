"""Deployments that test modules share: each starts when a module first asks for it and stops after
the last module of the session that asks for it, so its start-up (each process imports torch and
transformers, loads the model and profiles it: seconds per process) is paid once, not per module.

Only modules that send a deployment requests share it. A module that kills, freezes or restarts
what it runs on, counts absolute metrics, or runs it with settings of its own starts its own
deployment (`running_cluster`, or a module fixture of its own under the same name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.deploy import running_cluster
from trident.launcher.cluster import Cluster

SERVICES = Path(__file__).resolve().parent
Uses = Callable[[pytest.Item], str | None]  # the method a test runs on through a fixture, if shared


class SharedClusters:
    """The shared deployments by method, and which fixture names lead to them."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[Cluster, ExitStack]] = {}
        self.fixtures: dict[str, tuple[object, Uses]] = {}  # name → (its fixture, what a test needs)

    def fixture(self, name: str, uses: Uses) -> Callable:
        """Declares the shared fixture `name` (a decorator over it); `uses` says which method a test
        that asks for `name` runs on, or None when not a shared one."""

        def register(fixture: object) -> object:
            self.fixtures[name] = (fixture, uses)
            return fixture

        return register

    def get(self, method: str, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
        if method in self.running and any(
            p.poll() is not None for p in self.running[method][0].procs.values()
        ):
            self.running.pop(method)[1].close()  # a process of it died in an earlier module: start afresh
        if method not in self.running:
            stack = ExitStack()
            workdir = tmp_path_factory.mktemp("shared-" + method.replace("+", "_"))
            cluster = stack.enter_context(running_cluster(model, workdir, method))
            cluster.method = method
            self.running[method] = (cluster, stack)
        return self.running[method][0]

    def release(self, method: str, module: pytest.Module) -> None:
        """After `module`: stop `method`'s deployment unless a later test of the session needs it
        (its drain and integrity check fail the module's last test if they fail)."""
        items = module.session.items
        last = max(i for i, item in enumerate(items) if _within(item, module))
        if method in self.running and not any(method in self.needs(item) for item in items[last + 1 :]):
            _, stack = self.running.pop(method)
            stack.close()

    def needs(self, item: pytest.Item) -> set[str]:
        """The shared deployments a test runs on: through a shared fixture that its module does not
        replace with one of its own."""
        found = set()
        for name in getattr(item, "fixturenames", ()):
            if name in self.fixtures:
                fixture, uses = self.fixtures[name]
                own = getattr(getattr(item, "module", None), name, None)
                shared = own is fixture if own is not None else item.path.is_relative_to(SERVICES)
                if shared and (method := uses(item)) is not None:
                    found.add(method)
        return found

    def close(self) -> None:
        """At the end of the session (or of an interrupted one): stop whatever still runs."""
        while self.running:
            _, stack = self.running.popitem()[1]
            stack.close()


def _within(item: pytest.Item, module: pytest.Module) -> bool:
    node = item.parent
    while node is not None and node is not module:
        node = node.parent
    return node is module


SHARED = SharedClusters()


def shared_cluster(
    request: pytest.FixtureRequest, method: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The body of a module fixture over a shared deployment: the deployment, then its release."""
    yield SHARED.get(method, model, tmp_path_factory)
    SHARED.release(method, request.node)
