"""compose.yaml under a real Docker engine, as a test drives it: whether an engine answers, and a
running Compose project's commands, containers, instances and logs (tests/docker/conftest.py
starts one per module)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import yaml

from tests.deploy import TEST_ENV
from tests.helpers.chat import user_message

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
IMAGE = "trident:cpu"
UP_TIMEOUT = 900  # a cold build installs the project's dependencies into the image


def settings_override(path: Path) -> Path:
    """A compose file that puts the test settings every deployment a test starts runs under
    (tests/deploy.py: one torch thread, a small KV cache, one timed run per profiled point) into
    each of compose.yaml's services built from the project's image; written to `path`."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ours = sorted(name for name, spec in services.items() if spec.get("image") == IMAGE)
    path.write_text(yaml.safe_dump({"services": {name: {"environment": dict(TEST_ENV)} for name in ours}}))
    return path


def engine_problem() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        subprocess.run(["docker", "info"], capture_output=True, check=True, timeout=20)
        subprocess.run(["docker", "compose", "version"], capture_output=True, check=True, timeout=20)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"no Docker engine with Compose v2 answers ({exc})"
    return None


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    url: str
    overrides: tuple[Path, ...] = ()  # compose files over compose.yaml, in order

    def argv(self, *args: str) -> list[str]:
        files = [arg for path in (COMPOSE, *self.overrides) for arg in ("-f", str(path))]
        return ["docker", "compose", "-p", self.project, *files, *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = self.argv(*args)
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        return done

    def running(self) -> list[str]:
        """Names of this project's containers that run now."""
        out = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return out.split()

    def instances(self, role: str) -> list[dict]:
        found = httpx.get(self.url + "/v1/cluster", timeout=10).json()["instances"]
        return [i for i in found if role in i["roles"]]

    def wait_for(self, check, timeout: float = 300.0) -> None:  # a bound: a busy host starts them slowly
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "not reached in time"
            time.sleep(0.5)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", check=False).stdout


# -- what the tests ask of a stack ---------------------------------------------------------------
LONG = 1500  # tokens: long enough to strike mid-stream, once a heartbeat has named the holder


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def ask(stack, messages, max_tokens: int, stream: bool = False, on_chunk=None) -> str:
    client = client_of(stack)
    if not stream:
        reply = client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].message.content
    pieces = []
    chunks = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if on_chunk is not None:
                on_chunk(len(pieces))
    return "".join(pieces)


def metric(stack, service: str, index: int, name: str) -> float:
    """A metric of one replica, read inside its container (worker ports are not published)."""
    script = (
        "import urllib.request as u; "
        "print(u.urlopen('http://127.0.0.1:9000/metrics', timeout=5).read().decode())"
    )
    out = stack.compose("exec", "-T", "--index", str(index), service, "python", "-c", script).stdout
    return sum(float(m) for m in re.findall(rf"^{name}\S* (\S+)$", out, re.M))


def container_of(stack, service: str, index: int) -> str:
    """The short id of a replica's container (its host name inside)."""
    labels = {"project": stack.project, "service": service, "container-number": str(index)}
    filters = [arg for k, v in labels.items() for arg in ("--filter", f"label=com.docker.compose.{k}={v}")]
    done = subprocess.run(["docker", "ps", "-q", *filters], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def holder(stack, role: str) -> str | None:
    """The container of the `role` instance that holds the newest task (the highest stream
    sequence: the request streaming now), as its last heartbeat (every 0.5 s) tells the registry,
    read through the gateway: no `docker exec` into each replica, which took seconds a replica spent
    decoding on. Another replica may still list an earlier request's task a while after its answer
    ended. An instance id is `<kind>-<host>-<nonce>-<pid>`, and a container's host name is its
    short id."""
    held = [(max(i["held"]), i["instance_id"]) for i in stack.instances(role) if i["held"]]
    return max(held)[1].rsplit("-", 2)[0].split("-", 1)[1] if held else None


STORY = user_message([], "Tell me a long story")
ANSWERS: dict[str, str] = {}  # project -> the story's answer, asked without a strike


def story_answer(stack) -> str:
    """The long story's answer with nothing struck, asked once per stack (it takes a while)."""
    if stack.project not in ANSWERS:
        ANSWERS[stack.project] = ask(stack, STORY, LONG)
    return ANSWERS[stack.project]
