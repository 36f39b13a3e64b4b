"""Three "hosts" on one machine: network namespaces joined by veth links to a bridge, for running a
deployment (tests/services/test_three_hosts.py) or a transfer (bench/transfer.py) whose processes
reach each other only over the network.

    infra (bridge, .1): nats-server, redis-server, the gateway
    ep    (.2):         the encoder and the prefill
    d     (.3):         the decoder

Needs root and iproute2; `problem()` says why not where they are missing.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.231.{}.{}"
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def enter(name: str) -> None:
    """Move this process into namespace `name` as `ip netns exec` does: the network namespace, and a
    mount namespace of its own whose /sys shows that network's devices (UCX lists them there).
    Call it before the process starts threads: those started earlier stay where they were."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} (entering network namespace {name})")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


def problem() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip"
    probe = f"trident-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Namespaces:
    """`names[role]` is the namespace, `address[role]` its one address; deleted on exit."""

    tag: str  # short and unique: it names the namespaces and the links (15 characters at most)
    net: int  # the third octet of 10.231.x.0/24

    def __post_init__(self) -> None:
        self.names = {role: f"{self.tag}{role}" for role in ("infra", "ep", "d")}
        self.address = {"infra": SUBNET.format(self.net, 1), "ep": SUBNET.format(self.net, 2)}
        self.address["d"] = SUBNET.format(self.net, 3)

    def __enter__(self) -> Namespaces:
        try:
            for name in self.names.values():
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            infra = self.names["infra"]
            _ip("-n", infra, "link", "add", "br0", "type", "bridge")
            _ip("-n", infra, "link", "set", "br0", "up")
            _ip("-n", infra, "addr", "add", f"{self.address['infra']}/24", "dev", "br0")
            for role in ("ep", "d"):
                inside, port = f"{self.tag}{role}", f"{self.tag}{role}b"
                _ip("link", "add", inside, "type", "veth", "peer", "name", port)
                _ip("link", "set", inside, "netns", self.names[role])
                _ip("link", "set", port, "netns", infra)
                _ip("-n", infra, "link", "set", port, "master", "br0")
                _ip("-n", infra, "link", "set", port, "up")
                _ip("-n", self.names[role], "addr", "add", f"{self.address[role]}/24", "dev", inside)
                _ip("-n", self.names[role], "link", "set", inside, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names.values():  # its links go with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def run_in(self, role: str, argv: list[str]) -> list[str]:
        """`argv` as it runs inside a namespace."""
        return ["ip", "netns", "exec", self.names[role], *argv]
