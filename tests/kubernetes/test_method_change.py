"""The planner moves a running deployment from EP+D to E+P+D by the counts it publishes alone, with
nothing lost: the planner and the gateway in process, on real NATS and Redis; the workers real
processes, started and stopped (SIGTERM: drained, as a pod's preStop does) by what KEDA makes of the
planner's counts through the rendered ScaledObjects (keda.py).

A fresh deployment first: no worker runs when the first request arrives, so the gateway holds it;
the planner publishes the method the deployment starts with (EP+D), KEDA starts those instances,
and the held request goes through. Then, with the hybrids capped at 0 (TRIDENT_PLANNER_MAX_REPLICAS,
as an operator would), the planner's first sizing asks for E+P+D: KEDA starts an encoder and a
prefill instance while the EP instance keeps serving, and only once they registered does the planner
drop EP, which drains. Requests with and without images flow the whole time; every one is answered,
and answered the same (greedy decoding of one prompt)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from common.infra import NatsServer, RedisServer
from common.planner.drift import kind_counts
from common.roles import InstanceKind
from common.secrets import DeploymentSecrets
from services.planner.planner import Planner
from services.settings import GatewaySettings, PlannerSettings
from tests.gateway.in_process import gateway
from tests.kubernetes import keda
from tests.kubernetes.keda import desired
from tests.tiers import count_deployment
from trident.kubernetes.render import Options, render
from trident.launcher.cluster import Cluster
from trident.launcher.specs import worker_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def image() -> str:
    pixels = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(with_image: bool) -> dict:
    content: list[dict] = [{"type": "text", "text": "What is this?"}]
    if with_image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image()}})
    return {"model": "tiny-llava", "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip


class Keda:
    """The worker processes KEDA would run: each kind's replicas after every reading of the planner's
    counts, a new one started, a retired one sent SIGTERM (it drains) and waited for."""

    def __init__(self, cluster: Cluster, planner: Planner, scalers: dict[str, dict]) -> None:
        self.cluster, self.planner, self.scalers = cluster, planner, scalers
        self.service = {
            InstanceKind.of(cluster.compose.services[n].roles).value: n for n in cluster.compose.all_workers
        }
        self.running: dict[str, list[str]] = {kind: [] for kind in scalers}
        self.started = 0
        self.log: list[tuple[float, str, dict[str, int]]] = []  # when, +/- kind, what was live

    async def run(self) -> None:
        while True:
            reading = desired(self.planner)
            for kind, scaled in self.scalers.items():
                have = self.running[kind]
                want = keda.replicas(scaled, reading.get(kind), len(have))
                while len(have) < want:
                    self.started += 1
                    spec = worker_spec(
                        self.cluster.compose, self.service[kind], self.started, self.cluster.setup, 4
                    )
                    have.append(self.cluster.start_spec(spec).name)
                    self.log.append((time.monotonic(), f"+{kind}", await live(self.planner)))
                while len(have) > want:
                    name = have.pop()
                    self.log.append((time.monotonic(), f"-{kind}", await live(self.planner)))
                    await asyncio.to_thread(self.cluster.stop, name, 60)
            await asyncio.sleep(0.3)


async def live(planner: Planner) -> dict[str, int]:
    beats = await planner.store.registry.instances()
    return {str(k): n for k, n in kind_counts(hb.roles for hb in beats if not hb.draining).items()}


def test_the_planner_moves_ep_d_to_e_p_d_through_keda_with_nothing_lost(
    tmp_path: Path, tiny_model_dir
) -> None:
    secrets_dir = tmp_path / "secrets"
    secrets = DeploymentSecrets.ensure(secrets_dir)
    objects = render(Options(method="ep+d"))
    scalers = {o["metadata"]["labels"]["trident.dev/kind"]: o for o in objects if o["kind"] == "ScaledObject"}
    with (
        NatsServer(workdir=tmp_path / "nats", token=secrets.nats_token) as nats,
        RedisServer(workdir=tmp_path / "redis", password=secrets.redis_password) as redis,
    ):
        cluster = Cluster(tiny_model_dir, tmp_path, nats, redis, env={"TRIDENT_PROFILE": "off"})
        count_deployment("cluster")  # its workers come and go below, as KEDA would scale them
        urls = {"nats_url": nats.address, "redis_url": redis.address, "secrets_dir": secrets_dir}
        gw_settings = GatewaySettings(model=tiny_model_dir, hold_timeout=240.0, **urls)
        planner_settings = PlannerSettings(
            **urls, http_port=0, planner_start="ep=1,d=1", planner_profiles="paper:llava-1.5-7b",
            planner_min_requests=6, planner_shift_check_interval=0.5, planner_budget=8,
            planner_max_replicas="e=1,p=1,d=1,ep=0,ed=0,epd=0",  # the hybrids capped: E+P+D
        )  # fmt: skip
        try:
            asyncio.run(scenario(cluster, gw_settings, planner_settings, scalers))
        except BaseException as exc:
            exc.add_note(cluster.tails())
            raise
        finally:
            cluster.stop()
        assert not cluster.integrity_failures(), cluster.integrity_failures()


async def scenario(cluster: Cluster, gw_settings, planner_settings, scalers) -> None:
    planner = Planner(planner_settings)
    await planner.start()
    scaler = Keda(cluster, planner, scalers)
    keda_task = asyncio.create_task(scaler.run())
    answers: dict[int, tuple[int, str]] = {}  # request -> status, text
    try:
        async with gateway(gw_settings) as (url, _), httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def ask(i: int) -> None:
                reply = await http.post("/v1/chat/completions", json=body(i % 2 == 0))
                text = (
                    reply.json()["choices"][0]["message"]["content"]
                    if reply.status_code == 200
                    else reply.text
                )
                answers[i] = (reply.status_code, text)

            # A fresh deployment: the first request waits for the instances KEDA starts.
            await ask(0)
            assert answers[0][0] == 200, answers
            assert {k for k, n in (await live(planner)).items() if n} == {"ep", "d"}
            # Load through the method change, until E+P+D alone runs and EP has drained.
            load: list[asyncio.Task] = []
            deadline = time.monotonic() + 400
            while (await live(planner)) != {"e": 1, "p": 1, "d": 1} or scaler.running["ep"]:
                assert time.monotonic() < deadline, (await live(planner), scaler.log, planner.status)
                load.append(asyncio.create_task(ask(len(load) + 1)))
                await asyncio.sleep(1.0)
            for _ in range(4):  # served by E+P+D alone
                load.append(asyncio.create_task(ask(len(load) + 1)))
            await asyncio.gather(*load)
    finally:
        keda_task.cancel()
        await asyncio.gather(keda_task, return_exceptions=True)
        await planner.close()
    events = {e: seen for _, e, seen in scaler.log}
    start = scaler.log[0][0]
    print("keda:", [(round(t - start, 1), e, seen) for t, e, seen in scaler.log], "answered:", len(answers))
    # Make before break: the EP instance was retired only once an encoder and a prefill instance
    # had registered (loaded, pulling); the decoder served throughout.
    assert events["-ep"].get("e") == 1 and events["-ep"].get("p") == 1, scaler.log
    assert "-d" not in events and list(events)[:2] == ["+d", "+ep"], scaler.log
    assert len(answers) >= 8 and all(code == 200 for code, _ in answers.values()), answers
    for parity in (0, 1):  # with an image, without: each answered alike before, through and after
        assert len({text for i, (_, text) in answers.items() if i % 2 == parity}) == 1, answers
