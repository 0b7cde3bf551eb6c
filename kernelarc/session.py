"""The orchestrator: one search session.

N agents propose in rounds; candidates are evaluated by the guard (several in flight per
GPU so compilation overlaps timing; timing itself is serialised per GPU); every verdict
is appended to a state log and handed to the sinks (MLflow tracker, registry, board,
progress: kernelarc.sinks) and fed back to its agent; the champion moves only on a
side-by-side win; a plateau detector redirects the team. A session killed at any point
and started again with the same command resumes from its state log: nothing measured is
lost or measured twice.

The session reads no config: kernelarc.wiring builds it (task, agents, guards, state log,
board, plateau detector, sinks and the loop's settings) from the config, once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from kernelarc import dispatch
from kernelarc.agents.base import AgentContext
from kernelarc.allot import allot, credit, frontier_wins
from kernelarc.guard.judge import Evaluation, Guard
from kernelarc.guard.memory import max_parallel
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status, Verdict
from kernelarc.plateau import PlateauDetector, PlateauEvent
from kernelarc.session_phases import UNCROWNED, SessionFailed, SessionPhases, open_tracking, record_early_failure
from kernelarc.sinks import Judged, Sinks
from kernelarc.state import Record, StateLog
from kernelarc.tasks.loader import Task

log = logging.getLogger(__name__)

__all__ = ["LoopSettings", "Record", "SearchSession", "SessionFailed", "StateLog", "record_early_failure"]


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs of the config (budget, agents.per_round, memory.limit, executor.parallel,
    search.*), resolved by kernelarc.wiring; ``guard`` the guards' own settings (timeouts, the rule)."""

    candidates: int  # budget.candidates
    minutes: float  # budget.minutes
    usd: float | None  # budget.usd
    per_round: int  # the most candidates one agent proposes in one request (kernelarc.allot sizes requests)
    memory_limit: int | None  # board findings an agent sees
    credit: bool  # agents.credit: slots shared by each agent's win rate (kernelarc.allot.credit), else evenly
    parallel: int  # candidates in flight per device (fewer where the judge's memory plan says so)
    calibrate: bool
    dispatch: bool
    dispatch_min_gain: float
    dispatch_route_margin: float
    dispatch_baselines: bool
    guard: GuardSettings
    compile_beside_search: bool | None = None  # search.compile_beside_search (None: on a GPU only)


@dataclass
class _Baseline:
    """A baseline measured beside the search (torch.compile): queued, or in flight."""

    label: str
    candidate: Candidate
    timeout: float  # the time it is given, again when it is timed a second time
    first: Evaluation | None = None  # its first verdict, when it is timed again beside a champion that moved


@dataclass
class _Flight:
    """Candidates between proposal and verdict: queued, to be measured again, in flight."""

    slots: int  # candidates in flight at most, over all devices
    queue: list[Candidate] = field(default_factory=list)
    rematch: list[Candidate] = field(default_factory=list)  # crowned against a champion that has since moved
    inflight: dict[Future, tuple[Candidate, str | None]] = field(default_factory=dict)  # -> (candidate, champion)
    baselines: dict[Future, _Baseline] = field(default_factory=dict)  # in-flight baselines (trusted)
    baseline_queue: list[_Baseline] = field(default_factory=list)
    guard_of: dict[Future, int] = field(default_factory=dict)  # the guard each evaluation in flight runs on
    said_time: bool = False

    def room(self) -> bool:
        return len(self.inflight) < self.slots

    def searching(self) -> int:
        """Candidates in flight (baselines take slots, not candidate budget)."""
        return len(self.inflight) - len(self.baselines)

    def idlest(self, guards: int) -> int:
        """The guard with the fewest evaluations in flight (the first of those): baselines and candidates
        share the devices, none gets more than its share of slots."""
        load = [0] * max(1, guards)
        for i in self.guard_of.values():
            load[i] += 1
        return min(range(len(load)), key=lambda i: (load[i], i))

    def pending(self) -> list[Candidate]:
        return [c for c, _ in self.inflight.values()] + self.queue + self.rematch


