"""The substrate in the Kubernetes manifests: NATS nodes whose routes authenticate (the start script
run for real, its config checked by nats-server itself), and Redis as a primary, a replica and
three sentinels that every service reaches through the sentinels."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from common.certs import issue
from common.infra.nats_server import nats_server_binary
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
    certs = issue(tmp_path / "tls")  # where the pod mounts the Secret trident-tls
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
    assert [p["port"] for p in policies["redis-sentinel"]["ingress"][0]["ports"]] == [26379]
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
