"""The body of POST /plan/jobs, checked field by field so a bad one gets a 400 naming it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.planner.trace import TraceEntry
from common.planner.workloads import SHAPES

MAX_REQUESTS = 100_000  # a what-if trace, inline or generated


class TraceEntryIn(BaseModel):
    """One request of an inline trace: the fields of a trace file's line (docs/workloads.md)."""

    model_config = ConfigDict(extra="ignore")

    arrival: float = Field(ge=0, allow_inf_nan=False)
    prompt_tokens: int = Field(ge=0)
    num_images: int = Field(0, ge=0)
    image_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(ge=0)
    image_sizes: list[tuple[int, int]] = []
    request_id: str = ""
    dataset: str = ""
    encoded_images: int = Field(0, ge=0)  # images needing no encoder run (features stored)
    cached_tokens: int = Field(0, ge=0)  # prompt tokens found in a prefix cache


class WorkloadIn(BaseModel):
    """A generated trace (common.planner.workloads.generate)."""

    model_config = ConfigDict(extra="forbid")

    shape: str
    rate: float = Field(gt=0, allow_inf_nan=False)
    num_requests: int = Field(200, ge=2, le=MAX_REQUESTS)
    seed: int = 0
    arrival: Literal["poisson", "gamma"] = "poisson"

    @field_validator("shape")
    @classmethod
    def _known_shape(cls, shape: str) -> str:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        return shape


class SLOIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft: float = Field(gt=0, allow_inf_nan=False)
    tbt: float = Field(gt=0, allow_inf_nan=False)
    attainment: float = Field(0.9, gt=0, le=1)


class JobRequest(BaseModel):
    """Exactly one of `trace` and `workload`; `profiles` is "cluster", "paper:<model>" or a ProfileSet
    object (the JSON `trident plan --profile` reads)."""

    model_config = ConfigDict(extra="forbid")

    trace: list[TraceEntryIn] | None = Field(None, min_length=2, max_length=MAX_REQUESTS)
    workload: WorkloadIn | None = None
    slo: SLOIn
    instances: int = Field(ge=3, le=256)  # Algorithm 2 splits N over the three stages; with rate, the most
    rate: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)  # req/s: find the fewest instances
    profiles: str | dict[str, Any] = "cluster"
    exhaustive: bool | None = None

    def entries(self) -> list[TraceEntry] | None:
        """The inline trace as TraceEntry; ValueError names the entry that is inconsistent."""
        if self.trace is None:
            return None
        entries = []
        for i, item in enumerate(self.trace):
            try:
                entries.append(TraceEntry(**item.model_dump()))
            except ValueError as exc:
                raise ValueError(f"trace[{i}]: {exc}") from None
        return entries

    def payload(self, entries: list[TraceEntry] | None, profiles: str | dict[str, Any]) -> dict[str, Any]:
        """What the Celery task gets: JSON only, nothing left to resolve."""
        return {
            "trace": [dataclasses.asdict(e) for e in entries] if entries is not None else None,
            "workload": self.workload.model_dump() if self.workload is not None else None,
            "slo": self.slo.model_dump(),
            "instances": self.instances,
            "rate": self.rate,
            "profiles": profiles,
            "exhaustive": self.exhaustive,
        }
