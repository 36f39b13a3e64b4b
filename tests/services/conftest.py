"""Service fixtures: the deployments of the four methods, shared by the modules that only send them
requests (tests/helpers/deployments.py), and what a failed test shows of every deployment running."""

from __future__ import annotations

import pytest

from tests.helpers.deployments import Deployment, shared
from tests.helpers.images import data_url, make_image
from trident.launcher.cluster import Cluster

METHODS = ("e+p+d", "ep+d", "ed+p", "epd")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of every running deployment's logs (a fence, a traceback)."""
    report = yield
    if report.failed:
        for cluster in Cluster.running:
            report.sections.append((f"logs of {cluster.workdir.name}", cluster.tails()))
    return report


@pytest.fixture(scope="module")
def image_urls():
    return [data_url(make_image(i)) for i in range(3)]


# Each method in turn, on tiny-llava: the same deployments as `epd` and `e_p_d` (tests/conftest.py)
# for EPD and E+P+D, and the hybrids' for whoever else asks for them.
cluster = shared(*(Deployment.of(method=m) for m in METHODS), ids=list(METHODS))
