"""Service fixtures: real deployments (nats-server, redis-server, workers, gateway), shared by the
modules that only send them requests (tests/services/shared.py)."""

from __future__ import annotations

import base64
import io

import openai
import pytest

from tests.deploy import running_cluster
from tests.engine.conftest import make_image
from tests.services.shared import SHARED, shared_cluster
from trident.launcher.cluster import Cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of every running deployment's logs (a fence, a traceback)."""
    report = yield
    if report.failed:
        for cluster in Cluster.running:
            report.sections.append((f"logs of {cluster.workdir.name}", cluster.tails()))
    return report


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def image_urls():
    return [data_url(make_image(i)) for i in range(3)]


def start(tiny_model_dir, tmp_path_factory, method, scale=None):
    return running_cluster(tiny_model_dir, tmp_path_factory.mktemp(method.replace("+", "")), method, scale)


SHARED_METHODS = ("epd", "e+p+d")  # the methods `cluster` runs on shared deployments


@SHARED.fixture("epd", lambda item: "epd")
@pytest.fixture(scope="module")
def epd(request, tiny_model_dir, tmp_path_factory):
    """One EPD instance and a gateway, shared with every module that uses this fixture (or
    `cluster`'s epd): for modules that only send it requests."""
    yield from shared_cluster(request, "epd", tiny_model_dir, tmp_path_factory)


@SHARED.fixture("e_p_d", lambda item: "e+p+d")
@pytest.fixture(scope="module")
def e_p_d(request, tiny_model_dir, tmp_path_factory):
    """An E+P+D deployment (one instance each), shared like `epd`."""
    yield from shared_cluster(request, "e+p+d", tiny_model_dir, tmp_path_factory)


def _cluster_method(item) -> str | None:
    method = item.callspec.params.get("cluster") if hasattr(item, "callspec") else None
    return method if method in SHARED_METHODS else None


@SHARED.fixture("cluster", _cluster_method)
@pytest.fixture(scope="module", params=["e+p+d", "ep+d", "ed+p", "epd"])
def cluster(request, tiny_model_dir, tmp_path_factory):
    """Each method in turn: the shared deployments for EPD and E+P+D, one of the module's own for
    the hybrids (no other module runs them)."""
    if request.param in SHARED_METHODS:
        yield from shared_cluster(request, request.param, tiny_model_dir, tmp_path_factory)
        return
    with start(tiny_model_dir, tmp_path_factory, request.param) as c:
        c.method = request.param
        yield c


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
