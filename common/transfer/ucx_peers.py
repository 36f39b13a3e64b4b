"""Endpoints to other processes, the work outstanding with each, and noticing when one dies.

UCX error handling is off (it is the price of shared memory, see ucx.py), so UCX never reports
a dead peer: a receive from it just waits, and a send to it over shared memory even succeeds.
Every `probe_interval`, for each peer with work outstanding, we check that its process still
runs (liveness.py) or, for a peer on another host, ping it; the ping's send fails on the reset
TCP connection. A dead peer's endpoint is closed and its pulls fail at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.transfer.base import Pulled, pack_request
from common.transfer.errors import PeerLost, TransferError
from common.transfer.liveness import ProcessId, checkable, known_dead
from common.transfer.pool import PoolBuffer
from common.transfer.sink import Out
from common.transfer.ucx_thread import UcxThread
from common.transfer.ucx_wire import CONTROL_TAG, frame

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PullState:
    """One pull in flight; the UCX thread settles `future` on the caller's loop."""

    peer: bytes
    handle: str
    out: Out
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Pulled]
    abort_error: TransferError | None = None
    buffer: PoolBuffer | None = None
    stream_only: bool = False  # asks for the bytes (a host-local copy of it failed)
    copy: concurrent.futures.Future[None] | None = None  # a host-local copy in flight
    copy_failed: str | None = None  # why the host-local copy failed, once it did


@dataclass(eq=False)
class Peer:
    """Our endpoint to one other process, and the work outstanding with it."""

    ep: Any
    process: ProcessId | None
    pulls: set[PullState] = field(default_factory=set)
    sends: int = 0  # replies we are still sending to it
    busy_since: float = 0.0
    pinging: bool = False
    watches: list[Any] = field(default_factory=list)  # its requests' watches, while it is busy

    @property
    def busy(self) -> bool:
        return bool(self.pulls) or self.sends > 0


class Peers:
    """The peer table (UCX thread only). `settle(pull, error)` fails a pull of an aborted peer."""

    def __init__(
        self, api: Any, array: Any, thread: UcxThread, probe_interval: float,
        settle: Callable[[PullState, TransferError], None],
    ) -> None:  # fmt: skip
        self._api = api
        self._array = array
        self._thread = thread
        self._probe_interval = probe_interval
        self._settle = settle
        self._peers: dict[bytes, Peer] = {}

    def get(self, address: bytes, process: ProcessId | None) -> Peer:
        """The peer at a worker address, connecting on first use (raises if UCX cannot)."""
        peer = self._peers.get(address)
        if peer is None:
            worker_address = self._api.UCXAddress.create_from_buffer(address)
            # Error handling off: UCX uses shared memory only without it.
            ep = self._api.UCXEndpoint.create_from_worker_address(self._thread.worker, worker_address, False)
            peer = self._peers[address] = Peer(ep, process)
        elif peer.process is None and process is not None:
            peer.process = process
        return peer

    def lookup(self, address: bytes) -> Peer | None:
        return self._peers.get(address)

    def start_work(self, peer: Peer) -> None:
        """Note that work with `peer` begins; its liveness is checked from now on."""
        if not peer.busy:
            peer.busy_since = time.monotonic()
            peer.watches.clear()  # all completed: nothing else outstanding with this peer

    def check(self) -> None:
        """Periodic: abort peers that died while we had work outstanding with them."""
        now = time.monotonic()
        for address, peer in list(self._peers.items()):
            if not peer.busy or now - peer.busy_since < self._probe_interval:
                continue
            if checkable(peer.process):
                if known_dead(peer.process):
                    pid = peer.process.pid  # type: ignore[union-attr]
                    self.abort(address, PeerLost(f"peer process {pid} is gone"), dead=True)
            elif peer.pulls:
                self._ping(address, peer)

    def abort(self, address: bytes, error: TransferError, dead: bool = False) -> None:
        """Close the endpoint to a peer: its transfers are cancelled and its pulls fail with `error`.

        Closing cancels the endpoint's requests once the close completes, which needs the peer. A
        `dead` peer cannot finish it, but cannot send anything more either: after one last drain
        of what it already wrote, its pulls fail at once and its requests stop counting as busy.
        """
        peer = self._peers.pop(address, None)
        if peer is None:
            return
        dead = dead or known_dead(peer.process)  # a send failed because it died: nothing will cancel
        log.debug("closing the UCX endpoint to a peer: %s", error)
        for pull in peer.pulls:
            pull.abort_error = pull.abort_error or error
        try:
            peer.ep.close()
        except Exception as exc:
            log.debug("closing UCX endpoint failed: %r", exc)
        if dead:
            self._thread.progress(rounds=10)
            for w in peer.watches:
                w.busy = False
            for pull in list(peer.pulls):
                self._settle(pull, error)

    def close_all(self, error: TransferError) -> list[Peer]:
        """Abort every peer (at shutdown); returns them, for their pulls to be failed."""
        peers = list(self._peers.values())
        for address in list(self._peers):
            self.abort(address, error)
        return peers

    def _ping(self, address: bytes, peer: Peer) -> None:
        if peer.pinging:
            return
        peer.pinging = True
        ping = frame(pack_request("", op="ping"))
        send = peer.ep.tag_send(self._array(ping), self._api.UCXXTag(CONTROL_TAG))
        self._thread.watch(send, lambda r, k=ping: self._on_ping(address, peer, r, k))

    def _on_ping(self, address: bytes, peer: Peer, request: Any, _sent: np.ndarray) -> None:
        peer.pinging = False
        try:
            request.check_error()
        except Exception as exc:
            self.abort(address, PeerLost(f"peer is gone: {exc}"))
