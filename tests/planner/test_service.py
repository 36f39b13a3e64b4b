"""The planner in a running cluster (tiny model, real nats-server and redis-server): once a few
requests have finished, a recommendation appears on every channel — GET /plan, a NATS plan event, the
Redis plan key (the gateway's /v1/cluster shows it) and the Prometheus gauges — with one decision id."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from common.bus import Bus, BusConfig
from common.infra import free_port
from common.planner.forecast import ForecastConfig
from common.planner.trace import from_records, read_trace
from common.planner.types import KIND_ROLES, METHOD_KINDS, Deployment, PlanResult
from common.protocol import Plan, TraceRecord
from common.secrets import DeploymentSecrets
from common.store import Store, StoreConfig
from services.planner.capacity import CapacityDecision, finish_lag, forecast_load, moved
from services.planner.planner import Decision, Planner
from services.settings import PlannerSettings
from tests.deploy import running_cluster
from tests.helpers.images import data_url, make_image
from trident.cli.app import app as cli_app
from trident.launcher.cluster import Cluster

MIN_REQUESTS = 4


def _records(n: int, prompt: int, start: float = 0.0, gap: float = 0.5) -> list[TraceRecord]:
    return [
        TraceRecord(
            request_id=f"r{start}-{i}", arrival=start + i * gap, prompt_tokens=prompt, output_tokens=8
        )
        for i in range(n)
    ]


def _decision() -> Decision:
    """A published 1ED2P plan."""
    plan = Plan(decision_id=1, method="ed+p", replicas={"ed": 1, "p": 2}, time=0.0)
    return Decision(plan, PlanResult(Deployment.of("ed+p", ed=1, p=2), 1.0, 1.0, []), "first", 0.1, {})


def test_triggers() -> None:
    """First plan once enough requests finished, then on the interval or a shift of the workload."""
    planner = Planner(
        PlannerSettings(planner_min_requests=10, planner_interval=60, planner_shift_threshold=0.2)
    )
    planner.window.extend(_records(9, prompt=100))
    assert planner.due() is None and "waiting for 10 finished requests (have 9)" in planner.status
    planner.window.extend(_records(1, prompt=100, start=4.5))
    assert planner.due() == "first"
    planner.decision = _decision()
    planner.planned_for, planner.planned_at = from_records(planner.window), time.monotonic()
    more = _records(10, prompt=100, start=5.0)
    planner.window.extend(more)
    planner.since_plan = len(more)
    assert planner.due() is None  # the same workload
    longer = _records(10, prompt=900, start=10.0)
    planner.window.extend(longer)
    planner.since_plan = len(longer)
    assert planner.due() == "workload shift 1.00 > 0.2"
    planner.planned_at -= 61
    assert planner.due() == "interval"


def test_capacity_is_resized_when_the_forecast_moves_and_lags_unfinished_requests() -> None:
    records = [
        TraceRecord(request_id=f"c{i}", arrival=100.0 + i, prompt_tokens=10, output_tokens=4,
                    stages={"arrival": 100.0 + i, "finished": 100.0 + i + (8.0 if i % 10 == 0 else 1.0)})
        for i in range(100)
    ]  # fmt: skip
    assert finish_lag(records) == pytest.approx(1.0)  # the p90 of how long they took
    config = ForecastConfig(bin_s=5.0, window_s=60.0, horizon_s=10.0)
    steady = forecast_load(records, config, now=200.0)
    assert steady.rate == pytest.approx(1.0, rel=0.05)
    sized = CapacityDecision(0.0, "first", steady, None)
    assert not moved(sized, steady, 0.1)
    assert moved(sized, forecast_load(records[::2], config, now=200.0), 0.1)  # half the load
    assert moved(None, steady, 0.1)


def planner_auth(cluster: Cluster) -> dict[str, str]:
    """The planner's writes take the deployment's planner key (its secrets folder)."""
    return {"Authorization": f"Bearer {DeploymentSecrets.read(cluster.workdir / 'secrets').planner_key}"}


def test_instances_follow_the_live_deployment() -> None:
    planner = Planner(PlannerSettings())
    assert planner._instances(Deployment.of("ep+d", ep=2, d=1), live=3) == 3
    assert planner._instances(None, live=5) == 5
    planner.decision = _decision()
    # Moving to 1ED2P from 1E1P1D: five live instances of no one method; N stays the plan's.
    assert planner._instances(None, live=5) == 3


def test_host_cpu_is_measured_since_a_read_at_least_a_window_ago(monkeypatch) -> None:
    """Each plan's read of the instances' steps is kept; the cost outside the engines is measured
    against the latest read at least CPU_WINDOW old (the oldest kept while none is)."""
    from services.planner import planner as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    planner = Planner(PlannerSettings())
    assert planner._earlier_steps(["a"]) == []  # the first read: nothing before it
    now[0] += 20
    assert planner._earlier_steps(["b"]) == ["a"]  # none a window old yet: the oldest
    now[0] += 50  # "a" 70 s old, "b" 50 s
    assert planner._earlier_steps(["c"]) == ["a"]
    now[0] += 15  # "b" 65 s old: the latest a window old; "a" is let go
    assert planner._earlier_steps(["d"]) == ["b"]
    assert [read for _, read in planner._step_reads] == [["b"], ["c"], ["d"]]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    # One EPD instance starts fastest; the planner partitions N = 3 all the same.
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("planner"), "epd") as c:
        c.planner_url = f"http://127.0.0.1:{free_port()}"
        c.start(
            "planner",
            "services.planner",
            TRIDENT_HTTP_PORT=c.planner_url.rsplit(":", 1)[1],
            TRIDENT_PLANNER_MIN_REQUESTS=str(MIN_REQUESTS),
            TRIDENT_PLANNER_INSTANCES="3",
            TRIDENT_PLANNER_SHIFT_CHECK_INTERVAL="0.3",
            TRIDENT_PLANNER_INTERVAL="600",  # only the first plan and the ones asked for
            TRIDENT_PLANNER_PROFILES="cluster",
            TRIDENT_PLANNER_BUDGET="6",  # cores capacity may ask for (this machine's 2 run two instances)
            TRIDENT_PLANNER_FORECAST_BIN="1",
            TRIDENT_TTFT_SLO="1.0",
            TRIDENT_TBT_SLO="0.2",
        )
        c.wait_ready()
        _wait_for(lambda: httpx.get(c.planner_url + "/ready", timeout=1).status_code == 200, c)
        yield c


def _wait_for(ok, cluster: Cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(cluster.log("planner")[-3000:])


async def _chat(http: httpx.AsyncClient, url: str, model: str, i: int) -> None:
    content = [{"type": "text", "text": f"Describe picture {i}."}]
    if i % 2:
        content.append({"type": "image_url", "image_url": {"url": data_url(make_image(i))}})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    reply = await http.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def _gauges(text: str) -> dict[str, float]:
    """The planner's samples by `name{labels}` (label values here hold no spaces)."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^(trident_planner_\S+) (\S+)$", text, re.M)}


