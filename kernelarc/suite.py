"""python -m kernelarc.suite dir=TREE [budget.candidates=8] [suite.workloads=N] [suite.problems=[A,B]]

One search session per SOL-ExecBench problem folder found under ``dir`` (a folder holding
``definition.json`` and ``workload.jsonl``), each with the same per-problem budget (the
``budget.*`` keys), run one after the other in this process (``suite.isolation=process``: one
subprocess per problem). Every problem ends with a row: a champion, or a recorded reason; one
failing problem never stops the others. A suite killed at any point and started again with the
same command reads the problems already done from their saved results and resumes the one that
was running from its session state. A suite stopped by a signal (SIGTERM: ``timeout``, a
scheduler) first saves the running problem's row from what its session has judged so far, marked
``stopped``; the same command started again runs that problem again from its session state. The
table is printed, written as ``table.csv`` and ``table.json`` and logged as an MLflow run of the
experiment ``kernelarc/suite/<gpu>``, with the sessions' run ids. ``scripts/harness_eval.py`` later
fills its ``harness_*`` columns on the GPU machine with the verdicts of NVIDIA's harness on the
exported champions.
"""

from __future__ import annotations

import contextlib
import csv
import faulthandler
import gc
import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, open_dict
from pydantic import BaseModel

from kernelarc.config import register_configs
from kernelarc.dispatch import FAMILY as DISPATCH
from kernelarc.memory_pool import MemoryPool, PoolTooSmall
from kernelarc.models import GRAPH_LEVEL_ONLY

register_configs()

log = logging.getLogger(__name__)

CHILD_ENV = "KERNELARC_SUITE_CHILD"  # set in a problem's subprocess (suite.isolation=process)
STOP_GRACE_S = 8.0  # a stopped suite's wait for a problem's subprocess to save its row (timeout -k 10 kills at 10 s)
COLUMNS = (
    "problem", "definition", "status", "champion_family", "champion_parts", "champion_graph_level_only",
    "speedup_vs_reference",
    "speedup_vs_compile", "compile_after_budget", "speedup_vs_reference_drift_corrected",
    "speedup_vs_compile_drift_corrected", "sol_score", "sol_fraction", "latency_ms", "evaluated", "elapsed_min",
    "workloads", "workloads_not_run", "reason", "mlflow_run_id", "registry_version", "harness_verdict",
    "harness_passed", "harness_speedup",
    "verdicts", "void_comparisons", "timed_again", "stopped",
)  # fmt: skip


class SuiteStopped(BaseException):  # noqa: N818 - an interrupt (like KeyboardInterrupt), not an error
    """A stop signal reached the suite. A BaseException, so that no ``except Exception`` on the way swallows it."""


# The row of the problem this process is running, from what its session has judged so far: set while a session
# runs inline, called by the stop signal's handler (_on_stop) before the suite unwinds.
_SAVE_RUNNING: dict[str, Any] = {}


def _on_stop(signum: int, _frame: Any) -> None:
    with contextlib.suppress(ValueError):  # one stop is enough: a second signal must not cut the row being saved
        signal.signal(signum, signal.SIG_IGN)
    name = signal.Signals(signum).name
    save = _SAVE_RUNNING.pop("save", None)
    if save is not None:
        try:
            save(f"stopped by {name} while it ran: the row is its champion so far; the same command runs it "
                 "again from its session state")  # fmt: skip
        except Exception:  # noqa: BLE001 - the stop goes on; the session state on disk still has the measurements
            log.exception("could not save the running problem's row on %s", name)
    raise SuiteStopped(name)


class ProblemStatus(StrEnum):
    improved = "improved"  # a searched kernel beat the reference (and torch.compile where measured)
    baseline = "baseline"  # finished; no kernel beat the best baseline, which stays champion
    failed = "failed"  # the session ended with a recorded reason (e.g. the reference fails)
    crashed = "crashed"  # an unexpected exception or a killed subprocess: a bug to report
    invalid = "invalid"  # the folder is not a loadable SOL-ExecBench problem


class ProblemResult(BaseModel):
    """One row of the suite table (also the saved result a resumed suite reads)."""

    problem: str  # path relative to dir
    definition: str | None = None
    status: ProblemStatus
    champion_family: str | None = None
    champion_parts: list[str] | None = None  # a shape dispatch's parts by family (or baseline label)
    # the champion is a composition that substitutes no recognised site (the reference's graph under other
    # execution settings: Inductor options, CUDA-graph replay): faster perhaps, but not KernelArc-built
    champion_graph_level_only: bool = False
    speedup_vs_reference: float | None = None
    speedup_vs_compile: float | None = None
    compile_after_budget: bool = False  # torch.compile measured after the budget (none within it, or uncrowned)
    speedup_vs_reference_drift_corrected: float | None = None  # both on the session's first time base
    speedup_vs_compile_drift_corrected: float | None = None  # (chained side-by-side ratios)
    sol_score: float | None = None
    sol_fraction: float | None = None
    latency_ms: float | None = None
    evaluated: int = 0
    verdicts: int = 0  # the session's verdicts, baselines included ...
    void_comparisons: int = 0  # ... those void for a champion measured inconsistently beside the challenger
    timed_again: int = 0  # workload timings done again before a decision (guard: Driver.time_workload)
    stopped: bool = False  # the suite was stopped while this problem ran: its champion so far; run again on resume
    elapsed_min: float | None = None
    workloads: list[int] | None = None
    # of those, the ones the guard's memory plan left out (index -> why): the row's figures cover the others only
    workloads_not_run: dict[int, str] | None = None
    reason: str | None = None
    mlflow_run_id: str | None = None
    registry_version: int | None = None
    harness_verdict: str | None = None  # filled by scripts/harness_eval.py on the GPU machine
    harness_passed: str | None = None  # e.g. "14/16" workloads PASSED
    harness_speedup: float | None = None  # geomean of the harness's speedup_factor over passed workloads


