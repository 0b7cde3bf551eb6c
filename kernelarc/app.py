"""Shared wiring of the entry points: typed config, hardware target, agents, errors."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from omegaconf import DictConfig

from kernelarc.config import KernelArcConfig, to_object
from kernelarc.families.base import STRATEGIES
from kernelarc.tasks.loader import TaskError, builtin_tasks

log = logging.getLogger("kernelarc")


class UsageError(Exception):
    """Misuse of a command (exit code 2), as opposed to a verdict or a search outcome."""


def typed(cfg: DictConfig) -> KernelArcConfig:
    if "task" not in cfg or cfg.task is None or cfg.task.get("name") in (None, "???"):
        raise UsageError(
            "no task given: add +task=NAME, one of "
            + ", ".join(builtin_tasks())
            + " (or +task=sol_execbench task.path=DIR)"
        )
    try:
        obj = to_object(cfg)
    except Exception as e:  # noqa: BLE001 - OmegaConf validation and missing values
        raise UsageError(f"invalid configuration: {e}") from None
    if obj.task.name not in builtin_tasks() and obj.task.name != "sol_execbench":
        raise UsageError(
            f"unknown task {obj.task.name!r}; built-in tasks: {', '.join(builtin_tasks())} (or sol_execbench)"
        )
    from kernelarc.agents.search import OPERATOR_STRATEGIES

    bad = [s for s in obj.strategies.names if s not in STRATEGIES + OPERATOR_STRATEGIES]
    if bad:
        raise UsageError(f"unknown strategies {bad}; known: {', '.join(STRATEGIES + OPERATOR_STRATEGIES)}")
    from kernelarc.executors import ExecutorError, check_executor

    try:
        check_executor(obj)
    except ExecutorError as e:
        raise UsageError(str(e)) from None
    check_limits(obj)
    return obj


def check_limits(c: KernelArcConfig) -> None:
    """Budgets and counts that cannot run (zero, negative, not a number) are usage errors, raised
    before anything is measured: a session with nothing to spend must not start and idle."""
    import math

    def positive(key: str, value: float | None, *, integer: bool = False, allow_zero: bool = False) -> None:
        if value is None:
            return
        bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        bad = bad or (value < 0 if allow_zero else value <= 0)
        if bad or (integer and int(value) != value):
            kind = "a non-negative" if allow_zero else "a positive"
            raise UsageError(f"{key} must be {kind} {'integer' if integer else 'number'}, not {value!r}")

    positive("budget.candidates", c.budget.candidates, integer=True)
    positive("budget.minutes", c.budget.minutes)
    positive("budget.usd", c.budget.usd)
    positive("agents.count", c.agents.count, integer=True)
    positive("agents.per_round", c.agents.per_round, integer=True)
    positive("executor.parallel", c.executor.parallel, integer=True)
    positive("executor.prestart", c.executor.prestart, integer=True, allow_zero=True)
    positive("memory.limit", c.memory.limit, integer=True, allow_zero=True)
    positive("guard.seeds", c.guard.seeds, integer=True)
    positive("guard.seed_pool", c.guard.seed_pool, integer=True)
    positive("guard.timeout_s", c.guard.timeout_s)
    positive("guard.baseline_timeout_s", c.guard.baseline_timeout_s)
    positive("guard.target_ms", c.guard.target_ms)
    positive("guard.min_iters", c.guard.min_iters, integer=True)
    positive("guard.max_iters", c.guard.max_iters, integer=True)
    positive("search.plateau_patience", c.search.plateau_patience, integer=True)
    positive("suite.workloads", c.suite.workloads, integer=True)
    positive("suite.problem_timeout_s", c.suite.problem_timeout_s)
    if c.guard.max_iters < c.guard.min_iters:
        raise UsageError(f"guard.max_iters ({c.guard.max_iters}) is below guard.min_iters ({c.guard.min_iters})")
    if c.guard.seed_pool < c.guard.seeds:
        raise UsageError(f"guard.seed_pool ({c.guard.seed_pool}) is below guard.seeds ({c.guard.seeds})")
    if c.suite.isolation not in ("inline", "process"):
        raise UsageError(f"suite.isolation must be inline or process, not {c.suite.isolation!r}")


def resolve_gpu(cfg: KernelArcConfig):
    from kernelarc.hardware import HardwareMismatch, resolve_target

    try:
        return resolve_target(cfg.gpu)
    except (HardwareMismatch, ValueError) as e:
        raise UsageError(str(e)) from None


def backend_of(cfg: KernelArcConfig) -> str:
    b = cfg.agents.backend
    if b == "auto":
        return "anthropic" if os.environ.get("ANTHROPIC_API_KEY") else "search"
    if b not in ("search", "anthropic", "sweep"):
        raise UsageError(f"agents.backend must be search, anthropic, sweep or auto, not {b!r}")
    return b


def relevant_strategies(names: list[str], task_name: str) -> list[str]:
    """``names`` reordered for the offline agents: first the strategies that own a knob of the task's
    kernel families (or, for ``algorithmic``, can switch between several families), in the user's
    order, then the others. With fewer agents than strategies, no agent is spent on a strategy that
    has nothing to move for this task (precision and fusion own no GEMM knob)."""
    from kernelarc.families import families_for

    fams = families_for(task_name)
    owned = {k.strategy for f in fams for k in f.knobs}
    if len(fams) > 1:
        owned.add("algorithmic")
    if not owned:
        return list(names)
    return [n for n in names if n in owned] + [n for n in names if n not in owned]


def build_agents(cfg: KernelArcConfig, task, library: dict | None = None, cuda: bool = True) -> list[Any]:
    """The team. ``library``: kernel family -> knobs of the registry's champions of the built-in tasks
    (kernelarc.registry.kernel_library), start points for a composed problem's sites. ``cuda=False``: the
    guards run on the CPU (the offline agents leave out what only a GPU run changes)."""
    backend = backend_of(cfg)
    if backend == "sweep":
        from kernelarc.agents.sweep import SweepError, build_sweep_agents

        sw = cfg.agents.sweep
        try:
            return build_sweep_agents(task.name, cfg.agents.count, sw.family, sw.grid, sw.points)
        except SweepError as e:
            raise UsageError(str(e)) from None
    strategies = list(cfg.strategies.names)
    if backend == "search":
        from kernelarc.agents.search import offline_team

        # operators first, then the knob classes this task's families have; one agent: the generalist
        strategies = offline_team(strategies, cfg.agents.count, task)
    else:
        # exploit / explore / transplant / generalist are offline operators: LLM agents take the briefed strategies
        strategies = [s for s in strategies if s in STRATEGIES] or list(STRATEGIES)
    agents: list[Any] = []
    for i in range(cfg.agents.count):
        strategy = strategies[i % len(strategies)]
        name = f"agent{i}-{strategy}"
        if backend == "search":
            from kernelarc.agents.search import SearchAgent

            agents.append(SearchAgent(name, strategy, task, seed=cfg.seed, credit=cfg.agents.credit, library=library,
                                      cuda=cuda))  # fmt: skip
        else:
            from kernelarc.agents.briefs import load_brief
            from kernelarc.agents.llm import AgentConfigError, AnthropicAgent

            try:
                agents.append(
                    AnthropicAgent(
                        name,
                        strategy,
                        load_brief(strategy, cfg.strategies.briefs_dir),
                        cfg.agents.model,
                        max_tokens=cfg.agents.max_tokens,
                        temperature=cfg.agents.temperature,
                        pricing=cfg.agents.pricing,
                        timeout=cfg.agents.timeout_s,
                        max_retries=cfg.agents.max_retries,
                    )  # fmt: skip
                )
            except AgentConfigError as e:
                raise UsageError(str(e)) from None
    if backend == "anthropic" and cfg.agents.tune_llm_knobs:
        from kernelarc.agents.tuner import KnobTuner

        agents.append(KnobTuner("tuner-llm-knobs", "tiling", task, seed=cfg.seed))
    return agents


def fail(msg: str, code: int = 2) -> None:
    print(f"kernelarc: error: {msg}", file=sys.stderr)
    sys.exit(code)


__all__ = ["TaskError", "UsageError", "backend_of", "build_agents", "check_limits", "fail", "resolve_gpu", "typed"]
