"""Deployments that test modules share, keyed by what they are: (checkpoint, method, scale,
environment). Each starts when a module first asks for it and stops after the last module of its
lane that asks for it, so its start-up (every process loads and profiles the model) is paid once per
run, not once per module: test_e2e.py and test_model_families.py ask for the same E+P+D deployment
of tiny-llava, and get the same one.

Only modules that send a deployment requests share it, and count what their requests added (a
metric's growth, not its value). A module that kills, freezes or restarts what it runs on starts
its own (`tests.deploy.running_cluster`), or restarts its victim before the next test.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common import checkpoints  # its writer (and transformers) loads when a checkpoint is written
from common.infra import free_port
from tests.deploy import running_cluster
from trident.launcher.cluster import Cluster

TINY = "tiny-llava"  # the session's `tiny_model_dir` (seed 0): HF's answers on it are shared too


@dataclass(frozen=True)
class Deployment:
    """What a shared deployment is. `checkpoint` is a preset written with seed 0, once per session;
    `scale` and `env` are sorted pairs, so equal deployments compare equal however they were asked."""

    checkpoint: str = TINY
    method: str = "e+p+d"
    scale: tuple[tuple[str, int], ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls, checkpoint: str = TINY, method: str = "e+p+d", scale: Mapping[str, int] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Deployment:  # fmt: skip
        pairs = (tuple(sorted((given or {}).items())) for given in (scale, env))
        return cls(checkpoint, method, *pairs)

    @property
    def name(self) -> str:
        """`checkpoint method[ scale][ env]`, as the lanes file records it and a test id shows it."""
        extra = [",".join(f"{k}={v}" for k, v in pairs) for pairs in (self.scale, self.env) if pairs]
        return " ".join([self.checkpoint, self.method, *extra])


Uses = Callable[[pytest.Item, str], "Deployment | None"]  # (test, fixture name) -> the deployment


class Registry:
    """The running shared deployments, and which of them each test needs."""

    def __init__(self) -> None:
        self.running: dict[Deployment, tuple[Cluster, ExitStack]] = {}
        self.started: list[Deployment] = []  # in order, restarts included
        self.used_by: dict[str, set[str]] = {}  # module (tests/…py) -> names of the deployments it used
        self.leases: dict[Deployment, int] = {}  # fixture instances holding each now
        self.current: pytest.Item | None = None  # the test running now (tests/conftest.py sets it)
        # The tests still to run after one, in its lane (tests/lanes.py narrows it to the lane).
        self.later: Callable[[pytest.Item], list[pytest.Item]] = _later_in_session

    def get(self, key: Deployment, request: pytest.FixtureRequest) -> Cluster:
        if key in self.running and any(p.poll() is not None for p in self.running[key][0].procs.values()):
            self.running.pop(key)[1].close()  # a process of it died in an earlier module: start afresh
        if key not in self.running:
            stack = ExitStack()
            factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
            workdir = factory.mktemp("shared-" + key.name.replace(" ", "-").replace("+", "_")[:60])
            model = _checkpoint(key.checkpoint, request)
            cluster = running_cluster(model, workdir, key.method, dict(key.scale), dict(key.env))
            cluster = stack.enter_context(cluster)
            cluster.method = key.method
            self.running[key] = (cluster, stack)
            self.started.append(key)
        self.used_by.setdefault(request.node.nodeid.split("::")[0], set()).add(key.name)
        return self.running[key][0]

    def lease(self, key: Deployment, request: pytest.FixtureRequest) -> Iterator[Cluster]:
        """The body of a fixture over `key`: its deployment, then, once no fixture holds it, its stop
        unless a later test of this lane needs it (a drain and integrity check that fail the test
        being torn down if they fail)."""
        cluster = self.get(key, request)
        self.leases[key] = self.leases.get(key, 0) + 1
        try:
            yield cluster
        finally:
            self.leases[key] -= 1
            later = self.later(self.current) if self.current is not None else []
            if not self.leases[key] and key in self.running and not any(key in self.needs(i) for i in later):
                _, stack = self.running.pop(key)
                stack.close()

    def needs(self, item: pytest.Item) -> set[Deployment]:
        """The shared deployments a test runs on: through a fixture `shared()` made, which is the one
        the test resolves (not one of its module's own under the same name)."""
        found = set()
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in getattr(item, "fixturenames", ()):
            uses: Uses | None = getattr(defs[name][-1].func, "uses", None) if defs.get(name) else None
            if uses is not None and (key := uses(item, name)) is not None:
                found.add(key)
        return found

    def close(self) -> None:
        """At the end of the session (or of an interrupted one): stop whatever still runs."""
        while self.running:
            _, stack = self.running.popitem()[1]
            stack.close()


def shared(*keys: Deployment, ids: list[str] | None = None):
    """A module fixture over the shared deployment `keys[0]`, or, given several, over each in turn
    (its params: a test runs once per deployment). Assign it to the fixture's name:
    `epd = shared(Deployment.of(method="epd"))`."""

    def fixture(request: pytest.FixtureRequest) -> Iterator[Cluster]:
        yield from REGISTRY.lease(request.param if len(keys) > 1 else keys[0], request)

    def uses(item: pytest.Item, name: str) -> Deployment | None:
        if len(keys) == 1:
            return keys[0]
        callspec = getattr(item, "callspec", None)
        return callspec.params.get(name) if callspec is not None else None

    fixture.uses = uses  # type: ignore[attr-defined]  (what Registry.needs reads)
    params = list(keys) if len(keys) > 1 else None
    ids = ids or (params and [k.name for k in keys])
    return pytest.fixture(scope="module", params=params, ids=ids)(fixture)


def extra_gateway(cluster: Cluster, name: str, timeout: float = 60.0, **env: str) -> str:
    """Another gateway on a running deployment, configured by `env` over the deployment's, ready;
    returns its URL. A module that needs a gateway configured its own way starts one beside a shared
    deployment's (and stops it, `cluster.stop(name)`), instead of a deployment of its own."""
    port = free_port()
    cluster.start(name, "services.gateway", TRIDENT_PORT=str(port), **env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(cluster.log(name)[-2000:])


@functools.cache
def _written(preset: str, folder: Path) -> Path:
    return checkpoints.write_checkpoint(folder / preset, preset, seed=0)


def _checkpoint(preset: str, request: pytest.FixtureRequest) -> Path:
    """The preset's checkpoint directory: the session's tiny-llava, or one written once for the run."""
    if preset == TINY:
        return request.getfixturevalue("tiny_model_dir")
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    return _written(preset, factory.getbasetemp() / "shared-checkpoints")


def _later_in_session(item: pytest.Item) -> list[pytest.Item]:
    items = item.session.items
    return items[items.index(item) + 1 :] if item in items else []


REGISTRY = Registry()
