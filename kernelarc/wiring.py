"""The wiring: every object of a search session built from the typed config, once.

The entry points (``python -m kernelarc``, the suite, the ablation, the bench script) call
:func:`build_session`; it resolves the devices, loads the task once (the agents and the guards see
the same object), builds the agents, the guards (local, Ray actors or a test double), the state log,
the board, the plateau detector and the sinks, and hands them to :class:`SearchSession`, which reads
no config. Two sessions that differ only in config (the ablation's arms) are built alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernelarc.board import Board
from kernelarc.config import KernelArcConfig
from kernelarc.families import families_for
from kernelarc.guard.settings import GuardSettings
from kernelarc.plateau import PlateauDetector
from kernelarc.session import LoopSettings, SearchSession, SessionFailed, record_early_failure
from kernelarc.sinks import BoardSink, ProgressSink, RegistrySink, Sinks, TrackerSink, TrackingSpec
from kernelarc.state import StateLog
from kernelarc.tasks.loader import Task, TaskError, fit_workloads, load_builtin, load_task
from kernelarc.ui import Progress

log = logging.getLogger(__name__)

GuardFactory = Callable[[Task, str], Any]  # (task, device) -> an object with the Guard's public interface


def reference_problem(task: Task) -> str | None:
    """Why the task's reference cannot be the baseline before anything is measured (it does not
    import, or defines no callable ``run``), or None. Failures while running it are found by the
    guard, per workload."""
    from kernelarc.tasks.inputs import load_module

    try:
        mod = load_module(task.definition.reference, f"reference_{task.name}")
    except (Exception, SystemExit) as e:  # a reference may raise anything at import; a stop (KeyboardInterrupt, the
        # suite's SuiteStopped) is not the reference's failure and goes on
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


def guard_settings(cfg: KernelArcConfig, task: Task, on_cpu: bool) -> GuardSettings:
    """The session's guard settings: ``guard.*`` with the fields derived from other keys resolved."""
    workloads = cfg.task.workloads
    if on_cpu and workloads is None:
        # On the CPU only workloads that fit run (e.g. SOL-ExecBench problems without a CPU set).
        workloads = [i for i in range(len(task.workloads)) if task.io_bytes(i) <= 64 << 20] or [
            min(range(len(task.workloads)), key=task.io_bytes)
        ]
    return cfg.guard.resolved(
        on_cpu=on_cpu, prestart=cfg.executor.prestart, workloads=workloads, parallel=cfg.executor.parallel
    )


def devices_for(target: Any, cfg: KernelArcConfig) -> list[str]:
    from kernelarc import executors

    remote = executors.devices(cfg, target)  # executor=ray: the cluster's GPUs, not this machine's
    if remote is not None:
        return remote
    if getattr(target, "is_cpu", False) or not torch.cuda.is_available():
        return ["cpu"]
    ids = cfg.executor.gpus if cfg.executor.gpus is not None else list(range(torch.cuda.device_count()))
    return [f"cuda:{i}" for i in ids]


def session_key(cfg: KernelArcConfig, target_name: str) -> str:
    """The state folder's name: the same command resumes the same session."""
    ident = {
        "task": cfg.task.name, "path": cfg.task.path, "workloads": cfg.task.workloads, "gpu": target_name,
        "agents": [cfg.agents.count, cfg.agents.backend, cfg.agents.model], "memory": cfg.memory.limit,
        "strategies": cfg.strategies.names, "seed": cfg.seed, "budget": [cfg.budget.candidates, cfg.budget.minutes],
    }  # fmt: skip
    if cfg.agents.backend == "sweep":  # another sweep is another session (other keys are unchanged)
        sw = cfg.agents.sweep
        ident["sweep"] = [sw.family, sw.grid, sw.points]
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def loop_settings(cfg: KernelArcConfig, guard: GuardSettings) -> LoopSettings:
    b, s = cfg.budget, cfg.search
    return LoopSettings(
        candidates=b.candidates, minutes=b.minutes, usd=b.usd, per_round=cfg.agents.per_round,
        memory_limit=cfg.memory.limit, credit=cfg.agents.credit, parallel=cfg.executor.parallel,
        calibrate=s.calibrate, dispatch=s.dispatch,
        dispatch_min_gain=s.dispatch_min_gain, dispatch_route_margin=s.dispatch_route_margin,
        dispatch_baselines=s.dispatch_baselines, guard=guard, compile_beside_search=s.compile_beside_search,
    )  # fmt: skip


