"""Service fixtures: a real deployment per method (nats-server, redis-server, workers, gateway)."""

from __future__ import annotations

import base64
import io

import openai
import pytest

from tests.engine.conftest import make_image
from tests.services.cluster import Cluster, running_cluster


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


@pytest.fixture(scope="module")
def epd(tiny_model_dir, tmp_path_factory):
    """One EPD instance and a gateway, for the module's tests."""
    with start(tiny_model_dir, tmp_path_factory, "epd") as c:
        yield c


@pytest.fixture(scope="module", params=["e+p+d", "ep+d", "ed+p", "epd"])
def cluster(request, tiny_model_dir, tmp_path_factory):
    with start(tiny_model_dir, tmp_path_factory, request.param) as c:
        c.method = request.param
        yield c


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
