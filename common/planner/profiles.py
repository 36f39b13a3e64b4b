"""Latency models the simulator runs on: the curves instances measured (or curves derived from the
papers' GPU figures), interpolated, plus memory and transfer costs.

A `StageCurves` holds one hardware + model's latency as a function of batch shape. Budgets are not
stored with it but derived for each instance kind and SLO with the engine's own binary search
(`common.engine.budgets.search_budget`), so a what-if plan for other SLOs gets the budgets the
instances would pick at start-up.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from common.engine.budgets import budget_target, latency_limit, search_budget
from common.planner.types import KIND_ROLES
from common.roles import InstanceKind, Role, StepKind
from common.stats import SLO


class ProfileError(ValueError):
    """A profile that cannot drive the simulator (missing curves, unreadable file)."""


def fit_nonnegative(columns: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[float, ...]:
    """Least squares in relative error with every coefficient ≥ 0: each subset of the columns is
    fitted and the best one whose coefficients are all non-negative wins (a handful of columns).

    Relative error, because a profile spans batches whose latencies differ by 100×, and the small
    ones are what an unloaded request sees."""
    x = np.asarray(columns, float).T
    target = np.asarray(y, float)
    weight = 1.0 / np.maximum(target, 1e-9)
    best, best_err = np.zeros(x.shape[1]), np.inf
    for k in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(range(x.shape[1]), k):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(x[:, cols] * weight[:, None], target * weight, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum(((x[:, cols] @ coef - target) * weight) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[cols] = coef
    return tuple(float(c) for c in best)


@dataclass(frozen=True)
class TransferModel:
    """What moving a request between services costs besides compute.

    - `dispatch` (+ `dispatch_per_image` per image): arrival to the first task queued plus first
      token to the client (the gateway's processing and the output's way back), on every TTFT;
    - `hop`: a task published until an idle instance has pulled it (the broker hop);
    - `latency` + bytes / `bandwidth`: pulling features (E→P) or KV (P→D) once pulled;
    - `step_gap`: between two of an instance's steps, time its engine does not step and that
      holds no core (the worker publishing tokens, waiting on its event loop, the broker, the
      GIL): every token's gap holds it, the cores are free meanwhile;
    - `host_cpu`: CPU seconds each request costs on the cores the instances share, outside them
      (the gateway, the broker, the store; common/planner/host_cpu.py): at a rate of r req/s,
      r × host_cpu of those cores are not the instances'.
    """

    latency: float = 2e-3  # s
    bandwidth: float = 1e9  # bytes/s
    hop: float = 1e-3  # s
    dispatch: float = 0.0  # s
    dispatch_per_image: float = 0.0  # s: fetching, decoding, preprocessing and hashing an image
    step_gap: float = 0.0  # s
    host_cpu: float = 0.0  # CPU s per request

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class StageCurves:
    """Measured latency (seconds) of one engine iteration by its shape, and per-instance memory."""

    encode: tuple[tuple[int, float], ...]  # (images, s)
    prefill: tuple[tuple[int, float], ...]  # (tokens, s)
    decode: tuple[tuple[int, int, float], ...]  # (batch, context, s)
    num_kv_blocks: int
    block_size: int = 16
    kv_bytes_per_token: int = 0
    feature_bytes_per_image_token: int = 0
    max_num_seqs: int = 256
    max_images: int = 32  # the budget searches' upper bounds
    max_tokens: int = 8192
    # Tokens of the image the encode curve was measured with; an image of k times as many tokens
    # (LLaVA-NeXT's tiles) costs k of them. 0: every image costs one.
    tokens_per_image: int = 0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ProfileError("a profile needs prefill and decode curves")
        if self.num_kv_blocks <= 0:
            raise ProfileError("a profile needs the number of KV blocks an instance holds")

    # -- one iteration ---------------------------------------------------------------------------
    # Measured points are noisy (a profile is taken while other processes start), so each stage is a
    # least-squares fit of the shape its cost has, not an interpolation through every point:
    #   encode(n)     = a + b·n                 (weights once, then per image)
    #   prefill(t)    = a + b·t + c·t²          (weights once, per token, attention over the prompt)
    #   decode(n, c)  = a + b·n + d·n·c         (weights once, per sequence, KV read per context token)
    # except that a decode step's cost at the batch sizes measured is taken as measured (less its
    # context part): on a CPU the matrix kernels change path with the batch (small-llava, one
    # thread: batch 1 31 ms, 2 52 ms, 3 66 ms, 4 47 ms), so a line through them is off by up to
    # 1.5× exactly where an unloaded decoder runs. Between measured sizes it is interpolated,
    # past the largest extended by the fitted b.

    @cached_property
    def _encode_fit(self) -> tuple[float, ...]:
        if not self.encode:
            return ()
        return fit_nonnegative(
            [[1.0] * len(self.encode), [n for n, _ in self.encode]], [s for _, s in self.encode]
        )

    @cached_property
    def _prefill_fit(self) -> tuple[float, ...]:
        tokens = [t for t, _ in self.prefill]
        return fit_nonnegative(
            [[1.0] * len(tokens), tokens, [t * t for t in tokens]], [s for _, s in self.prefill]
        )

    @cached_property
    def _decode_fit(self) -> tuple[float, ...]:
        rows = self.decode
        columns = [[1.0] * len(rows), [b for b, _, _ in rows], [b * c for b, c, _ in rows]]
        return fit_nonnegative(columns, [s for _, _, s in rows])

    @cached_property
    def _decode_base(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch sizes measured, a step's cost at each less its context part): the least over
        the contexts measured, which the fitted context term brings to one another. The least, as
        for a point's repeats (profiler `_time`): other work on the host can only add time, and
        one point of a batch size timed beside another worker's profiling is 1.5× its neighbours
        (small-llava, E+P+D's decoder: 50 ms for one sequence at context 64, 32 ms at 256)."""
        d = self._decode_fit[2]
        by_batch: dict[int, list[float]] = {}
        for n, c, s in self.decode:
            by_batch.setdefault(n, []).append(s - d * n * c)
        sizes = sorted(by_batch)
        return np.array(sizes, float), np.array([max(0.0, min(by_batch[n])) for n in sizes])

    def encode_time(self, images: float) -> float:
        if images <= 0:
            return 0.0
        if not self.encode:
            raise ProfileError("this profile has no encode curve")
        a, b = self._encode_fit
        return a + b * images

    def prefill_time(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        a, b, c = self._prefill_fit
        return a + b * tokens + c * tokens * tokens

    def decode_time(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        _, b, d = self._decode_fit
        sizes, base = self._decode_base
        if batch > sizes[-1]:
            step = base[-1] + b * (batch - sizes[-1])
        else:
            step = float(np.interp(batch, sizes, base))
        return step + d * batch * context

    def image_units(self, image_tokens: float, images: float) -> float:
        """What `images` images of `image_tokens` tokens in all cost the vision tower, in profiled images."""
        return image_tokens / self.tokens_per_image if self.tokens_per_image else images

    def iteration_time(self, images: float, prefill_tokens: int, decodes: int, context: float) -> float:
        """One engine iteration. The vision tower and the LLM run one after the other (CPU; the
        conservative bound on GPU). A mixed LLM batch costs a prefill over all its tokens plus the
        context-dependent part of the decodes' attention."""
        llm = 0.0
        if prefill_tokens:
            llm = self.prefill_time(prefill_tokens + decodes) + self._decode_fit[2] * decodes * context
        elif decodes:
            llm = self.decode_time(decodes, context)
        return self.encode_time(images) + llm

    # -- budgets (000 Algorithm 1 line 5, Algorithm 2 lines 6-8) ---------------------------------

    def budgets(self, roles: frozenset[Role], slo: SLO, context: float | None = None) -> tuple[int, int]:
        """(τe, τt) an instance with `roles` finds at start-up for `slo`: the largest batches whose
        iteration stays under the share of its latency limit that budgets are sized to (the
        engine's own search). On an instance that decodes, τt also keeps a step of τt decodes at
        `context` tokens under it: a decode batch reads every context token's KV, which a prefill
        of the same size does not."""
        engine_roles = frozenset(roles)
        limit = budget_target(latency_limit(engine_roles, slo.ttft, slo.tbt))
        image_budget = token_budget = 1
        if Role.ENCODE in engine_roles and self.encode:
            image_budget = search_budget(self.encode_time, limit, self.max_images)
        if engine_roles & {Role.PREFILL, Role.DECODE}:
            cap = min(self.max_tokens, self.num_kv_blocks * self.block_size)
            token_budget = search_budget(self.prefill_time, limit, cap)
            if Role.DECODE in engine_roles and context:
                by_decode = search_budget(lambda b: self.decode_time(b, context), limit, cap)
                token_budget = min(token_budget, by_decode)
        return image_budget, token_budget

    def scaled(self, encode: float = 1.0, prefill: float = 1.0, decode: float = 1.0) -> StageCurves:
        """The same curves with each stage's latencies multiplied (see calibrate.stage_factors)."""
        return dataclasses.replace(
            self,
            encode=tuple((n, s * encode) for n, s in self.encode),
            prefill=tuple((t, s * prefill) for t, s in self.prefill),
            decode=tuple((b, c, s * decode) for b, c, s in self.decode),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> StageCurves:
        try:
            return cls(
                encode=tuple((int(n), float(s)) for n, s in raw.get("encode", ())),
                prefill=tuple((int(n), float(s)) for n, s in raw["prefill"]),
                decode=tuple((int(b), int(c), float(s)) for b, c, s in raw["decode"]),
                **{k: int(raw[k]) for k in _INT_FIELDS if k in raw},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed stage curves: {exc!r}") from exc


_INT_FIELDS = (
    "num_kv_blocks", "block_size", "kv_bytes_per_token", "feature_bytes_per_image_token", "max_num_seqs",
    "max_images", "max_tokens", "tokens_per_image",
)  # fmt: skip


@dataclass(frozen=True)
class ProfileSet:
    """The curves of every instance kind a plan may use, and how hand-offs cost.

    Curves are per stage, not per kind: on the same hardware a P instance's prefill is an EP
    instance's prefill. `by_kind` may override them for a kind whose instances measured their own.
    """

    curves: StageCurves
    transfer: TransferModel = TransferModel()
    by_kind: dict[str, StageCurves] = field(default_factory=dict)
    source: str = ""
    # Spread of one iteration's time around the curve: σ of a mean-preserving log-normal factor
    # (0: every iteration takes exactly what the curve says).
    jitter: float = 0.0
    # Instances sharing one host's CPU cores (a CPU deployment on one machine): while more
    # iterations run than there are cores, each runs that much slower, for as long as that lasts
    # (processor sharing). 0: every instance has its own device (GPUs).
    host_cores: int = 0
    # On shared cores, the torch threads the curves were measured with (0: not recorded), and by
    # step kind (Batch.kind) how a step's time falls with more of them: time ∝ threads^-exponent
    # (absent or 0: not at all; 1: in proportion). A worker that encodes or prefills takes the
    # cores the others leave idle (the core board, services/worker/cores.py).
    threads: int = 0
    thread_exponent: dict[str, float] = field(default_factory=dict)
    # On shared cores, by step kind (Batch.kind): how much each other instance's step running
    # beside one slows it, as e^λ, where it has cores of its own too (caches, memory bandwidth).
    interference: dict[str, float] = field(default_factory=dict)

    def for_kind(self, kind: str) -> StageCurves:
        if kind not in KIND_ROLES:
            raise ProfileError(f"unknown instance kind {kind!r}")
        return self.by_kind.get(kind, self.curves)

    # -- from the running system -----------------------------------------------------------------

    @classmethod
    def from_records(cls, records: Sequence, transfer: TransferModel | None = None) -> ProfileSet:
        """From the StageProfile records instances publish in Redis. The shared curves take the
        vision curve from a record that has one and the LLM curves from one that has them (an
        encoder holds no LLM, a prefill instance no vision tower); each role set's own record
        becomes that kind's, its gaps filled from the shared ones. A record's budgets cap the
        simulated ones: an instance never searched beyond its configured caps."""
        vision = [r for r in records if r.encode]
        llm = [r for r in records if r.prefill and r.decode]
        if not llm:
            raise ProfileError("no published profile has prefill and decode curves (is an LLM instance up?)")
        enc = max(vision, key=_most_roles) if vision else None
        lm = max(llm, key=_most_roles)
        base = _record_curves(lm, enc, image_cap=max((r.image_budget for r in vision), default=0))
        by_kind: dict[str, StageCurves] = {}
        for record in records:
            kind = InstanceKind.of(record.roles)
            if kind is None:
                continue
            own_llm = record if record.prefill and record.decode else lm
            own_vision = record if record.encode else enc
            by_kind[kind] = _record_curves(own_llm, own_vision, image_cap=record.image_budget)
        source = ", ".join(sorted({r.profile_id for r in records}))
        threads = int(getattr(lm, "threads", 0) or 0)
        return cls(base, transfer or TransferModel(), by_kind, f"cluster: {source}", threads=threads)

    # -- files -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": "trident-profiles",
            "version": 1,
            "source": self.source,
            "transfer": asdict(self.transfer),
            "jitter": self.jitter,
            "host_cores": self.host_cores,
            "threads": self.threads,
            "thread_exponent": self.thread_exponent,
            "interference": self.interference,
            "curves": self.curves.to_dict(),
            "by_kind": {k: v.to_dict() for k, v in self.by_kind.items()},
        }

    @classmethod
    def from_dict(cls, raw: dict) -> ProfileSet:
        if not isinstance(raw, dict) or "curves" not in raw:
            raise ProfileError("a profile file is a JSON object with `curves` (see docs/planner.md)")
        transfer = TransferModel(**raw.get("transfer", {}))
        by_kind = {k: StageCurves.from_dict(v) for k, v in raw.get("by_kind", {}).items()}
        unknown = set(by_kind) - set(KIND_ROLES)
        if unknown:
            raise ProfileError(f"unknown instance kinds in by_kind: {sorted(unknown)}")
        curves = StageCurves.from_dict(raw["curves"])
        return cls(
            curves,
            transfer,
            by_kind,
            raw.get("source", ""),
            float(raw.get("jitter", 0.0)),
            int(raw.get("host_cores", 0)),
            int(raw.get("threads", 0)),
            _by_kind(raw.get("thread_exponent")),
            _by_kind(raw.get("interference")),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ProfileSet:
        """A JSON file written by `save` (`paper_profiles.profiles_from` also reads `paper:<model>`)."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile file {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path} is not JSON: {exc}") from exc
        return cls.from_dict(raw)


def _by_kind(raw) -> dict[str, float]:
    """A value by step kind; a bare number is the same for every kind."""
    if isinstance(raw, int | float):
        return dict.fromkeys(StepKind, float(raw)) if raw else {}
    return {str(k): float(v) for k, v in (raw or {}).items()}


def _most_roles(record) -> tuple[int, str]:
    """Prefer the record of the instance with the most stages (then the id, for a stable choice)."""
    return len(record.roles), record.profile_id


def _record_curves(llm, vision, image_cap: int = 0) -> StageCurves:
    """StageCurves from protocol StageProfile records: LLM curves and sizes from `llm`, the vision
    curve from `vision` (None: none); budgets found become the search caps."""
    sizes = {k: int(getattr(llm, k)) for k in _INT_FIELDS if getattr(llm, k, None)}
    if vision is not None and getattr(vision, "tokens_per_image", 0):  # what the encode curve's image was
        sizes["tokens_per_image"] = int(vision.tokens_per_image)
    sizes.setdefault("num_kv_blocks", 1)
    if llm.token_budget:
        sizes["max_tokens"] = llm.token_budget
    if image_cap:
        sizes["max_images"] = image_cap
    return StageCurves(
        encode=tuple(vision.encode) if vision is not None else (),
        prefill=tuple(llm.prefill),
        decode=tuple(llm.decode),
        **sizes,
    )


def scale_profiles(
    profiles: ProfileSet,
    factors: dict[str, float],
    transfer: TransferModel | None = None,
    jitter: float | None = None,
    thread_exponent: dict[str, float] | None = None,
    interference: dict[str, float] | None = None,
) -> ProfileSet:
    """Every kind's curves scaled by per-stage factors; optionally a new transfer model, jitter,
    thread exponent and interference."""
    return ProfileSet(
        profiles.curves.scaled(**factors),
        transfer or profiles.transfer,
        {k: v.scaled(**factors) for k, v in profiles.by_kind.items()},
        profiles.source,
        profiles.jitter if jitter is None else jitter,
        profiles.host_cores,
        profiles.threads,
        profiles.thread_exponent if thread_exponent is None else thread_exponent,
        profiles.interference if interference is None else interference,
    )