@pytest.mark.slow
async def test_a_plan_reaches_every_channel(cluster: Cluster, tmp_path: Path) -> None:
    bus = await Bus.connect(BusConfig(url=cluster.nats.url, name="test-planner"))
    store = await Store.connect(StoreConfig(url=cluster.redis.url))
    plans = await bus.events.plans()
    try:
        async with httpx.AsyncClient() as http:
            early = await http.get(cluster.planner_url + "/plan")
            assert early.status_code == 404
            assert early.json()["error"]["code"] == "no_plan"
            assert f"waiting for {MIN_REQUESTS} finished requests" in early.json()["error"]["message"]

            model = cluster.model.name
            await asyncio.gather(*(_chat(http, cluster.url, model, i) for i in range(MIN_REQUESTS + 2)))
            event = await plans.get(timeout=60)
            assert isinstance(event, Plan)

            body = (await http.get(cluster.planner_url + "/plan")).json()
            assert body["decision_id"] == event.decision_id and body["trigger"] == "first"
            assert (body["method"], body["replicas"]) == (event.method, event.replicas)
            assert body["method"] in METHOD_KINDS and sum(body["replicas"].values()) == 3
            assert body["candidates"] and body["goodput"] == pytest.approx(event.goodput)
            inputs = body["inputs"]
            assert inputs["trace"]["count"] >= MIN_REQUESTS and inputs["instances"] == 3
            assert inputs["current"]["label"] == "1EPD" and inputs["profiles"].startswith("cluster")
            assert inputs["slo"] == {"ttft": 1.0, "tbt": 0.2, "attainment": 0.9}
            assert set(inputs["correction"]) == {"ttft", "tbt"}

            stored = await store.planning.current_plan()
            assert stored is not None and stored.decision_id == event.decision_id
            assert stored.replicas == event.replicas
            cluster_view = (await http.get(cluster.url + "/v1/cluster")).json()
            assert cluster_view["plan"]["decision_id"] == event.decision_id

            gauges = _gauges((await http.get(cluster.planner_url + "/metrics")).text)
            assert gauges["trident_planner_decision_id"] == event.decision_id
            for kind in KIND_ROLES:
                want = event.replicas.get(kind, 0)
                assert gauges[f'trident_planner_recommended_replicas{{role="{kind}"}}'] == want
            for method in METHOD_KINDS:
                assert gauges[f'trident_planner_method{{method="{method}"}}'] == (method == event.method)
            assert gauges["trident_planner_predicted_goodput"] == pytest.approx(event.goodput)
            assert gauges["trident_planner_plan_duration_seconds"] > 0

            # Capacity for the forecast load, sized after the plan: on GET /plan/capacity, in
            # GET /plan and as the desired-instances gauges.
            deadline = time.monotonic() + 30
            while (reply := await http.get(cluster.planner_url + "/plan/capacity")).status_code == 404:
                assert reply.json()["error"]["code"] == "no_capacity"
                assert time.monotonic() < deadline, "no capacity sized after the plan"
                await asyncio.sleep(0.2)
            sized = reply.json()
            assert sized["forecast"]["rate"] > 0 and sized["budget"] == 6 and sized["unit"] == "cores"
            assert sized["error"] is None, sized
            assert 2 <= sum(sized["desired"].values()) == sized["instances"] <= 6
            assert sized["running"] == {"epd": 1} and set(sized["desired"]) == set(KIND_ROLES)
            assert (await http.get(cluster.planner_url + "/plan")).json()["capacity"]["desired"]
            gauges = _gauges((await http.get(cluster.planner_url + "/metrics")).text)
            # What is published: the sizing's counts handed over against what runs (the live EPD
            # instance kept while the kinds asked for do not run yet: common/planner/handover.py).
            current = (await http.get(cluster.planner_url + "/plan/capacity")).json()
            for kind in KIND_ROLES:
                published = gauges[f'trident_planner_desired_instances{{kind="{kind}"}}']
                assert published == current["published"][kind]
                assert published == (
                    max(1, current["desired"][kind]) if kind == "epd" else current["desired"][kind]
                )
            assert gauges["trident_planner_forecast_rate"] > 0

            # The instance publishes its steps in service (every 5 s); the next plan fits its
            # curves to them and says what it fitted on.
            deadline = time.monotonic() + 30
            while not (published := await store.planning.steps()):
                assert time.monotonic() < deadline, "no step stats published"
                await asyncio.sleep(0.2)
            (instance,) = [i["instance_id"] for i in cluster_view["instances"] if i.get("kind") == "worker"]
            assert [p.instance_id for p in published] == [instance] and published[0].steps
            # With counters of its host's cores and its own, for the cost outside the engines.
            assert published[0].host and published[0].host_cores > 0
            assert published[0].host_cpu_seconds >= published[0].process_cpu_seconds > 0

            # Asked for, a new decision comes at once under the next id, on every channel again.
            again = await http.post(
                cluster.planner_url + "/plan/replan",
                params={"wait": "true"},
                timeout=120,
                headers=planner_auth(cluster),
            )
            assert again.status_code == 200, again.text
            assert again.json()["decision_id"] == event.decision_id + 1
            assert again.json()["trigger"] == "requested"
            calibration = again.json()["inputs"]["calibration"]
            assert sum(calibration["steps"].values()) >= len(published[0].steps) > 0
            assert set(calibration["budgets"]) == {instance}
            second = await plans.get(timeout=10)
            assert second.decision_id == event.decision_id + 1
            assert (await store.planning.current_plan()).decision_id == second.decision_id
            chart = await http.get(cluster.planner_url + "/plan/chart.png")
            assert chart.status_code == 200 and chart.content.startswith(b"\x89PNG")

            # What it planned for, exported: `trident plan --trace` plans it offline with the same
            # profiles and calibration.
            exported = await http.get(cluster.planner_url + "/plan/trace")
            assert exported.status_code == 200, exported.text
            path = tmp_path / "served.jsonl"
            path.write_text(exported.text)
            served = read_trace(path)
            assert len(served.entries) >= MIN_REQUESTS + 2 and all(e.ttft for e in served.entries)
            assert served.meta["slo"] == {"ttft": 1.0, "tbt": 0.2, "attainment": 0.9}
            assert set(served.meta["calibration"]["budgets"]) == {instance}
            offline = CliRunner().invoke(
                cli_app,
                [
                    "plan",
                    "--trace",
                    str(path),
                    "--ttft-slo",
                    "1",
                    "--tbt-slo",
                    "0.2",
                    "--instances",
                    "3",
                    "--json",
                ],
            )
            assert offline.exit_code == 0, offline.output
            planned = json.loads(offline.stdout.strip().splitlines()[-1])
            assert planned["inputs"]["profiles"].startswith("the trace's header, calibrated from service")
    finally:
        await plans.close()
        await bus.close()
        await store.close()
