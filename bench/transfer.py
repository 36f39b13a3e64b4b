"""Moving one tensor between two processes: UCX, TCP, Redis SET/GET and inline NATS, beside memcpy.

    python bench/transfer.py             # 64 KB, 3.7 MB (one LLaVA-1.5 image's features), 64 MB
    python bench/transfer.py --quick     # fewer repetitions
    python bench/transfer.py --tls       # also TCP over mutual TLS (a deployment's TRIDENT_TLS_DIR)
    python bench/transfer.py --kv [--kv-shape 32,32,128] [--kv-tokens 2048] [--kv-dtype bfloat16]
                                  [--device cpu|cuda:0]
                                         # instead: one request's KV P→D, host-local against the
                                         # byte stream (trident/bench/kv_transfer.py)

Every path is a pull between two processes, the way prefill gets features and decode gets KV:

* ucx, tcp: an owner process publishes the tensor; this process pulls it by handle into a reused
  destination (`out=`), so each sample is request + reply header + the bytes.
* redis: the owner SETs the bytes once; this process GETs them (the bytes cross two sockets, via
  redis-server). The owner's SET time is reported beside it.
* nats: the owner answers a request with the bytes inline in the reply (through nats-server);
  64 MB exceeds the 8 MB max_payload and is not measured.
* tcp-tls (with --tls): the tcp pull over mutual TLS, both ends showing a certificate of one
  fresh deployment CA (common/certs.py), as every transfer runs with TRIDENT_TLS_DIR.
* memcpy: single-threaded `numpy.copyto` of the same size in this process, at the start of the run.
* ucx-netns, tcp-netns: the ucx and tcp pulls again between two network namespaces joined by veth
  links through a bridge (common/infra/netns.py), the owner in one and the puller in the other,
  UCX on TCP only: the path between two hosts, without a NIC. Run where root can make namespaces
  (skipped, saying why, elsewhere; `--no-netns` skips them).

A table goes to stdout, then the key figures as one JSON object on the last line. Timings on a
machine shared with busy processes swing widely; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from common.certs import issue
from common.infra import NatsServer, RedisServer, netns
from common.tls import Tls
from common.transfer import TransferConfig, create_backend, ucx_available
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from trident.bench import kv_transfer

SIZES = {"64KB": 64 * 1024, "3.7MB": 576 * 1606 * 4, "64MB": 64 * 1024 * 1024}
NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def _spec(nbytes: int, seed: int) -> TensorSpec:
    return TensorSpec((nbytes // 4,), "float32", seed)


def _stats(samples: list[float], nbytes: int) -> dict[str, float]:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "GBps": nbytes / p50 / 1e9, "n": len(ordered)}


def _repeats(nbytes: int, scale: float) -> int:
    return max(5, int((400 if nbytes < 1 << 20 else 60 if nbytes < 16 << 20 else 25) * scale))


async def bench_pull(
    backend: str, scale: float, owner_env: dict[str, str] | None = None, tls: Tls | None = None
) -> dict[str, dict[str, float]]:
    """The byte stream (host-local off: `--kv` compares the two)."""
    specs = [_spec(n, i) for i, n in enumerate(SIZES.values())]
    results = {}
    if tls is not None:
        owner_env = {**(owner_env or {}), "TRIDENT_TLS_DIR": str(tls.folder)}
    owner = OwnerProcess(backend, specs, owner_env)
    await asyncio.to_thread(owner.start)
    try:
        config = TransferConfig(backend=backend, timeout=30, tls=tls, host_local=False)  # type: ignore[arg-type]
        puller = create_backend(config)
        await puller.start()
        for (name, nbytes), spec, handle in zip(SIZES.items(), specs, owner.handles, strict=True):
            out = torch.empty(spec.shape, dtype=torch.float32)
            for _ in range(3):  # warm: endpoints, connections, first-touch pages
                await puller.pull(owner.address, handle, out=out)
            assert same_bytes(out, make_tensor(spec)), f"{backend} {name}: bytes differ"
            samples = []
            for _ in range(_repeats(nbytes, scale)):
                t0 = time.perf_counter()
                await puller.pull(owner.address, handle, out=out)
                samples.append(time.perf_counter() - t0)
            results[name] = _stats(samples, nbytes)
        await puller.close()
    finally:
        await asyncio.to_thread(owner.stop)
    return results


def _redis_owner(url: str, conn: Connection) -> None:
    import redis

    client = redis.Redis.from_url(url)
    for name, nbytes in SIZES.items():
        payload = make_tensor(_spec(nbytes, 0)).numpy().tobytes()
        t0 = time.perf_counter()
        client.set(f"bench:{name}", payload)
        conn.send((name, time.perf_counter() - t0))
    conn.send(None)
    conn.recv()  # stay until told


def bench_redis(url: str, scale: float) -> dict[str, dict[str, float]]:
    import redis

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_redis_owner, args=(url, child), daemon=True)
    proc.start()
    set_times = dict(iter(parent.recv, None))
    client = redis.Redis.from_url(url)
    results = {}
    for name, nbytes in SIZES.items():
        for _ in range(2):
            client.get(f"bench:{name}")
        samples = []
        for _ in range(_repeats(nbytes, scale)):
            t0 = time.perf_counter()
            data = client.get(f"bench:{name}")
            samples.append(time.perf_counter() - t0)
        assert data is not None and len(data) == nbytes
        results[name] = {**_stats(samples, nbytes), "set_ms": set_times[name] * 1e3}
    parent.send("done")
    proc.join(10)
    return results


def _nats_owner(url: str, conn: Connection) -> None:
    import nats

    async def main() -> None:
        nc = await nats.connect(url)
        payloads = {
            n: make_tensor(_spec(n, 0)).numpy().tobytes() for n in SIZES.values() if n <= NATS_MAX_PAYLOAD
        }

        async def answer(msg) -> None:  # type: ignore[no-untyped-def]
            await msg.respond(payloads[int(msg.data)])

        await nc.subscribe("bench.pull", cb=answer)
        await nc.flush()
        await asyncio.to_thread(conn.send, "ready")
        await asyncio.to_thread(conn.recv)
        await nc.close()

    asyncio.run(main())


async def bench_nats(url: str, scale: float) -> dict[str, dict[str, float]]:
    import nats

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nats_owner, args=(url, child), daemon=True)
    await asyncio.to_thread(proc.start)
    assert await asyncio.to_thread(parent.recv) == "ready"
    nc = await nats.connect(url)
    results = {}
    for name, nbytes in SIZES.items():
        if nbytes > NATS_MAX_PAYLOAD:
            continue
        for _ in range(3):
            await nc.request("bench.pull", str(nbytes).encode(), timeout=30)
        samples = []
        for _ in range(_repeats(nbytes, scale)):
            t0 = time.perf_counter()
            reply = await nc.request("bench.pull", str(nbytes).encode(), timeout=30)
            samples.append(time.perf_counter() - t0)
        assert len(reply.data) == nbytes
        results[name] = _stats(samples, nbytes)
    await nc.close()
    await asyncio.to_thread(parent.send, "done")
    await asyncio.to_thread(proc.join, 10)
    return results


def bench_memcpy(scale: float) -> dict[str, dict[str, float]]:
    results = {}
    for name, nbytes in SIZES.items():
        src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        samples = []
        for _ in range(_repeats(nbytes, scale)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            samples.append(time.perf_counter() - t0)
        results[name] = _stats(samples, nbytes)
    return results


def across_namespaces(scale: float) -> dict[str, dict[str, dict[str, float]]]:
    """The pulls between two namespaces, in this process (run as `--netns-only`: UCX is set up for
    TCP alone before it starts, which a process that already used UCX on shared memory cannot be)."""
    tcp_only = {"UCX_TLS": "tcp,self"}
    os.environ.update(tcp_only)
    results = {}
    with netns.Namespaces(f"tb{os.getpid() % 10000}", 50 + os.getpid() % 40) as spaces:
        netns.enter(spaces.names["d"])  # the puller: this process
        owner_env = {
            **tcp_only,
            "TRIDENT_NETNS": spaces.names["ep"],
            "TRIDENT_BIND_HOST": spaces.address["ep"],
        }
        for backend in (["ucx"] if ucx_available() else []) + ["tcp"]:
            results[f"{backend}-netns"] = asyncio.run(bench_pull(backend, scale, owner_env))
    return results


def _across_namespaces_child(quick: bool) -> dict[str, dict[str, dict[str, float]]]:
    argv = [sys.executable, __file__, "--netns-only", *(["--quick"] if quick else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the cross-namespace run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| path | size | p50 ms | p99 ms | GB/s (at p50) |", "| --- | --- | ---: | ---: | ---: |"]
    for path, by_size in results.items():
        for size in SIZES:
            r = by_size.get(size)
            if r is None:
                lines.append(f"| {path} | {size} | n/a | n/a | n/a |")
            else:
                lines.append(f"| {path} | {size} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['GBps']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the repetitions")
    parser.add_argument("--no-netns", action="store_true", help="skip the pulls across namespaces")
    parser.add_argument("--tls", action="store_true", help="also the TCP pull over mutual TLS")
    parser.add_argument("--netns-only", action="store_true", help=argparse.SUPPRESS)  # the child run
    parser.add_argument("--kv", action="store_true", help="one request's KV: host-local against the stream")
    parser.add_argument("--kv-shape", default="32,32,128", help="layers,kv_heads,head_dim (llava-1.5-7b's)")
    parser.add_argument("--kv-tokens", type=int, default=2048, help="the request's tokens")
    parser.add_argument("--kv-dtype", default="bfloat16", help="the KV cache's dtype")
    parser.add_argument("--device", default="cpu", help="where both ends keep the KV: cpu or cuda:N")
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    if args.kv:
        shape = kv_transfer.KvShape.parse(args.kv_shape, args.kv_tokens, args.kv_dtype)
        results, figures = kv_transfer.run(shape, args.device, args.quick)
        print(kv_transfer.table(results, shape))
        print(json.dumps({"loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), **figures}))
        return
    if args.netns_only:
        print(json.dumps(across_namespaces(scale)))
        return
    # memcpy first, before any server or peer process exists to compete with it.
    results: dict[str, dict[str, dict[str, float]]] = {"memcpy": bench_memcpy(scale)}
    with NatsServer() as nats_server, RedisServer() as redis_server:
        if ucx_available():
            results["ucx"] = asyncio.run(bench_pull("ucx", scale))
        results["tcp"] = asyncio.run(bench_pull("tcp", scale))
        if args.tls:
            with tempfile.TemporaryDirectory() as folder:
                results["tcp-tls"] = asyncio.run(bench_pull("tcp", scale, tls=issue(folder)))
        results["redis"] = bench_redis(redis_server.url, scale)
        results["nats-inline"] = asyncio.run(bench_nats(nats_server.url, scale))
    why_not = "--no-netns" if args.no_netns else netns.problem()
    if why_not is None:
        results.update(_across_namespaces_child(args.quick))
    else:
        print(f"across namespaces: not measured ({why_not})", file=sys.stderr)
    results["memcpy"] = results.pop("memcpy")  # listed last, as the reference
    print(table(results))

    memcpy_bw = results["memcpy"]["64MB"]["GBps"]
    figures: dict[str, object] = {"loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    for path, by_size in results.items():
        for size, r in by_size.items():
            figures[f"{path}_{size}_p50_ms"] = round(r["p50_ms"], 3)
            figures[f"{path}_{size}_p99_ms"] = round(r["p99_ms"], 3)
            figures[f"{path}_{size}_GBps"] = round(r["GBps"], 2)
    if "tcp-tls" in results:  # what TLS costs a pull, as a ratio of this run's plain TCP
        for size in SIZES:
            figures[f"tcp_tls_over_tcp_{size}_p50"] = round(
                results["tcp-tls"][size]["p50_ms"] / results["tcp"][size]["p50_ms"], 2
            )
    if "ucx" in results:
        ucx = results["ucx"]
        figures["ucx_64MB_fraction_of_memcpy"] = round(ucx["64MB"]["GBps"] / memcpy_bw, 3)
        figures["goal_ucx_3.7MB_p50_le_1.5ms"] = ucx["3.7MB"]["p50_ms"] <= 1.5
        figures["goal_ucx_64MB_ge_half_memcpy"] = ucx["64MB"]["GBps"] >= 0.5 * memcpy_bw
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
