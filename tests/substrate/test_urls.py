"""How a deployment names its substrate: a NATS cluster as a list of URLs, Redis behind sentinels as
one redis+sentinel:// URL; credentials go into each, and nothing printed carries them."""

from __future__ import annotations

import pytest

from common.bus import BusConfig
from common.bus.connection import credentials
from common.compose import map_hosts
from common.secrets import with_credentials
from common.store.connect import SentinelTarget, sentinel_target
from services.planner.jobs import celery_url

SENTINELS = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,sentinel-3:26380/trident/2"


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_db() -> None:
    assert sentinel_target(SENTINELS) == SentinelTarget(
        (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("sentinel-3", 26380)), "trident", 2, None
    )
    found = sentinel_target(with_credentials(SENTINELS, "", "p@ss/word"))
    assert found is not None and found.password == "p@ss/word" and found.db == 2
    assert sentinel_target("redis+sentinel://h:1/trident") == SentinelTarget((("h", 1),), "trident", 0, None)
    assert sentinel_target("redis://:pw@h:6379/0") is None


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h:1",
        "redis+sentinel://h:1/a/b/c",
        "redis+sentinel://h/x",
        "redis+sentinel://h:1/x/db",
    ],
)
def test_a_malformed_sentinel_url_says_what_is_wrong(url: str) -> None:
    with pytest.raises(ValueError, match="redis\\+sentinel"):
        sentinel_target(url)


def test_a_nats_cluster_url_lists_its_nodes_each_with_the_token() -> None:
    url = with_credentials("nats://a:4222, nats://b:4222,nats://c:4222", "tok", "")
    assert url == "nats://tok@a:4222,nats://tok@b:4222,nats://tok@c:4222"
    assert BusConfig(url=url).servers == ["nats://tok@a:4222", "nats://tok@b:4222", "nats://tok@c:4222"]
    assert BusConfig().servers == ["nats://127.0.0.1:4222"]
    assert (
        with_credentials("nats://own@a:4222,nats://b:4222", "tok", "")
        == "nats://own@a:4222,nats://tok@b:4222"
    )


def test_celery_gets_one_sentinel_url_per_sentinel_and_the_service_name() -> None:
    url, options = celery_url(with_credentials(SENTINELS, "", "pw"))
    assert url.split(";") == [
        "sentinel://:pw@10.0.0.1:26379/2", "sentinel://:pw@10.0.0.2:26379/2", "sentinel://:pw@sentinel-3:26380/2"
    ]  # fmt: skip
    assert options == {"master_name": "trident", "sentinel_kwargs": {"password": "pw"}}
    assert celery_url("redis://:pw@r:6379/0") == ("redis://:pw@r:6379/0", {})


def test_trident_up_replaces_a_grouped_server_s_whole_url() -> None:
    urls = {
        "redis": "redis+sentinel://127.0.0.1:1,127.0.0.1:2/trident/0",
        "nats": "nats://127.0.0.1:5,nats://127.0.0.1:6",
    }
    assert map_hosts("redis://redis:6379/0", {}, urls) == urls["redis"]
    assert map_hosts("redis://:secret@redis:6379/0", {}, urls) == urls["redis"]
    assert map_hosts("nats://nats:4222", {}, urls) == urls["nats"]
    assert map_hosts("http://gateway:8000/ready", {}, urls) == "http://gateway:8000/ready"


def test_the_credentials_reach_every_node_the_cluster_names() -> None:
    """nats-py sends a URL's credentials to that server only; the nodes a cluster announces come
    bare, and a client that moved to one was refused (`authentication error` in nats-server's log)."""
    assert credentials(["nats://a:1", "nats://t%40k@b:2"]) == {"token": "t@k"}
    assert credentials(["nats://u:p%2Fw@a:1"]) == {"user": "u", "password": "p/w"}
    assert credentials(["nats://a:1"]) == {}