def find_problems(root: Path) -> list[Path]:
    """Every folder under ``root`` (itself included) with a definition.json and a workload.jsonl."""
    if not root.is_dir():
        raise FileNotFoundError(f"dir={root}: not a folder")
    found = {p.parent for p in root.rglob("definition.json") if (p.parent / "workload.jsonl").is_file()}
    return sorted(found, key=lambda p: str(p.relative_to(root)))


def select_problems(root: Path, problems: list[Path], wanted: list[str] | None) -> list[Path]:
    """``suite.problems`` entries match a folder name or a path relative to ``dir``."""
    if not wanted:
        return problems
    out, unknown = [], []
    for w in wanted:
        w = str(w).strip().rstrip("/")
        hits = [p for p in problems if p.name == w or str(p.relative_to(root)) == w]
        if not hits:
            unknown.append(w)
        out += [p for p in hits if p not in out]
    if unknown:
        raise ValueError(f"suite.problems: no problem folder under {root} named {unknown}")
    return out


def representative(indices: list[int], n: int | None, size) -> list[int]:
    """``n`` workloads spread over the sizes of ``indices`` (smallest and largest included; the
    median one for n=1), in index order."""
    if n is None or n >= len(indices):
        return sorted(indices)
    by_size = sorted(indices, key=lambda i: (size(i), i))
    if n == 1:
        return [by_size[len(by_size) // 2]]
    picks = {by_size[round(k * (len(by_size) - 1) / (n - 1))] for k in range(n)}
    return sorted(picks)


def slug(problem: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in problem)


def claim(claims: Path, problem: str) -> bool:
    """Take ``problem`` from the queue shared through the folder ``claims``: true for exactly one of the
    processes that ask (the file is created atomically, ``O_EXCL``; it holds the claimant's pid)."""
    try:
        fd = os.open(claims / f"{slug(problem)}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


def suite_key(cfg: Any, root: Path, gpu: str) -> str:
    """Same results folder for the same suite: dir, per-problem workloads and the session settings
    that change a result (not the problem filter, isolation or progress)."""
    ident = {
        "dir": str(root.resolve()), "workloads": cfg.suite.workloads, "gpu": gpu,
        "budget": [cfg.budget.candidates, cfg.budget.minutes, cfg.budget.usd],
        "agents": [cfg.agents.count, cfg.agents.backend, cfg.agents.model], "memory": cfg.memory.limit,
        "strategies": list(cfg.strategies.names), "seed": cfg.seed, "compile": cfg.guard.compile_baseline,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def result_from_summary(problem: str, summary: dict[str, Any], workloads: list[int] | None) -> ProblemResult:
    stopped = bool(summary.get("stopped"))
    failed = summary.get("status") == "failed" or (stopped and not summary.get("champion"))
    # torch.compile against the champion as the guard timed them side by side where a chain of such pairs links
    # them, else the ratio of their own medians (measured minutes apart: on the H200, Quant/014's champion was
    # crowned at a slow 0.125 ms and timed 0.07 / 0.0096 ms beside every later challenger, torch.compile 1.9x
    # slower beside it, and the medians' ratio read 0.46x)
    vs_compile = summary.get("speedup_vs_compile_drift_corrected") or summary.get("speedup_vs_compile")
    if failed:
        status = ProblemStatus.failed
    elif summary.get("champion_agent") in (None, "baseline"):
        status = ProblemStatus.baseline
    elif (vs_compile or 1.0) < 1.0:
        # a searched kernel beat the reference but not torch.compile, which then could not be crowned (e.g. it
        # was measured inconsistently): the table must not call that an improvement
        status = ProblemStatus.baseline
    else:
        status = ProblemStatus.improved
    reason = summary.get("reason")
    notes = summary.get("baseline_notes") or {}
    if summary.get("status") != "failed" and notes:  # a baseline that failed or was skipped is worth a word
        said = "; ".join(f"{k}: {v}" for k, v in notes.items())
        reason = f"{reason}; {said}" if stopped and reason else said
    return ProblemResult(
        problem=problem, definition=summary.get("task"), status=status,
        champion_family=summary.get("champion_family"), champion_parts=summary.get("champion_parts"),
        champion_graph_level_only=bool(summary.get("champion_graph_level_only")),
        speedup_vs_reference=summary.get("speedup_vs_baseline"),
        speedup_vs_compile=summary.get("speedup_vs_compile"),
        compile_after_budget=summary.get("compile_after_budget_s") is not None,
        speedup_vs_reference_drift_corrected=summary.get("speedup_vs_baseline_drift_corrected"),
        speedup_vs_compile_drift_corrected=summary.get("speedup_vs_compile_drift_corrected"),
        sol_score=summary.get("sol_score"),
        sol_fraction=summary.get("sol_fraction"), latency_ms=summary.get("latency_ms"),
        evaluated=int(summary.get("evaluated") or 0), elapsed_min=summary.get("elapsed_min"), workloads=workloads,
        workloads_not_run=summary.get("workloads_not_run") or None,
        verdicts=int(summary.get("verdicts") or 0), void_comparisons=int(summary.get("void_comparisons") or 0),
        timed_again=int(summary.get("timed_again") or 0), stopped=stopped,
        reason=reason, mlflow_run_id=summary.get("mlflow_run_id"), registry_version=summary.get("registry_version"),
    )  # fmt: skip


# -- the table -------------------------------------------------------------------------------
def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a kill mid-write leaves the last version."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def saved_row(path: Path) -> ProblemResult | None:
    """A problem's saved row; None where there is none, or it cannot be read (no result: the problem runs again)."""
    if not path.is_file():
        return None
    try:
        return ProblemResult.model_validate_json(path.read_text())
    except ValueError as e:
        log.warning("unreadable saved row %s (%s): the problem runs again", path, e)
        return None


def write_table(results: list[ProblemResult], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.model_dump(mode="json") for r in results]
    jpath, cpath = out / "table.json", out / "table.csv"
    _write_whole(jpath, json.dumps(rows, indent=2) + "\n")
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for row in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items() if k in COLUMNS})
    return jpath, cpath


def load_table(path: Path) -> list[ProblemResult]:
    return [ProblemResult.model_validate(r) for r in json.loads(path.read_text())]


def _fmt(v: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _champion_label(r: ProblemResult) -> str:
    return GRAPH_LEVEL_ONLY if r.champion_graph_level_only else (r.champion_family or "-")


def render_table(results: list[ProblemResult]) -> str:
    head = f"{'problem':<58} {'status':<9} {'champion':<26} {'x ref':>6} {'x comp':>6} {'SOL':>5} {'n':>3}  reason"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.problem[-58:]:<58} {r.status.value:<9} {_champion_label(r)[:26]:<26} "
            f"{_fmt(r.speedup_vs_reference, '.2f', 'x'):>6} "
            f"{_fmt(r.speedup_vs_compile, '.2f', '*' if r.compile_after_budget else 'x'):>6} "
            f"{_fmt(r.sol_score, '.2f'):>5} {r.evaluated:>3}  {(r.reason or '')[:90]}"
        )
    counts = {s.value: sum(r.status is s for r in results) for s in ProblemStatus}
    lines.append("-" * len(head))
    stopped = sum(r.stopped for r in results)
    lines.append(", ".join(f"{k} {v}" for k, v in counts.items() if v) + f" of {len(results)} problems"
                 + (f" ({stopped} stopped while running: their champions so far)" if stopped else ""))  # fmt: skip
    built = sum(is_kernelarc_built(r) for r in results)
    tc = [r.speedup_vs_compile for r in results if r.speedup_vs_compile]
    dc = geomean([r.speedup_vs_compile_drift_corrected or 0 for r in results])
    # of those, the ones not behind torch.compile where it was measured: a champion crowned while torch.compile
    # was still compiling (measured after the budget) can be slower than it (the row's status says baseline)
    behind = sum(is_kernelarc_built(r) and r.status is ProblemStatus.baseline for r in results)
    line = f"a KernelArc-built champion on {built} of {len(results)}"
    if behind:
        line += f" ({behind} of them behind torch.compile)"
    line += f"; x torch.compile known on {len(tc)}"
    if tc:
        line += f", geomean {_fmt(geomean(tc), '.3f')} (drift-corrected {_fmt(dc, '.3f')})"
    late = sum(r.compile_after_budget for r in results)
    if late:
        line += f"; * torch.compile measured after the budget on {late}"
    lines.append(line)
    partial = [r for r in results if r.workloads_not_run]
    if partial:
        lines.append(f"memory: {len(partial)} judged without some of their workloads (left out by the guard's memory "
                     f"plan): " + ", ".join(f"{r.problem.split('_')[0]} {sorted(r.workloads_not_run or {})}"
                                            for r in partial))  # fmt: skip
    verdicts = sum(r.verdicts for r in results)
    if verdicts:
        lines.append(f"timing: {sum(r.void_comparisons for r in results)} of {verdicts} verdicts void (champion "
                     f"inconsistent beside the challenger); {sum(r.timed_again for r in results)} workload timings "
                     "done again")  # fmt: skip
    return "\n".join(lines)


# what is not KernelArc-built (issue 14): the reference, its torch.compile, the reference re-run under other
# torch.compile settings (the generic family, kernelarc.agents.search.GENERIC_FAMILY), and a composition that
# substitutes no recognised site (the reference's graph under Inductor options or CUDA-graph replay)
NOT_BUILT = (None, "reference", "torch.compile", "pytorch.compile_variants", GRAPH_LEVEL_ONLY)


def is_kernelarc_built(r: ProblemResult) -> bool:
    """The champion is a kernel KernelArc built (a family, a composition substituting at least one recognised site
    with a KernelArc kernel or a fused library call, a dispatch with such a part), not the reference, its plain
    torch.compile, the reference under other torch.compile settings or execution settings (a composition with no
    substituted site), or a dispatch that only routes between those (a part that cannot be named counts as not
    built)."""
    if r.champion_family == DISPATCH and r.champion_parts is not None:
        return any(p not in NOT_BUILT and p != "unknown" for p in r.champion_parts)
    return r.champion_family not in NOT_BUILT and not r.champion_graph_level_only


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def save_meta(path: Path, **entries: Any) -> dict[str, Any]:
    """``suite.json`` beside the table: the tree, the gpu, the suite's MLflow run (for resume and
    for scripts/harness_eval.py)."""
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta.update(entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(path)
    return meta


# -- MLflow ----------------------------------------------------------------------------------
class SuiteTracker:
    """The suite's parent run (experiment ``kernelarc/suite/<gpu>``); reopened on resume.
    Tracking trouble is logged, never fatal: the table on disk is the result."""

    def __init__(self, uri: str | None, gpu: str, meta_path: Path):
        from mlflow import MlflowClient

        from kernelarc.tracking import default_tracking_uri, local_artifact_location, prepare_sqlite

        self.uri = uri or default_tracking_uri()
        prepare_sqlite(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        name = f"kernelarc/suite/{gpu}"
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            location = local_artifact_location(self.uri)
            self.experiment_id = self.client.create_experiment(name, artifact_location=location)
        else:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self.experiment_id = exp.experiment_id
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        self.run_id = meta.get("mlflow_run_id")
        if self.run_id:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except Exception:  # noqa: BLE001 - the old run is gone (another store): start a new one
                self.run_id = None
        self.meta_path = meta_path
        self.resumed = self.run_id is not None

    def start(self, params: dict[str, Any], run_name: str) -> str:
        from mlflow.entities import Param

        from kernelarc.tracking import sanitize_key

        if self.run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags={"kernelarc.kind": "suite"})
            self.run_id = run.info.run_id
            ps = [Param(sanitize_key(k), str(v)[:6000]) for k, v in params.items()]
            self.client.log_batch(self.run_id, params=ps, synchronous=True)
            save_meta(self.meta_path, mlflow_run_id=self.run_id)
        return self.run_id

    def problem_done(self, step: int, r: ProblemResult, results: list[ProblemResult]) -> None:
        from kernelarc.tracking import sanitize_key

        key = sanitize_key(f"kernelarc.problem.{slug(r.problem)}")[:240]
        self.client.set_tag(self.run_id, key, f"{r.status.value} run={r.mlflow_run_id or '-'}")
        for s in ProblemStatus:
            self.client.log_metric(self.run_id, f"problems_{s.value}", sum(x.status is s for x in results), step=step)
        if r.mlflow_run_id:
            try:  # the session's own run points back at the suite
                self.client.set_tag(r.mlflow_run_id, "kernelarc.suite_run_id", self.run_id)
            except Exception as e:  # noqa: BLE001
                log.debug("tagging session run %s failed: %s", r.mlflow_run_id, e)

    def finish(self, results: list[ProblemResult], files: list[Path], status: str = "FINISHED") -> None:
        done = [r for r in results if r.status in (ProblemStatus.improved, ProblemStatus.baseline)]
        metrics = {
            "problems": len(results),
            "geomean_speedup_vs_reference": geomean([r.speedup_vs_reference or 0 for r in done]),
            # over the problems with a torch.compile figure (problems_with_compile_figure of them)
            "geomean_speedup_vs_compile": geomean([r.speedup_vs_compile or 0 for r in done]),
            "geomean_speedup_vs_compile_drift_corrected": geomean(
                [r.speedup_vs_compile_drift_corrected or 0 for r in done]
            ),
            "problems_with_compile_figure": sum(bool(r.speedup_vs_compile) for r in done),
            "problems_kernelarc_built": sum(is_kernelarc_built(r) for r in done),
        }
        for k, v in metrics.items():
            if v is not None:
                self.client.log_metric(self.run_id, k, float(v))
        for f in files:
            self.client.log_artifact(self.run_id, str(f))
        self.client.set_terminated(self.run_id, status)


# -- running one problem ---------------------------------------------------------------------
def _problem_cfg(base: DictConfig, problem: Path, workloads: list[int] | None) -> DictConfig:
    cfg = base.copy()
    with open_dict(cfg):
        cfg.task.name = "sol_execbench"
        cfg.task.path = str(problem)
        cfg.task.workloads = workloads
    return cfg


def session_workloads(cfg: DictConfig, problem: Path, on_cpu: bool) -> tuple[Any, Any, list[int]]:
    """The problem's task, its session's guard settings and the workloads the suite's session runs: ``suite.workloads``
    representative ones of those a session would run by default, or all of those where it is null."""
    from kernelarc.app import typed
    from kernelarc.wiring import guard_settings, load_task_from_config

    c = typed(_problem_cfg(cfg, problem, None))
    task = load_task_from_config(c, on_cpu)
    gs = guard_settings(c, task, on_cpu)
    pool = list(gs.workloads) if gs.workloads is not None else list(range(len(task.workloads)))
    n = cfg.suite.workloads
    return task, gs, pool if n is None else representative(pool, int(n), task.io_bytes)


def choose_workloads(cfg: DictConfig, problem: Path, on_cpu: bool) -> tuple[list[int] | None, Any]:
    """``suite.workloads`` representative workloads of the ones a session would run by default, and the
    task loaded to choose them (the session reuses it: loaded once); (None, None) when there is no choice."""
    if cfg.suite.workloads is None:
        return None, None
    task, _, workloads = session_workloads(cfg, problem, on_cpu)
    return workloads, task


def run_inline(cfg: DictConfig, problem: Path, rel: str, target: Any, log_path: Path,
               on_stop: Callable[[ProblemResult], None] | None = None) -> ProblemResult:  # fmt: skip
    """One isolated search session in this process: every exception becomes the row's reason. While the session
    runs, a stop signal hands ``on_stop`` the row of what it has judged so far (``Session.summary_so_far``)."""
    from kernelarc.app import TaskError, UsageError, typed
    from kernelarc.config import plain
    from kernelarc.session import SessionFailed
    from kernelarc.ui import Progress
    from kernelarc.wiring import build_session

    on_cpu = bool(getattr(target, "is_cpu", True))
    workloads = None
    try:
        workloads, task = choose_workloads(cfg, problem, on_cpu)
        pcfg = _problem_cfg(cfg, problem, workloads)
        c = typed(pcfg)
        session = build_session(c, plain(pcfg), target, progress=Progress(bool(cfg.suite.progress)), task=task)
        if on_stop is not None:

            def save(why: str) -> None:
                on_stop(result_from_summary(rel, session.summary_so_far(why), workloads))

            _SAVE_RUNNING["save"] = save
        summary = session.run()
        _SAVE_RUNNING.pop("save", None)
        return result_from_summary(rel, summary, workloads)
    except SessionFailed as e:
        return result_from_summary(rel, {**e.summary, "status": "failed", "reason": e.reason}, workloads)
    except (TaskError, UsageError) as e:
        return ProblemResult(problem=rel, status=ProblemStatus.invalid, reason=str(e)[:1000], workloads=workloads)
    except Exception as e:  # noqa: BLE001 - one problem's bug never stops the suite
        tb = traceback.format_exc()
        log_path.write_text(tb)
        log.error("problem %s crashed:\n%s", rel, tb)
        first = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        return ProblemResult(problem=rel, status=ProblemStatus.crashed, reason=f"{first} (traceback: {log_path})",
                             workloads=workloads)  # fmt: skip
    finally:
        _SAVE_RUNNING.pop("save", None)
        session = None  # noqa: F841 - drop the session's references (cached reference outputs) now
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                # cuBLAS keeps its workspaces in the caching allocator: a few MB that can pin a freed segment of
                # any size (run DX, H100: 4 GB still reserved after L2/024, whose weights are 4 GB tensors)
                clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear is not None:
                    clear()
                torch.cuda.empty_cache()
                # which process goes past its share of a shared GPU (on the H100, runs DT and DU: one held 20.7 GB
                # under an 11 GB share, named by its pid only): the judge's peak, with its pid, in the shard's log;
                # what stays reserved after, and how much of it live tensors take (the rest: pinned segments)
                peak, left = torch.cuda.max_memory_reserved() / 2**30, torch.cuda.memory_reserved() / 2**30
                live = torch.cuda.memory_allocated() / 2**30
                log.warning("%s: this process (pid %d) reserved at most %.1f GB on the GPU, %.1f GB still after "
                            "(%.2f GB of it allocated)", rel, os.getpid(), peak, left, live)  # fmt: skip
                torch.cuda.reset_peak_memory_stats()
        except Exception:  # noqa: BLE001
            pass


def run_subprocess(overrides: list[str], rel: str, result_path: Path, log_path: Path, timeout: float | None):
    """The same problem in a child ``python -m kernelarc.suite`` that writes its result file: a
    crash that takes the process down (a segfault, an OOM kill) is this problem's row only."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("suite.problems", "suite.isolation"))]
    cmd = [sys.executable, "-m", "kernelarc.suite", *keep, f"suite.problems=['{rel}']", "suite.isolation=inline"]
    env = dict(os.environ, **{CHILD_ENV: "1"})
    # a row left by an earlier attempt (crashed, stopped) is not this run's: a child that dies without one is a crash
    result_path.unlink(missing_ok=True)
    with log_path.open("w") as logf:
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
            why = f"exit code {code}"
        except SuiteStopped:
            # the child runs in its own process group, out of the stop's reach: pass it on, so that the child saves
            # its row (its own _on_stop), and end it if it does not stop within a few seconds
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            why = f"killed after suite.problem_timeout_s={timeout:.0f} s"
    if (row := saved_row(result_path)) is not None:
        return row
    tail = log_path.read_text()[-300:].strip().splitlines()
    last = tail[-1] if tail else ""
    reason = f"subprocess {why}: {last} (log: {log_path})"
    return ProblemResult(problem=rel, status=ProblemStatus.crashed, reason=reason)


def _progress(i: int, n: int, r: ProblemResult, seconds: float | None, note: str = "") -> str:
    vs = f" {r.speedup_vs_reference:.2f}x ref" if r.speedup_vs_reference else ""
    vc = f" {r.speedup_vs_compile:.2f}x compile" if r.speedup_vs_compile else ""
    t = f" ({seconds:.0f} s)" if seconds is not None else ""
    why = f" | {r.reason[:120]}" if r.reason and r.status is not ProblemStatus.improved else ""
    bar = "#" * round(20 * i / n) + "." * (20 - round(20 * i / n))
    return f"[{bar}] {i}/{n} {r.problem}: {r.status.value} {r.champion_family or ''}{vs}{vc}{t}{note}{why}"


DEFERRED = "runs again with the cap it needs"  # a failed row's mark: refused for memory, to be run with more
# runs of a problem refused for memory, each with a larger cap (run_again): a lower bound from its inputs and
# outputs, then dry runs out of memory under their caps (each names twice the cap), then the measured need
MEMORY_RETRIES = 5
OOM_SHARES = 3  # a reference out of the shared GPU's memory with no need named: once more with this many shares


def first_cap_gb(cfg: DictConfig, problem: Path, on_cpu: bool, share: float, pool_gb: float) -> float | None:
    """A first run's ``guard.memory_gb`` above the share, where the definition's sizes alone (no dry run: a lower
    bound of the need) show that the share cannot hold one input set of every workload the session runs beside
    the others: its plan would leave workloads out, and its row would count fewer (at an 11 GB share, L2/001 and
    L2/008 once the plan counted the champion's worker). The smallest cap, in 0.5 GB steps up to the pool, that
    holds them all; None where the share does, or nothing in the pool does (the run's refusal names its need, and
    the retries go on from there)."""
    from kernelarc.guard.memory import plan_memory, plan_settings

    task, gs, workloads = session_workloads(cfg, problem, on_cpu)
    device = "cpu" if on_cpu else "cuda"
    # one input set each, one challenger: what the plan gives up last before it leaves a workload out
    settings = {**plan_settings(gs), "parallel": 1, "hp_reference": False}

    def holds(gb: float) -> bool:
        plan = plan_memory(task, workloads, device, **{**settings, "memory_gb": gb})
        return len(plan.runnable) == len(workloads)

    if holds(share):
        return None
    gb = share
    while gb < pool_gb:
        gb = min(math.floor(gb * 2 + 1) / 2, pool_gb)
        if holds(gb):
            return gb
    return None


def memory_retry_gb(r: ProblemResult, share: float, pool_gb: float) -> float | None:
    """The cap a failed row runs again with in the suite's memory pool: the need its plan named where above the
    share; where the task's reference itself ran out of the GPU's memory and no need was named (the plan's dry run
    ran out too: other shards held more than their shares), ``OOM_SHARES`` shares, at most the pool (on the H200,
    run DR: L2/055's reference ran out at 14.7 GB in an 11 GB share beside 11 other shards and the session failed;
    alone with a 40 GB cap it ran). None: not a failure for memory."""
    from kernelarc.guard.memory import cap_needed_gb

    if r.status is not ProblemStatus.failed:
        return None
    need = cap_needed_gb(r.reason)
    if need is not None:
        need = min(need, pool_gb)  # a lower bound above the pool still runs once with all of it
        return need if need > share else None
    why = (r.reason or "").lower()
    if "reference failed in the guard" in why and "out of memory" in why and share < pool_gb:
        return min(pool_gb, OOM_SHARES * share)
    return None


def ran_out_beside_others(r: ProblemResult) -> bool:
    """A failed row whose run ran out of the GPU's memory (an allocation refused), not refused by its memory plan
    (a need named) nor by its dry run's own cap: on a shared GPU, other processes held more than their shares."""
    from kernelarc.guard.memory import WITHIN_CAP, cap_needed_gb

    why = (r.reason or "").lower()
    return (
        r.status is ProblemStatus.failed
        and "out of memory" in why
        and cap_needed_gb(r.reason) is None
        and WITHIN_CAP not in why
    )


def _memory_pool(c: Any, claims: Path | None) -> tuple[MemoryPool | None, float]:
    """The pool shared over ``suite.claims`` (``suite.memory_pool_gb``) and a session's usual share of it."""
    from kernelarc.app import UsageError

    gb = c.suite.memory_pool_gb
    if gb is None or os.environ.get(CHILD_ENV) == "1":
        return None, 0.0
    if claims is None:
        raise UsageError("suite.memory_pool_gb needs suite.claims: the folder the processes that share it agree on")
    if c.guard.memory_gb is None or c.guard.memory_gb > gb:
        raise UsageError(f"suite.memory_pool_gb={gb:g} needs guard.memory_gb (each session's share) at most that large")
    return MemoryPool(claims / "memory", gb, device_free_gb=_device_free_gb), float(c.guard.memory_gb)


def _device_free_gb() -> float | None:
    """The GPU memory open to this process's reservation (None: no GPU): the driver's free count, this process's
    cached blocks returned first, plus what its allocator still holds, as a reservation caps the process's whole
    use. Counted as free by the driver alone, a process that held any memory could never see its own reservation
    free: on the H100, L2/024's retry with the whole 77 GB pool waited out the pool's grace with the card idle
    (79.2 GB, 4 GB of them this process's)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    return (free + torch.cuda.memory_reserved()) / 2**30


def run_suite(cfg: DictConfig, overrides: list[str]) -> list[ProblemResult]:
    from kernelarc.app import UsageError, resolve_gpu, typed
    from kernelarc.guard.memory import cap_needed_gb

    if not cfg.get("dir"):
        raise UsageError("dir=TREE is required: a folder of SOL-ExecBench problems (definition.json + workload.jsonl)")
    root = Path(hydra.utils.to_absolute_path(cfg.dir))
    try:
        problems = find_problems(root)
        problems = select_problems(root, problems, list(cfg.suite.problems) if cfg.suite.problems else None)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not problems:
        raise UsageError(f"dir={root}: no problem folder (definition.json + workload.jsonl) under it")
    c = typed(_problem_cfg(cfg, problems[0], None))  # validates every key once, before anything runs
    target = resolve_gpu(c)
    out = Path(hydra.utils.to_absolute_path(c.suite.out)) / target.name / suite_key(c, root, target.name)
    results_dir = out / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    child = os.environ.get(CHILD_ENV) == "1"
    if not child:
        save_meta(out / "suite.json", dir=str(root), gpu=target.name, tracking_uri=c.tracking.uri)
    tracker = None
    if c.tracking.enabled and not child:
        try:
            tracker = SuiteTracker(c.tracking.uri, target.name, out / "suite.json")
            params = {"dir": str(root), "problems": len(problems), "suite.workloads": c.suite.workloads,
                      "budget.candidates": c.budget.candidates, "budget.minutes": c.budget.minutes,
                      "agents.count": c.agents.count, "seed": c.seed, "results": str(out)}  # fmt: skip
            tracker.start(params, run_name=f"suite-{root.name}-{target.name}")
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow suite run unavailable: %s", e)
            tracker = None
    if not child:
        print(f"suite: {len(problems)} problems under {root} on {target.name}; results in {out}", flush=True)
    results: list[ProblemResult] = []
    claims = Path(hydra.utils.to_absolute_path(c.suite.claims)) if c.suite.claims and not child else None
    if claims is not None:
        claims.mkdir(parents=True, exist_ok=True)
    pool, share = _memory_pool(c, claims)

    def run_one(i: int, rel: str, problem: Path, memory_gb: float | None) -> ProblemResult:
        """One problem's session (a pool reservation around it where there is a pool); its row, not yet saved."""
        if not child:
            more = f" (guard.memory_gb={memory_gb:g})" if memory_gb is not None else ""
            print(f"[{i}/{len(problems)}] {rel}{more} ...", flush=True)
        log_path = results_dir / f"{slug(rel)}.log"
        pcfg, over = cfg, overrides
        if memory_gb is not None:
            # the refused run's row goes: a child process would return it as its result, and a crash of this
            # run must read as a crash
            rpath_of(rel).unlink(missing_ok=True)
            pcfg = cfg.copy()
            with open_dict(pcfg):
                pcfg.guard.memory_gb = memory_gb
            over = [o for o in overrides if not o.lstrip("+~").startswith("guard.memory_gb=")]
            over.append(f"guard.memory_gb={memory_gb:g}")

        def run() -> ProblemResult:
            if c.suite.isolation == "process" and not child:
                try:
                    return run_subprocess(over, rel, rpath_of(rel), log_path, c.suite.problem_timeout_s)
                except SuiteStopped:
                    if (saved := saved_row(rpath_of(rel))) is not None:  # the child's, saved when the stop reached it
                        record(i, rel, saved, track=False)
                    raise
            return run_inline(pcfg, problem, rel, target, log_path, on_stop=lambda r: record(i, rel, r, track=False))

        t = time.monotonic()
        if pool is None:
            r = run()
        else:
            gb = memory_gb if memory_gb is not None else share

            def waiting(free: float, _s: float) -> None:
                print(f"  {rel}: waiting for {gb:g} GB of the memory pool ({free:g} GB free)", flush=True)

            try:
                with pool.reserved(f"{rel}@{os.getpid()}", gb, priority=memory_gb is not None, on_wait=waiting):
                    t = time.monotonic()
                    r = run()
            except PoolTooSmall as e:
                r = ProblemResult(problem=rel, status=ProblemStatus.failed, reason=f"{e} (the guard's memory plan "
                                  f"needs that for one input set)")  # fmt: skip
        if not child:
            print(_progress(i, len(problems), r, time.monotonic() - t), flush=True)
        return r

    def run_again(i: int, rel: str, problem: Path, need: float) -> ProblemResult:
        """A problem refused for memory, once more with the cap it needs: its pool reservation has priority (no
        process starts a new problem while it waits), so it runs as soon as the others have freed that much. A
        need that was a lower bound (inputs and outputs alone over the cap: the reference never ran) can name a
        larger one once the reference has run: then again with that (at most MEMORY_RETRIES runs, each larger).
        A run out of the GPU's memory with no larger need named, its reservation held, ran out beside other shards'
        processes over their shares (on the H100, runs DT and DU: L2/024's 55.4 GB reservation granted with the
        device free, then another process grew to 20.7 GB): once more with the same cap, after the pool's wait for
        the device's own free memory."""
        r = run_one(i, rel, problem, need)
        same_again = True
        for _ in range(MEMORY_RETRIES - 1):
            more = cap_needed_gb(r.reason) if r.status is ProblemStatus.failed else None
            if more is not None and pool is not None:
                more = min(more, pool.total_gb)  # a lower bound above the pool: once with all of it
            if more is None or more <= need:
                if not (same_again and ran_out_beside_others(r)):
                    break
                same_again = False
                if not child:
                    print(f"  {rel}: out of the GPU's memory with {need:g} GB reserved (other processes over their "
                          "shares): once more", flush=True)  # fmt: skip
                r = run_one(i, rel, problem, need)
                continue
            need = more
            r = run_one(i, rel, problem, need)
        if r.status is ProblemStatus.failed and r.reason and "memory_pool_gb" not in r.reason:
            r.reason = f"with guard.memory_gb={need:g} (suite.memory_pool_gb): {r.reason.split(' [' + DEFERRED)[0]}"
        return r

    def record(i: int, rel: str, r: ProblemResult, track: bool = True) -> None:
        """Save a problem's row (its result file and the table) and log it to the suite's MLflow run; ``track=False``
        from the stop signal's handler, which may have interrupted this thread inside a store call."""
        _write_whole(rpath_of(rel), r.model_dump_json(indent=2))
        results[:] = [x for x in results if x.problem != rel]  # a row saved at a stop, or refused for memory
        results.append(r)
        if not child:
            write_table(results, out)
        if tracker is not None and track:
            try:
                tracker.problem_done(i, r, results)
            except Exception as e:  # noqa: BLE001
                log.warning("MLflow suite logging failed: %s", e)

    def rpath_of(rel: str) -> Path:
        return results_dir / f"{slug(rel)}.json"

    status = "FAILED"
    try:
        for i, problem in enumerate(problems, 1):
            rel = str(problem.relative_to(root)) if problem != root else problem.name
            saved = saved_row(rpath_of(rel))
            if saved is not None and (saved.status is ProblemStatus.crashed or saved.stopped):
                # a crash is a bug or a transient fault (a killed process, a store error), not a result, and a
                # stopped row is a session's result so far: run it again, from its session state
                saved = None
            if saved is not None:
                r = saved
                results.append(r)
                if not child:
                    print(_progress(i, len(problems), r, None, " [saved result]"), flush=True)
                # refused for memory and not yet run again: by one process (another reading the same row from a
                # shared suite.out leaves it)
                again = pool is not None and claims is not None and r.reason and DEFERRED in r.reason
                need = cap_needed_gb(r.reason) or (memory_retry_gb(r, share, pool.total_gb) if again else None)
                if again and need and claim(claims, f"{rel}#memory"):
                    record(i, rel, run_again(i, rel, problem, max(need, share)))
                continue
            if claims is not None and not claim(claims, rel):
                continue  # another process of the same queue runs (or ran) it: its row is in that table
            first = None
            if pool is not None and c.suite.memory_estimate:
                try:
                    first = first_cap_gb(cfg, problem, bool(getattr(target, "is_cpu", True)), share, pool.total_gb)
                except Exception as e:  # noqa: BLE001 - an estimate; the session reports a task that cannot load
                    log.warning("%s: no first memory estimate (%s: %s)", rel, type(e).__name__, e)
            r = run_one(i, rel, problem, first)
            if pool is not None and r.status is ProblemStatus.failed:
                need = memory_retry_gb(r, first or share, pool.total_gb)
                if need is not None and claims is not None and claim(claims, f"{rel}#memory"):
                    # right away, not at the end of the queue: a suite cut by its time limit never reached the
                    # end (on the H200, run DH: L2/004's 24 GB reference); its row says so until the run ends
                    r.reason = f"{r.reason} [{DEFERRED} with guard.memory_gb={need:g}]"
                    record(i, rel, r)
                    r = run_again(i, rel, problem, need)
            record(i, rel, r)
        status = "FINISHED"
    finally:
        if not child:
            files = list(write_table(results, out))
            if tracker is not None:
                try:
                    tracker.finish(results, files, status)
                except Exception as e:  # noqa: BLE001
                    log.warning("closing the MLflow suite run failed: %s", e)
    if not child:
        print("\n" + render_table(results))
        print(
            f"\ntable: {out / 'table.csv'} and {out / 'table.json'}"
            + (f"; MLflow run {tracker.run_id} (experiment kernelarc/suite/{target.name})" if tracker else "")
        )
    return results


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kernelarc.app import TaskError, UsageError, fail

    logging.getLogger("kernelarc").setLevel(logging.WARNING)
    # A suite cut by an outer time limit (``timeout``, a scheduler) says where each thread was, so a
    # problem that overran its budget can be diagnosed from the log alone; then it ends as before.
    # Before that, the running problem's row is saved from what its session has judged so far (_on_stop).
    with contextlib.suppress(AttributeError, ValueError, RuntimeError):  # no SIGTERM here, or not the main thread
        signal.signal(signal.SIGTERM, _on_stop)
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra's runtime (called directly)
        overrides = []
    try:
        run_suite(cfg, overrides)
    except (UsageError, TaskError) as e:
        fail(str(e))
    except SuiteStopped as e:
        print(f"suite stopped by {e}: the rows so far are saved; the same command resumes it", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
