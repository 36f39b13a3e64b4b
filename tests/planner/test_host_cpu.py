"""What a request costs outside the engines (the gateway, the broker, the store on the workers'
cores): measured from the workers' reports, charged by the simulator at the rate it replays."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from common.planner.calibrate import calibrate_from_service
from common.planner.host_cpu import measure_host_cpu
from common.planner.profiles import ProfileSet, StageCurves, TransferModel
from common.planner.simulator import simulate
from common.planner.trace import TraceEntry
from common.planner.types import Deployment
from common.protocol import StepStats, TraceRecord
from common.stats import SLO
from services.worker.cpu_use import CpuUse, host_id

CURVES = StageCurves(
    encode=((1, 0.01),),
    prefill=((1, 0.0005), (1000, 0.05)),
    decode=((1, 16, 0.002), (64, 16, 0.004), (1, 4096, 0.002), (64, 4096, 0.004)),
    num_kv_blocks=256,
)
PROFILES = ProfileSet(CURVES, TransferModel(latency=1e-4, bandwidth=1e12, hop=1e-3), host_cores=2)
SLO_ = SLO(ttft=0.5, tbt=0.1)


def reports(instance: str, host: str, busy: float, own: float, span: float = 60.0, at: float = 1000.0):
    """Two reports of one worker, `span` seconds apart, its counters grown by `busy` host cores
    and `own` of its own over them."""
    first = StepStats(
        instance_id=instance, roles=("decode",), time=at - span, host=host, host_cores=2,
        host_cpu_seconds=5000.0, process_cpu_seconds=30.0,
    )  # fmt: skip
    grown = {"host_cpu_seconds": 5000.0 + busy * span, "process_cpu_seconds": 30.0 + own * span}
    return first, first.model_copy(update={"time": at, **grown})


def measure(workers, records):
    return measure_host_cpu([w[0] for w in workers], [w[1] for w in workers], records)


def arrivals(times) -> list[TraceRecord]:
    return [TraceRecord(request_id=f"r{i}", arrival=t, prompt_tokens=8) for i, t in enumerate(times)]


def test_what_a_host_did_beyond_its_workers_is_charged_to_the_requests_served_meanwhile() -> None:
    # 1.5 cores busy for 60 s, 0.4 + 0.3 of them the workers': 0.8 × 60 = 48 CPU s over 120 requests.
    workers = [reports("ep", "a", 1.5, 0.4), reports("d", "a", 1.5, 0.3)]
    records = arrivals(np.linspace(941, 999, 120)) + arrivals([900.0, 1001.0])  # the last two outside
    found = measure(workers, records)
    assert found is not None
    assert found.per_request == pytest.approx(0.4) and found.busy == pytest.approx(0.8)
    assert (found.cores, found.requests, found.span) == (2, 120, 60.0)


def test_two_hosts_add_up_and_leave_the_cores_unshared() -> None:
    found = measure(
        [reports("ep", "a", 1.0, 0.5), reports("d", "b", 0.9, 0.6)], arrivals(np.linspace(950, 1000, 40))
    )
    assert found is not None
    assert found.busy == pytest.approx(0.8) and found.per_request == pytest.approx(0.8 * 60 / 40)
    assert found.cores == 0  # the simulator has one pool of cores; several hosts are not it


def test_nothing_is_measured_without_two_reports_of_a_host_or_with_too_few_requests() -> None:
    many = arrivals(np.linspace(950, 1000, 50))
    first, last = reports("d", "a", 1.0, 0.5)
    assert measure_host_cpu([], [last], many) is None  # no earlier report
    assert measure_host_cpu([first], [first], many) is None  # no time between them
    unmeasured = last.model_copy(update={"host": ""})  # a worker off Linux
    assert measure_host_cpu([first], [unmeasured], many) is None
    restarted = last.model_copy(update={"process_cpu_seconds": 1.0})  # a counter that went back
    assert measure_host_cpu([first], [restarted], many) is None
    assert measure_host_cpu([first], [last], arrivals([990.0, 995.0])) is None


def load(rate: float, n: int = 300) -> list[TraceEntry]:
    return [TraceEntry(i / rate, 400, 0, 0, 8) for i in range(n)]


def test_the_cost_outside_the_instances_grows_with_the_rate_and_takes_their_cores() -> None:
    """At 5 req/s, 0.1 CPU s a request leaves 1.5 of 2 cores: the steps hardly notice. At 15 req/s
    it leaves 0.5: the same requests queue for them. With no cost, the two rates look alike."""
    deployment = Deployment.of("ep+d", ep=1, d=1)
    charged = dataclasses.replace(PROFILES, transfer=dataclasses.replace(PROFILES.transfer, host_cpu=0.1))

    def ttft_p90(profiles, rate):
        return float(np.quantile(simulate(load(rate), deployment, profiles, SLO_).ttft, 0.9))

    free_low, free_high = ttft_p90(PROFILES, 5), ttft_p90(PROFILES, 15)
    assert free_high < 1.5 * free_low
    assert ttft_p90(charged, 5) < 1.5 * free_low
    assert ttft_p90(charged, 15) > 3 * free_high
    # More cost than the host has cores: the instances crawl and the requests miss, but end.
    swamped = simulate(load(30, 60), deployment, charged, SLO_)
    assert swamped.complete and swamped.attainment < 0.5


def test_the_profile_file_keeps_the_cost() -> None:
    charged = dataclasses.replace(PROFILES, transfer=dataclasses.replace(PROFILES.transfer, host_cpu=0.02))
    assert ProfileSet.from_dict(charged.to_dict()).transfer.host_cpu == 0.02
    old = charged.to_dict()
    del old["transfer"]["host_cpu"]  # a file written before: nothing charged
    assert ProfileSet.from_dict(old).transfer.host_cpu == 0.0


def test_calibration_takes_the_background_out_of_the_steps_and_charges_it_per_request() -> None:
    """Steps that ran on 2 cores with 1.5 of them busy outside the workers took twice their curve
    (one thread on the half core left, no other step beside them): their factor is 1 once the
    background is known, and the cost per request is what the simulator will charge."""
    profiles = dataclasses.replace(PROFILES, threads=1)
    steps = tuple(("decode", 0, 0, 1, 16.0, 2 * 0.002, 1.0, 0.0) for _ in range(40))
    first, last = reports("d", "a", 1.9, 0.4)
    record = StepStats(**{**last.model_dump(), "steps": steps})
    found = measure_host_cpu([first], [record], arrivals(np.linspace(941, 999, 60)))
    unaware = calibrate_from_service([record], profiles)
    aware = calibrate_from_service([record], profiles, host_cpu=found)
    assert unaware.factors["decode"] == pytest.approx(2.0)
    assert aware.factors["decode"] == pytest.approx(1.0)
    assert aware.host_cpu == pytest.approx(1.5)
    assert aware.apply(profiles).transfer.host_cpu == pytest.approx(1.5)


def test_a_worker_measures_its_host_and_itself() -> None:
    """Real /proc: CPU burnt in this process between two reads is this process's and the host's."""
    cpu = CpuUse(cores=2)
    busy0, own0 = cpu.counters()
    start = time.monotonic()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, own1 = cpu.counters()
    wall = time.monotonic() - start
    # It spun 0.3 s of its own CPU; a loaded host stretches the wall time, never the CPU time.
    assert 0.3 - 0.02 <= own1 - own0 <= wall + 0.05
    assert busy1 - busy0 >= own1 - own0 - 0.05  # the host's busy cores hold this process (to a tick)
    assert host_id() and cpu.host == host_id() and cpu.cores == 2
