"""Where a verdict goes once the guard has judged it: the MLflow tracker, the registry, the board and
the progress display.

The session hands every measured record to each sink as one :class:`Judged`; a sink keeps what
concerns it (the board and the progress line only candidates; tracking and the registry baselines
too). Tracking and registry trouble is logged, never raised into the search: a session whose MLflow
store misbehaves still searches, and its state log stays the source of truth.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from kernelarc.board import Board, Conditions
from kernelarc.models import Candidate, Finding, Status, Verdict
from kernelarc.plateau import PlateauEvent
from kernelarc.state import Record
from kernelarc.tasks.loader import Task
from kernelarc.ui import Progress

log = logging.getLogger(__name__)


@dataclass
class Judged:
    """One measured record as the sinks see it, with the session's standing right after it."""

    record: Record
    lessons: list[str] = field(default_factory=list)  # conclusions for the board, the agent's own first
    evaluated: int = 0  # candidates evaluated so far (the progress index and the metrics' step)
    budget: int = 0  # budget.candidates
    champion_ms: float | None = None  # the champion's latency after this verdict
    extra: dict[str, Any] = field(default_factory=dict)  # the child run's extra metrics (index, LLM cost share)
    wall: tuple[float | None, float | None] = (None, None)  # the evaluation's wall start and end
    usd: float = 0.0
    tokens: dict[str, float] = field(default_factory=dict)  # LLM token counters of the session


@dataclass(frozen=True)
class TrackingSpec:
    """What the tracker needs, resolved from ``tracking.*`` and the composed config by the wiring."""

    uri: str | None
    run_name: str
    params: dict[str, Any]  # the whole composed config: the parent run's params
    register: bool  # tracking.register: every champion becomes a registry version


class TrackerSink:
    """The session's MLflow parent run and one child run per measured record."""

    def __init__(self, spec: TrackingSpec, task: Task, gpu: str):
        self.spec = spec
        self.task = task
        self.gpu = gpu
        self.tracker: Any = None  # kernelarc.tracking.Tracker once opened

    @property
    def parent_run_id(self) -> str | None:
        return self.tracker.parent_run_id if self.tracker is not None else None

    def open(self, resume_run_id: str | None) -> str:
        from kernelarc.tracking import Tracker

        self.tracker = Tracker(self.spec.uri, self.task.name, self.gpu)
        return self.tracker.start_session(self.spec.params, run_name=self.spec.run_name, resume_run_id=resume_run_id)

    def verdict(self, j: Judged) -> None:
        if self.tracker is None:
            return
        rec = j.record
        try:
            rec.run_id = self.tracker.log_candidate(rec.candidate, rec.verdict, j.extra, *j.wall)
        except Exception as e:  # noqa: BLE001 - tracking trouble must not kill the search
            log.warning("MLflow logging failed for %s: %s", rec.candidate.id, e)
        if rec.kind == "candidate" and j.champion_ms:
            tokens = {f"llm_{k}": v for k, v in j.tokens.items() if k != "usd"}
            self.metrics(j.evaluated, best_latency_ms=j.champion_ms, evaluated=j.evaluated, usd=j.usd, **tokens)

    def metrics(self, step: int, **values: float) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log_session_metrics(step, **values)
        except Exception as e:  # noqa: BLE001
            log.debug("session metric failed: %s", e)

    def plateau(self, event: PlateauEvent, fired: int) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log_session_metrics(event.at_candidate, plateau=1.0)
            self.tracker.client.set_tag(self.tracker.parent_run_id, f"kernelarc.plateau.{fired}",
                                        json.dumps(event.to_dict()))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            log.debug("plateau tag failed: %s", e)

    def best_so_far(self, records: list[Record], champions: list[tuple[int, float]]) -> None:
        if self.tracker is None or not champions:
            return
        try:
            every = [(r.index, r.verdict.latency_ms) for r in records if r.kind == "candidate"
                     and r.verdict.correct and r.verdict.latency_ms]  # fmt: skip
            self.tracker.log_best_so_far_plot(every, champions=champions)
        except Exception as e:  # noqa: BLE001
            log.warning("best-so-far plot failed: %s", e)

    def close(self, status: str, summary: dict[str, Any], reason: str | None = None) -> None:
        """Close the parent run (FINISHED or FAILED); a failure's reason is a tag of its own."""
        if self.tracker is None or self.tracker.parent_run_id is None:
            return
        try:
            if reason:
                self.tracker.client.set_tag(self.tracker.parent_run_id, "kernelarc.failure_reason", reason[:4000])
            elif status == "FINISHED":  # a session that failed once and finished when run again (more memory)
                with contextlib.suppress(Exception):
                    self.tracker.client.delete_tag(self.tracker.parent_run_id, "kernelarc.failure_reason")
            self.tracker.end_session(status, {k: v for k, v in summary.items() if not isinstance(v, dict)})
        except Exception as e:  # noqa: BLE001 - tracking trouble must not hide the outcome
            log.warning("closing the MLflow run failed: %s", e)


