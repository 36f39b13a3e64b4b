"""The continuous planner: reads the trace, re-plans on an interval and on a workload shift, and
publishes each decision (Redis plan key, NATS plan event, REST, metrics, the actuator).

    every planner_shift_check_interval:
        read new finished requests from the trace stream into the window
        trigger = first plan | interval elapsed | workload moved > threshold | POST /plan/replan
        if trigger: correction = observed/predicted on the current deployment
                    result = plan(window, profiles, SLO, N, correction)     # in a thread: CPU-bound
                    put_plan → publish → metrics → actuator
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.aio import raise_if_cancelled
from common.bus import Bus
from common.planner.algorithm import plan as make_plan
from common.planner.calibrate import ServiceCalibration, calibrate_from_service, transfer_model
from common.planner.capacity import Capacity, recommend
from common.planner.drift import current_deployment, kind_counts, measure_correction, workload_distance
from common.planner.forecast import Forecast
from common.planner.handover import hand_over, standing
from common.planner.host_cpu import measure_host_cpu
from common.planner.limits import MIN_INSTANCES, parse_counts
from common.planner.paper_profiles import profiles_from
from common.planner.profiles import ProfileError, ProfileSet
from common.planner.simulator import Correction
from common.planner.sizing import OutOfReach
from common.planner.trace import TraceEntry, from_records, summary
from common.planner.types import Deployment, PlanResult
from common.protocol import Plan, TraceRecord
from common.roles import Role
from common.runtime import Runtime
from common.stats import SLO
from common.store import Store
from services.planner.actuators import Actuator, make_actuator
from services.planner.capacity import MIN_RATE, CapacityDecision, forecast_load, moved
from services.planner.metrics import Metrics
from services.settings import PlannerSettings

log = logging.getLogger(__name__)


class NotPlanned(Exception):
    """Why no plan can be made now (too few requests, no profiles, no instances)."""


@dataclass
class Decision:
    """One published plan with everything behind it."""

    plan: Plan  # what went to Redis and NATS
    result: PlanResult
    trigger: str
    duration: float
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.plan.decision_id,
            "time": self.plan.time,
            "trigger": self.trigger,
            "reason": self.plan.reason,
            **self.result.to_dict(),
            "inputs": self.inputs,
            "duration": round(self.duration, 3),
        }


def load_profiles(source: str, published: list, trace: Sequence[TraceRecord] = ()) -> ProfileSet:
    """`cluster` (the profiles instances published, with the fixed costs between them measured from
    the trace's stage marks), `paper:<model>` or a ProfileSet JSON file."""
    if source == "cluster":
        if not published:
            raise ProfileError("no instance has published a stage profile yet")
        return ProfileSet.from_records(published, transfer_model(trace))
    return profiles_from(source)


CPU_WINDOW = 60.0  # s: the host CPU a request costs is measured over at least this long


@dataclass(frozen=True)
class PlanInputs:
    """What one plan is made from."""

    trace: list[TraceEntry]  # the window's finished requests
    profiles: ProfileSet  # calibrated, when they can be
    calibration: ServiceCalibration | None
    current: Deployment | None  # what the live instances form, if they form one
    live: int  # live instances
    instances: int  # how many to plan for


class Planner:
    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self.slo = SLO(settings.ttft_slo, settings.tbt_slo, settings.planner_attainment)
        self.instance_id = settings.instance_id or f"planner-{socket.gethostname()}-{os.getpid()}"
        self.metrics = Metrics.create()
        self.window: deque[TraceRecord] = deque(maxlen=settings.planner_window)
        self.last_id = "-"  # trace stream id read up to
        self.since_plan = 0  # finished requests read since the last plan
        self.planned_for: list[TraceEntry] = []
        self.decision: Decision | None = None
        self.status = "starting"
        self.progress: tuple[float, str] | None = None  # of the plan being computed
        self.planned_at = 0.0  # monotonic
        self._wake = asyncio.Event()
        self._requested: list[asyncio.Future[Decision]] = []  # POST /plan/replan callers
        self.capacity: CapacityDecision | None = None
        self._sized_at = 0.0  # monotonic
        # The last plan's model of the cluster, which capacity is sized with until the next plan:
        # its stage profiles (calibrated from service) and its correction.
        self._step_reads: deque[tuple[float, list]] = deque()  # (monotonic, StepStats): host CPU
        self._profiles: ProfileSet | None = None
        self._correction: Correction | None = None
        # Connected in start(), inside uvicorn's event loop (its lifespan): None until then.
        self.runtime: Runtime | None = None
        self._actuator: Actuator | None = None

    async def start(self) -> None:
        """Connect through the service runtime and run the planning loop under its supervision: a
        failed loop ends the process (EXIT_LOOP_FAILED) rather than leave an API that plans no more."""
        self.runtime = rt = await Runtime.connect(self.settings, self.instance_id, dead_letters=False)
        self._actuator = make_actuator(self.settings, rt.store)
        rt.start(None)  # no heartbeats: nothing fails over to or from a planner
        rt.supervise("planning", self.run)
        rt.supervise("exit-on-failure", rt.exit_on_failure, may_end=True)

    async def close(self) -> None:
        if self.runtime is not None:
            await self.runtime.close()

    def unhealthy(self) -> str | None:
        """Why the planner cannot plan (its loop failed), or None."""
        return self.runtime.health() if self.runtime is not None else None

    def _connected(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeError("the planner has not started")
        return self.runtime

    @property
    def store(self) -> Store:
        return self._connected().store

    @property
    def bus(self) -> Bus:
        return self._connected().bus

    @property
    def actuator(self) -> Actuator:
        if self._actuator is None:
            raise RuntimeError("the planner has not started")
        return self._actuator

    # -- the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled. A failed round is logged and shown in the status; the next one tries again."""
        while True:
            raise_if_cancelled()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("planning round failed")
                self.status = f"last round failed: {exc!r}"
            with contextlib.suppress(TimeoutError):  # not wait_for, which on 3.11 can drop a cancel
                async with asyncio.timeout(self.settings.planner_shift_check_interval):
                    await self._wake.wait()
            self._wake.clear()

    async def step(self) -> Decision | None:
        await self.publish_desired()
        await self.read_trace()
        requested, self._requested = self._requested, []
        trigger = "requested" if requested else self.due()
        decision = None
        if trigger is not None:
            try:
                decision = await self.replan(trigger)
            except NotPlanned as exc:
                self.status = f"no plan: {exc}"
                _settle(requested, error=NotPlanned(str(exc)))
                return None
            except BaseException as exc:
                _settle(requested, error=exc)
                raise
            _settle(requested, decision)
        if self.decision is not None and await self.resize("plan" if decision is not None else None):
            await self.publish_desired()
        return decision

    async def publish_desired(self) -> None:
        """trident_planner_desired_instances, what an autoscaler follows (KEDA on Kubernetes): the last
        sizing's counts handed over against what runs now (common/planner/handover.py); before the
        first sizing, what runs or the method the deployment starts with (TRIDENT_PLANNER_START)."""
        live = await self._live_counts()
        if live is None:
            return  # the registry cannot be read now: what was published stands
        sized = self.capacity.capacity if self.capacity is not None else None
        if sized is None:
            counts = standing(live, parse_counts(self.settings.planner_start, "TRIDENT_PLANNER_START"))
        else:
            counts = hand_over(sized.desired, live, self.settings.capacity_limits().maximum)
        if counts is not None:
            self.metrics.publish_desired(counts)
            if self.capacity is not None:
                self.capacity.published = counts

    async def _live_counts(self) -> dict[str, int] | None:
        try:
            registered = await self.store.registry.instances()
        except Exception as exc:  # Redis away
            log.debug("registry unreadable: %r", exc)
            return None
        live = kind_counts(hb.roles for hb in registered if not hb.draining)
        return {str(kind): n for kind, n in live.items() if kind}

    # -- capacity ----------------------------------------------------------------------------------
    async def resize(self, trigger: str | None) -> CapacityDecision | None:
        """Size capacity for the forecast load when `trigger` says so, or the forecast moved, or a
        plan interval has passed since the last sizing (services/planner/capacity.py)."""
        s = self.settings
        predicted = forecast_load(self.window, s.forecast_config())
        if trigger is None:
            trigger = self._capacity_due(predicted)
            if trigger is None:
                return None
        started = time.monotonic()
        registered = await self.store.registry.instances()
        live = kind_counts(hb.roles for hb in registered if not hb.draining)
        running = {str(kind): n for kind, n in live.items() if kind}
        queued = await self._queued()
        try:
            capacity, error = await self._recommend(max(predicted.rate, MIN_RATE), queued, running), None
        except (OutOfReach, ValueError) as exc:
            capacity, error = None, str(exc)
        self.capacity = CapacityDecision(
            time.time(),
            trigger,
            predicted,
            capacity,
            error,
            {str(r): n for r, n in queued.items()},
            running,
            time.monotonic() - started,
        )
        self._sized_at = time.monotonic()
        self.metrics.record_capacity(self.capacity)
        if capacity is not None:
            log.info(
                "capacity (%s): %.3g req/s forecast → %s%s",
                trigger,
                predicted.rate,
                capacity.deployment.label,
                f" ({capacity.short})" if capacity.short else "",
            )
            if s.planner_follow_capacity:
                await self._follow(capacity, running)
        else:
            log.warning("capacity (%s): none fits: %s", trigger, error)
        return self.capacity

    def _capacity_due(self, predicted: Forecast) -> str | None:
        """Why capacity is sized again now, if it is: the forecast moved (or there was none), or a
        plan interval passed; never sooner than the minimum interval after the last sizing."""
        s, last = self.settings, self.capacity
        since = time.monotonic() - self._sized_at
        if last is not None and since < s.planner_capacity_min_interval:
            return None  # a noisy forecast does not keep the planner's core busy
        if moved(last, predicted, s.planner_capacity_change):
            return (
                "first" if last is None else f"forecast {last.forecast.rate:.3g} → {predicted.rate:.3g} req/s"
            )
        if since >= s.planner_interval:
            return "interval"
        return None

    async def _recommend(self, rate: float, queued: dict[Role, int], running: dict[str, int]) -> Capacity:
        """The fewest instances that serve `rate` within the limits (common/planner/capacity.py), in a
        thread: it simulates."""
        return await asyncio.to_thread(
            recommend,
            from_records(self.window),
            self._profiles,
            self.slo,
            rate,
            self.settings.capacity_limits(),
            queued=queued,
            running=running,
            correction=self._correction,
        )

    async def _follow(self, capacity: Capacity, running: dict[str, int]) -> None:
        """Hand a recommendation that differs from what runs to the actuator, as a plan of its own
        (the next split then divides the instances it brought). The launcher and compose actuators
        add the new replicas first and drain the old ones once those registered."""
        wanted = capacity.deployment
        running = {kind: n for kind, n in running.items() if n}
        current = await self.store.planning.current_plan()
        if running == wanted.counts or (
            current is not None and (current.method, current.replicas) == (wanted.method, wanted.counts)
        ):
            return  # it runs, or is on its way
        reason = f"capacity: {capacity.rate:.3g} req/s forecast needs {wanted.label}"
        if capacity.short:
            reason += f" ({capacity.short})"
        plan = await self.store.planning.put_plan(wanted.method, wanted.counts, capacity.goodput, reason)
        await self.bus.events.plan(plan)
        log.info("plan %d (%s)", plan.decision_id, reason)
        await self._apply(plan)

    async def _apply(self, plan: Plan) -> None:
        try:
            await self.actuator.apply(plan)
        except Exception:  # the plan stands; applying it is the actuator's business
            log.exception("the %s actuator failed on plan %d", self.actuator.name, plan.decision_id)

    async def _queued(self) -> dict[Role, int]:
        """Tasks waiting per stage; a stage whose queue cannot be read now counts as empty."""
        out: dict[Role, int] = {}
        for role in Role:
            try:
                out[role] = await self.bus.queued(role)
            except Exception as exc:  # NATS away: the floor is left out this round
                log.debug("queue of %s unknown now: %r", role, exc)
        return out

    def request(self) -> asyncio.Future[Decision]:
        """Re-plan at the next round, now; the future gets the decision or NotPlanned."""
        waiter: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._requested.append(waiter)
        self._wake.set()
        return waiter

    async def read_trace(self) -> None:
        while True:
            rows = await self.store.requests.trace(after=self.last_id, count=1000)
            for stream_id, record in rows:
                self.window.append(record)
                self.last_id = stream_id
            self.since_plan += len(rows)
            if len(rows) < 1000:
                break
        self.metrics.window.set(len(self.window))

    def due(self) -> str | None:
        """What triggers a plan now, if anything."""
        s = self.settings
        if len(self.window) < s.planner_min_requests:
            self.status = f"waiting for {s.planner_min_requests} finished requests (have {len(self.window)})"
            return None
        if self.decision is None:
            return "first"
        if time.monotonic() - self.planned_at >= s.planner_interval:
            return "interval"
        if self.since_plan >= s.planner_min_requests:
            distance = workload_distance(self.recent(), self.planned_for)
            self.metrics.distance.set(distance)
            if distance > s.planner_shift_threshold:
                return f"workload shift {distance:.2f} > {s.planner_shift_threshold}"
        return None

    def recent(self) -> list[TraceEntry]:
        """The requests finished since the last plan."""
        count = min(self.since_plan, len(self.window))
        return from_records(list(self.window)[-count:]) if count else []

    # -- one plan --------------------------------------------------------------------------------
    async def replan(self, trigger: str) -> Decision:
        on = await self._plan_inputs()
        self.status = f"planning ({trigger})"
        started = time.monotonic()
        result, correction = await self._simulate(on)
        duration = time.monotonic() - started
        reason = f"{trigger}; {len(on.trace)} requests, {on.instances} instances"
        if (runner := result.runner_up) is not None:
            below = f"{result.margin:.0%} below"
            reason += f"; runner-up {runner.deployment.label} at {runner.goodput:.3f} req/s ({below})"
        decision_plan = await self.store.planning.put_plan(
            result.deployment.method, result.deployment.counts, result.goodput, reason
        )
        await self.bus.events.plan(decision_plan)
        inputs = {
            **result.inputs,
            "trace": summary(on.trace),
            "current": on.current.to_dict() if on.current else None,
            "live_instances": on.live,
            "correction": dataclasses.asdict(correction),
            "calibration": on.calibration.to_dict() if on.calibration else None,
            "slo": dataclasses.asdict(self.slo),
            "instances": on.instances,
            "actuator": self.actuator.name,
        }
        self.decision = Decision(decision_plan, result, trigger, duration, inputs)
        self.metrics.record(decision_plan, result, duration, trigger.split()[0])
        self.planned_for, self.since_plan, self.planned_at = on.trace, 0, time.monotonic()
        self.status = "planned"
        log.info(
            "plan %d (%s): %s, %.2f req/s at %.0f%% attainment, in %.1f s",
            decision_plan.decision_id,
            trigger,
            result.deployment.label,
            result.goodput,
            100 * result.attainment,
            duration,
        )
        await self._apply(decision_plan)
        return self.decision

    async def _plan_inputs(self) -> PlanInputs:
        """The window as a trace, the profiles (calibrated when they can be), the deployment running
        now and how many instances to plan for; NotPlanned when any is missing."""
        s = self.settings
        if len(self.window) < s.planner_min_requests:
            raise NotPlanned(f"need {s.planner_min_requests} finished requests, have {len(self.window)}")
        trace = from_records(self.window)
        registered = await self.store.registry.instances()
        base, calibration = await self.profiles(registered)
        profiles = calibration.apply(base) if calibration else base
        live = [hb for hb in registered if not hb.draining]
        current = current_deployment([hb.roles for hb in live])
        instances = s.planner_instances or self._instances(current, len(live))
        if instances < 1:
            raise NotPlanned("no live instances, and TRIDENT_PLANNER_INSTANCES is 0")
        return PlanInputs(trace, profiles, calibration, current, len(live), instances)

    async def _simulate(self, on: PlanInputs) -> tuple[PlanResult, Correction]:
        """Algorithm 2 over the inputs, in a thread (it is CPU-bound), corrected by how the current
        deployment's predictions compare with what it served."""
        correction = Correction()
        if on.current is not None:
            correction = await asyncio.to_thread(
                measure_correction, on.trace, on.current, on.profiles, self.slo
            )
        self._profiles, self._correction = on.profiles, correction
        try:
            result = await asyncio.to_thread(
                make_plan,
                on.trace,
                on.profiles,
                self.slo,
                on.instances,
                correction=correction,
                progress=self._on_progress,
            )
        except ValueError as exc:  # e.g. too few instances to split
            raise NotPlanned(str(exc)) from exc
        finally:
            self.progress = None
        return result, correction

    async def profiles(self, registered: list | None = None) -> tuple[ProfileSet, ServiceCalibration | None]:
        """The stage profiles plans use (TRIDENT_PLANNER_PROFILES) and, for the cluster's own, their
        calibration from the steps its live instances ran in service and from the gaps between
        tokens the gateway measured (TRIDENT_PLANNER_CALIBRATE); NotPlanned if there are none yet."""
        s = self.settings
        try:
            profiles = load_profiles(s.planner_profiles, await self.store.planning.profiles(), self.window)
        except ProfileError as exc:
            raise NotPlanned(f"stage profiles ({s.planner_profiles}): {exc}") from exc
        if not (s.planner_calibrate and s.planner_profiles == "cluster"):  # only the same machines' steps
            return profiles, None
        registered = await self.store.registry.instances() if registered is None else registered
        live_ids = {hb.instance_id for hb in registered}
        steps = [st for st in await self.store.planning.steps() if st.instance_id in live_ids]
        # The gaps between tokens the gateway measured fit the workers' time between steps too,
        # replayed on the deployment that served them (when the live instances form one).
        current = current_deployment([hb.roles for hb in registered if not hb.draining])
        # What requests cost on the workers' cores outside them, since a read at least
        # CPU_WINDOW ago; on one host, its cores are shared.
        host_cpu = measure_host_cpu(self._earlier_steps(steps), steps, self.window)
        if host_cpu is not None and host_cpu.cores and not profiles.host_cores:
            profiles = dataclasses.replace(profiles, host_cores=host_cpu.cores)
        calibration = await asyncio.to_thread(
            calibrate_from_service, steps, profiles, from_records(self.window), current, self.slo, host_cpu
        )
        return profiles, calibration

    def _earlier_steps(self, steps: list) -> list:
        """The latest read of the instances' steps at least CPU_WINDOW before this one (else the
        oldest kept); this one is kept for the reads after it."""
        now = time.monotonic()
        reads = self._step_reads
        while len(reads) > 1 and now - reads[1][0] >= CPU_WINDOW:
            reads.popleft()
        earlier = reads[0][1] if reads else []
        reads.append((now, steps))
        return earlier

    async def export(self) -> tuple[list[TraceEntry], dict]:
        """The requests in the planning window as a trace, and a header that lets `trident plan
        --trace` plan them offline as this service would: the profiles, their calibration, the SLOs."""
        profiles, calibration = await self.profiles()
        meta = {
            "source": f"planner {self.instance_id}",
            "profiles": profiles.to_dict(),
            "calibration": calibration.to_dict() if calibration else None,
            "slo": dataclasses.asdict(self.slo),
        }
        return from_records(self.window), meta

    def _instances(self, current: Deployment | None, live: int) -> int:
        """N when TRIDENT_PLANNER_INSTANCES leaves it to the cluster: the live deployment's size; while
        the live instances form no one method (a deployment moving to the last plan: new replicas up,
        old ones not yet drained), the last plan's size, so a transition does not inflate N. A lone
        EPD instance counts as the fewest a split takes: its plan, and the capacity sized after it,
        are what move such a deployment on (an autoscaler follows the capacity)."""
        if current is not None:
            n = current.instances
        elif self.decision is not None:
            n = self.decision.result.deployment.instances
        else:
            n = live
        return max(n, MIN_INSTANCES) if n else 0

    def _on_progress(self, fraction: float, message: str) -> None:
        self.progress = (fraction, message)  # from the planning thread; a tuple is replaced atomically


def _settle(
    waiters: list[asyncio.Future[Decision]],
    decision: Decision | None = None,
    error: BaseException | None = None,
) -> None:
    for waiter in waiters:
        if waiter.done():  # the caller went away
            continue
        if isinstance(error, asyncio.CancelledError):
            waiter.cancel()
        elif error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(decision)
