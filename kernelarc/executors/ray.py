"""``executor=ray``: guards as Ray actors, one per GPU (``num_gpus=1``), CPU actors where there is no GPU.

The agents, the board, the state log and MLflow stay on the driver (the session); each actor hosts a
``kernelarc.guard.judge.Guard`` and its worker processes on its node, with Ray's CUDA_VISIBLE_DEVICES
making its GPU ``cuda:0``. ``RayGuard`` is the driver-side stand-in with the Guard's public interface
(``evaluate``, ``set_baselines``, ``refresh_metrics``, ``close``; ``workloads``, ``work``,
``baseline_ms``, ``compile_ms``), so the session's loop is the same for both executors.

An actor that dies (its node lost, killed, out of memory) is the verdict of the candidates it was
judging (``runtime_error``), never a dead session: the next call starts a fresh actor and gives it the
baselines measured so far. ``executor.address`` joins an existing cluster (``ray start --head`` on one
node, ``ray start --address=HEAD:6379`` on the others); without it a local one is started.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kernelarc.executors import ExecutorError
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Status, Verdict

log = logging.getLogger(__name__)

# Passed to every actor: how kernels run there must match how they would run here.
_FORWARD_ENV = ("TRITON_INTERPRET", "PYTHONPATH", "KERNELARC_CUTLASS_DIR", "CUTLASS_PATH")
_STATE = ("workloads", "work", "baseline_ms", "compile_ms")
_init_lock = threading.Lock()


def require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ExecutorError("executor=ray needs Ray: pip install -e '.[ray]'") from None


def connect(address: str | None) -> None:
    """Join ``address`` (a running cluster) or start a local one, once per process."""
    require_ray()
    import ray

    with _init_lock:
        if ray.is_initialized():
            return
        env = {k: os.environ[k] for k in _FORWARD_ENV if k in os.environ}
        kw: dict[str, Any] = {
            "runtime_env": {"env_vars": env} if env else None,
            "logging_level": logging.WARNING,
            "configure_logging": False,
        }
        try:
            if address:
                ray.init(address=address, **kw)
            else:
                ray.init(include_dashboard=False, **kw)
        except ConnectionError as e:
            raise ExecutorError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
        log.info("ray: %s", ray.cluster_resources())


def ray_devices(ex: Any, target: Any) -> list[str]:
    """The actors' devices: ``cuda:0`` (each actor's own GPU) per GPU used, or ``cpu`` per CPU actor."""
    connect(getattr(ex, "address", None))
    import ray

    actors = getattr(ex, "actors", None)
    if getattr(target, "is_cpu", False):
        return ["cpu"] * (actors or 1)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        raise ExecutorError("the Ray cluster has no GPU: add GPU nodes, or run on the CPU with gpu=cpu")
    wanted = actors or (len(ex.gpus) if ex.gpus else gpus)
    if wanted > gpus:
        raise ExecutorError(f"{wanted} guard actors asked for, the Ray cluster has {gpus} GPUs")
    return ["cuda:0"] * wanted


class _GuardHost:
    """The Ray actor: a Guard on this node (threaded: several candidates in flight, as locally)."""

    def __init__(self, task: Any, target: Any, device: str, gcfg: GuardSettings, seed: int):
        from kernelarc.guard.judge import Guard

        self.guard = Guard(task, target, device, gcfg, seed=seed)

    def state(self) -> dict[str, Any]:
        return {name: getattr(self.guard, name) for name in _STATE}

    def node(self) -> dict[str, Any]:
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def evaluate(self, args: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
        return self.guard.evaluate(*args, **kwargs), self.state()

    def set_baselines(self, reference: Any, compiled: Any) -> dict[str, Any]:
        self.guard.set_baselines(reference, compiled)
        return self.state()

    def refresh_metrics(self, ev: Any) -> tuple[Any, dict[str, Any]]:
        self.guard.refresh_metrics(ev)
        return ev.verdict, self.state()

    def close(self) -> None:
        self.guard.close()


class RayGuard:
    """Driver-side Guard whose work runs in a Ray actor (restarted after it dies)."""

    def __init__(self, task: Any, target: Any, device: str, gcfg: GuardSettings, seed: int = 0, index: int = 0):
        self.task, self.target, self.device, self.cfg, self.seed, self.index = task, target, device, gcfg, seed, index
        self.workloads: list[int] = []
        self.work: dict[int, Any] = {}
        self.baseline_ms: dict[int, float] = {}
        self.compile_ms: dict[int, float] = {}
        self.restarts = 0
        self._baselines: list[tuple[Any, Any]] = []  # replayed into a restarted actor
        self._lock = threading.Lock()
        self._actor = self._start()

    def _start(self):
        import ray

        gpu = self.device.startswith("cuda")
        # Timing is serialised inside the Guard; the extra slots let state queries pass waiting evaluations.
        concurrency = max(2, int(getattr(self.cfg, "prestart", 2)) + 4)
        host = ray.remote(_GuardHost).options(
            num_gpus=1 if gpu else 0,
            num_cpus=1 if gpu else 0,
            max_concurrency=concurrency,
            name=None,
        )
        actor = host.remote(self.task, self.target, self.device, self.cfg, self.seed)
        for reference, compiled in self._baselines:  # one by one: a threaded actor does not keep call order
            ray.get(actor.set_baselines.remote(reference, compiled))
        self._apply(ray.get(actor.state.remote()))
        return actor

    def _apply(self, state: dict[str, Any]) -> None:
        for name in _STATE:
            setattr(self, name, state[name])

    def _call(self, method: str, *args: Any) -> Any:
        """``actor.method(*args)``; a dead actor is replaced and the error re-raised to the caller."""
        import ray
        from ray.exceptions import RayActorError

        actor = self._actor
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except RayActorError:
            with self._lock:
                if self._actor is actor:  # the first caller to see it dead starts the next one
                    self.restarts += 1
                    log.warning("guard actor %d died (restart %d)", self.index, self.restarts)
                    self._actor = self._start()
            raise

    def node(self) -> dict[str, Any]:
        """Where the actor runs (pid, host, its CUDA_VISIBLE_DEVICES)."""
        return self._call("node")

    def evaluate(self, candidate: Any, *args: Any, **kwargs: Any):
        from ray.exceptions import RayActorError

        from kernelarc.guard.judge import Evaluation

        try:
            ev, state = self._call("evaluate", (candidate, *args), kwargs)
        except RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            verdict = Verdict(
                candidate_id=candidate.id,
                status=Status.runtime_error,
                errors=[f"guard actor {self.index} died while judging this candidate: {first[:300]}"],
            )
            return Evaluation(verdict)
        self._apply(state)
        return ev

    def set_baselines(self, reference: Any, compiled: Any) -> None:
        self._baselines.append((reference, compiled))
        self._apply(self._call("set_baselines", reference, compiled))

    def refresh_metrics(self, ev: Any) -> None:
        verdict, state = self._call("refresh_metrics", ev)
        for name in type(verdict).model_fields:  # the Guard updates the caller's verdict in place
            setattr(ev.verdict, name, getattr(verdict, name))
        self._apply(state)

    def close(self) -> None:
        import ray

        try:
            ray.get(self._actor.close.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - closing a dead actor's workers is the node's business
            log.debug("guard actor %d close: %s", self.index, e)
        ray.kill(self._actor)

    def __enter__(self) -> RayGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