class RegistrySink:
    """The MLflow model registry: a version for every champion, the ``champion`` alias at the end."""

    def __init__(self, tracking: TrackerSink, task: Task, gpu: str, device: str):
        self.tracking = tracking
        self.task = task
        self.gpu = gpu
        self.device = device
        self.registry: Any = None  # kernelarc.registry.Registry once opened

    def open(self) -> None:
        from kernelarc.registry import Registry

        self.registry = Registry(self.tracking.tracker, self.task.name, self.gpu, problem=self.task)

    def _register(self, rec: Record) -> int:
        from kernelarc.registry import collect_versions_info

        info = collect_versions_info(self.gpu, device=self.device)
        return self.registry.register(rec.candidate, rec.verdict, rec.run_id, info)

    def verdict(self, j: Judged) -> None:
        rec = j.record
        if self.registry is None or rec.verdict.status is not Status.champion or not rec.run_id:
            return
        try:
            rec.version = self._register(rec)
        except Exception as e:  # noqa: BLE001
            log.warning("registering %s failed: %s", rec.candidate.id, e)

    def champion(self) -> tuple[int, Candidate, dict[str, str]] | None:
        """The registry's champion from earlier sessions (None when there is none or it cannot be read)."""
        if self.registry is None:
            return None
        try:
            return self.registry.champion()
        except Exception as e:  # noqa: BLE001
            log.warning("could not read the registry champion: %s", e)
            return None

    def promote(self, version: int, beat: bool) -> bool:
        return self.registry.promote(version, beat)

    def version_of(self, cid: str, records: list[Record]) -> int | None:
        """The champion's registry version when the state folder does not have it (a kill between
        its record and its registration): the version registered for it before, or a new one from
        its MLflow child run (logged now if the kill came before that too)."""
        tracker = self.tracking.tracker
        try:
            version = self.registry.version_for(cid)
            if version is None:
                rec = next((r for r in reversed(records) if r.candidate.id == cid and r.verdict.correct), None)
                if rec is None:
                    return None
                run_id = rec.run_id
                if run_id is None and tracker is not None:
                    run_id = tracker.find_candidate_runs().get(cid)
                if run_id is None and tracker is not None:
                    run_id = tracker.log_candidate(rec.candidate, rec.verdict, {"index": rec.index})
                if run_id is None:
                    return None
                from kernelarc.registry import collect_versions_info

                info = collect_versions_info(self.gpu, device=self.device)
                version = self.registry.register(rec.candidate, rec.verdict, run_id, info)
        except Exception as e:  # noqa: BLE001 - without a version the alias stays where it is
            log.warning("could not find or register the champion's version: %s", e)
            return None
        return version


class BoardSink:
    """Findings on the shared board: what worked or failed, against which champion, and why."""

    def __init__(self, board: Board, task: Task, workloads: list[int]):
        self.board = board
        self.task = task
        self.workloads = list(workloads)  # the shapes a finding holds for when its verdict names none

    def verdict(self, j: Judged) -> None:
        if j.record.kind != "candidate":
            return
        for lesson in j.lessons:
            self.post(j.record, lesson)

    def post(self, rec: Record, lesson: str) -> None:
        cand, v = rec.candidate, rec.verdict
        gain = (v.speedup_vs_champion - 1.0) if v.speedup_vs_champion else None
        shapes = [w.axes for w in v.workloads] or [self.task.axes(i) for i in self.workloads]
        cond = Conditions(workloads=shapes, champion_id=rec.champion_id, latency_ms=v.latency_ms)
        self.board.post(finding(cand, v, gain, lesson), conditions=cond, reason=reason_of(v))


def finding(cand: Candidate, v: Verdict, gain: float | None, lesson: str) -> Finding:
    return Finding(agent=cand.agent, strategy=cand.strategy, candidate_id=cand.id, family=cand.family,
                   knobs=cand.knobs, status=v.status, gain=gain, lesson=lesson.splitlines()[0][:200])  # fmt: skip


def reason_of(v: Verdict) -> str:
    """A finding's reason: the gain against the champion, or the first line of what went wrong."""
    if v.correct:
        return f"{v.speedup_vs_champion:.3f}x the champion" if v.speedup_vs_champion else "first correct kernel"
    first = next((ln.strip() for e in v.errors for ln in e.splitlines() if ln.strip()), "")
    return f"{v.status.value}: {first[:160]}"


class ProgressSink:
    """One line (or a live bar) per candidate."""

    def __init__(self, ui: Progress):
        self.ui = ui

    def verdict(self, j: Judged) -> None:
        if j.record.kind == "candidate":
            self.ui.candidate(j.evaluated, j.budget, j.record.candidate, j.record.verdict, j.champion_ms)


@dataclass
class Sinks:
    """The session's sinks, in the order a verdict reaches them (the registry needs the tracker's run)."""

    board: BoardSink
    progress: ProgressSink
    tracker: TrackerSink | None = None
    registry: RegistrySink | None = None

    def all(self) -> list[Any]:
        return [s for s in (self.tracker, self.registry, self.board, self.progress) if s is not None]

    def verdict(self, j: Judged) -> None:
        for sink in self.all():
            sink.verdict(j)

    @property
    def parent_run_id(self) -> str | None:
        return self.tracker.parent_run_id if self.tracker is not None else None
