"""The orchestrator: one search session.

N agents propose in rounds; candidates are evaluated by the guard (several in flight per
GPU so compilation overlaps timing; timing itself is serialised per GPU); every verdict
is appended to a state log, tracked in MLflow, posted on the board as a finding and fed
back to its agent; the champion moves only on a side-by-side win; a plateau detector
redirects the team. A session killed at any point and started again with the same
command resumes from its state log: nothing measured is lost or measured twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelarc import dispatch
from kernelarc.agents.base import AgentContext
from kernelarc.board import Board, Conditions
from kernelarc.config import KernelArcConfig
from kernelarc.families import families_for
from kernelarc.guard.judge import Evaluation, Guard, compiled_candidate, reference_candidate
from kernelarc.guard.memory import max_parallel
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Finding, Status, Verdict
from kernelarc.plateau import PlateauDetector, PlateauEvent
from kernelarc.tasks.loader import Task, TaskError, fit_workloads, load_builtin, load_task
from kernelarc.ui import Progress

log = logging.getLogger(__name__)


class SessionFailed(Exception):
    """The session cannot search (the task's reference fails, or cannot be loaded): a recorded
    outcome with its reason, not a bug. ``reason`` is one line a user can act on; ``summary`` is
    the session's closing summary (status ``failed``)."""

    def __init__(self, reason: str, summary: dict[str, Any] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.summary = summary or {}


def reference_problem(task: Task) -> str | None:
    """Why the task's reference cannot be the baseline before anything is measured (it does not
    import, or defines no callable ``run``), or None. Failures while running it are found by the
    guard, per workload."""
    from kernelarc.tasks.inputs import load_module

    try:
        mod = load_module(task.definition.reference, f"reference_{task.name}")
    except BaseException as e:  # noqa: BLE001 - a reference may raise anything at import, SystemExit too
        first = str(e).splitlines()[0][:300] if str(e) else ""
        return f"the task's reference does not import: {type(e).__name__}: {first}"
    if not callable(getattr(mod, "run", None)):
        return "the task's reference defines no top-level run() (SOL-ExecBench's entry point)"
    return None


def load_task_from_config(cfg: KernelArcConfig, on_cpu: bool) -> Task:
    name = cfg.task.name
    cpu = on_cpu if cfg.task.cpu_workloads is None else cfg.task.cpu_workloads
    if name == "sol_execbench":
        if not cfg.task.path:
            raise TaskError("task=sol_execbench needs task.path=DIR (a SOL-ExecBench problem folder)")
        task = load_task(cfg.task.path, cpu=cpu)
    else:
        task = load_builtin(name, cpu=cpu)
    # On the CPU, workloads too big are shrunk within the definition's constraints, with a warning.
    return fit_workloads(task) if on_cpu else task


def guard_config(cfg: KernelArcConfig, task: Task, on_cpu: bool) -> GuardSettings:
    """The session's guard settings: ``guard.*`` with the fields derived from other keys resolved."""
    workloads = cfg.task.workloads
    if on_cpu and workloads is None:
        # On the CPU only workloads that fit run (e.g. SOL-ExecBench problems without a CPU set).
        workloads = [i for i in range(len(task.workloads)) if task.io_bytes(i) <= 64 << 20] or [
            min(range(len(task.workloads)), key=task.io_bytes)
        ]
    return cfg.guard.resolved(on_cpu=on_cpu, prestart=cfg.executor.prestart, workloads=workloads)


def devices_for(target: Any, cfg: KernelArcConfig) -> list[str]:
    from kernelarc import executors

    remote = executors.devices(cfg, target)  # executor=ray: the cluster's GPUs, not this machine's
    if remote is not None:
        return remote
    if getattr(target, "is_cpu", False) or not torch.cuda.is_available():
        return ["cpu"]
    ids = cfg.executor.gpus if cfg.executor.gpus is not None else list(range(torch.cuda.device_count()))
    return [f"cuda:{i}" for i in ids]


@dataclass
class Record:
    index: int  # 0-based count of evaluated candidates; -1 for baselines
    kind: str  # candidate | baseline | incumbent | rematch | final
    candidate: Candidate
    verdict: Verdict
    samples: dict[int, list[float]] = field(default_factory=dict)
    champion_id: str | None = None
    run_id: str | None = None
    version: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index, "kind": self.kind, "candidate": self.candidate.model_dump(),
                "verdict": self.verdict.model_dump(mode="json"),
                "samples": {str(k): v for k, v in self.samples.items()},
                "champion_id": self.champion_id, "run_id": self.run_id, "version": self.version,
            }
        )  # fmt: skip

    @classmethod
    def from_json(cls, line: str) -> Record:
        d = json.loads(line)
        return cls(
            index=d["index"], kind=d["kind"], candidate=Candidate.model_validate(d["candidate"]),
            verdict=Verdict.model_validate(d["verdict"]), samples={int(k): v for k, v in d["samples"].items()},
            champion_id=d.get("champion_id"), run_id=d.get("run_id"), version=d.get("version"),
        )  # fmt: skip


