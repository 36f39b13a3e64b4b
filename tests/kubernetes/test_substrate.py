"""The substrate in the Kubernetes manifests: NATS nodes whose routes authenticate (the start script
run for real, its config checked by nats-server itself), and Redis as a primary, a replica and
three sentinels that every service reaches through the sentinels."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import redis

from common.certs import issue
from common.infra import RedisServer, free_port
from common.infra.nats_server import nats_server_binary
from common.infra.settings import SENTINEL
from common.store.connect import sentinel_target
from trident.kubernetes.redis_ha import SENTINELS, node_script, sentinel_script
from trident.kubernetes.render import Options, render
from trident.kubernetes.substrate import nats_config, nats_start


@pytest.mark.parametrize("tls", [False, True])
def test_a_nats_node_writes_routes_that_carry_the_token_and_its_config_parses(
    tmp_path: Path, tls: bool
) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir(), run.mkdir()
    certs = issue(tmp_path / "tls")  # where cert-manager's csi-driver writes the pod's own
    config = nats_config(tls).replace("/tls/", f"{certs.folder}/")
    (etc / "nats.conf").write_text(config + f"pid_file: {run}/nats.pid\n")
    script = nats_start("ns1").replace("/tmp/", "RUN/").replace("/etc/nats/", f"{etc}/")
    script = script.replace("RUN/", f"{run}/")  # tmp_path is under /tmp itself
    script = script.replace("exec nats-server", f"exec {nats_server_binary()} -t")  # -t: check, then exit
    env = {**os.environ, "NATS_TOKEN": "s0123abc", "POD_NAME": "nats-1"}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    routes = (run / "routes.conf").read_text()
    assert routes.count("nats-route://route:s0123abc@") == 3
    assert "nats-2.nats-cluster.ns1.svc:6222" in routes
    assert stat.S_IMODE((run / "routes.conf").stat().st_mode) == 0o600
    assert "authorization { user: route, password: $NATS_TOKEN }" in nats_config()
    assert ("verify: true" in config) == tls


def test_redis_runs_a_primary_a_replica_and_three_sentinels_the_services_ask() -> None:
    objects = render(Options(method="e+p+d", namespace="ns1"))
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    assert sets["redis"]["spec"]["replicas"] == 2 and sets["redis-sentinel"]["spec"]["replicas"] == SENTINELS
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services["redis"]["spec"]["clusterIP"] == "None"  # each pod by its stable DNS name
    assert services["redis-sentinel"]["spec"]["clusterIP"] == "None"
    budgets = {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert {"redis", "redis-sentinel"} <= budgets
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert {p["port"] for r in policies["redis-sentinel-ingress"]["ingress"] for p in r["ports"]} == {26379}
    for o in objects:
        if o["kind"] != "Deployment":
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            url = next(e["value"] for e in c["env"] if e["name"] == "TRIDENT_REDIS_URL")
            target = sentinel_target(url)
            assert target is not None and target.service == "trident" and target.password is None
            assert [h for h, _ in target.sentinels] == [
                f"redis-sentinel-{i}.redis-sentinel.ns1.svc" for i in range(SENTINELS)
            ]


@pytest.mark.parametrize("tls", [False, True])
def test_a_redis_pod_follows_the_sentinels_and_waits_for_them_when_they_name_itself(tls: bool) -> None:
    script = node_script("ns1", tls)
    # No sentinel answers: redis-0 starts as the primary, the others as its replicas.
    assert 'elif [ "$POD_NAME" != "redis-0" ]; then\n  M="redis-0.redis.ns1.svc"' in script
    # Named itself: it waits for the promotion, up to 50 x 0.2 s, before starting as a primary.
    assert 'for i in $(seq 50); do [ "$M" != "$SELF" ] && break; sleep 0.2; M="$(ask)"; done' in script
    assert '--replicaof "$M" 6379' in script and "--masterauth" in script
    watch = sentinel_script("ns1", tls)
    assert "sentinel monitor trident $M 6379 2" in watch and 'if [ ! -f "$CONF" ]' in watch
    for text in (script, watch):
        assert "redis-sentinel-2.redis-sentinel.ns1.svc" in text
        subprocess.run(["sh", "-n", "-c", text], check=True)  # the shell parses it


def statefulsets(tls: bool = True) -> dict[str, dict]:
    objects = render(Options(method="ep+d", namespace="ns1", tls=tls))
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}


@pytest.fixture
def lone_nats_node(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """One node of the rendered NATS cluster, run for real with its peers gone (their names do not
    resolve): what a node cut off by a partition looks like. Yields its client URL and monitor port."""
    client, route, monitor = free_port(), free_port(), free_port()
    conf = nats_config(False).replace("port: 4222", f"port: {client}").replace("port: 6222", f"port: {route}")
    conf = conf.replace("http_port: 8222", f"http_port: {monitor}").replace(
        "store_dir: /data", f"store_dir: {tmp_path}"
    )
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / "routes.conf").write_text('routes: ["nats-route://route:tok@nats-9.nowhere.invalid:6222"]\n')
    env = {**os.environ, "NATS_TOKEN": "tok", "POD_NAME": "nats-0"}
    proc = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and status(monitor, "/varz") != 200:
            time.sleep(0.05)
        yield f"nats://tok@127.0.0.1:{client}", monitor
    finally:
        proc.terminate()
        proc.wait(10)


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_a_task_of_two_mebibytes_fits_through_the_rendered_nats(lone_nats_node) -> None:
    """Defect 4: the nodes kept NATS's 1 MiB limit, which compose and `trident up` raise."""
    url, _ = lone_nats_node

    async def main() -> None:
        nc = await nats.connect(url)
        try:
            inbox = await nc.subscribe("big")
            payload = b"x" * (2 << 20)
            await nc.publish("big", payload)
            assert (await inbox.next_msg(timeout=5)).data == payload
        finally:
            await nc.close()

    asyncio.run(main())


