"""Every channel between a deployment's processes speaks mutual TLS when the deployment has
certificates: a member (a certificate the deployment's CA signed) gets through; a probe without
one, or with a certificate another CA signed, reads and writes nothing. One test per channel, each
against the real server: nats-server, redis-server (and its sentinels), the TCP transfer port."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
import torch

from common.bus.connection import BusConfig, connect_nats
from common.certs import issue
from common.infra.ha import RedisGroup
from common.infra.nats_server import NatsServer
from common.infra.redis_server import RedisServer
from common.store import Store, StoreConfig
from common.store.connect import sync_client
from common.tls import Tls
from common.transfer import TransferConfig, create_backend
from common.transfer.errors import TransferError
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.helpers import run
from tests.tls_probes import only_alerts, probe, probes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A certificate, good in itself, that another deployment's CA signed."""
    return issue(tmp_path_factory.mktemp("other-tls"))


def test_nats_serves_members_only(tmp_path: Path, tls: Tls, stranger: Tls) -> None:
    with NatsServer(tmp_path / "nats", token="tok", tls=tls) as server:

        async def member() -> bytes:
            nc = await connect_nats(BusConfig(url=server.url, tls=tls))
            try:
                sub = await nc.subscribe("probe.>")
                await nc.publish("probe.one", b"hello")
                return (await sub.next_msg(timeout=5)).data
            finally:
                await nc.close()

        assert run(member()) == b"hello"
        # The token alone is not enough: a client that knows it but has no certificate reads nothing,
        # not even the server's INFO (the handshake comes first).
        connect = b'CONNECT {"auth_token":"tok","verbose":false}\r\nSUB > 1\r\nPING\r\n'
        for how, ctx in probes(stranger).items():
            answer = probe(server.host, server.port, ctx, connect)
            assert only_alerts(answer), (how, answer[:200])


def test_redis_serves_members_only(tmp_path: Path, tls: Tls, stranger: Tls) -> None:
    with RedisServer(tmp_path / "redis", password="pw", tls=tls) as server:

        async def member() -> bytes | None:
            plain_url = server.url.replace("rediss://", "redis://")  # TLS comes from `tls`
            store = await Store.connect(StoreConfig(url=plain_url, tls=tls))
            try:
                await store.redis.set("probe", b"kept")
                return await store.redis.get("probe")
            finally:
                await store.close()

        assert run(member()) == b"kept"
        for how, ctx in probes(stranger).items():
            answer = probe(server.host, server.port, ctx, b"AUTH pw\r\nGET probe\r\nSET probe gone\r\n")
            assert only_alerts(answer), (how, answer[:200])
        assert sync_client(server.url, 2.0, tls).get("probe") == b"kept"
        with pytest.raises(redis.ConnectionError):
            sync_client(server.url.replace("rediss://", "redis://"), 2.0).ping()


@pytest.mark.slow  # five servers and a failover: `make test`, not the fast tier
def test_redis_sentinels_speak_tls_and_follow_a_failover(tmp_path: Path, tls: Tls, stranger: Tls) -> None:
    with RedisGroup(tmp_path, ["127.0.0.1"] * 3, "pw", tls=tls) as group:
        client = sync_client(group.url, 2.0, tls)
        client.set("probe", b"kept")
        assert client.execute_command("WAIT", 1, 5000) == 1  # the replica has it, over TLS
        for sentinel in group.sentinels:
            for how, ctx in probes(stranger).items():
                answer = probe(sentinel.host, sentinel.port, ctx, b"AUTH pw\r\nSENTINEL MASTERS\r\n")
                assert only_alerts(answer), (how, answer[:200])
        first = group.primary_node()
        assert first is not None
        first.kill()  # the sentinels, talking TLS to each other and the servers, promote the replica
        deadline = time.monotonic() + 30
        while group.primary_node() in (None, first):
            assert time.monotonic() < deadline, "no replica was promoted"
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while True:  # the client's reconnect asks the sentinels, over TLS, for the new primary
            try:
                assert client.get("probe") == b"kept"
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the client never found the promoted primary"
                time.sleep(0.1)


def test_transfer_serves_members_only(tls: Tls, stranger: Tls) -> None:
    spec = TensorSpec((512, 256), "float32", 5)  # 512 KB: by handle, not inline
    with OwnerProcess("auto", [spec], env={"TRIDENT_TLS_DIR": str(tls.folder)}) as owner:
        (handle,) = owner.handles
        assert owner.address.startswith("tcp://")  # with TLS, "auto" does not pick UCX

        async def pull(with_tls: Tls | None):
            puller = create_backend(TransferConfig(backend="tcp", timeout=10, tls=with_tls))
            await puller.start()
            try:
                with await puller.pull(owner.address, handle) as tensor:
                    return tensor.clone()
            except TransferError as exc:
                return exc
            finally:
                await puller.close()

        assert same_bytes(run(pull(tls)), make_tensor(spec))
        assert isinstance(run(pull(stranger)), TransferError)
        assert isinstance(run(pull(None)), TransferError)
        host, _, port = owner.address.removeprefix("tcp://").rpartition(":")
        request = b"\x00\x00\x00\x0a" + b"\x81\xa1h\xa8" + handle.encode()[:8]
        for how, ctx in probes(stranger).items():
            assert only_alerts(probe(host, int(port), ctx, request)), how
        # The owner still serves its members after the probes.
        assert same_bytes(run(pull(tls)), make_tensor(spec))


def test_ucx_is_refused_with_tls(tls: Tls) -> None:
    with pytest.raises(ValueError, match="no encryption"):
        create_backend(TransferConfig(backend="ucx", tls=tls))


def test_a_folder_without_its_files_is_named(tmp_path: Path, tls: Tls) -> None:
    with pytest.raises(ValueError, match=r"nowhere/ca\.pem is missing"):
        Tls.at(tls.folder.parent / "nowhere")
    (tmp_path / "ca.pem").write_bytes(Path(tls.ca).read_bytes())
    (tmp_path / "cert.pem").write_bytes(Path(tls.cert).read_bytes())
    (tmp_path / "key.pem").write_text("not a key")
    with pytest.raises(ValueError, match="usable certificate"):
        Tls.at(tmp_path)


@pytest.mark.parametrize("numel", [1, 1000, 70_000, 3_000_000])
def test_tls_pulls_bring_every_byte(tls: Tls, numel: int) -> None:
    """Regression: decrypted bytes that came while no read waited were written into a copy of the
    spill buffer (asyncio fills a buffer through slices, and a slice of a bytearray is a copy), so
    tensors arrived with runs of zeros. Every pull on one connection, into `out` and into the pool,
    carries each value where it belongs."""

    async def pulls() -> None:
        owner = create_backend(TransferConfig(backend="tcp", tls=tls, inline_max_bytes=0))
        puller = create_backend(TransferConfig(backend="tcp", tls=tls, timeout=30))
        await owner.start()
        await puller.start()
        try:
            want = torch.arange(numel, dtype=torch.float32)
            other = torch.arange(numel, 0, -1, dtype=torch.float32)
            handles = [owner.publish(want, ttl=60), owner.publish(other, ttl=60)]
            for _ in range(3):  # back to back on the one connection the puller keeps
                for handle, tensor in zip(handles, (want, other), strict=True):
                    out = torch.full_like(tensor, -1.0)
                    await puller.pull(owner.address, handle, out=out)
                    assert torch.equal(out, tensor)
                    with await puller.pull(owner.address, handle) as got:
                        assert torch.equal(got, tensor)
        finally:
            await puller.close()
            await owner.close()

    run(pulls())