class StateLog:
    """Append-only JSONL of every measurement; the source of truth for resume."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = directory / "evaluations.jsonl"
        self.meta_path = directory / "session.json"
        self._lock = threading.Lock()

    def load(self) -> list[Record]:
        out = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    out.append(Record.from_json(line))
                except (ValueError, KeyError):
                    continue  # torn last line after a kill
        return out

    def append(self, rec: Record) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(rec.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def meta(self) -> dict:
        return json.loads(self.meta_path.read_text()) if self.meta_path.is_file() else {}

    def save_meta(self, meta: dict) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(self.meta_path)


def session_key(cfg: KernelArcConfig, target_name: str) -> str:
    ident = {
        "task": cfg.task.name, "path": cfg.task.path, "workloads": cfg.task.workloads, "gpu": target_name,
        "agents": [cfg.agents.count, cfg.agents.backend, cfg.agents.model], "memory": cfg.memory.limit,
        "strategies": cfg.strategies.names, "seed": cfg.seed, "budget": [cfg.budget.candidates, cfg.budget.minutes],
    }  # fmt: skip
    if cfg.agents.backend == "sweep":  # another sweep is another session (other keys are unchanged)
        sw = cfg.agents.sweep
        ident["sweep"] = [sw.family, sw.grid, sw.points]
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


class SearchSession:
    def __init__(self, cfg: KernelArcConfig, raw_config: dict, target: Any, agents: list, *, progress: Progress,
                 make_guard: Callable[[Task, str], Any] | None = None):  # fmt: skip
        self.cfg = cfg
        self.raw_config = raw_config
        self.target = target
        self.devices = devices_for(target, cfg)
        self.on_cpu = all(d == "cpu" for d in self.devices)  # executor=ray may run several CPU guards
        self.task = load_task_from_config(cfg, self.on_cpu)
        problem = reference_problem(self.task) if make_guard is None else None
        if problem is not None:
            raise SessionFailed(problem, self._record_early_failure(problem))
        if make_guard is not None:
            # a test double of the guard (kernelarc.simguard): the same loop, another measurement
            self.guards = [make_guard(self.task, d) for d in self.devices]
        else:
            gcfg = guard_config(cfg, self.task, self.on_cpu)
            from kernelarc.executors import make_guards

            self.guards = make_guards(cfg, self.task, target, self.devices, gcfg)  # local Guards or Ray actors
        self.agents = agents
        self.ui = progress
        key = session_key(cfg, target.name)
        state_dir = Path(cfg.search.state_dir) / self.task.name / target.name / key
        if not cfg.search.resume and state_dir.is_dir():  # start fresh; the old log stays beside it
            state_dir.rename(state_dir.with_name(f"{key}.{time.strftime('%Y%m%d-%H%M%S')}"))
        self.state = StateLog(state_dir)
        self.board = Board(self.state.dir / "board.jsonl")
        self.plateau = PlateauDetector(cfg.search.plateau_patience,
                                       families={f.name: f.language for f in families_for(self.task)})  # fmt: skip
        self.lock = threading.RLock()
        self.records: list[Record] = []
        self.champion: Candidate | None = None
        self.champion_verdict: Verdict | None = None
        self.backups: list[tuple[Candidate, Verdict]] = []
        self.history: dict[str, list[tuple[Candidate, Verdict]]] = {a.name: [] for a in agents}
        self.seen: set[str] = set()
        self.evaluated = 0
        self.redirect: PlateauEvent | None = None  # the last plateau firing, until its agent has proposed
        self.tokens: dict[str, float] = {}
        self.best_history: list[tuple[int, float]] = []
        self.tracker = None
        self.registry = None
        self.incumbent: tuple[int, Candidate] | None = None
        self.versions: dict[str, int] = {}
        self.pending_conclusions: dict[str, list[str]] = {}
        self.cand_cost: dict[str, dict[str, float]] = {}  # LLM tokens and USD per candidate
        self.busy: dict[str, int] = {}  # agent -> its candidates queued or in flight
        self.t0 = time.monotonic()
        self.elapsed_before = 0.0
        self.eval_seconds = 0.0
        self.eval_wall: dict[str, tuple[float, float]] = {}  # candidate -> its last evaluation's wall start, end
        self.timing_seconds = 0.0
        self.dispatch_tried: set[tuple] = set()  # plans already composed (kernelarc.dispatch)
        self.baseline_notes: dict[str, str] = {}  # baseline -> why it is not a baseline (skipped, failed)
        self._signatures: dict[int, tuple] | None = None

    # -- tracking ------------------------------------------------------------------------
    def _open_tracking(self, resume_run: str | None) -> None:
        if not self.cfg.tracking.enabled:
            return
        from kernelarc.registry import Registry
        from kernelarc.tracking import Tracker

        self.tracker = Tracker(self.cfg.tracking.uri, self.task.name, self.target.name)
        from kernelarc.tracking import session_run_name

        name = session_run_name(self.task.name, self.target.name, self.cfg.agents.count, self.cfg.memory.limit,
                                self.cfg.agents.backend, self.cfg.seed)  # fmt: skip
        run_id = self.tracker.start_session(self.raw_config, run_name=name, resume_run_id=resume_run)
        meta = self.state.meta()
        meta["parent_run_id"] = run_id
        self.state.save_meta(meta)
        if self.cfg.tracking.register:
            self.registry = Registry(self.tracker, self.task.name, self.target.name, problem=self.task)

    def _close_tracking(self, status: str, summary: dict[str, Any], reason: str | None = None) -> None:
        """Close the parent run (FINISHED or FAILED); a failure's reason is a tag of its own."""
        if self.tracker is None or self.tracker.parent_run_id is None:
            return
        try:
            if reason:
                self.tracker.client.set_tag(self.tracker.parent_run_id, "kernelarc.failure_reason", reason[:4000])
            self.tracker.end_session(status, {k: v for k, v in summary.items() if not isinstance(v, dict)})
        except Exception as e:  # noqa: BLE001 - tracking trouble must not hide the outcome
            log.warning("closing the MLflow run failed: %s", e)

    def _failed_summary(self, reason: str) -> dict[str, Any]:
        return {
            "task": self.task.name, "gpu": self.target.name, "status": "failed", "reason": reason,
            "champion": None, "champion_family": None, "champion_agent": None, "latency_ms": None,
            "speedup_vs_baseline": None, "speedup_vs_compile": None, "sol_fraction": None, "sol_score": None,
            "evaluated": getattr(self, "evaluated", 0),
            "mlflow_run_id": self.tracker.parent_run_id if getattr(self, "tracker", None) else None,
            "registry_version": None, "alias_moved": False,
            "state_dir": str(self.state.dir) if getattr(self, "state", None) else None,
        }  # fmt: skip

    def _record_early_failure(self, reason: str) -> dict[str, Any]:
        """A session that fails before its guards exist (the reference does not load) still leaves
        its reason in the state folder and a FAILED MLflow run."""
        self.state = StateLog(Path(self.cfg.search.state_dir) / self.task.name / self.target.name
                              / session_key(self.cfg, self.target.name))  # fmt: skip
        self.tracker = None
        try:
            self._open_tracking(None)
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow tracking unavailable: %s", e)
        summary = self._failed_summary(reason)
        self.state.save_meta({**self.state.meta(), "status": "failed", "reason": reason})
        self._close_tracking("FAILED", summary, reason)
        return summary

    def _time_left_s(self) -> float:
        """Seconds left of budget.minutes; the clock started with the session (baselines, compile
        warm-ups, calibration and autotuning count)."""
        return self.cfg.budget.minutes * 60 - (time.monotonic() - self.t0 + self.elapsed_before)

    def _save_versions(self) -> None:
        """Registry versions go to the state folder as soon as they exist (a resumed session must
        find its champion's version, a baseline's too, to point the alias at it)."""
        if self.versions:
            self.state.save_meta({**self.state.meta(), "versions": self.versions})

    # -- state ---------------------------------------------------------------------------
    def _replay(self, rec: Record) -> None:
        """Apply a record to the in-memory state (used live and on resume)."""
        c, v = rec.candidate, rec.verdict
        self.records.append(rec)
        self.seen.add(c.id)
        if rec.version is not None:
            self.versions[c.id] = rec.version
        if rec.kind == "candidate":
            self.evaluated = max(self.evaluated, rec.index + 1)
            if c.agent in self.history:
                self.history[c.agent].append((c, v))
        if rec.kind == "final":
            return
        if v.status is Status.champion:
            if self.champion is not None and self.champion_verdict is not None:
                self.backups.append((self.champion, self.champion_verdict))
            self.champion, self.champion_verdict = c, v
            if v.latency_ms:
                self.best_history.append((max(self.evaluated, 0), v.latency_ms))
        elif v.status is Status.correct_slower:
            self.backups.append((c, v))
        if rec.kind == "baseline":
            self._apply_baseline(c, Evaluation(v, rec.samples))

    def _apply_baseline(self, cand: Candidate, ev: Evaluation) -> None:
        """Make a measured baseline (the reference or its torch.compile) T_b on every guard."""
        if not ev.verdict.correct:
            return
        is_ref = cand.strategy == "reference"
        for g in self.guards:
            g.set_baselines(ev if is_ref else None, None if is_ref else ev)

    def _track(self, rec: Record) -> None:
        if self.tracker is None:
            return
        try:
            extra = {"index": rec.index, **self.cand_cost.pop(rec.candidate.id, {})}
            started, ended = self.eval_wall.pop(rec.candidate.id, (None, None))  # the run lasts as its evaluation
            rec.run_id = self.tracker.log_candidate(rec.candidate, rec.verdict, extra, started, ended)
        except Exception as e:  # noqa: BLE001 - tracking trouble must not kill the search
            log.warning("MLflow logging failed for %s: %s", rec.candidate.id, e)
        if self.registry is not None and rec.verdict.status is Status.champion and rec.run_id:
            try:
                from kernelarc.registry import collect_versions_info

                info = collect_versions_info(getattr(self.target, "name", None), device=self.devices[0])
                rec.version = self.registry.register(rec.candidate, rec.verdict, rec.run_id, info)
                self.versions[rec.candidate.id] = rec.version
            except Exception as e:  # noqa: BLE001
                log.warning("registering %s failed: %s", rec.candidate.id, e)

    # -- evaluation ----------------------------------------------------------------------
    def _guard_for(self, i: int) -> Guard:
        return self.guards[i % len(self.guards)]

    def _champion_reference(self, champion: Candidate | None) -> dict[int, float] | None:
        if champion is None:
            return None
        rec = next((r for r in reversed(self.records) if r.candidate.id == champion.id and r.verdict.correct), None)
        if rec is None:
            return None
        return {w.index: w.latency_ms for w in rec.verdict.workloads if w.latency_ms}

    def _evaluate(self, cand: Candidate, champion: Candidate | None, trusted: bool, timeout: float | None, i: int):
        t = time.monotonic()
        wall = time.time()
        # The consistency check (the champion side by side must look like the champion alone) guards against a
        # challenger that slows the champion down; a trusted baseline cannot, and on a shared, drifting GPU the
        # check would only keep a much faster torch.compile from being crowned.
        ref = None if trusted else self._champion_reference(champion)
        ev = self._guard_for(i).evaluate(cand, champion, trusted=trusted, timeout_s=timeout, champion_reference=ref)
        dt = time.monotonic() - t
        with self.lock:
            self.eval_wall[cand.id] = (wall, wall + dt)
            self.eval_seconds += dt
            self.timing_seconds += ev.verdict.phases.get("timing", 0.0)
        return ev

    def _baselines(self) -> None:
        done = {(r.kind, r.candidate.strategy) for r in self.records}
        todo = [("reference", reference_candidate(self.task))]
        if self.cfg.guard.compile_baseline:
            todo.append(("torch.compile", compiled_candidate(self.task)))
        g = self.cfg.guard
        for label, cand in todo:
            if ("baseline", label) in done:
                continue
            left = self._time_left_s()
            if label == "reference":
                # Without the reference nothing can be judged: it may overrun the budget by at most
                # one candidate's timeout.
                timeout = min(g.baseline_timeout_s, max(left, 0.0) + g.timeout_s)
            else:
                # torch.compile (and max-autotune) gets at most half the budget left, so that a slow
                # compile leaves the search time to run candidates.
                timeout = min(g.baseline_timeout_s, 0.5 * left)
                if timeout < 1.0:
                    self.baseline_notes[label] = "skipped: no time left in budget.minutes"
                    self.ui.line(f"  {label}: skipped (no time left in budget.minutes={self.cfg.budget.minutes})")
                    continue
            self.ui.line(f"measuring baseline: {label} (at most {timeout:.0f} s) ...")
            try:
                ev = self._evaluate(cand, self.champion, True, timeout, 0)
            except Exception as e:  # noqa: BLE001 - a baseline that cannot be measured is a verdict
                log.exception("baseline %s failed", label)
                ev = Evaluation(Verdict(candidate_id=cand.id, status=Status.runtime_error,
                                        errors=[f"{type(e).__name__}: {e}"]))  # fmt: skip
            rec = Record(-1, "baseline", cand, ev.verdict, ev.samples, self.champion.id if self.champion else None)
            self._apply_baseline(cand, ev)
            if ev.verdict.correct:
                self.guards[0].refresh_metrics(ev)  # its own metrics against the baselines known now
            self.state.append(rec)
            self._replay(rec)
            self._track(rec)
            self._save_versions()
            v = ev.verdict
            self.ui.line(
                f"  {label}: {v.status.value}"
                + (f", {v.latency_ms:.4f} ms" if v.latency_ms else "")
                + (f" ({v.errors[0].splitlines()[0][:100]})" if v.errors else "")
            )
        for r in self.records:
            if r.kind == "baseline" and r.candidate.strategy != "reference" and not r.verdict.correct:
                first = r.verdict.errors[0].splitlines()[0][:200] if r.verdict.errors else ""
                self.baseline_notes[r.candidate.strategy] = f"{r.verdict.status.value}: {first}".rstrip(": ")
        ref = next((r for r in self.records if r.kind == "baseline" and r.candidate.strategy == "reference"), None)
        if ref is None or not ref.verdict.correct:
            why = "; ".join(e.splitlines()[0][:300] for e in ref.verdict.errors) if ref else "not measured"
            status = ref.verdict.status.value if ref else "missing"
            raise SessionFailed(f"the task's reference failed in the guard ({status}): {why}")

    def _calibrate(self) -> None:
        """Measure the GPU's real ceilings; speed of light is computed over them, and both are recorded."""
        if self.on_cpu or not self.cfg.search.calibrate or getattr(self.target, "calibrated", None):
            return
        from kernelarc.hardware import calibrate

        try:
            cal = calibrate(self.target, self.devices[0])
        except Exception as e:  # noqa: BLE001 - datasheet ceilings remain
            log.warning("calibration failed, using datasheet ceilings: %s", e)
            return
        nums = {k: float(v) for k, v in cal.items() if isinstance(v, int | float)}
        self.ui.line("calibrated: " + ", ".join(f"{k}={v:.4g}" for k, v in nums.items()))
        if self.tracker is not None:
            try:
                self.tracker.log_session_metrics(0, **{f"calibration.{k}": v for k, v in nums.items()})
            except Exception as e:  # noqa: BLE001
                log.debug("calibration metrics failed: %s", e)

    def _incumbent(self) -> None:
        """The registry's champion from earlier sessions, re-measured side by side in this run."""
        if self.registry is None:
            return
        try:
            found = self.registry.champion()
        except Exception as e:  # noqa: BLE001
            log.warning("could not read the registry champion: %s", e)
            return
        if not found:
            return
        version, cand, _tags = found
        self.incumbent = (version, cand)
        if any(r.kind == "incumbent" for r in self.records) or cand.id in self.seen:
            return
        self.ui.line(f"re-measuring registry champion v{version} side by side ...")
        ev = self._evaluate(cand, self.champion, True, self.cfg.guard.timeout_s, 0)
        rec = Record(-1, "incumbent", cand, ev.verdict, ev.samples, self.champion.id if self.champion else None,
                     version=version)  # fmt: skip
        self.state.append(rec)
        self._replay(rec)
        self.ui.line(f"  registry champion v{version}: {ev.verdict.status.value}")

    # -- main loop -----------------------------------------------------------------------
    @property
    def usd(self) -> float:
        return self.tokens.get("usd", 0.0)

    def _budget_left(self) -> int:
        return self.cfg.budget.candidates - self.evaluated

    def _out_of_time(self) -> bool:
        mins = (time.monotonic() - self.t0 + self.elapsed_before) / 60
        if mins >= self.cfg.budget.minutes:
            return True
        return self.cfg.budget.usd is not None and self.usd >= self.cfg.budget.usd

    def _context(self, agent) -> AgentContext:
        with self.lock:
            redirect = self.redirect if self.redirect is not None and agent.name in self.redirect.agents else None
            return AgentContext(
                task=self.task,
                target=self.target,
                champion=self.champion,
                champion_verdict=self.champion_verdict,
                findings=self.board.view(self.cfg.memory.limit),
                history=list(self.history.get(agent.name, [])),
                seen=frozenset(self.seen),
                redirect=redirect.instruction if redirect else None,
                plateau=redirect,
                backups=sorted(self.backups, key=lambda cv: cv[1].latency_ms or math.inf)[:8],
                budget_left=self._budget_left(),
            )

    def _propose_round(self, pool: ThreadPoolExecutor) -> list[Candidate]:
        per = self.cfg.agents.per_round
        # An agent proposes again only once its earlier candidates have verdicts, so that every
        # proposal can learn from the agent's own results.
        ready = [a for a in self.agents if self.busy.get(a.name, 0) == 0]
        futs = {pool.submit(a.propose, self._context(a), per): a for a in ready}
        out: list[Candidate] = []
        for fut, agent in futs.items():
            try:
                prop = fut.result()
            except Exception as e:  # noqa: BLE001 - one agent's failure never stops the team
                log.warning("agent %s failed to propose: %s", agent.name, e)
                continue
            for cid, lesson in prop.conclusions:
                self._post_conclusion(agent, cid, lesson)
            for k, v in prop.cost.items():
                self.tokens[k] = self.tokens.get(k, 0.0) + float(v)
            if prop.cost and prop.candidates:
                share = {f"llm.{k}": float(v) / len(prop.candidates) for k, v in prop.cost.items()}
                for c in prop.candidates:
                    self.cand_cost[c.id] = share
            for f in prop.failures:
                self.ui.line(f"  agent {agent.name}: {f[:150]}")
            with self.lock:
                for c in prop.candidates:
                    if c.id not in self.seen:
                        self.seen.add(c.id)
                        self.busy[c.agent] = self.busy.get(c.agent, 0) + 1
                        out.append(c)
        if self.redirect is not None and any(a.name in self.redirect.agents for a in ready):
            self.redirect = None
        return out

    def _post_conclusion(self, agent, cid: str, lesson: str) -> None:
        rec = next((r for r in reversed(self.records) if r.candidate.id == cid), None)
        if rec is None:
            # Its verdict has not arrived yet: post the conclusion when it does.
            self.pending_conclusions.setdefault(cid, []).append(lesson)
            return
        self._post(rec.candidate, rec.verdict, lesson)

    def _post(self, cand: Candidate, v: Verdict, lesson: str) -> None:
        gain = (v.speedup_vs_champion - 1.0) if v.speedup_vs_champion else None
        rec = next((r for r in reversed(self.records) if r.candidate.id == cand.id), None)
        shapes = [w.axes for w in v.workloads] or [self.task.axes(i) for i in self.guards[0].workloads]
        cond = Conditions(workloads=shapes, champion_id=rec.champion_id if rec else None, latency_ms=v.latency_ms)
        if v.correct:
            reason = f"{v.speedup_vs_champion:.3f}x the champion" if v.speedup_vs_champion else "first correct kernel"
        else:
            first = next((ln.strip() for e in v.errors for ln in e.splitlines() if ln.strip()), "")
            reason = f"{v.status.value}: {first[:160]}"
        self.board.post(Finding(agent=cand.agent, strategy=cand.strategy, candidate_id=cand.id, family=cand.family,
                                knobs=cand.knobs, status=v.status, gain=gain, lesson=lesson.splitlines()[0][:200]),
                        conditions=cond, reason=reason)  # fmt: skip

    def _on_verdict(self, cand: Candidate, ev: Evaluation, champion_id: str | None, pending_rematch: list) -> None:
        v = ev.verdict
        with self.lock:
            if v.status is Status.champion and (self.champion.id if self.champion else None) != champion_id:
                # The champion moved while this one was measured: measure again against the new one.
                pending_rematch.append(cand)
                return
            rec = Record(self.evaluated, "candidate", cand, v, ev.samples, champion_id)
            self.state.append(rec)
            self._replay(rec)
            idx = self.evaluated
        self._track(rec)
        if rec.version is not None:
            self.state.save_meta({**self.state.meta(), "versions": self.versions})
        agent = next((a for a in self.agents if a.name == cand.agent), None)
        lesson = agent.observe(cand, v) if agent is not None else None
        if cand.family == dispatch.FAMILY:
            gain = f"{(v.speedup_vs_champion - 1) * 100:+.1f}% vs champion" if v.speedup_vs_champion else v.status.value
            lesson = f"shape dispatch over {len(set(cand.knobs.values()))} kernels: {v.status.value}, {gain}"
        if lesson:
            self._post(cand, v, lesson)
        for pending in self.pending_conclusions.pop(cand.id, []):
            self._post(cand, v, pending)
        with self.lock:
            self.busy[cand.agent] = max(0, self.busy.get(cand.agent, 0) - 1)
        self.ui.candidate(idx, self.cfg.budget.candidates, cand, v,
                          self.champion_verdict.latency_ms if self.champion_verdict else None)  # fmt: skip
        event = self.plateau.update(v.status, idx, tried=self._timed_per_family(),
                                    champion_family=self.champion.family if self.champion else None)  # fmt: skip
        if event is not None:
            self._on_plateau(event)
        if self.tracker is not None and self.champion_verdict is not None and self.champion_verdict.latency_ms:
            try:
                tokens = {f"llm_{k}": v for k, v in self.tokens.items() if k != "usd"}
                self.tracker.log_session_metrics(idx, best_latency_ms=self.champion_verdict.latency_ms,
                                                 evaluated=idx, usd=self.usd, **tokens)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log.debug("session metric failed: %s", e)

    def _timed_per_family(self) -> dict[str, int]:
        """Benchmarked (correct, timed) candidates per kernel family so far."""
        out: dict[str, int] = {}
        with self.lock:
            for r in self.records:
                if r.kind == "candidate" and r.verdict.correct and r.candidate.family:
                    out[r.candidate.family] = out.get(r.candidate.family, 0) + 1
        return out

    def _on_plateau(self, event: PlateauEvent) -> None:
        # One agent per firing (round robin), so a team and a single agent pay alike for it.
        if self.agents:
            event.agents = [self.agents[(self.plateau.fired - 1) % len(self.agents)].name]
        self.redirect = event
        self.ui.line(f"  ⟳ {event.instruction} ({', '.join(event.agents)})")
        log.info("plateau: %s", json.dumps(event.to_dict()))
        with (self.state.dir / "plateau.jsonl").open("a") as f:
            f.write(json.dumps(event.to_dict()) + "\n")
        if self.tracker is not None:
            try:
                self.tracker.log_session_metrics(event.at_candidate, plateau=1.0)
                self.tracker.client.set_tag(self.tracker.parent_run_id, f"kernelarc.plateau.{self.plateau.fired}",
                                            json.dumps(event.to_dict()))  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log.debug("plateau tag failed: %s", e)

    def run(self) -> dict[str, Any]:
        meta = self.state.meta()
        for rec in self.state.load():
            self._replay(rec)
        resumed = bool(self.records)
        self.elapsed_before = float(meta.get("elapsed_s", 0.0)) if resumed else 0.0
        if resumed:
            # versions registered before the kill (records are written before their registration)
            for cid, version in (meta.get("versions") or {}).items():
                self.versions.setdefault(cid, int(version))
            done = " (it had finished)" if meta.get("status") == "finished" else ""
            self.ui.line(f"resumed session {self.state.dir} with {len(self.records)} measurements{done}; "
                         "to start fresh: search.resume=false (the old log is kept) or another seed=N")  # fmt: skip
        try:
            self._open_tracking(meta.get("parent_run_id") if resumed else None)
            self.ui.line(f"task {self.task.name} on {self.target.name} ({', '.join(self.devices)}), "
                         f"{len(self.guards[0].workloads)} workloads, {len(self.agents)} agents")  # fmt: skip
            self._calibrate()
            self._baselines()
            self._incumbent()
            self._search()
            final = self._finalize()
            self.state.save_meta({**self.state.meta(), "status": "finished", "reason": None})
        except SessionFailed as e:
            self.ui.line(f"session failed: {e.reason}")
            e.summary = self._failed_summary(e.reason)
            self.state.save_meta({**self.state.meta(), "status": "failed", "reason": e.reason})
            self._close_tracking("FAILED", e.summary, e.reason)
            raise
        except BaseException as e:
            # Any other exception (a bug, an interrupt) still closes the MLflow run, as FAILED.
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            self._close_tracking("FAILED", self._failed_summary(reason), reason)
            raise
        finally:
            self.state.save_meta({**self.state.meta(), "elapsed_s": time.monotonic() - self.t0 + self.elapsed_before})
            for g in self.guards:
                g.close()
        return final

    def _search(self) -> None:
        # In flight per device: executor.parallel, or fewer where the judge's memory plan says that many workers
        # do not fit beside the reference (its note says so; test doubles and Ray guards have no plan here).
        per = max(1, self.cfg.executor.parallel)
        parallel = sum(max_parallel(g, per) if isinstance(g, Guard) else per for g in self.guards)
        queue: list[Candidate] = []
        rematch: list[Candidate] = []
        inflight: dict[Future, tuple[Candidate, str | None]] = {}
        n_submitted = 0
        with (
            ThreadPoolExecutor(max_workers=parallel) as epool,
            ThreadPoolExecutor(max_workers=max(1, len(self.agents))) as apool,
        ):
            stalls = 0
            said_time = False
            while True:
                out_of_time = self._out_of_time()
                if out_of_time and inflight and not said_time:
                    said_time = True
                    self.ui.line(f"  ⏱ time budget reached; finishing the {len(inflight)} candidate(s) in flight")
                budget_open = self._budget_left() - len(inflight) > 0 and not out_of_time
                while budget_open and len(inflight) < parallel and (queue or rematch):
                    cand = rematch.pop(0) if rematch else queue.pop(0)
                    champ = self.champion
                    fut = epool.submit(self._evaluate, cand, champ, False, None, n_submitted)
                    n_submitted += 1
                    inflight[fut] = (cand, champ.id if champ else None)
                    budget_open = self._budget_left() - len(inflight) > 0
                if budget_open and not queue and len(inflight) < parallel:
                    new = self._propose_round(apool)
                    if not new:
                        stalls += 1
                        if stalls >= 3 and not inflight:
                            self.ui.line("agents have nothing new to propose; stopping")
                            break
                        if not inflight:
                            continue
                    else:
                        stalls = 0
                        queue.extend(new)
                        continue
                if not inflight:
                    break
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED, timeout=5)
                for fut in done:
                    cand, champ_id = inflight.pop(fut)
                    try:
                        ev = fut.result()
                    except Exception as e:  # noqa: BLE001 - the guard returns verdicts; this is a bug guard
                        log.exception("evaluation of %s failed", cand.id)
                        ev = Evaluation(Verdict(candidate_id=cand.id, status=Status.runtime_error, errors=[str(e)]))
                    self._on_verdict(cand, ev, champ_id, rematch)
                pending = [c for c, _ in inflight.values()] + queue + rematch
                if done and not any(c.family == dispatch.FAMILY for c in pending):
                    composite = self._dispatch_candidate()
                    if composite is not None:
                        queue.insert(0, composite)

    def drift_corrected_latencies(self) -> dict[str, dict[int, float]]:
        """Per-workload latency of every correct measurement, on the time base of the session's first
        one (chained interleaved champion ratios: see kernelarc.dispatch.drift_corrected)."""
        with self.lock:
            timed = [(r.candidate, r.verdict, r.champion_id) for r in self.records
                     if r.kind in ("baseline", "candidate", "incumbent") and r.verdict.correct]  # fmt: skip
        return dispatch.drift_corrected(timed)

    def _dispatch_candidate(self) -> Candidate | None:
        """A shape-dispatch composite of the fastest kernel per workload, when one promises a gain
        over the champion and has not been tried (see kernelarc.dispatch)."""
        if not self.cfg.search.dispatch or self._budget_left() <= 0 or self._out_of_time():
            return None
        try:
            if self._signatures is None:
                self._signatures = {i: dispatch.workload_signature(self.task, i) for i in self.guards[0].workloads}
            with self.lock:
                # the baselines are parts too: the library's kernel may stay the route for some shapes
                kinds = ("candidate", "baseline") if self.cfg.search.dispatch_baselines else ("candidate",)
                candidates = [r.candidate for r in self.records if r.kind in kinds and r.verdict.correct]
                judged = [(r.candidate, r.verdict, r.champion_id) for r in self.records if r.kind == "candidate"]
                champ_id = self.champion.id if self.champion else None
            lat = self.drift_corrected_latencies()
            pool = [(c, lat[c.id]) for c in candidates if c.id in lat]
            g = self.cfg.guard
            failed = dispatch.failed_routes(judged, g.min_gain, g.noise_factor)
            champ_lat = lat.get(champ_id or "")
            champ_ms = dispatch.geomean_over(champ_lat, self._signatures) if champ_lat else None
            s = self.cfg.search
            p = dispatch.plan(pool, self._signatures, champ_ms, s.dispatch_min_gain, s.dispatch_route_margin, failed,
                              champion_id=champ_id)  # fmt: skip
            if p is None or p.key in self.dispatch_tried:
                return None
            self.dispatch_tried.add(p.key)
            cand = dispatch.build_candidate(p, {i: self.task.axes(i) for i in self._signatures})
        except Exception as e:  # noqa: BLE001 - a composition that cannot be built is skipped, never fatal
            log.warning("shape dispatch not composed: %s", e)
            self._signatures = self._signatures or {}
            return None
        with self.lock:
            if cand.id in self.seen:
                return None
            self.seen.add(cand.id)
        self.ui.line(f"  ⇉ {cand.rationale}")
        return cand

    def _finalize(self) -> dict[str, Any]:
        version = None
        moved = False
        if self.champion is not None and self.registry is not None:
            version = self.versions.get(self.champion.id)
            if version is None:
                version = self._champion_version()
            inc = self.incumbent
            if inc is not None and inc[1].id == self.champion.id:
                version, moved = inc[0], False
            elif version is not None:
                beat = True
                if inc is not None:
                    # Side by side, in this run, on this GPU: the alias moves only on a win.
                    ev = self._evaluate(self.champion, inc[1], True, self.cfg.guard.timeout_s, 0)
                    beat = ev.verdict.status is Status.champion
                    rec = Record(-1, "final", self.champion, ev.verdict, ev.samples, inc[1].id)
                    self.state.append(rec)
                    why = ev.decision.reason if ev.decision else ev.verdict.status.value
                    self.ui.line(f"final side-by-side vs registry v{inc[0]}: {why}")
                moved = self.registry.promote(version, beat)
        if self.tracker is not None and self.best_history:
            try:
                every = [(r.index, r.verdict.latency_ms) for r in self.records if r.kind == "candidate"
                         and r.verdict.correct and r.verdict.latency_ms]  # fmt: skip
                self.tracker.log_best_so_far_plot(every, champions=self.best_history)
            except Exception as e:  # noqa: BLE001
                log.warning("best-so-far plot failed: %s", e)
        elapsed = time.monotonic() - self.t0 + self.elapsed_before
        rec = next((r for r in reversed(self.records) if self.champion and r.candidate.id == self.champion.id
                    and r.verdict.correct and r.samples), None)  # fmt: skip
        if rec is not None:
            # Baselines measured after this champion was crowned (e.g. torch.compile) complete its metrics.
            self.guards[0].refresh_metrics(Evaluation(rec.verdict, rec.samples))
            self.champion_verdict = rec.verdict
        v = self.champion_verdict
        gpu_min = self.timing_seconds / 60
        summary = {
            "task": self.task.name,
            "gpu": self.target.name,
            "champion": self.champion.id if self.champion else None,
            "champion_family": (self.champion.family or self.champion.strategy) if self.champion else None,
            "champion_agent": self.champion.agent if self.champion else None,
            "latency_ms": v.latency_ms if v else None,
            "tflops": v.tflops if v else None,
            "tbps": v.tbps if v else None,
            "sol_fraction": v.sol_fraction if v else None,
            "speedup_vs_baseline": v.speedup_vs_baseline if v else None,
            "speedup_vs_compile": v.speedup_vs_compile if v else None,
            "evaluated": self.evaluated,
            "by_status": self._by_status(),
            "plateau_events": self.plateau.fired,
            "phase_mean_s": self._phase_means(),
            "elapsed_min": elapsed / 60,
            "candidates_per_min": self.evaluated / (elapsed / 60) if elapsed > 0 else None,
            "gpu_timing_min": gpu_min,
            "usd": self.usd,
            "mlflow_run_id": self.tracker.parent_run_id if self.tracker else None,
            "registry_version": version,
            "alias_moved": moved,
            "state_dir": str(self.state.dir),
            "status": "finished",
            "reason": None,
            "sol_score": v.sol_score if v else None,
            "baseline_notes": dict(self.baseline_notes),
        }
        self._close_tracking("FINISHED", summary)
        return summary

    def _champion_version(self) -> int | None:
        """The champion's registry version when the state folder does not have it (a kill between
        its record and its registration): the version registered for it before, or a new one from
        its MLflow child run (logged now if the kill came before that too)."""
        assert self.champion is not None and self.registry is not None
        cid = self.champion.id
        try:
            version = self.registry.version_for(cid)
            if version is None:
                rec = next((r for r in reversed(self.records) if r.candidate.id == cid and r.verdict.correct), None)
                if rec is None:
                    return None
                run_id = rec.run_id
                if run_id is None and self.tracker is not None:
                    run_id = self.tracker.find_candidate_runs().get(cid)
                if run_id is None and self.tracker is not None:
                    run_id = self.tracker.log_candidate(rec.candidate, rec.verdict, {"index": rec.index})
                if run_id is None:
                    return None
                from kernelarc.registry import collect_versions_info

                info = collect_versions_info(getattr(self.target, "name", None), device=self.devices[0])
                version = self.registry.register(rec.candidate, rec.verdict, run_id, info)
        except Exception as e:  # noqa: BLE001 - without a version the alias stays where it is
            log.warning("could not find or register the champion's version: %s", e)
            return None
        self.versions[cid] = version
        self._save_versions()
        return version

    def _phase_means(self) -> dict[str, float]:
        """Where a candidate's time goes: mean wall seconds per guard phase over evaluated candidates."""
        totals: dict[str, float] = {}
        n = 0
        for r in self.records:
            if r.kind != "candidate":
                continue
            n += 1
            for k, v in {**r.verdict.phases, "total": r.verdict.eval_seconds or 0.0}.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return {k: round(v / n, 3) for k, v in totals.items()} if n else {}

    def _by_status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if r.kind == "candidate":
                out[r.verdict.status.value] = out.get(r.verdict.status.value, 0) + 1
        return out
