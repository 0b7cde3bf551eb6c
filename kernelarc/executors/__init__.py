"""Where guards run: ``executor=local`` (worker processes on this machine, one guard per visible GPU)
or ``executor=ray`` (one Ray actor per GPU of a cluster hosting a guard; agents and the session stay
on the driver). Both give the session objects with the Guard's public interface."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Executor(StrEnum):
    local = "local"
    ray = "ray"


class ExecutorError(ValueError):
    """A misconfigured executor (unknown name, Ray missing or unreachable)."""


def executor_of(name: str) -> Executor:
    try:
        return Executor(name)
    except ValueError:
        raise ExecutorError(
            f"unknown executor {name!r}: executor=local (worker processes on this machine) or executor=ray "
            "(guard actors on a Ray cluster; pip install -e '.[ray]')"
        ) from None


def check_executor(cfg: Any) -> None:
    """Validate ``cfg.executor`` before anything runs (the app turns ExecutorError into a usage error)."""
    ex = executor_of(cfg.executor.name)
    actors = getattr(cfg.executor, "actors", None)
    if actors is not None and (isinstance(actors, bool) or not isinstance(actors, int) or actors < 1):
        raise ExecutorError(f"executor.actors must be a positive integer or null, not {actors!r}")
    if ex is Executor.ray:
        from kernelarc.executors.ray import require_ray

        require_ray()


def devices(cfg: Any, target: Any) -> list[str] | None:
    """The guards' devices for a non-local executor (None: the local rule applies)."""
    if executor_of(cfg.executor.name) is Executor.ray:
        from kernelarc.executors.ray import ray_devices

        return ray_devices(cfg.executor, target)
    return None


def make_guards(cfg: Any, task: Any, target: Any, devices: list[str], gcfg: Any) -> list[Any]:
    """One guard per device: in this process (local) or as Ray actors."""
    if executor_of(cfg.executor.name) is Executor.ray:
        from kernelarc.executors.ray import RayGuard

        return [RayGuard(task, target, d, gcfg, seed=cfg.seed, index=i) for i, d in enumerate(devices)]
    from kernelarc.guard.judge import Guard

    return [Guard(task, target, d, gcfg, seed=cfg.seed) for d in devices]