def _uncrowned(ev: Evaluation) -> Evaluation:
    """A verdict of champion (a baseline's, or a candidate's) over a champion that has since been beaten, when it
    cannot be timed again beside the new one: correct, measured, not crowned."""
    v = ev.verdict.model_copy(update={"status": Status.correct_slower, "errors": [
        *ev.verdict.errors,
        f"{UNCROWNED}; not timed again beside the new one (no time left, or that timing failed)"]})  # fmt: skip
    return replace(ev, verdict=v)


class SearchSession(SessionPhases):
    def __init__(self, task: Task, target: Any, agents: list, guards: list, *, devices: list[str],
                 settings: LoopSettings, state: StateLog, plateau: PlateauDetector, sinks: Sinks,
                 started: float | None = None):  # fmt: skip
        self.task = task
        self.target = target
        self.devices = devices
        self.on_cpu = all(d == "cpu" for d in devices)  # executor=ray may run several CPU guards
        self.guards = guards
        self.agents = agents
        self.settings = settings
        self.state = state
        self.plateau = plateau
        self.sinks = sinks
        self.board = sinks.board.board
        self.ui = sinks.progress.ui
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
        self.incumbent: tuple[int, Candidate] | None = None
        self.versions: dict[str, int] = {}
        self.pending_conclusions: dict[str, list[str]] = {}
        self.cand_cost: dict[str, dict[str, float]] = {}  # LLM tokens and USD per candidate
        self.busy: dict[str, int] = {}  # agent -> its candidates queued or in flight
        self.queued: dict[str, int] = {}  # agent -> its candidates queued so far this run (the queue's fairness)
        # budget.minutes counts from ``started`` (a time.monotonic() instant: the wiring's start, so that
        # capturing and recognising the reference count too), else from now
        self.t0 = time.monotonic() if started is None else started
        self.elapsed_before = 0.0  # wall seconds of earlier runs of this session (resumed)
        self.budget_before = 0.0  # their budget.minutes share (SessionPhases._budget_spent_s)
        self.reference_s = 0.0  # wall seconds of this run's reference measurement ...
        self.reference_wait_s = 0.0  # ... of which waiting for a device another process held
        self.reference_judge_s = 0.0  # ... and the judge computing the reference's outputs
        self.eval_seconds = 0.0
        self.eval_wall: dict[str, tuple[float, float]] = {}  # candidate -> its last evaluation's wall start, end
        self.timing_seconds = 0.0
        self.dispatch_tried: set[tuple] = set()  # plans already composed (kernelarc.dispatch)
        # candidates waiting to be judged again (flight.rematch) -> the evaluation that stands if that never happens,
        # and its champion: a crowning beside a champion since beaten, or else an out-of-memory failure on a shared GPU
        self.first_of: dict[str, tuple[Evaluation, str | None]] = {}
        self.oom_retried: set[str] = set()
        self.baseline_notes: dict[str, str] = {}  # baseline -> why it is not a baseline (skipped, failed)
        self.compile_after_budget: float | None = None  # seconds torch.compile took when measured after the budget
        self.compile_after_budget_tried = False
        self.redo_baselines = False  # resuming a session that failed before its search
        self.deferred_baselines: list[tuple[str, Candidate, float]] = []  # measured beside the search (label, cand, s)
        self._signatures: dict[int, tuple] | None = None
        # Verdicts in submission order (the oldest in flight first) instead of as evaluations finish: what a
        # deterministic guard (the simulated one) asks for, so a run depends on its seed, not on thread timing.
        self.ordered_verdicts = bool(guards) and all(getattr(g, "ordered_verdicts", False) for g in guards)

    @property
    def tracker(self) -> Any:
        """The MLflow tracker (kernelarc.tracking.Tracker) once the session has opened it, else None."""
        return self.sinks.tracker.tracker if self.sinks.tracker is not None else None

    def _forget_lost_store(self) -> None:
        """The saved session's MLflow run is not in this store (kernelarc.tracking resumed it under a new run):
        its registry versions and child runs are not there either, so none is pointed at; the champion is
        registered again from its record when the session ends (RegistrySink.version_of)."""
        self.versions.clear()
        for r in self.records:
            r.version, r.run_id = None, None
        self.state.save_meta({k: v for k, v in self.state.meta().items() if k != "versions"})
        self.ui.line("the saved session's MLflow run is not in this store: resuming under a new run, "
                     "its champion registered again at the end")  # fmt: skip

    def _save_versions(self) -> None:
        """Registry versions go to the state folder as soon as they exist (a resumed session must
        find its champion's version, a baseline's too, to point the alias at it)."""
        if self.versions:
            self.state.save_meta({**self.state.meta(), "versions": self.versions})

    def _close_tracking(self, status: str, summary: dict[str, Any], reason: str | None = None) -> None:
        if self.sinks.tracker is not None:
            self.sinks.tracker.close(status, summary, reason)

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
            try:
                g.set_baselines(ev if is_ref else None, None if is_ref else ev)
            except Exception as e:  # noqa: BLE001 - a Ray actor lost mid-search; a restarted one gets them again
                log.warning("could not hand the %s baseline to a guard: %s", cand.strategy, e)

    def _to_sinks(self, rec: Record, lessons: list[str] | None = None) -> None:
        """Hand a measured record to the sinks; a registry version they made goes to the state folder."""
        cid = rec.candidate.id
        with self.lock:
            extra = {"index": rec.index, **self.cand_cost.pop(cid, {})}
            wall = self.eval_wall.pop(cid, (None, None))  # the child run lasts as its evaluation
            champ_ms = self.champion_verdict.latency_ms if self.champion_verdict else None
            judged = Judged(rec, lessons or [], self.evaluated, self.settings.candidates, champ_ms, extra, wall,
                            self.usd, dict(self.tokens))  # fmt: skip
        self.sinks.verdict(judged)
        if rec.version is not None:
            self.versions[cid] = rec.version
            self._save_versions()

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

    def _evaluate(self, cand: Candidate, champion: Candidate | None, trusted: bool, timeout: float | None, i: int,
                  deadline: float | None = None):  # fmt: skip
        t = time.monotonic()
        wall = time.time()
        # The consistency check (the champion side by side must look like the champion alone) guards against a
        # challenger that slows the champion down; for a trusted baseline the guard voids only a gross slowdown
        # (GuardSettings.trusted_slack): on a shared, drifting GPU the plain check would keep a much faster
        # torch.compile from being crowned, but a comparison whose champion ran 228x slower than alone says nothing.
        # The registry's incumbent and the final side-by-side are trusted runs of searched code: not checked, as before.
        ref = self._champion_reference(champion) if not trusted or cand.agent == "baseline" else None
        # No evaluation outlives the session's budget by more than one candidate's timeout, however long it waits for
        # a GPU that other sessions (suite shards, sweeps) are measuring on, except by the waits the budget does not
        # count (_budget_spent_s: at most budget.minutes of them in all), by which its end moves on as they happen
        # (guard.drive.Hard): without it, on the H200, torch.compile beside the search timed out after 95-99 s
        # waiting behind L1/094's timings. Waits behind this session's own other evaluation in flight move nothing
        # (on the CPU, a 60 s session with two in flight ran 240 s when the allowance was added up front).
        extra: dict[str, float] = {}
        if deadline is None:
            deadline = wall + max(self._time_left_s(), 0.0) + self.settings.guard.timeout_s
            if (allowance := self._wait_allowance_s()) > 0:
                extra["wait_allowance_s"] = allowance
        ev = self._guard_for(i).evaluate(
            cand, champion, trusted=trusted, timeout_s=timeout, champion_reference=ref, deadline=deadline, **extra
        )
        dt = time.monotonic() - t
        with self.lock:
            self.eval_wall[cand.id] = (wall, wall + dt)
            self.eval_seconds += dt
            self.timing_seconds += ev.verdict.phases.get("timing", 0.0)
        return ev

    # -- main loop -----------------------------------------------------------------------
    @property
    def usd(self) -> float:
        return self.tokens.get("usd", 0.0)

    def _budget_left(self) -> int:
        return self.settings.candidates - self.evaluated

    def _out_of_time(self) -> bool:
        if self._time_left_s() <= 0:
            return True
        return self.settings.usd is not None and self.usd >= self.settings.usd

    def _context(self, agent) -> AgentContext:
        with self.lock:
            redirect = self.redirect if self.redirect is not None and agent.name in self.redirect.agents else None
            return AgentContext(
                task=self.task,
                target=self.target,
                champion=self.champion,
                champion_verdict=self.champion_verdict,
                findings=self.board.view(self.settings.memory_limit),
                leaders=self.board.leaderboard(),
                history=list(self.history.get(agent.name, [])),
                seen=frozenset(self.seen),
                redirect=redirect.instruction if redirect else None,
                plateau=redirect,
                backups=sorted(self.backups, key=lambda cv: cv[1].latency_ms or math.inf)[:8],
                budget_left=self._budget_left(),
                baselines={r.candidate.strategy: r.verdict.status for r in self.records if r.kind == "baseline"},
            )

    def _propose_round(self, pool: ThreadPoolExecutor, free: int) -> list[Candidate]:
        """Candidates for ``free`` evaluation slots: only as many as can start now, shared among the agents
        by kernelarc.allot (agents.per_round the most per agent and request), so each is proposed with the
        freshest board and verdicts. Agents that come back with fewer leave their slots to the others."""
        mine: dict[str, list[Candidate]] = {}
        asked: set[str] = set()
        while free > 0:
            lead = list(self.redirect.agents) if self.redirect is not None else []
            # an agent that concludes about its attempts in its next proposal (LLM) waits for their verdicts
            names = [a.name for a in self.agents if a.name not in asked
                     and not (getattr(a, "waits_for_verdicts", False) and self.busy.get(a.name, 0))]  # fmt: skip
            weight = None
            if self.settings.credit:
                judged = [(r.candidate, r.verdict) for r in self.records if r.kind == "candidate"]
                weight = credit(self.history, frontier_wins(judged).__contains__)
            plan = allot(names, free, self.settings.per_round, busy=self.busy, queued=self.queued, first=lead,
                         weight=weight)  # fmt: skip
            if not plan:
                break
            asked |= set(plan)
            got = self._ask(pool, plan, mine)
            free -= got
            if self.redirect is not None and any(n in self.redirect.agents for n in plan):
                self.redirect = None
        return self._interleave(mine)

    def _ask(self, pool: ThreadPoolExecutor, plan: dict[str, int], mine: dict[str, list[Candidate]]) -> int:
        """Ask each agent of ``plan`` for its number of candidates (in parallel); the new ones go to ``mine``."""
        futs = {pool.submit(a.propose, self._context(a), plan[a.name]): a for a in self.agents if a.name in plan}
        got = 0
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
                # no more than asked for: an extra would wait in the queue, proposed blind to the verdicts ahead
                for c in [c for c in prop.candidates if c.id not in self.seen][: plan[agent.name]]:
                    self.seen.add(c.id)
                    self.busy[c.agent] = self.busy.get(c.agent, 0) + 1
                    mine.setdefault(agent.name, []).append(c)
                    got += 1
        return got

    def _interleave(self, mine: dict[str, list[Candidate]]) -> list[Candidate]:
        """The round's candidates in a fair queue order: one per agent in turn, the agents that have had the
        fewest candidates queued so far first (ties in team order), so that no agent's proposals always go
        first when the slots are few and the budget runs out mid-queue."""
        rank = {a.name: i for i, a in enumerate(self.agents)}
        order = sorted(mine, key=lambda n: (self.queued.get(n, 0), rank.get(n, len(rank))))
        out: list[Candidate] = []
        for i in range(max((len(v) for v in mine.values()), default=0)):
            out += [mine[n][i] for n in order if i < len(mine[n])]
        for n, cands in mine.items():
            self.queued[n] = self.queued.get(n, 0) + len(cands)
        return out

    def _post_conclusion(self, agent, cid: str, lesson: str) -> None:
        rec = next((r for r in reversed(self.records) if r.candidate.id == cid), None)
        if rec is None:
            # Its verdict has not arrived yet: post the conclusion when it does.
            self.pending_conclusions.setdefault(cid, []).append(lesson)
            return
        self.sinks.board.post(rec, lesson)

    def _lessons(self, cand: Candidate, v: Verdict) -> list[str]:
        """What the board learns from a verdict: its agent's conclusion, then any posted before it arrived."""
        agent = next((a for a in self.agents if a.name == cand.agent), None)
        lesson = agent.observe(cand, v) if agent is not None else None
        if cand.family == dispatch.FAMILY:
            gain = f"{(v.speedup_vs_champion - 1) * 100:+.1f}% vs champion" if v.speedup_vs_champion else v.status.value
            lesson = f"shape dispatch over {len(set(cand.knobs.values()))} kernels: {v.status.value}, {gain}"
        return ([lesson] if lesson else []) + self.pending_conclusions.pop(cand.id, [])

    def _on_verdict(self, cand: Candidate, ev: Evaluation, champion_id: str | None, pending_rematch: list) -> None:
        v = ev.verdict
        with self.lock:
            if v.status is Status.champion and (self.champion.id if self.champion else None) != champion_id:
                # The champion moved while this one was measured: measure again against the new one.
                self.first_of[cand.id] = (ev, champion_id)
                pending_rematch.append(cand)
                return
            self.first_of.pop(cand.id, None)
            rec = Record(self.evaluated, "candidate", cand, v, ev.samples, champion_id)
            self.state.append(rec)
            self._replay(rec)
            idx = self.evaluated
        self._to_sinks(rec, self._lessons(cand, v))
        with self.lock:
            self.busy[cand.agent] = max(0, self.busy.get(cand.agent, 0) - 1)
        # a family record (on the board as a win) is progress too: the breaker does not fire while the
        # search still sets records in some family behind a library champion
        event = self.plateau.update(v.status, idx, tried=self._timed_per_family(),
                                    champion_family=self.champion.family if self.champion else None,
                                    record=self.board.is_win(cand.id))  # fmt: skip
        if event is not None:
            self._on_plateau(event)

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
        if self.sinks.tracker is not None:
            self.sinks.tracker.plateau(event, self.plateau.fired)

    def run(self) -> dict[str, Any]:
        meta = self.state.meta()
        for rec in self.state.load():
            self._replay(rec)
        resumed = bool(self.records)
        # a session that failed before its search (its reference refused: out of memory, too slow) starts over
        # when run again (with more memory, a longer timeout): its baselines are measured again, and the failed
        # attempt's set-up does not count against the budget
        self.redo_baselines = resumed and meta.get("status") == "failed"
        self.elapsed_before = float(meta.get("elapsed_s", 0.0)) if resumed and not self.redo_baselines else 0.0
        self.budget_before = float(meta.get("budget_s", self.elapsed_before)) if self.elapsed_before else 0.0
        late = meta.get("compile_after_budget") or {}
        if late:  # measured after the budget before the session was stopped: once is enough
            self.compile_after_budget = late.get("s")
            self.compile_after_budget_tried = True
        if resumed:
            # versions registered before the kill (records are written before their registration)
            for cid, version in (meta.get("versions") or {}).items():
                self.versions.setdefault(cid, int(version))
            done = " (it had finished)" if meta.get("status") == "finished" else ""
            self.ui.line(f"resumed session {self.state.dir} with {len(self.records)} measurements{done}; "
                         "to start fresh: search.resume=false (the old log is kept) or another seed=N")  # fmt: skip
        try:
            open_tracking(self.state, self.sinks.tracker, self.sinks.registry,
                          meta.get("parent_run_id") if resumed else None)  # fmt: skip
            if resumed and meta.get("parent_run_id") and self.sinks.parent_run_id not in (None, meta["parent_run_id"]):
                self._forget_lost_store()
            self.ui.line(f"task {self.task.name} on {self.target.name} ({', '.join(self.devices)}), "
                         f"{len(self.guards[0].workloads)} workloads, {len(self.agents)} agents")  # fmt: skip
            self._calibrate()
            self._baselines()
            self._incumbent()
            self._search()
            self._compile_after_budget()
            self._prove_vs_compile()
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
            self.state.save_meta({**self.state.meta(), "elapsed_s": time.monotonic() - self.t0 + self.elapsed_before,
                                  "budget_s": self._budget_spent_s()})  # fmt: skip
            for g in self.guards:
                g.close()
        return final

    def _search(self) -> None:
        """The loop: propose, judge, hand each verdict to the sinks, until the budget or the ideas run out."""
        # In flight per device: executor.parallel, or fewer where the judge's memory plan says that many workers
        # do not fit beside the reference (its note says so; test doubles and Ray guards have no plan here).
        per = max(1, self.settings.parallel)
        flight = _Flight(sum(max_parallel(g, per) if isinstance(g, Guard) else per for g in self.guards))
        deferred, self.deferred_baselines = self.deferred_baselines, []
        g = self.settings.guard
        if flight.slots == 1 and deferred and g.compile_baseline and g.compile_after_budget:
            # One evaluation at a time here (the memory plan): torch.compile beside the search would hold the only
            # slot for up to half the budget (on the H200, L1/094's timed out there and left the search 40 s).
            # It is measured after the search instead, side by side with the champion and crowned if faster, with
            # its full guard.baseline_timeout_s (_compile_after_budget).
            for label, _, _ in deferred:
                self.baseline_notes[label] = "one evaluation at a time on this device (memory plan): after the search"
            deferred = []
        flight.baseline_queue = [_Baseline(label, cand, t) for label, cand, t in deferred]
        with (
            ThreadPoolExecutor(max_workers=flight.slots) as epool,
            ThreadPoolExecutor(max_workers=max(1, len(self.agents))) as apool,
        ):
            try:
                self._loop(flight, epool, apool)
            except BaseException:
                # an interrupt (or a bug): stop the guards' workers first, so that the pools' exit does not
                # wait for evaluations in flight (a torch.compile baseline may have minutes left)
                epool.shutdown(wait=False, cancel_futures=True)
                for g in self.guards:
                    with contextlib.suppress(Exception):
                        g.close()
                raise

    def _loop(self, flight: _Flight, epool: ThreadPoolExecutor, apool: ThreadPoolExecutor) -> None:
        """Propose, submit and collect until the budget or the ideas run out (and nothing is in flight)."""
        stalls = 0
        while True:
            budget_open = self._submit(flight, epool)
            if budget_open and not flight.queue and flight.room():
                free = min(flight.slots - len(flight.inflight), self._budget_left() - flight.searching())
                new = self._propose_round(apool, free)
                if new:
                    stalls = 0
                    flight.queue.extend(new)
                    continue
                stalls += 1
                if stalls >= 3 and not flight.inflight:
                    self.ui.line("agents have nothing new to propose; stopping")
                    break
                if not flight.inflight:
                    continue
            if not flight.inflight:
                break
            self._collect(flight)
        # a second measurement the budget or the time left no room for: the first is the record (nothing proposed is
        # lost): an out-of-memory retry's failure, or a crowning beside a champion since beaten, not crowned
        for cand in list(flight.rematch):
            flight.rematch.remove(cand)
            if (first := self.first_of.pop(cand.id, None)) is not None:
                ev, champ_id = first
                self._on_verdict(cand, _uncrowned(ev) if ev.verdict.status is Status.champion else ev, champ_id,
                                 flight.rematch)  # fmt: skip

    def _submit(self, flight: _Flight, pool: ThreadPoolExecutor) -> bool:
        """Start queued candidates (rematches first) while budget and slots allow; whether budget is left."""
        out_of_time = self._out_of_time()
        if out_of_time and flight.searching() and not flight.said_time:
            flight.said_time = True
            self.ui.line(f"  ⏱ time budget reached; finishing the {flight.searching()} candidate(s) in flight")
        while flight.baseline_queue and flight.room():
            # a baseline takes a slot but no candidate budget
            b = flight.baseline_queue.pop(0)
            if b.first is not None and out_of_time:
                # no time to time it again beside the new champion: its first verdict stands, not crowned
                self._record_baseline(b.label, b.candidate, _uncrowned(b.first), None)
                continue
            again = " again, beside the new champion" if b.first is not None else " beside the search"
            self.ui.line(f"measuring baseline: {b.label} (at most {b.timeout:.0f} s){again} ...")
            g = flight.idlest(len(self.guards))
            fut = pool.submit(self._evaluate, b.candidate, self.champion, True, b.timeout, g)
            flight.inflight[fut] = (b.candidate, self.champion.id if self.champion else None)
            flight.baselines[fut] = b
            flight.guard_of[fut] = g
        budget_open = self._budget_left() - flight.searching() > 0 and not out_of_time
        while budget_open and flight.room() and (flight.queue or flight.rematch):
            cand = flight.rematch.pop(0) if flight.rematch else flight.queue.pop(0)
            champ = self.champion
            g = flight.idlest(len(self.guards))
            fut = pool.submit(self._evaluate, cand, champ, False, None, g)
            flight.inflight[fut] = (cand, champ.id if champ else None)
            flight.guard_of[fut] = g
            budget_open = self._budget_left() - flight.searching() > 0
        return budget_open

    def _collect(self, flight: _Flight) -> None:
        """Wait for verdicts and act on them; then, when none is pending, try a shape-dispatch composite."""
        if self.ordered_verdicts:
            oldest = next(iter(flight.inflight))  # dicts keep insertion (submission) order
            done = [oldest] if wait([oldest], timeout=5).done else []
        else:
            done, _ = wait(list(flight.inflight), return_when=FIRST_COMPLETED, timeout=5)
        for fut in done:
            cand, champ_id = flight.inflight.pop(fut)
            flight.guard_of.pop(fut, None)
            try:
                ev = fut.result()
            except Exception as e:  # noqa: BLE001 - the guard returns verdicts; this is a bug guard
                log.exception("evaluation of %s failed", cand.id)
                ev = Evaluation(Verdict(candidate_id=cand.id, status=Status.runtime_error, errors=[str(e)]))
            b = flight.baselines.pop(fut, None)
            if b is None and self._retry_out_of_memory(cand, ev):
                self.first_of.setdefault(cand.id, (ev, champ_id))  # a crowning beside a beaten champion outweighs it
                flight.rematch.append(cand)
            elif b is None:
                self._on_verdict(cand, ev, champ_id, flight.rematch)
            elif ev.verdict.status is Status.champion and (self.champion.id if self.champion else None) != champ_id:
                # faster than the champion it was timed beside, which has since been beaten: again, beside the
                # new one, with the time it was given (its compile is not cached across workers)
                flight.baseline_queue.append(replace(b, first=b.first or ev))
            elif b.first is not None and not ev.verdict.correct:
                # timed again and failed this time (a timeout, say): the first, correct verdict stands, not crowned
                self._record_baseline(b.label, cand, _uncrowned(b.first), None)
            else:
                self._record_baseline(b.label, cand, ev, champ_id)
        if done and not any(c.family == dispatch.FAMILY for c in flight.pending()):
            composite = self._dispatch_candidate()
            if composite is not None:
                flight.queue.insert(0, composite)

    def _retry_out_of_memory(self, cand: Candidate, ev: Evaluation) -> bool:
        """Whether a candidate that ran out of GPU memory is judged once more instead of recorded as failed: only
        where the GPU is shared (``guard.memory_gb`` caps this session's plan below the device's memory), since there
        other processes' memory, not the candidate's, can be what ran out. On the H200 (run DL, 9 suite shards beside
        L2/024's 47 GB reference) 7 candidates failed so, 5 of them L2/024's own: their knobs were blamed for it and
        their slots lost. A second failure is recorded as any other."""
        v = ev.verdict
        if v.status is not Status.runtime_error or self.settings.guard.memory_gb is None:
            return False
        if cand.id in self.oom_retried or not any("out of memory" in e.lower() for e in v.errors):
            return False
        self.oom_retried.add(cand.id)
        self.ui.line(f"  ↻ {cand.id[:12]} ran out of the shared GPU's memory: judged once more")
        log.info("candidate %s out of memory on a shared GPU: judged again", cand.id)
        return True

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
        if not self.settings.dispatch or self._budget_left() <= 0 or self._out_of_time():
            return None
        try:
            if self._signatures is None:
                self._signatures = {i: dispatch.workload_signature(self.task, i) for i in self.guards[0].workloads}
            with self.lock:
                # the baselines are parts too: the library's kernel may stay the route for some shapes
                kinds = ("candidate", "baseline") if self.settings.dispatch_baselines else ("candidate",)
                candidates = [r.candidate for r in self.records if r.kind in kinds and r.verdict.correct]
                judged = [(r.candidate, r.verdict, r.champion_id) for r in self.records if r.kind == "candidate"]
                champ_id = self.champion.id if self.champion else None
            lat = self.drift_corrected_latencies()
            pool = [(c, lat[c.id]) for c in candidates if c.id in lat]
            g = self.settings.guard
            failed = dispatch.failed_routes(judged, g.min_gain, g.noise_factor)
            champ_lat = lat.get(champ_id or "")
            champ_ms = dispatch.geomean_over(champ_lat, self._signatures) if champ_lat else None
            s = self.settings
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