def test_nats_liveness_survives_a_partition_and_the_lame_duck_ends_in_the_grace_period(
    lone_nats_node,
) -> None:
    """Defect 5: liveness on the full /healthz restarts a node that lost its peers; the lame duck
    (2 min by default) outlasted the 60 s grace period."""
    _, monitor = lone_nats_node
    (container,) = statefulsets()["nats"]["spec"]["template"]["spec"]["containers"]
    live = container["livenessProbe"]["httpGet"]["path"]
    deadline = time.monotonic() + 15
    while status(monitor, live) != 200:  # the liveness probe's check passes on a node alone...
        assert time.monotonic() < deadline, f"{live} never answered 200"
        time.sleep(0.1)
    assert status(monitor, "/healthz") >= 500  # ...where the full check fails (no meta leader)
    conf = nats_config()
    duck = int(re.search(r"lame_duck_duration: (\d+)s", conf)[1])
    grace = int(re.search(r"lame_duck_grace_period: (\d+)s", conf)[1])
    pod = statefulsets()["nats"]["spec"]["template"]["spec"]
    assert duck + grace < pod["terminationGracePeriodSeconds"]
    hook = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert "--signal ldm=" in hook and "while kill -0 1" in hook  # waits for the server to end


def test_servers_never_share_a_node_persist_nothing_and_wait_for_replication(tmp_path: Path) -> None:
    """Defect 6: spreading was only preferred, the sentinels called a primary down after 1 s, a bare
    PING let a rolling update go on before the replica synced, and every Redis pod had a claim."""
    sets = statefulsets(tls=False)
    for name in ("nats", "redis", "redis-sentinel"):
        rule = sets[name]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        (required,) = rule["requiredDuringSchedulingIgnoredDuringExecution"]
        assert required["topologyKey"] == "kubernetes.io/hostname"
        assert required["labelSelector"]["matchLabels"] == sets[name]["spec"]["selector"]["matchLabels"]
    assert (
        "volumeClaimTemplates" not in sets["redis"]["spec"] and "volumeClaimTemplates" in sets["nats"]["spec"]
    )
    assert f"down-after-milliseconds trident {SENTINEL.down_after_ms}\n" in sentinel_script("ns1")
    assert SENTINEL.down_after_ms >= 3000
    # The readiness command, run for real: a replica is ready only once its copy is in sync.
    (node,) = sets["redis"]["spec"]["template"]["spec"]["containers"]
    ready = node["readinessProbe"]["exec"]["command"][-1]
    with RedisServer(workdir=tmp_path / "primary", password="pw") as primary:
        replica = RedisServer(workdir=tmp_path / "replica", password="pw")
        gone = free_port()
        replica.primary = lambda: ("127.0.0.1", gone)  # its primary does not answer
        with replica:
            assert not probe(ready, replica.port)
            assert probe(ready, primary.port)
            client = redis.Redis(port=replica.port, password="pw")
            client.replicaof("127.0.0.1", primary.port)
            deadline = time.monotonic() + 20
            while not probe(ready, replica.port) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert replica.replicating() and probe(ready, replica.port)
            client.close()


def probe(command: str, port: int) -> bool:
    command = command.replace("-p 6379", f"-p {port}")
    env = {**os.environ, "REDIS_PASSWORD": "pw"}
    return subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=10).returncode == 0
