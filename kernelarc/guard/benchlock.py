"""A warm-up's GPU benchmarking, never beside another session's timing (``guard.bench_lock_s``).

Autotuning runs kernels on the GPU in tight loops: Triton's ``@triton.autotune`` (``triton.testing.do_bench``)
and Inductor's (``torch._inductor.runtime.benchmarking``'s benchmarker, max-autotune, its Triton heuristics)
time every configuration at a candidate's first calls, in its warm-up, outside the device lock. On a GPU that
several sessions share, those loops time-slice with another session's measured calls: run E2 (twelve sessions
on one H100) voided 19 of 230 comparisons and cost four champions their final proof, the champion timing 1.5-3x
slower beside a challenger than when it was crowned. ``guard.warmup_lock_s`` keeps every timing back for a
whole warm-up, compilation (CPU work) included, and halved the candidates judged with eight sessions on a GPU.

This keeps back only the benchmarking. With ``guard.bench_lock_s`` > 0 the judge passes each worker a
descriptor of its device's lock file (``DeviceLock.path``) and of its turnstile (the worker's uid could not open
the judge's files); in a warm-up the judge allows it, each benchmarking call of the worker takes the lock
*shared* (``BenchLock.hold``): it waits while another process times on the device, and a timer waits for it,
and for the others in progress, to end. Calls nest (a benchmarker delegating to another) and take it once.
A worker waits ``bench_lock_s`` seconds at most in all (the judge moves the candidate's deadline by what it
waited, as for its own waits for the device); past that its benchmarking goes on unlocked. Outside a warm-up (and
in a warm-up the judge runs under its own exclusive lock: a CUTLASS candidate's) the hooks do nothing.

A candidate could flock the descriptor itself: it could then hold other sessions' timings back until it is
killed, never make its own timing faster (its judge's timing waits too). The hooks measure nothing the judge
uses, so undoing them only undoes the protection.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kernelarc.guard.devlock import _flock

log = logging.getLogger(__name__)

ENV = "KERNELARC_BENCH_LOCK"  # in a worker's environment: "LOCK_FD,GATE_FD,BUDGET_S"
INDUCTOR = "torch._inductor.runtime.benchmarking"


def open_for_worker(path: Path | None, budget_s: float) -> tuple[tuple[int, ...], dict[str, str]]:
    """The judge's side: descriptors of the lock file and its turnstile for a worker to inherit, and the
    environment entry that names them; none where there is no cross-process lock or no budget. The caller closes
    the descriptors once the worker has started."""
    if path is None or budget_s <= 0:
        return (), {}
    fds: list[int] = []
    try:
        for p in (path, Path(str(path) + ".gate")):
            fds.append(os.open(p, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        log.warning("benchmarking lock %s unavailable to the workers: %s", path, e)
        return (), {}
    return tuple(fds), {ENV: f"{fds[0]},{fds[1]},{budget_s:g}"}


class BenchLock:
    """The worker's side: the device lock taken shared around each benchmarking call while ``armed``."""

    def __init__(self, lock_fd: int, gate_fd: int, budget_s: float):
        self.lock_fd, self.gate_fd, self.budget_s = lock_fd, gate_fd, budget_s
        self.armed = False  # in a warm-up the judge allowed it for
        self.waited_s = 0.0  # seconds waited for other sessions' timings, this worker's life long
        self.calls = 0  # benchmarking calls that took the lock
        self._depth = 0
        self._mutex = threading.Lock()

    def left_s(self) -> float:
        return max(self.budget_s - self.waited_s, 0.0)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._mutex:
            self._depth += 1
            outer = self._depth == 1
        taken = False
        try:
            if outer and self.armed and self.left_s() > 0:
                taken = self._take()
            yield
        finally:
            with self._mutex:
                self._depth -= 1
            if taken:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def _take(self) -> bool:
        t = time.monotonic()
        deadline = t + self.left_s()
        try:
            # through the turnstile without keeping it (a waiting timer holds it): no stream of benchmarking calls
            # keeps a timer waiting for ever
            passed = _flock(self.gate_fd, fcntl.LOCK_SH, deadline)
            if passed:
                fcntl.flock(self.gate_fd, fcntl.LOCK_UN)
            taken = passed and _flock(self.lock_fd, fcntl.LOCK_SH, deadline)
        except OSError as e:
            log.debug("benchmarking lock unavailable: %s", e)
            taken = False
        self.waited_s += time.monotonic() - t
        self.calls += taken
        return taken

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(fn, "_kernelarc_bench_lock", None) is self:
            return fn

        @functools.wraps(fn)
        def locked(*a: Any, **k: Any) -> Any:
            with self.hold():
                return fn(*a, **k)

        locked._kernelarc_bench_lock = self  # type: ignore[attr-defined]
        return locked


def _patch_inductor(bl: BenchLock, mod: Any) -> None:
    if hasattr(mod, "set_gpu_benchmark_lock_context"):  # torch >= 2.13: the hook Inductor provides for this
        mod.set_gpu_benchmark_lock_context(bl.hold)
        return
    inst = getattr(mod, "benchmarker", None)  # before: the one benchmarker instance every caller uses
    if inst is not None:
        for name in ("benchmark_gpu", "benchmark"):
            if callable(getattr(inst, name, None)):
                setattr(inst, name, bl.wrap(getattr(inst, name)))


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches Inductor's benchmarking module when it is first imported (it costs about a second to import, which a
    worker that never compiles should not pay)."""

    def __init__(self, bl: BenchLock):
        self.bl = bl

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != INDUCTOR:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, bl = loader.exec_module, self.bl

        def exec_module(module: Any) -> None:
            run(module)
            _patch_inductor(bl, module)

        loader.exec_module = exec_module
        return spec


def install(env: dict[str, str] | os._Environ = os.environ) -> BenchLock | None:
    """In a worker, before any candidate code: hooks on Triton's and Inductor's GPU benchmarking, where the judge
    passed the descriptors (``ENV``); None otherwise."""
    spec = env.get(ENV)
    if not spec:
        return None
    lock_fd, gate_fd, budget = spec.split(",")
    bl = BenchLock(int(lock_fd), int(gate_fd), float(budget))
    try:
        import triton.testing as tt

        tt.do_bench = bl.wrap(tt.do_bench)
    except Exception as e:  # noqa: BLE001 - no Triton: nothing of its to hold back
        log.debug("no triton.testing to hook: %s", e)
    if INDUCTOR in sys.modules:
        _patch_inductor(bl, sys.modules[INDUCTOR])
    else:
        sys.meta_path.insert(0, _OnImport(bl))
    return bl
