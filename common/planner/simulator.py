"""A discrete-event simulation of a deployment, driven by stage profiles.

Every simulated instance runs the engine's own batching code — `common.engine.scheduler.Scheduler`
over a real `BlockManager` — on real `Request` objects; only the model is replaced, by the iteration
latency the profile predicts for the batch the scheduler built. Around the instances the simulation
plays what the services do: the gateway routes text-only requests straight to prefill, instances pull
tasks from per-stage queues with the workers' pull rules (`common.engine.admission`; each stage's
handler names its own, and tests/stages/test_plugins.py holds the two tables equal),
features and KV move with a transfer cost, a prefill instance keeps a request's KV blocks until the
decoder has pulled them, and decode pulls only when its blocks can hold the request.

Times are seconds from the start of the trace. Per request it records TTFT and every token gap;
per instance, busy time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from common.engine.admission import Load, decode_room, encode_room, prefill_room
from common.engine.block_manager import BlockManager, blocks_needed
from common.engine.budgets import budget_target, latency_limit
from common.engine.config import EngineConfig, Policy
from common.engine.governor import BudgetGovernor, budget_share
from common.engine.prefix import PrefixReuse
from common.engine.request import ImageInput, Request, Status
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Batch, Scheduler
from common.planner.profiles import ProfileSet, StageCurves
from common.planner.trace import rate
from common.planner.types import KIND_ROLES, Deployment
from common.roles import PULL_ORDER, Role
from common.stats import SLO, quantile, request_tbt, slo_met
from common.threads import RECENT, greedy_threads, thread_split

_ENCODED = np.empty(0)  # stands in for an image's features once it has been encoded
# What each stage's handler does (services/<stage>/handler.py `pull_rule`, `takes_idle_cores`),
# replayed here: how much an instance pulls, and which instances take the host's idle cores.
PULL_RULES = {Role.ENCODE: encode_room, Role.PREFILL: prefill_room, Role.DECODE: decode_room}
IDLE_CORE_ROLES = frozenset({Role.ENCODE, Role.PREFILL})
# A load whose cost outside the instances would take all of the host's cores still leaves them this
# share: they crawl, and the requests miss their SLOs, rather than never end.
BACKGROUND_FLOOR = 0.05


def cores_left(host_cores: float, background: float) -> float:
    """The host's cores the instances share while `background` of them are busy outside them
    (the simulator's, and the calibration's to take out of the steps' times: the same rule)."""
    return max(host_cores - background, BACKGROUND_FLOOR * host_cores)


@dataclass
class Correction:
    """Multipliers on predicted latencies, observed/predicted (Dynamo's SLA planner does the same)."""

    ttft: float = 1.0
    tbt: float = 1.0


@dataclass
class _Track:
    """What the simulation learns about one request."""

    arrival: float
    output_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    done: float | None = None
    failed: bool = False  # known to miss its TTFT already


@dataclass
class SimResult:
    """Per-request latencies and per-instance utilisation of one simulated run."""

    ttft: np.ndarray  # s, per request (nan if never reached)
    tbt_p90: np.ndarray  # s, per request (0 with fewer than two tokens)
    gaps: np.ndarray  # every inter-token gap, pooled
    met: np.ndarray  # bool per request
    utilisation: dict[str, float]
    duration: float
    complete: bool  # False when stopped early because attainment was already out of reach
    # By iteration kind (Batch.kind): how much longer iterations took for sharing the host's cores
    # than at their threads alone (elapsed over unshared, summed; 1.0 unshared).
    sharing: dict[str, float] = field(default_factory=dict)

    @property
    def attainment(self) -> float:
        return float(self.met.mean()) if len(self.met) else 1.0

    def ttft_percentile(self, q: float) -> float:
        """Over the requests that got a first token (nan if none did; 0.0 for no requests)."""
        if not len(self.ttft):
            return 0.0
        reached = [t for t in self.ttft.tolist() if not math.isnan(t)]
        return quantile(reached, q / 100) if reached else math.nan

    def tbt_percentile(self, q: float) -> float:
        return quantile(self.gaps.tolist(), q / 100) if len(self.gaps) else 0.0


class _TracePrefixes(PrefixReuse):
    """The engine's prefix lookup answered by the trace: a request finds the cached tokens its entry
    says (a measured count, or a workload's ideal), in whole blocks and never its last token, as
    `PrefixReuse.lookup` would; the blocks then count as its own."""

    def __init__(self, blocks: BlockManager, cached: dict[str, int] | None) -> None:
        super().__init__(blocks)
        self.cached = cached if cached is not None else {}

    def lookup(self, req: Request) -> tuple[int, int]:
        found = self.cached.get(req.request_id, 0)
        if not found or req.num_computed_tokens or self.blocks.table(req.request_id):
            return 0, 0
        size = self.blocks.block_size
        req.num_computed_tokens = min(found, req.num_tokens - 1) // size * size
        return req.num_tokens, req.num_computed_tokens

    def admitted(self, req: Request, looked: tuple[int, int]) -> None:
        if looked[0]:
            req.num_cached_tokens = looked[1]


class _Instance:
    """One simulated engine: the engine's scheduler and block manager, timed by a profile."""

    def __init__(
        self,
        name: str,
        kind: str,
        curves: StageCurves,
        slo: SLO,
        policy: Policy,
        context: float,
        governor: bool = True,
        cached: dict[str, int] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.roles = KIND_ROLES[kind]
        self.curves = curves
        image_budget, token_budget = curves.budgets(KIND_ROLES[kind], slo, context)
        config = EngineConfig(
            roles=self.roles,
            policy=policy,
            block_size=curves.block_size,
            token_budget=token_budget,
            image_budget=image_budget,
            max_num_seqs=curves.max_num_seqs,
        )
        self.blocks = BlockManager(curves.num_kv_blocks, curves.block_size)
        self.scheduler = Scheduler(config, self.blocks, _TracePrefixes(self.blocks, cached))
        # τe counts what the engine's does: images, or image tokens in units of the profiled image.
        self.scheduler.image_unit = curves.tokens_per_image or None
        # The workers' budget governor, by default on there too: it shrinks the budgets while full
        # iterations run over their target (here: slowed by shared cores or jitter).
        target = budget_target(latency_limit(self.roles, slo.ttft, slo.tbt))
        self.governor = BudgetGovernor(image_budget, token_budget, target) if governor else None
        self.busy_until: float | None = None  # when the running iteration ends; None when idle
        self.busy_time = 0.0
        self.batch: Batch | None = None
        # On shared cores an iteration's end moves as other instances start and stop: the work it
        # has left (seconds at full speed), the speed it runs at, since when, and a version that
        # retires its superseded end events.
        self.work = 0.0
        self.speed = 1.0
        self.since = 0.0
        self.started = 0.0
        self.version = 0
        # The core board (common/threads.py): an instance that encodes or prefills takes the cores
        # the others leave; the running iteration's threads, what sharing the cores left of its
        # speed at those threads, and the seconds it would have taken at them unshared.
        self.greedy = bool(self.roles & IDLE_CORE_ROLES)
        self.threads = 0
        self.contention = 1.0
        self.unshared = 0.0
        self.ended = -math.inf  # when its last iteration ended
        self.arriving: list[tuple[float, int, Request, bool]] = []  # (ready, seq, request, prefilled)
        self.decode_pulled = 0  # decode tasks taken whose KV is still on its way

    def room(self, stage: Role) -> int:
        if stage == Role.DECODE and self.decode_pulled:
            return 0  # a worker pulls one request's KV at a time
        load = Load(
            waiting=len(self.scheduler.waiting) + len(self.arriving) - self.decode_pulled,
            free_blocks=self.blocks.num_free,
            image_budget=self.scheduler.image_budget,
            running=len(self.scheduler.running),
            token_budget=self.scheduler.token_budget,
        )
        return PULL_RULES[stage](load)


class Simulation:
    """Replays a trace on a deployment. Use `run()` once."""

    def __init__(
        self,
        trace: Sequence,
        deployment: Deployment,
        profiles: ProfileSet,
        slo: SLO,
        *,
        policy: Policy = Policy.STAGE,
        correction: Correction | None = None,
        stop_early: bool = False,
        seed: int = 0,
        governor: bool = True,
    ) -> None:
        self.trace = sorted(trace, key=lambda e: e.arrival)
        self.slo = slo
        self.transfer = profiles.transfer
        self.jitter = profiles.jitter
        self.host_cores = profiles.host_cores
        # Threads are modelled where the profile says what it was measured with.
        self.profile_threads = profiles.threads if profiles.host_cores else 0
        self.thread_exponent = profiles.thread_exponent
        self.interference = profiles.interference if profiles.host_cores else {}
        self._rng = np.random.default_rng(seed)
        self.correction = correction or Correction()
        # The decode context budgets are sized for: the trace's mean over a request's decode.
        context = sum(e.prompt_tokens + e.output_tokens / 2 for e in self.trace) / max(len(self.trace), 1)
        self.cached: dict[str, int] = {}  # prompt tokens each request finds in a prefix cache
        self.instances = [
            _Instance(
                f"{kind}{i}", kind, profiles.for_kind(kind), slo, policy, context, governor, self.cached
            )
            for kind, n in deployment.replicas
            for i in range(n)
        ]
        # Per-stage task queues, first visible first (the JetStream subjects).
        self.queues: dict[Role, list[tuple[float, int, Request]]] = {s: [] for s in Role}
        self.tracks: dict[str, _Track] = {}
        self.kv_owner: dict[str, _Instance] = {}
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.now = 0.0
        # Stop once more requests are sure to miss their TTFT than the attainment allows.
        self._allowed_failures = math.floor((1 - slo.attainment) * len(self.trace)) if stop_early else None
        self._failures = 0
        self._turn = 0
        self._stretch: dict[str, list[float]] = {}  # by iteration kind: [elapsed, unshared] seconds
        self.split = thread_split(self.host_cores, len(self.instances))  # each worker's own threads
        # The cores the instances have: the host's, less what requests cost outside them at the
        # trace's rate (TransferModel.host_cpu), never under BACKGROUND_FLOOR of them.
        self.cores = cores_left(self.host_cores, self.transfer.host_cpu * rate(self.trace))

    # -- the event loop --------------------------------------------------------------------------

    def run(self) -> SimResult:
        for i, entry in enumerate(self.trace):
            # Tracks in trace order, so results line up with the trace whatever order requests
            # reach their first queue in (dispatch differs with the number of images).
            rid = entry.request_id or f"r{i}"
            rid = rid if rid not in self.tracks else f"{rid}#{i}"
            self.tracks[rid] = _Track(entry.arrival, max(entry.output_tokens, 1))
            units = entry.num_images + getattr(entry, "num_videos", 0)
            dispatch = self.transfer.dispatch + self.transfer.dispatch_per_image * units
            self._push(entry.arrival + dispatch, "arrive", (rid, entry))
        complete = True
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(*payload)
            elif kind == "iteration":
                inst, version = payload
                if version != inst.version:
                    continue  # superseded: the cores were shared out again since
                self._end_iteration(inst)
                if self.host_cores:
                    self._share_cores()  # the others speed up
                if self.transfer.step_gap > 0:  # the worker between steps: no step, no core
                    inst.busy_until = self.now + self.transfer.step_gap
                    self._push(inst.busy_until, "gap", inst)
            elif kind == "gap":
                if payload.batch is None:
                    payload.busy_until = None
            elif kind == "deadline":
                self._deadline(payload)
            elif kind == "reshare":  # an instance's last step is no longer recent: the cores move
                self._share_cores()
            # "wake": data an instance pulled has arrived; the idle instances look below
            self._start_idle()
            if self._allowed_failures is not None and self._failures > self._allowed_failures:
                complete = False
                break
        return self._result(complete)

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    # -- the gateway -----------------------------------------------------------------------------

    def _arrive(self, rid: str, entry) -> None:
        per_image = _split(entry.image_tokens, entry.num_images)
        per_clip = _split(getattr(entry, "video_tokens", 0), getattr(entry, "num_videos", 0))
        images = [ImageInput(f"{rid}/{k}", n) for k, n in enumerate(per_image)]
        # A clip: one encode that costs its tokens, a long prefill (paced beside decodes).
        images += [ImageInput(f"{rid}/v{k}", n, video=True) for k, n in enumerate(per_clip)]
        for img in images[: getattr(entry, "encoded_images", 0)]:
            img.features = _ENCODED  # stored already: no encoder runs for it
        req = Request(
            rid,
            [0] * max(entry.prompt_tokens, 1),
            SamplingParams(max_tokens=max(entry.output_tokens, 1)),
            images,
        )
        self.cached[rid] = getattr(entry, "cached_tokens", 0)
        self._enqueue(Role.ENCODE if req.needs_encode else Role.PREFILL, self.now, req)
        self._push(entry.arrival + self.slo.ttft / self.correction.ttft, "deadline", rid)

    def _enqueue(self, stage: Role, visible: float, req: Request) -> None:
        """A task published to `stage`'s queue; pullers see it from `visible` on (the broker hop)."""
        heapq.heappush(self.queues[stage], (visible, next(self._seq), req))
        if visible > self.now:
            self._push(visible, "wake", None)

    def _deadline(self, rid: str) -> None:
        track = self.tracks[rid]
        if track.first_token is None and not track.failed:
            track.failed = True
            self._failures += 1

    # -- instances pull, batch and run -----------------------------------------------------------

    def _start_idle(self) -> None:
        # Pull loops run beside each engine, so busy instances fetch too, but the broker serves the
        # waiting fetches in turn: idle instances first, in rotation, then the busy ones.
        self._turn = (self._turn + 1) % len(self.instances)
        order = self.instances[self._turn :] + self.instances[: self._turn]
        for inst in sorted(order, key=lambda i: i.busy_until is not None):
            self._pull(inst)
        for inst in self.instances:
            if inst.busy_until is None:  # what was fetched joins the engine between steps
                self._admit_arrived(inst)
                self._start(inst)

    def _pull(self, inst: _Instance) -> None:
        for stage in PULL_ORDER:
            if stage not in inst.roles:
                continue
            queue = self.queues[stage]
            if not queue or queue[0][0] > self.now:
                continue  # nothing to fetch yet: the pull rule need not be asked
            room = inst.room(stage)
            while room > 0 and queue and queue[0][0] <= self.now:
                if stage == Role.DECODE and not self._can_hold(inst, queue[0][2]):
                    break  # pull-based migration: KV moves only when it fits
                _, _, req = heapq.heappop(queue)
                self._take(inst, stage, req)
                room -= 1

    def _can_hold(self, inst: _Instance, req: Request) -> bool:
        need = len(req.prompt_token_ids) + req.params.max_tokens
        return blocks_needed(need, inst.curves.block_size) <= inst.blocks.num_free

    def _take(self, inst: _Instance, stage: str, req: Request) -> None:
        """A task reaches an instance; its data arrives after the transfer (features or KV)."""
        ready = self.now
        if stage == Role.PREFILL and req.images:
            tokens = sum(img.num_tokens for img in req.images)
            ready += self.transfer.time(tokens * inst.curves.feature_bytes_per_image_token)
        elif stage == Role.DECODE:
            ready += self.transfer.time(req.num_computed_tokens * inst.curves.kv_bytes_per_token)
            inst.decode_pulled += 1
            # Reserve the blocks now so two pulls cannot both count on them; an instance that cannot
            # prefill reserves the request's whole length, as the engine does.
            reserve = req.num_computed_tokens
            if Role.PREFILL not in inst.roles:
                reserve = max(reserve, len(req.prompt_token_ids) + req.params.max_tokens)
            inst.blocks.allocate(req.request_id, reserve)
        heapq.heappush(inst.arriving, (ready, next(self._seq), req, stage == Role.DECODE))
        self._push(ready, "wake", None)

    def _admit_arrived(self, inst: _Instance) -> None:
        while inst.arriving and inst.arriving[0][0] <= self.now:
            _, _, req, prefilled = heapq.heappop(inst.arriving)
            if prefilled:
                inst.decode_pulled -= 1
                self._release_kv(req.request_id)
                inst.scheduler.add_running(req)
            else:
                req.status = Status.WAITING
                inst.scheduler.add(req)

    def _release_kv(self, rid: str) -> None:
        owner = self.kv_owner.pop(rid, None)
        if owner is not None:
            owner.blocks.free(rid)

    def _start(self, inst: _Instance) -> None:
        if not inst.scheduler.has_work:
            return
        batch = inst.scheduler.schedule()
        if Role.PREFILL not in inst.roles:
            for req in batch.preempted:  # its KV is gone and it cannot prefill here: prefill it again
                inst.scheduler.remove(req)
                self._enqueue(Role.PREFILL, self.now + self.transfer.hop, req)
        if batch.empty:
            return
        images = inst.curves.image_units(batch.image_tokens, batch.num_images)
        seconds = inst.curves.iteration_time(
            images, batch.prefill_tokens, len(batch.decodes), batch.decode_context
        )
        if self.jitter:
            seconds *= float(np.exp(self.jitter * self._rng.standard_normal() - self.jitter**2 / 2))
        inst.batch, inst.started = batch, self.now
        inst.work, inst.speed, inst.since = seconds, 1.0, self.now
        inst.unshared, inst.contention = 0.0, 1.0
        if self.host_cores:
            self._share_cores()
        else:
            self._schedule_end(inst)

    def _share_cores(self) -> None:
        """Instances on one host share its cores. Where the profile does not say how many threads
        it was measured with, each iteration is one core's worth: while n run on c cores, each
        progresses at min(1, c/n) of its full speed (processor sharing). Where it does, each runs
        the threads the core board gives it (`_threads`), at (threads / profiled)^exponent of its
        profiled speed (its kind's exponent), and while the running iterations' threads outnumber
        the cores, each gets that share of them. Each other iteration running beside one slows it
        by e^λ more, λ its kind's `ProfileSet.interference` (caches and memory bandwidth are
        shared where cores are not). Called whenever an iteration starts or ends, or a step stops
        being recent, it moves every running iteration's end accordingly."""
        running = [i for i in self.instances if i.batch is not None]
        if self.profile_threads:
            for inst in running:
                inst.threads = self._threads(inst)
            total = sum(i.threads for i in running)
        else:
            total = len(running)
        contention = min(1.0, self.cores / total) if total else 1.0
        for inst in running:
            elapsed = self.now - inst.since
            inst.work = max(0.0, inst.work - elapsed * inst.speed)
            inst.unshared += elapsed * inst.contention
            inst.contention, inst.since = contention, self.now
            beside = math.exp(-self.interference.get(inst.batch.kind, 0.0) * (len(running) - 1))
            inst.speed = contention * self._thread_speed(inst.batch.kind, inst.threads) * beside
            self._schedule_end(inst)

    def _threads(self, inst: _Instance) -> int:
        """The torch threads `inst`'s worker runs its step with now (common/threads.py)."""
        if not inst.greedy:
            return self.split
        recent = RECENT - 1e-9  # one that ended exactly RECENT ago (its "reshare" event) is not
        busy = sum(
            1
            for o in self.instances
            if o is not inst and (o.batch is not None or self.now - o.ended < recent)
        )
        return greedy_threads(self.host_cores, busy)

    def _thread_speed(self, kind: str, threads: int) -> float:
        exponent = self.thread_exponent.get(kind, 0.0)
        if not self.profile_threads or not exponent:
            return 1.0
        return (threads / self.profile_threads) ** exponent

    def _schedule_end(self, inst: _Instance) -> None:
        inst.version += 1
        inst.busy_until = self.now + inst.work / inst.speed
        self._push(inst.busy_until, "iteration", (inst, inst.version))

    # -- what an iteration did (the engine's step, with the model's output replaced) --------------

    def _end_iteration(self, inst: _Instance) -> None:
        batch, inst.batch, inst.busy_until = inst.batch, None, None
        inst.busy_time += self.now - inst.started
        inst.unshared += (self.now - inst.since) * inst.contention
        inst.ended = self.now
        stretch = self._stretch.setdefault(batch.kind, [0.0, 0.0])
        stretch[0] += self.now - inst.started
        stretch[1] += inst.unshared
        if self.profile_threads and any(self.thread_exponent.values()):
            self._push(self.now + RECENT, "reshare", None)
        if inst.governor is not None:
            s = inst.scheduler
            share = budget_share(batch, s.image_budget, s.token_budget, s.image_unit)
            if inst.governor.observe(share, self.now - inst.started):
                s.image_budget, s.token_budget = inst.governor.budgets
        inst.scheduler.observe(batch, self.now - inst.started)  # long prompts paced, as the engine does
        for req, indices in batch.encodes:
            for k in indices:
                req.images[k].features = _ENCODED
        sampled = []
        for req, n in batch.prefills:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
        for req in batch.decodes:
            req.num_computed_tokens += 1
            sampled.append(req)
        for req in sampled:
            self._token(inst, req)
        for req in [r for r, _ in batch.encodes] + [r for r, _ in batch.prefills]:
            # The engine's rule for where a request goes next (Request.next_stage), as a worker runs it.
            stage = req.next_stage
            if stage is None or stage in inst.roles or req.status == Status.HANDED_OFF:
                continue
            inst.scheduler.remove(req)
            req.status = Status.HANDED_OFF
            if stage == Role.DECODE:
                self.kv_owner[req.request_id] = inst
            self._enqueue(stage, self.now + self.transfer.hop, req)

    def _token(self, inst: _Instance, req: Request) -> None:
        req.output_token_ids.append(0)
        track = self.tracks[req.request_id]
        if track.first_token is None:
            track.first_token = self.now
        else:
            track.gaps.append(self.now - track.last_token)
        track.last_token = self.now
        if len(req.output_token_ids) >= track.output_tokens:
            req.status = Status.FINISHED
            track.done = self.now
            inst.scheduler.remove(req)
            inst.blocks.free(req.request_id)
            self._release_kv(req.request_id)

    # -- results -----------------------------------------------------------------------------------

    def _result(self, complete: bool) -> SimResult:
        c = self.correction
        tracks = list(self.tracks.values())  # in trace order; one stopped early before its token misses
        ttft = [(t.first_token - t.arrival) * c.ttft if t.first_token is not None else None for t in tracks]
        tbt = [_scaled(request_tbt(t.gaps), c.tbt) for t in tracks]
        met = [
            t.done is not None and slo_met(f, g, self.slo) for t, f, g in zip(tracks, ttft, tbt, strict=True)
        ]
        gaps = np.concatenate([np.asarray(t.gaps) for t in tracks if t.gaps] or [np.empty(0)]) * c.tbt
        ttft, tbt = np.array([np.nan if f is None else f for f in ttft]), np.array([g or 0.0 for g in tbt])
        span = max(self.now, 1e-9)
        utilisation = {inst.name: min(1.0, inst.busy_time / span) for inst in self.instances}
        sharing = {kind: took / nominal for kind, (took, nominal) in self._stretch.items() if nominal > 0}
        return SimResult(ttft, tbt, gaps, np.array(met, dtype=bool), utilisation, self.now, complete, sharing)


def simulate(
    trace: Sequence,
    deployment: Deployment,
    profiles: ProfileSet,
    slo: SLO,
    *,
    policy: Policy = Policy.STAGE,
    correction: Correction | None = None,
    stop_early: bool = False,
    seed: int = 0,
    governor: bool = True,
) -> SimResult:
    """Replay `trace` (TraceEntry-like: arrival, prompt_tokens, num_images, image_tokens,
    output_tokens) on `deployment`; with `stop_early`, stop once attainment cannot be reached.
    `seed` drives the profile's iteration jitter, if it has any; `governor` False keeps every
    instance's start-up budgets whatever its iterations take (a worker with adapt_budgets off)."""
    sim = Simulation(
        trace,
        deployment,
        profiles,
        slo,
        policy=policy,
        correction=correction,
        stop_early=stop_early,
        seed=seed,
        governor=governor,
    )
    return sim.run()


def _split(total: int, parts: int) -> list[int]:
    """`total` image tokens over `parts` images, as evenly as whole tokens allow."""
    if parts <= 0:
        return []
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
