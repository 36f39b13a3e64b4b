"""The planner's vocabulary: SLOs, a deployment (method + replicas), a plan and its candidates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from common.protocol import Method
from common.roles import InstanceKind, Role

# The instance kinds each method runs, in the order replicas are written (e.g. "2E3P3D").
METHOD_KINDS: dict[str, tuple[InstanceKind, ...]] = {
    "e+p+d": (InstanceKind.E, InstanceKind.P, InstanceKind.D),
    "ep+d": (InstanceKind.EP, InstanceKind.D),
    "ed+p": (InstanceKind.ED, InstanceKind.P),
    "epd": (InstanceKind.EPD,),
}

# Which stages an instance kind runs (a StrEnum key: `KIND_ROLES["ep"]` finds it too).
KIND_ROLES: dict[InstanceKind, frozenset[Role]] = {kind: kind.roles for kind in InstanceKind}


@dataclass(frozen=True)
class Deployment:
    """A method and how many instances of each of its kinds, e.g. e+p+d with {"e": 2, "p": 3, "d": 3}."""

    method: Method
    replicas: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, method: Method, **replicas: int) -> Deployment:
        kinds = METHOD_KINDS[method]
        if set(replicas) != set(kinds):
            raise ValueError(f"{method} needs replicas for {kinds}, got {sorted(replicas)}")
        if any(n < 1 for n in replicas.values()):
            raise ValueError("every kind of a method needs at least one instance")
        return cls(method, tuple((k, replicas[k]) for k in kinds))

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.replicas)

    @property
    def instances(self) -> int:
        return sum(n for _, n in self.replicas)

    @property
    def label(self) -> str:
        """Short form, e.g. `2E3P3D`, `5EP3D`, `4EPD`."""
        return "".join(f"{n}{k.upper()}" for k, n in self.replicas)

    def to_dict(self) -> dict:
        return {"method": self.method, "replicas": self.counts, "label": self.label}


@dataclass
class CandidateScore:
    """One deployment's simulated result: the highest rate with attainment ≥ the SLO's share.

    A pruned candidate was not simulated: its throughput `bound` was already below the best goodput
    found, so its goodput (≤ bound) could not win; `goodput` and `attainment` are then None."""

    deployment: Deployment
    goodput: float | None  # requests/s
    attainment: float | None  # at that rate
    ttft_p90: float | None = None
    tbt_p90: float | None = None
    bound: float | None = None  # requests/s no run of this deployment can sustain beyond
    pruned: bool = False

    def to_dict(self) -> dict:
        return {**self.deployment.to_dict(), **{k: v for k, v in asdict(self).items() if k != "deployment"}}


@dataclass
class PlanResult:
    """The chosen deployment, its predicted goodput, every candidate's score and what went in."""

    deployment: Deployment
    goodput: float
    attainment: float
    candidates: list[CandidateScore]
    inputs: dict = field(default_factory=dict)

    @property
    def runner_up(self) -> CandidateScore | None:
        """The best simulated candidate other than the pick: how close the choice was."""
        others = [c for c in self.candidates if not c.pruned and c.deployment != self.deployment]
        return max(others, key=lambda c: c.goodput or 0.0, default=None)

    @property
    def margin(self) -> float | None:
        """How much more the pick is predicted to serve than the runner-up, as a share of the pick's
        goodput (0: a tie; None: no runner-up was simulated)."""
        runner = self.runner_up
        if runner is None or not self.goodput:
            return None
        return (self.goodput - (runner.goodput or 0.0)) / self.goodput

    def to_dict(self) -> dict:
        runner = self.runner_up
        return {
            "method": self.deployment.method,
            "replicas": self.deployment.counts,
            "label": self.deployment.label,
            "goodput": self.goodput,
            "attainment": self.attainment,
            "runner_up": None if runner is None else {**runner.to_dict(), "margin": self.margin},
            "candidates": [c.to_dict() for c in self.candidates],
            "inputs": self.inputs,
        }
