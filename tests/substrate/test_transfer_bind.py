"""A transfer backend told to bind loopback listens on loopback only: UCX's TCP transport would
otherwise listen on every interface, reachable from other machines on a deployment meant to be
local (a probe of `trident up` found one on the machine's public address)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest

from common.transfer import TransferConfig, create_backend
from common.transfer.ucx import is_loopback
from tests.substrate.helpers import run

pytest.importorskip("ucxx")
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")


def listening() -> set[str]:
    """The IPv4 addresses this process's TCP sockets listen on (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:  # 0A: LISTEN
            found.add(socket.inet_ntoa(struct.pack("<I", int(local.split(":")[0], 16))))
    return found


@pytest.mark.parametrize("backend", ["ucx", "tcp"])
def test_a_backend_bound_to_loopback_listens_on_loopback_only(backend: str) -> None:
    async def main() -> set[str]:
        transfer = create_backend(TransferConfig(backend=backend, host="127.0.0.1"))  # type: ignore[arg-type]
        await transfer.start()
        try:
            return listening()
        finally:
            await transfer.close()

    found = run(main())
    assert found and all(ipaddress.ip_address(a).is_loopback for a in found), found


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2") and not is_loopback("host-a")
