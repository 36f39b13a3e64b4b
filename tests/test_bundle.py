"""The offline bundle (trident/bundle/): everything the project needs beside the GPU image's own
packages is carried, refused when it is incomplete or made for another Python, and — built here
for this Python from the package index, as a user builds it for the GPU machine's — installs with
no index into a folder whose nats-server and redis-server run and whose modules are the ones used."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.package_index import index_reachable
from trident.bundle import GPU_PYTHON, IMAGE_PACKAGES, LEFT_OUT, LIMIT_BYTES, MANIFEST, ROOTS, normalize
from trident.bundle.build import BundleError, build, unmet
from trident.bundle.install import InstallError, activated, install, read_manifest

REPO = Path(__file__).resolve().parents[1]


def test_every_runtime_dependency_is_carried_in_the_image_or_left_out_for_a_reason() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {normalize(re.match(r"[A-Za-z0-9._-]+", d)[0]) for d in deps}
    unaccounted = names - set(ROOTS) - IMAGE_PACKAGES - set(LEFT_OUT)
    assert not unaccounted, f"say whether the bundle carries {sorted(unaccounted)} (trident/bundle)"
    assert not set(ROOTS) & IMAGE_PACKAGES, "carry a package the image has only for another version"


def test_a_requirement_neither_the_bundle_nor_the_image_meets_is_named() -> None:
    needs = {"fastapi": ["starlette", "pydantic", "anyio"], "starlette": ["anyio"]}
    assert unmet(needs, carried={"fastapi", "starlette", "pydantic"}) == {}
    assert unmet(needs, carried={"fastapi", "starlette"}) == {"fastapi": ["pydantic"]}  # anyio: the image's


def write_manifest(folder: Path, python: str, wheels: list[dict]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"python": python, "wheels": wheels}))


def test_an_incomplete_or_foreign_bundle_is_refused_saying_why(tmp_path: Path) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(InstallError, match="no bundle"):
        read_manifest(tmp_path / "nothing")
    write_manifest(tmp_path / "other", "2.7", [])
    with pytest.raises(InstallError, match=r"built for Python 2\.7"):
        read_manifest(tmp_path / "other")
    wheel = {"file": "x-1.0-py3-none-any.whl", "sha256": "0" * 64}
    write_manifest(tmp_path / "short", here, [wheel])
    with pytest.raises(InstallError, match="is missing"):
        read_manifest(tmp_path / "short")
    (tmp_path / "short" / wheel["file"]).write_bytes(b"not the wheel it was")
    with pytest.raises(InstallError, match="sha256 differs"):
        read_manifest(tmp_path / "short")


@pytest.fixture(scope="module")
def online() -> None:
    if not index_reachable():
        pytest.skip("pip cannot reach its package index from here: the bundle is built where it can")


@pytest.mark.slow
def test_the_gpu_machines_bundle_fits(online: None, tmp_path: Path) -> None:
    manifest = build(tmp_path / "bundle", GPU_PYTHON)
    carried = {w["name"] for w in manifest["wheels"]}
    assert set(ROOTS) <= carried and not carried & IMAGE_PACKAGES
    assert manifest["python"] == "3.12" and 0 < manifest["bytes"] <= LIMIT_BYTES
    on_disk = sum(f.stat().st_size for f in (tmp_path / "bundle").glob("*.whl"))
    assert on_disk == manifest["bytes"]
    with pytest.raises(BundleError, match="over 1 MiB"):
        build(tmp_path / "small", GPU_PYTHON, limit=1 << 20)


@pytest.mark.slow
def test_built_here_it_installs_without_an_index_and_its_servers_and_modules_work(
    online: None, tmp_path: Path
) -> None:
    build(tmp_path / "bundle", platform.python_version())
    done = install(tmp_path / "bundle", tmp_path / "site")
    assert set(done.versions) == {"nats-server", "redis-server"}
    assert "Valkey" in done.versions["redis-server"]  # Redis 7.2's commands (SET NX GET: the registry's)
    env = activated(done)
    probe = (
        "import fastapi, nats, redis, pydantic_settings, celery, cryptography, openai, uvicorn, shutil;"
        "print(all(m.__file__.startswith(sys.argv[1]) for m in (fastapi, nats, redis, pydantic_settings,"
        " celery, cryptography, openai, uvicorn)), shutil.which('redis-server'), shutil.which('nats-server'))"
    )
    run = subprocess.run(
        [sys.executable, "-c", "import sys;" + probe, str(done.target)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.stdout.split() == ["True", str(done.bin / "redis-server"), str(done.bin / "nats-server")]
    served = subprocess.run(
        [sys.executable, "-c", SERVE], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert served.returncode == 0 and served.stdout.strip() == "b'v' True", served.stderr[-2000:]


# The servers from the bundle's bin/ (first on PATH), started as every deployment starts them. On the
# GPU machine no nats-server sits beside python, so PATH finds the bundle's; here the venv has one there.
SERVE = """
import asyncio, shutil, nats
import common.infra.nats_server as nats_server
from common.infra import NatsServer, RedisServer
from common.infra.redis_server import redis_server_binary
nats_server.nats_server_binary = lambda: shutil.which("nats-server")
assert redis_server_binary() == shutil.which("redis-server")
with NatsServer(workdir="nats") as n, RedisServer(workdir="redis", password="pw") as r:
    client = r._client()
    client.set("k", "v", nx=True, get=True, ex=5)
    async def ping():
        nc = await nats.connect(n.url)
        ok = nc.is_connected
        await nc.close()
        return ok
    print(client.get("k"), asyncio.run(ping()))
"""
