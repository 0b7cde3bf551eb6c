"""Serialized contracts shared by the guard, agents, board, tracker and registry.

Everything that crosses a process or storage boundary is one of these models.
Guard outcomes are values (a Verdict with a Status), never exceptions.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LANGUAGES = ("triton", "cutlass", "pytorch")


class Status(str, Enum):  # noqa: UP042 - str() and format() of a status stay "Status.x" as before
    """Verdict status (DESIGN.md, Guard)."""

    champion = "champion"
    correct_slower = "correct_slower"
    incorrect = "incorrect"
    compile_error = "compile_error"
    runtime_error = "runtime_error"
    timeout = "timeout"
    rejected_hack = "rejected_hack"

    @property
    def correct(self) -> bool:
        return self in (Status.champion, Status.correct_slower)


# The label of a champion (or a dispatch's part) that is a composition substituting no recognised site: the
# reference's own graph under other execution settings (kernelarc.families.composed.graph_level_only). Not a kernel
# KernelArc built, in the suite's count.
GRAPH_LEVEL_ONLY = "graph-level only"


class Candidate(BaseModel):
    """One proposed kernel: a Python source file defining ``run(*inputs)``."""

    model_config = ConfigDict(frozen=True)

    source: str = Field(description="Complete Python module text defining run(*inputs).")
    language: str = Field(description="triton, cutlass or pytorch.")
    agent: str = Field(default="user", description="Name of the agent that proposed it.")
    strategy: str = Field(default="none", description="Strategy the agent works under.")
    family: str | None = Field(default=None, description="Kernel family it was rendered from, if any.")
    knobs: dict[str, Any] = Field(default_factory=dict, description="Knob values of the family point.")
    parent: str | None = Field(default=None, description="Candidate id this one was derived from.")
    rationale: str = Field(default="", description="One line: why the agent proposed it.")

    @property
    def id(self) -> str:
        """Content hash: two candidates with the same source are the same candidate."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


class WorkloadResult(BaseModel):
    """Measurements of one candidate on one workload."""

    index: int = Field(description="Workload index in the task's workload list.")
    uuid: str = ""
    axes: dict[str, int] = Field(default_factory=dict)
    correct: bool = False
    max_abs_err: float | None = None
    rel_err: float | None = Field(default=None, description="||out-ref_hp|| / ||ref_hp|| vs a float64 reference.")
    matched_ratio: float | None = None
    latency_ms: float | None = Field(default=None, description="Median latency over timed iterations.")
    noise: float | None = Field(default=None, description="Relative spread (IQR / median) of the timed iterations.")
    iterations: int = 0
    flops: float | None = None
    bytes: float | None = None
    tflops: float | None = None
    tbps: float | None = None
    t_sol_ms: float | None = None
    sol_bound: str | None = Field(default=None, description="Which ceiling bounds T_SOL: compute or memory.")
    sol_fraction: float | None = Field(default=None, description="T_SOL / latency.")
    baseline_ms: float | None = Field(default=None, description="T_b: the reference timed in the same run.")
    compile_ms: float | None = Field(default=None, description="torch.compile(reference) timed in the same run.")
    speedup_vs_baseline: float | None = None
    speedup_vs_compile: float | None = None
    champion_ms: float | None = Field(
        default=None, description="The champion's median timed interleaved with this candidate in the same worker."
    )
    sol_score: float | None = None
    error: str | None = None


class Verdict(BaseModel):
    """The guard's judgement of one candidate."""

    candidate_id: str
    status: Status
    errors: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    workloads: list[WorkloadResult] = Field(default_factory=list)
    latency_ms: float | None = Field(default=None, description="Geometric mean latency over workloads.")
    noise: float | None = Field(default=None, description="Largest per-workload relative noise.")
    speedup_vs_baseline: float | None = None
    speedup_vs_compile: float | None = None
    speedup_vs_champion: float | None = Field(default=None, description="From the interleaved side-by-side timing.")
    sol_fraction: float | None = None
    sol_score: float | None = None
    tflops: float | None = None
    tbps: float | None = None
    eval_seconds: float | None = None
    phases: dict[str, float] = Field(default_factory=dict, description="Wall seconds per guard phase.")
    workloads_not_run: dict[int, str] = Field(
        default_factory=dict, description="Workloads the guard's memory plan left out, and why (the figures omit them)."
    )

    @property
    def correct(self) -> bool:
        return self.status.correct


class Finding(BaseModel):
    """A conclusion on the board: short, never a transcript."""

    agent: str
    strategy: str
    candidate_id: str
    family: str | None = None
    knobs: dict[str, Any] = Field(default_factory=dict)
    status: Status
    gain: float | None = Field(
        default=None, description="Champion latency / candidate latency - 1 (positive = faster)."
    )
    lesson: str = Field(description="One-line conclusion: what worked or failed, and why.")
    seq: int = 0
