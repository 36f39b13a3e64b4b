"""UCX transfer on ucxx: pull by handle over persistent endpoints, shared memory within a host.

Tags. Every process keeps one receive standing on CONTROL_TAG for requests. A pull picks a fresh
even tag T; the owner replies with a header on T and the bytes on T+1, through its endpoint to the
puller (made once per peer from the worker address in the request, then reused).

    puller                                     owner
      post recv(T) ── request(handle, T, my address) ──▶ standing control recv
      header ◀──────────────── send(T, header) ───────── look up handle
      post recv(T+1, pool buffer or `out`) ◀─ send(T+1, bytes)

UCX error handling is off: with it on, UCX will not use shared memory at all and every byte goes
over loopback TCP at a fifth of the speed. UCX then reports no dead peers, so ucx_peers.py watches
for them itself. The cma transport stays off too (TransferConfig.ucx_tls): with error handling off,
a peer dying during a cma read aborts the reading process. Failed pulls are settled only after
their receives stopped (or their peer is dead), so no late write lands in a buffer the caller got
back.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import random
from typing import Any

import numpy as np

from common.transfer import host_local, same_host
from common.transfer.base import (
    CONFIRM,
    Landing,
    Pulled,
    TransferBackend,
    TransferConfig,
    destination,
    out_nbytes,
    pack_ack,
    pack_request,
    unpack,
)
from common.transfer.errors import (
    PeerLost,
    PeerUnreachable,
    TransferClosed,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from common.transfer.handles import Lease
from common.transfer.liveness import ProcessId, known_dead, this_process
from common.transfer.same_host import TransferPath
from common.transfer.sink import Out
from common.transfer.tcp import TcpClient
from common.transfer.ucx_peers import Peer, Peers, PullState
from common.transfer.ucx_thread import UcxThread
from common.transfer.ucx_wire import (
    CONTROL_SIZE,
    CONTROL_TAG,
    format_address,
    frame,
    parse_address,
    ucx_env_defaults,
    unframe,
)

log = logging.getLogger(__name__)

# After a deadline aborts a pull, wait this long for its receives to be cancelled before giving up.
_ABORT_GRACE = 2.0
STREAM_INSTEAD = object()  # a host-local pull's result when the owner's memory could not be opened


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class UcxBackend(TransferBackend):
    scheme = "ucx"

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__(config or TransferConfig(backend="ucx"))
        ucx_env_defaults()
        import ucxx._lib.libucxx as ucx_api  # imported here: the TCP fallback must work without it
        from ucxx._lib.arr import Array

        self._api = ucx_api
        self._array = Array
        ucx_config = {} if "UCX_TLS" in os.environ else {"TLS": self.config.ucx_tls}
        if "UCX_NET_DEVICES" not in os.environ and is_loopback(self.config.host):
            # Bound to loopback, as the TCP server is: UCX's TCP transport otherwise listens on
            # every interface, reachable from other machines on a deployment meant to be local.
            ucx_config["NET_DEVICES"] = "lo"
        self._thread = UcxThread(ucx_config, self._on_start, self._periodic, self.config.probe_interval)
        self._peers = Peers(ucx_api, Array, self._thread, self.config.probe_interval, self._settle)
        self._tcp = TcpClient(self)
        self._process = this_process()
        self._worker_address = b""
        self._tags = itertools.count(random.getrandbits(40) << 20, 2)  # even: T for the header, T+1 for data
        self._lent: dict[tuple[bytes, int], tuple[Lease, ProcessId | None]] = {}  # host-local holds, by pull
        self._closed = False

    @property
    def address(self) -> str:
        return format_address(self._worker_address, self._process)

    async def start(self) -> None:
        await asyncio.to_thread(self._thread.start)

    async def close(self) -> None:
        self._closed = True
        self._tcp.close()
        await asyncio.to_thread(self._thread.stop, self._shutdown)
        self.handles.clear()

    async def _pull(self, address: str, handle: str, out: Out, timeout: float) -> Pulled:
        if address.startswith("tcp://"):
            return await self._tcp.pull(address, handle, out, timeout)
        if self._closed:
            raise TransferClosed("transfer backend closed")
        peer, process = parse_address(address)
        if known_dead(process):
            raise PeerUnreachable(f"the owner process ({process.pid if process else '?'}) is gone")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pull = PullState(peer, handle, out, loop, loop.create_future())
        pulled = await self._pull_once(pull, process, timeout)
        if pulled is STREAM_INSTEAD:  # the owner's memory could not be opened here: ask for the bytes
            pull = PullState(peer, handle, out, loop, loop.create_future(), stream_only=True)
            pulled = await self._pull_once(pull, process, max(0.001, deadline - loop.time()))
        return pulled  # type: ignore[return-value]

    async def _pull_once(self, pull: PullState, process: ProcessId | None, timeout: float) -> Pulled:
        self._thread.call(lambda: self._begin(pull, process))
        try:
            return await asyncio.wait_for(asyncio.shield(pull.future), timeout)
        except TimeoutError:
            error = TransferTimeout(f"pull of {pull.handle} took over {timeout}s")
            self._thread.call(lambda: self._peers.abort(pull.peer, error))
            try:  # the abort cancels the receives, then fails the pull with `error`
                return await asyncio.wait_for(pull.future, _ABORT_GRACE)
            except TimeoutError:
                raise error from None
        except asyncio.CancelledError:
            # Let the transfer finish on its own; its buffer goes back to the pool when it does.
            pull.future.add_done_callback(_release_unclaimed)
            raise

    # -- UCX thread: pulling -------------------------------------------------------------------------------
    def _begin(self, pull: PullState, process: ProcessId | None) -> None:
        try:
            peer = self._peers.get(pull.peer, process)
        except Exception as exc:
            self._settle(pull, PeerUnreachable(f"cannot reach UCX peer: {exc}"))
            return
        self._peers.start_work(peer)
        peer.pulls.add(pull)
        tag = next(self._tags)
        header = np.empty(CONTROL_SIZE, dtype=np.uint8)
        me = self._process.encode() if self._process else ""
        offer = {} if pull.stream_only else same_host.offer(self.config, by_socket=False)
        request = frame(
            pack_request(
                pull.handle,
                out_nbytes(pull.out),
                rt=tag,
                ra=self._worker_address,
                pi=me,
                k=self.config.secret,
                **offer,
            )
        )
        # Each callback holds the array its request reads or writes: UCX may touch it until completion.
        recv = peer.ep.tag_recv(self._array(header), self._api.UCXXTag(tag))
        self._watch(peer, recv, lambda r: self._on_header(pull, r, header, tag))
        send = peer.ep.tag_send(self._array(request), self._api.UCXXTag(CONTROL_TAG))
        self._watch(peer, send, lambda r: self._on_sent(pull, r, request))

    def _on_sent(self, pull: PullState, request: Any, _sent: np.ndarray) -> None:
        try:
            request.check_error()
        except Exception as exc:
            self._peers.abort(pull.peer, PeerUnreachable(f"request to owner failed: {exc}"))

    def _on_header(self, pull: PullState, request: Any, header: np.ndarray, tag: int) -> None:
        try:
            request.check_error()
            reply = unpack(unframe(header))
            if not reply.get("ok"):
                raise error_from_code(str(reply.get("e")), str(reply.get("m", "")))
            if "x" in reply:
                self._begin_host_local(pull, reply, tag)
                return
            spot = destination(self.pool, tuple(reply["s"]), reply["d"], pull.out)
            pull.buffer = spot.buffer
        except Exception as exc:
            self._settle(pull, self._failure(pull, exc))
            return
        peer = self._peers.lookup(pull.peer)
        if peer is None:
            self._settle(pull, self._failure(pull, PeerLost("endpoint to the owner closed")))
        elif spot.data.numel() == 0:
            self._settle(pull, spot.finish(TransferPath.STREAM))
        else:
            # `spot` in the callback keeps the memory alive while UCX may write to it.
            recv = peer.ep.tag_recv(self._array(spot.data.numpy()), self._api.UCXXTag(tag + 1))
            self._watch(peer, recv, lambda r: self._on_data(pull, r, spot))

    # -- UCX thread: host-local pulls (host_local.py) ------------------------------------------------------
    def _begin_host_local(self, pull: PullState, reply: dict, tag: int) -> None:
        """The owner lent its memory: copy from it on a copier thread, then acknowledge on the
        control tag; the owner's confirmation comes on T+1."""
        peer = self._peers.lookup(pull.peer)
        if peer is None:
            raise PeerLost("endpoint to the owner closed")
        try:
            spot = host_local.landing(self, reply, pull.out)
        except Exception as exc:  # nothing copied: let the owner's hold go, and fail
            self._acknowledge(pull, tag, f"no destination: {exc!r}")
            raise
        pull.buffer = spot.buffer
        confirm = np.empty(CONTROL_SIZE, dtype=np.uint8)
        recv = peer.ep.tag_recv(self._array(confirm), self._api.UCXXTag(tag + 1))
        self._watch(peer, recv, lambda r: self._on_confirm(pull, r, confirm, spot))
        pull.copy = host_local.start(self, reply, spot)
        pull.copy.add_done_callback(lambda job: self._thread.call(lambda: self._copied(pull, tag, job)))

    def _copied(self, pull: PullState, tag: int, job: Any) -> None:
        error = job.exception()
        pull.copy_failed = None if error is None else f"{type(error).__name__}: {error}"
        self._acknowledge(pull, tag, pull.copy_failed)

    def _acknowledge(self, pull: PullState, tag: int, failed: str | None) -> None:
        """Tell the owner the copy is over (or could not be made), which ends its hold; sent even
        after the pull failed here, since the owner holds the memory until it hears."""
        try:
            peer = self._peers.get(pull.peer, None)
        except Exception as exc:
            log.debug("cannot acknowledge a host-local copy: %r", exc)
            return
        ack = frame(pack_ack(failed is None, failed or "", rt=tag, ra=self._worker_address))
        send = peer.ep.tag_send(self._array(ack), self._api.UCXXTag(CONTROL_TAG))
        self._watch(peer, send, lambda r: self._on_sent(pull, r, ack))

    def _on_confirm(self, pull: PullState, request: Any, _confirm: np.ndarray, spot: Landing) -> None:
        try:
            request.check_error()
        except Exception as exc:
            self._settle(pull, self._failure(pull, exc))
            return
        if pull.copy_failed is not None:
            log.debug("host-local copy failed (%s); pulling the bytes", pull.copy_failed)
            self.host_local_fallbacks += 1
            spot.abandon()
            pull.buffer = None
            self._settle(pull, STREAM_INSTEAD)
        else:
            self._settle(pull, spot.finish(TransferPath.HOST_LOCAL))

    def _on_data(self, pull: PullState, request: Any, spot: Landing) -> None:
        try:
            request.check_error()
        except Exception as exc:
            self._settle(pull, self._failure(pull, exc))
            return
        self._settle(pull, spot.finish(TransferPath.STREAM))

    @staticmethod
    def _failure(pull: PullState, exc: Exception) -> TransferError:
        if pull.abort_error is not None:
            return pull.abort_error
        return exc if isinstance(exc, TransferError) else PeerLost(f"transfer from owner failed: {exc}")

    def _settle(self, pull: PullState, result: Pulled | TransferError | object) -> None:
        if isinstance(result, TransferError) and pull.copy is not None and not pull.copy.done():
            # A host-local copy still writes into the pull's buffer: fail it once that has stopped.
            pull.copy.add_done_callback(lambda _: self._thread.call(lambda: self._settle(pull, result)))
            return
        peer = self._peers.lookup(pull.peer)
        if peer is not None:
            peer.pulls.discard(pull)
        if isinstance(result, TransferError) and pull.buffer is not None:
            pull.buffer.release()  # safe: failures settle after the receive ended, or its peer died
        pull.loop.call_soon_threadsafe(_resolve, pull.future, result)

    # -- UCX thread: serving ------------------------------------------------------------------------------
    def _on_start(self, worker: Any) -> None:
        self._worker_address = worker.address.tobytes()
        self._post_control()

    def _post_control(self) -> None:
        buf = np.empty(CONTROL_SIZE, dtype=np.uint8)
        recv = self._thread.worker.tag_recv(self._array(buf), self._api.UCXXTag(CONTROL_TAG))
        self._thread.watch(recv, lambda r: self._on_control(r, buf), busy=False)

    def _on_control(self, request: Any, buf: np.ndarray) -> None:
        if self._closed:
            return
        self._post_control()  # keep one receive standing before handling this message
        try:
            request.check_error()
            message = unpack(unframe(buf))
            if message.get("op") == "pull":  # pings need no answer: their send succeeding is the answer
                self._serve(message)
            elif message.get("op") == "ack":
                self._on_ack(message)
        except Exception as exc:
            log.warning("bad UCX control message: %r", exc)

    def _serve(self, message: dict) -> None:
        address, tag = bytes(message["ra"]), int(message["rt"])
        try:
            peer = self._peers.get(address, ProcessId.decode(str(message.get("pi", ""))))
        except Exception as exc:
            log.debug("cannot reach a puller: %r", exc)
            return
        reply = self.answer(message, lambda: self._thread.call(lambda: self._serve(message)))
        if reply is None:
            return  # reserved and not yet filled, or being prepared: served again when it is
        sends = [frame(reply.header)]
        if reply.data is not None and reply.data.numel():
            # The tensor stays referenced until its send completes, even if released meanwhile.
            sends.append(reply.data.numpy())
        self._peers.start_work(peer)
        if reply.lease is not None:  # held until the puller acknowledges, or is found dead
            self._lent[(address, tag)] = (reply.lease, peer.process)
        self._send_all(peer, address, sends, tag)

    def _on_ack(self, message: dict) -> None:
        """A same-host puller is done with the memory it was lent: end its hold, and confirm."""
        address, tag = bytes(message["ra"]), int(message["rt"])
        lent = self._lent.pop((address, tag), None)
        if lent is None:
            return  # not ours, or its reader was found dead meanwhile, which ended the hold
        lent[0].end()
        if not message.get("ok"):
            log.debug("a same-host puller could not open a handle: %s", message.get("m"))
        try:
            peer = self._peers.get(address, lent[1])
        except Exception as exc:
            log.debug("cannot confirm to a puller: %r", exc)
            return
        self._peers.start_work(peer)
        self._send_all(peer, address, [frame(CONFIRM)], tag + 1)

    def _send_all(self, peer: Peer, address: bytes, sends: list[np.ndarray], tag: int) -> None:
        for i, array in enumerate(sends):
            peer.sends += 1
            send = peer.ep.tag_send(self._array(array), self._api.UCXXTag(tag + i))
            self._watch(peer, send, lambda r, a=array: self._on_served(peer, address, r, a))

    def _on_served(self, peer: Peer, address: bytes, request: Any, _sent: Any) -> None:
        peer.sends -= 1
        try:
            request.check_error()
        except Exception as exc:
            log.debug("serving a puller failed (it went away?): %r", exc)
            self._peers.abort(address, PeerLost(f"peer went away: {exc}"))

    # -- UCX thread: housekeeping ----------------------------------------------------------------------------
    def _watch(self, peer: Peer, request: Any, callback: Any) -> None:
        peer.watches.append(self._thread.watch(request, callback))

    def _periodic(self) -> None:
        self._peers.check()
        # Memory lent to a reader that died is let go (a live one's hold ends only with its ack:
        # it may still be copying, even after its endpoint here was closed).
        for key, (lease, process) in list(self._lent.items()):
            if known_dead(process):
                del self._lent[key]
                lease.end()

    def _shutdown(self) -> None:
        for lease, _ in self._lent.values():
            lease.end()
        self._lent.clear()
        closed = TransferClosed("transfer backend closed")
        for peer in self._peers.close_all(closed):
            for pull in list(peer.pulls):
                pull.buffer = None  # its receive may still be cancelling: never hand the memory out again
                self._settle(pull, pull.abort_error or closed)


def _resolve(future: asyncio.Future[Pulled], result: Pulled | TransferError) -> None:
    if future.done():
        if isinstance(result, Pulled):
            result.release()  # nobody waits for it any more
        return
    if isinstance(result, TransferError):
        future.set_exception(result)
    else:
        future.set_result(result)


def _release_unclaimed(future: asyncio.Future[Pulled]) -> None:
    if not future.cancelled() and future.exception() is None and isinstance(future.result(), Pulled):
        future.result().release()
