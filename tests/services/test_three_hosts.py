"""More than one host, on one machine: the deployment across three network namespaces joined by
veth links (common/infra/netns.py) — nats, redis and the gateway on one, encoder+prefill on a
second, the decoder on a third — each process bound to its namespace's one address. Every tensor
goes by handle (none inline in NATS) and UCX may use TCP only, so the KV cache crosses to the
decoder over the network: once over UCX, once with every channel between the hosts over mutual
TLS (the TCP backend, since UCX has no encryption); the answers are HF's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.infra import netns
from tests.helpers.chat import QUESTION, reference, user_message
from tests.helpers.images import data_url, make_image
from tests.tiers import count_deployment

REPO = Path(__file__).resolve().parents[2]

WHY_NOT = netns.problem()
# More than one host: CI's second step (`make test-extended`), not `make test`.
pytestmark = [
    pytest.mark.extended,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
    pytest.mark.timeout(400),
]


# "tls" runs the TCP backend (UCX has no encryption), so it covers the TCP path across the hosts
# as well; plain TCP between processes is tests/substrate/test_transfer.py's.
@pytest.mark.parametrize("transfer", ["ucx", "tls"])
def test_answers_across_three_namespaces_equal_hf(tiny_model_dir, hf_tiny, tmp_path, transfer):
    tag, net = f"tr{os.getpid() % 10000}{transfer[0]}", 100 + (os.getpid() + len(transfer)) % 100
    count_deployment("three hosts")
    with netns.Namespaces(tag, net) as spaces:
        spec = {
            "workdir": str(tmp_path), "model": str(tiny_model_dir), "transfer": transfer,
            "names": spaces.names, "address": spaces.address,
            "messages": [user_message([], QUESTION), user_message([data_url(make_image(0))], QUESTION)],
        }  # fmt: skip
        argv = [sys.executable, "-m", "tests.services.three_hosts_driver", json.dumps(spec)]
        done = subprocess.run(
            spaces.run_in("infra", argv), cwd=REPO, capture_output=True, text=True, timeout=360
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["answers"] == [reference(hf_tiny, 0, 16)[0], reference(hf_tiny, 1, 16)[0]]
    # Only the namespaces' own addresses: each instance is reached at its namespace's address.
    where = {tuple(i["roles"]): i for i in found["instances"]}
    ep, d = where[("encode", "prefill")], where[("decode",)]
    scheme = "https" if transfer == "tls" else "http"  # with TLS, the workers' HTTP asks for the certificate
    assert ep["http_address"].startswith(f"{scheme}://{spaces.address['ep']}:")
    assert d["http_address"].startswith(f"{scheme}://{spaces.address['d']}:")
    assert found["gateway"].startswith(f"http://{spaces.address['infra']}:")
    if transfer in ("tcp", "tls"):
        assert ep["transfer_address"].startswith(f"tcp://{spaces.address['ep']}:")
    else:
        assert ep["transfer_address"].startswith("ucx://")
    # The decoder pulled both requests' KV from the other namespace, and no pull failed.
    metrics = found["decoder_metrics"]
    assert _metric(metrics, "trident_decodes_admitted") == 2
    assert _metric(metrics, "trident_kv_pull_failures") == 0


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}\S* (\S+)$", text, re.M))


def test_losing_a_nats_node_or_the_redis_primary_loses_no_stream(tiny_model_dir, tmp_path):
    """A NATS node, a Redis node and a sentinel on each "host" (ha_hosts_driver.py); under a
    streaming load, `kill -9` of the node leading the task stream, then of the Redis primary: every
    request still ends with HF's text, and the sentinels promote the replica."""
    tag, net = f"ha{os.getpid() % 10000}", 100 + (os.getpid() + 7) % 100
    count_deployment("three hosts")
    with netns.Namespaces(tag, net) as spaces:
        spec = {"workdir": str(tmp_path), "model": str(tiny_model_dir), "names": spaces.names,
                "address": spaces.address}  # fmt: skip
        argv = [sys.executable, "-m", "tests.services.ha_hosts_driver", json.dumps(spec)]
        done = subprocess.run(
            spaces.run_in("infra", argv), cwd=REPO, capture_output=True, text=True, timeout=360
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = json.loads(done.stdout.strip().splitlines()[-1])["phases"]
    for fault, phase in phases.items():
        print(f"{fault}: killed {phase['killed']}, {len(phase['statuses'])} requests, "
              f"longest stall {phase['stall_s']:.2f} s")  # fmt: skip
        assert phase["statuses"], f"{fault}: no request ran"
        assert set(phase["statuses"]) == {"identical"}, (fault, phase)
    assert phases["nats-node"]["killed"].startswith("nats-")
    assert phases["redis-primary"]["killed"] == "redis-1"
    assert phases["redis-primary"]["promoted"] == "redis-2"
