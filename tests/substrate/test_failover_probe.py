"""The failover's question to a silent instance (`common.failover.probe`), against real sockets:
alive as itself; gone (nothing listens, or another process answers at its address); or hanging
(a frozen process's socket still accepts), which is given until TRIDENT_UNRESPONSIVE_AFTER."""

from __future__ import annotations

import asyncio
import socket

from common.failover import INSTANCE_HEADER, Probe, probe
from common.infra import free_port
from tests.substrate.helpers import run


async def ask_server(answering_as: str) -> Probe:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            f"HTTP/1.1 200 OK\r\n{INSTANCE_HEADER}: {answering_as}\r\ncontent-length: 2\r\n\r\nok".encode()
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await probe(f"http://127.0.0.1:{port}", "decode-a-1", timeout=2)


def test_an_instance_that_answers_as_itself_is_alive():
    assert run(ask_server("decode-a-1")) is Probe.ANSWERS


def test_another_process_at_its_address_means_it_is_gone():
    # A restarted container: same host name and port, a new instance id.
    assert run(ask_server("decode-b-1")) is Probe.GONE


def test_nothing_listening_means_it_is_gone():
    assert run(probe(f"http://127.0.0.1:{free_port()}", "decode-a-1", timeout=2)) is Probe.GONE


def test_a_socket_that_accepts_and_says_nothing_hangs():
    # A SIGSTOPped process: the kernel completes the handshake from the listen backlog.
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        port = frozen.getsockname()[1]
        assert run(probe(f"http://127.0.0.1:{port}", "decode-a-1", timeout=0.3)) is Probe.SILENT
