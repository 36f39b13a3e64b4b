"""A real `trident up` (EP+D with its planner), as a user runs it: it prints its gateway, serves,
keeps its state file, and drains and exits 0 on SIGTERM. It is closed by default: NATS asks for the
deployment's token, Redis for its password, every transfer port for its secret, and the planner's
writes for its key (a client without them reads no output subject, writes no plan, pulls nothing
and re-plans nothing; with them, what the services get, it does). And what the user watches it with:

- the shipped Prometheus config passes `promtool check config`;
- every metric the Grafana dashboard queries is exposed by the running services, and a real
  Prometheus scraping them answers every one of the dashboard's queries;
- `trident top` shows the instances, latencies and plan, live in a pseudo-terminal and once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import openai
import pytest
import redis
import yaml

from common.infra import free_port
from common.secrets import NAMES, DeploymentSecrets, operator_header
from common.store.keys import Keys
from common.transfer import TransferConfig, create_backend
from common.transfer.errors import Forbidden, HandleNotFound
from tests.helpers.chat import client_for, user_message
from tests.helpers.images import data_url, make_image

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana" / "dashboards" / "trident.json"
PROMETHEUS_CONFIG = REPO / "monitoring" / "prometheus.yml"
TRIDENT = Path(sys.executable).with_name("trident")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise TimeoutError(what)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """Where `trident up` runs: its compose.yaml, and the .trident folder it makes."""
    return tmp_path_factory.mktemp("up")


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, home):
    """`trident up --method ep+d` (workers, gateway, planner and its jobs worker as processes), after
    a few requests with images: (gateway, planner, workers). It must drain and exit 0 on SIGTERM."""
    shutil.copy(REPO / "compose.yaml", home / "compose.yaml")
    port, planner_port = free_port(), free_port()
    proc = subprocess.Popen(
        [str(TRIDENT), "up", "--model", str(tiny_model_dir), "--method", "ep+d",
         "--port", str(port), "--planner-port", str(planner_port)],
        cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
    )  # fmt: skip
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url, planner = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{planner_port}"
    try:
        wait_for(lambda: f"gateway: {url}\n" in printed or proc.poll() is not None, 120, "no gateway line")
        assert f"gateway: {url}\n" in printed, "".join(printed)

        def ready():
            assert proc.poll() is None, "".join(printed)
            try:
                operator = operator_header(home / ".trident" / "secrets")
                found = httpx.get(url + "/v1/cluster", headers=operator, timeout=2).json()["instances"]
                up = httpx.get(planner + "/ready", timeout=2).status_code == 200
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            workers = [i for i in found if i.get("kind") == "worker"]
            return workers if len(workers) == 2 and up else None

        workers = wait_for(ready, 120, "trident up did not come up")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        images = [data_url(make_image(i)) for i in range(2)]

        def ask(i: int):
            return client.chat.completions.create(
                model=tiny_model_dir.name, messages=user_message(images[: i % 3], f"question {i}"),
                max_tokens=5, temperature=0,
            )  # fmt: skip

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, range(6)))
        assert all(a.usage.completion_tokens == 5 for a in answers)
        assert (home / ".trident" / "logs").is_dir() and (home / ".trident" / "up.json").is_file()
        # The planner and its jobs worker run niced: a plan takes the cores serving leaves.
        side = [p["pid"] for p in json.loads((home / ".trident" / "up.json").read_text())["processes"]
                if p["service"] in ("planner", "planner-jobs")]  # fmt: skip
        assert len(side) == 2
        wait_for(lambda: all(os.getpriority(os.PRIO_PROCESS, pid) == 10 for pid in side), 60, "not niced")
        yield url, planner, workers
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        reader.join(10)
    assert code == 0, "".join(printed[-50:])  # drained and stopped everything
    assert not (home / ".trident" / "up.json").exists()


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def exposed(base_url: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_promtool_passes_the_shipped_config():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus package (`make install` does)"
    check = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_metric_the_dashboard_queries_is_exposed(deployment):
    url, planner, workers = deployment
    names = exposed(url) | exposed(planner)
    for worker in workers:
        names |= exposed(worker["http_address"])
    queried = {m for expr in dashboard_queries() for m in re.findall(r"\btrident_[a-z0-9_]+", expr)}
    assert len(queried) > 20
    assert queried <= names, f"queried but not exposed: {sorted(queried - names)}"


def test_prometheus_answers_every_dashboard_query(deployment, tmp_path):
    """The shipped scrape config with each job's targets made local (the compose network's names
    do not resolve here); every dashboard query, as Grafana would send it, returns series."""
    url, planner, workers = deployment
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: install Debian's prometheus package (`make install` does)"
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    local = {
        "trident-gateway": [url],
        "trident-planner": [planner],
        "trident-workers": [w["http_address"] for w in workers],
    }
    assert {job["job_name"] for job in config["scrape_configs"]} == set(local)
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [u.removeprefix("http://") for u in local[job["job_name"]]]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:

            def all_up():
                try:
                    targets = httpx.get(api + "/targets", timeout=2).json()["data"]["activeTargets"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
                return len(targets) == 2 + len(workers) and all(t["health"] == "up" for t in targets)

            wait_for(all_up, 60, "Prometheus did not scrape every service")

            def answers(expr: str):
                query = expr.replace("$__rate_interval", "15s")
                reply = httpx.get(api + "/query", params={"query": query}, timeout=5).json()
                assert reply["status"] == "success", (expr, reply)
                return reply["data"]["result"]

            for expr in dashboard_queries():
                wait_for(lambda e=expr: answers(e), 30, f"no series for {expr}")
        finally:
            proc.terminate()
            proc.wait(20)


@pytest.mark.alone  # a 30 s bound on quitting, which a lane beside it once pushed past
def test_trident_top_shows_the_deployment_live_in_a_terminal(epd):
    """...and Ctrl-C quits it, even when it starts with SIGINT ignored, as a shell starts a command
    in the background or under nohup (CI's test runs were started so: it never quit there). On the
    shared EPD deployment, which the other test that runs alone uses too: one start for both."""
    url = epd.url
    workers = [i for i in httpx.get(url + "/v1/cluster", timeout=5).json()["instances"] if i["roles"]]
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [str(TRIDENT), "top", "--url", url, "--interval", "0.5"],
        stdin=child, stdout=child, stderr=child,
        env={**os.environ, "COLUMNS": "160", "TERM": "xterm", "PYTHONFAULTHANDLER": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    os.close(child)
    seen = ""
    want = [w["instance_id"] for w in workers] + ["TTFT p50/p90", "TBT p50/p90", "queued:", "plan"]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(w in seen for w in want):
            if (chunk := _read_terminal(main, 0.5)) is None:
                break
            seen += ANSI.sub("", chunk)
        assert all(w in seen for w in want), seen[-3000:]
        assert "requests/s" in seen and "cannot read" not in seen
        proc.send_signal(signal.SIGINT)
        # A terminal keeps reading while the program exits: unread, the pty's buffer fills and
        # the last frame's write blocks the exit (it did, once the frames above went unread).
        deadline = time.monotonic() + 30  # a bound: idle, it exits in well under a second
        while proc.poll() is None and time.monotonic() < deadline:
            if _read_terminal(main, 0.2) is None:
                break  # it closed the terminal: what is left of its exit writes nothing
        with contextlib.suppress(subprocess.TimeoutExpired):  # the interpreter's teardown, bounded
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints where each thread is
            stuck = ""
            while chunk := _read_terminal(main, 2):
                stuck += chunk
            pytest.fail(f"trident top did not exit within 30 s of Ctrl-C:\n{ANSI.sub('', stuck)[-4000:]}")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)


def _read_terminal(fd: int, wait: float) -> str | None:
    """What the terminal has written within `wait` seconds ("" if nothing), None once the child
    closed it."""
    if not select.select([fd], [], [], wait)[0]:
        return ""
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except OSError:
        return None


def test_trident_top_once_prints_a_frame_and_says_when_it_cannot(deployment):
    url, _, workers = deployment
    once = subprocess.run(
        [str(TRIDENT), "top", "--url", url, "--once"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    assert once.returncode == 0, once.stderr
    assert all(w["instance_id"] in once.stdout for w in workers)
    assert re.search(r"TTFT p50/p90 \d+ ms / \d+ ms", once.stdout), once.stdout
    gone = subprocess.run(
        [str(TRIDENT), "top", "--url", f"http://127.0.0.1:{free_port()}", "--once"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert gone.returncode == 1 and "error: cannot read" in gone.stderr


# -- closed by default ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Running:
    """The deployment above as its user reads it: its gateway and the state file it keeps."""

    url: str
    home: Path

    def state(self) -> dict:
        return json.loads((self.home / ".trident" / "up.json").read_text())

    def cluster(self) -> list[dict]:
        """Every registered instance, addresses included (the operator's view of /v1/cluster)."""
        operator = operator_header(Path(self.state()["secrets"]))
        return httpx.get(self.url + "/v1/cluster", headers=operator, timeout=5).json()["instances"]

    def instances(self, role: str) -> list[dict]:
        return [i for i in self.cluster() if role in i["roles"]]


@pytest.fixture(scope="module")
def up(deployment, home) -> Running:
    return Running(deployment[0], home)


def secrets_of(up: Running) -> DeploymentSecrets:
    return DeploymentSecrets.read(Path(up.state()["secrets"]))


def test_the_secrets_are_made_for_the_deployment_and_readable_by_its_owner_only(up):
    folder = Path(up.state()["secrets"])
    for name in NAMES:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    found = secrets_of(up)
    assert len({found.nats_token, found.redis_password, found.transfer_secret}) == 3
    answer = client_for(up).chat.completions.create(
        model="tiny-llava", max_tokens=3, messages=user_message([], "hello")
    )
    assert answer.usage.completion_tokens == 3  # the services themselves have what they need


def test_nats_refuses_a_client_without_the_token(up):
    address = up.state()["servers"]["nats"]["url"]

    async def subscribe(url: str) -> None:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
        try:
            await nc.subscribe("trident.out.>")
            await nc.flush(timeout=2)
        finally:
            await nc.close()

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(subscribe(address))
    token = secrets_of(up).nats_token
    asyncio.run(subscribe(address.replace("nats://", f"nats://{token}@")))  # with it: allowed


def test_redis_refuses_a_plan_written_without_the_password(up):
    url = up.state()["servers"]["redis"]["url"]
    plan_key = Keys("trident").plan_apply
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=2).set(plan_key, b"x")
    with redis.Redis.from_url(url, password=secrets_of(up).redis_password) as client:
        assert client.exists(plan_key) == 0  # nothing was written
        assert client.ping()


def test_a_transfer_port_answers_only_with_the_secret(up):
    (decoder,) = up.instances("decode")
    address = decoder["transfer_address"]

    async def pull(secret: str) -> Exception:
        puller = create_backend(TransferConfig(timeout=10, secret=secret))
        await puller.start()
        try:
            await puller.pull(address, "no-such-handle")
        except Exception as exc:
            return exc
        finally:
            await puller.close()
        raise AssertionError("a pull of a handle nobody published succeeded")

    assert isinstance(asyncio.run(pull("")), Forbidden)
    assert isinstance(asyncio.run(pull("wrong")), Forbidden)
    # With the secret the owner looks the handle up: the refusal was the secret's, not the handle's.
    assert isinstance(asyncio.run(pull(secrets_of(up).transfer_secret)), HandleNotFound)


def test_the_planners_writes_take_the_deployments_planner_key(up):
    """Regression: with keys off (the default), POST /plan/replan and /plan/jobs answered 202 to anyone."""
    planner = up.state()["planner"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the planner starts beside the workers, maybe later
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(planner + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.5)
    for path in ("/plan/replan", "/plan/jobs"):
        refused = httpx.post(planner + path, json={}, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
    key = {"Authorization": f"Bearer {secrets_of(up).planner_key}"}
    assert httpx.post(planner + "/plan/replan", headers=key, timeout=10).status_code == 202


def test_the_cluster_view_shows_where_instances_listen_to_the_operator_only(up):
    """Regression: GET /v1/cluster listed every instance's HTTP and transfer address to anyone who
    reached the gateway. They are shown under the deployment's planner key, blank to others."""
    anyone = httpx.get(up.url + "/v1/cluster", timeout=5).json()
    assert anyone["instances"] and "planner key" in anyone["addresses"]
    assert all(i["http_address"] == i["transfer_address"] == "" for i in anyone["instances"])
    assert all(i["instance_id"] and i["roles"] for i in anyone["instances"])  # the rest stays
    wrong = httpx.get(up.url + "/v1/cluster", headers={"Authorization": "Bearer nope"}, timeout=5).json()
    assert all(i["http_address"] == "" for i in wrong["instances"])
    operator = up.cluster()  # under the planner key
    assert all(i["http_address"].startswith("http://127.0.0.1:") for i in operator)
    assert all(i["transfer_address"] for i in operator)