def tracking_spec(cfg: KernelArcConfig, raw_config: dict, task_name: str, target_name: str) -> TrackingSpec | None:
    if not cfg.tracking.enabled:
        return None
    from kernelarc.tracking import session_run_name

    name = session_run_name(task_name, target_name, cfg.agents.count, cfg.memory.limit, cfg.agents.backend, cfg.seed)
    return TrackingSpec(uri=cfg.tracking.uri, run_name=name, params=raw_config, register=cfg.tracking.register)


def build_tracking(cfg: KernelArcConfig, raw_config: dict, task: Task, target: Any,
                   devices: list[str]) -> tuple[TrackerSink | None, RegistrySink | None]:  # fmt: skip
    """The MLflow sinks (not opened yet: the session opens them, resuming its parent run)."""
    spec = tracking_spec(cfg, raw_config, task.name, target.name)
    if spec is None:
        return None, None
    tracker = TrackerSink(spec, task, target.name)
    return tracker, (RegistrySink(tracker, task, target.name, devices[0]) if spec.register else None)


def kernel_library(cfg: KernelArcConfig, task: Task, target: Any, progress: Progress) -> dict[str, dict] | None:
    """The registry as a kernel library for a SOL-ExecBench problem searched offline: the champions of the
    built-in tasks whose kernel families its sites use, on this GPU (kernelarc.registry.kernel_library)."""
    if not hasattr(task, "path") or not (cfg.search.library_uri or (cfg.tracking.enabled and cfg.tracking.register)):
        return None
    from kernelarc.app import backend_of

    if backend_of(cfg) != "search":
        return None
    from kernelarc.families.composed import library_tasks
    from kernelarc.registry import kernel_library as lookup

    wanted = library_tasks(task, families_for(task))
    found = lookup(cfg.search.library_uri or cfg.tracking.uri, target.name, wanted) if wanted else {}
    for fam, (_knobs, where) in sorted(found.items()):
        progress.line(f"kernel library: {fam} starts from {where}@champion")
    return {fam: knobs for fam, (knobs, _) in found.items()} or None


def build_session(cfg: KernelArcConfig, raw_config: dict, target: Any, *, progress: Progress | None = None,
                  agents: list | None = None, task: Task | None = None,
                  make_guard: GuardFactory | None = None) -> SearchSession:  # fmt: skip
    """A ready search session. ``raw_config`` is the composed config as plain data (the parent run's
    params); ``progress`` defaults to ``search.progress``; ``agents`` to the config's team
    (kernelarc.app.build_agents) over the session's task; ``task`` an already loaded one (else it is
    loaded here, once); ``make_guard`` a test double of the guard (kernelarc.simguard: the same loop,
    another measurement)."""
    started = time.monotonic()  # budget.minutes counts the set-up below (loading, capture, guards) too
    if progress is None:
        progress = Progress(cfg.search.progress)
    devices = devices_for(target, cfg)
    on_cpu = all(d == "cpu" for d in devices)  # executor=ray may run several CPU guards
    if task is None:
        task = load_task_from_config(cfg, on_cpu)
    if agents is None:
        from kernelarc.app import build_agents

        agents = build_agents(cfg, task, kernel_library(cfg, task, target, progress), cuda=not on_cpu)
    settings = guard_settings(cfg, task, on_cpu)
    key = session_key(cfg, target.name)
    state_dir = Path(cfg.search.state_dir) / task.name / target.name / key
    problem = reference_problem(task) if make_guard is None else None
    if problem is not None:
        # the reference does not load: no guard can start, the reason is still recorded
        tracker, registry = build_tracking(cfg, raw_config, task, target, devices)
        summary = record_early_failure(problem, task, target.name, StateLog(state_dir), tracker, registry)
        raise SessionFailed(problem, summary)
    if make_guard is not None:
        guards = [make_guard(task, d) for d in devices]
    else:
        from kernelarc.executors import make_guards

        guards = make_guards(cfg, task, target, devices, settings)  # local Guards or Ray actors
    if not cfg.search.resume and state_dir.is_dir():  # start fresh; the old log stays beside it
        state_dir.rename(state_dir.with_name(f"{key}.{time.strftime('%Y%m%d-%H%M%S')}"))
    state = StateLog(state_dir)
    board = Board(state.dir / "board.jsonl")
    plateau = PlateauDetector(cfg.search.plateau_patience, families={f.name: f.language for f in families_for(task)})
    tracker, registry = build_tracking(cfg, raw_config, task, target, devices)
    sinks = Sinks(board=BoardSink(board, task, guards[0].workloads), progress=ProgressSink(progress),
                  tracker=tracker, registry=registry)  # fmt: skip
    return SearchSession(task, target, agents, guards, devices=devices, settings=loop_settings(cfg, settings),
                         state=state, plateau=plateau, sinks=sinks, started=started)  # fmt: skip
