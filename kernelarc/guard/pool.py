"""Pre-started, single-use worker processes.

Starting a process that imports torch and initialises CUDA costs seconds; the pool keeps
a few such processes ready so that isolation does not slow the search. Each process
takes exactly one candidate and then exits; the pool starts its replacement at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch.multiprocessing as tmp

from kernelarc.guard.worker import worker_main

log = logging.getLogger(__name__)
_ctx = tmp.get_context("spawn")


@dataclass
class Worker:
    process: object
    conn: object
    started: float
    ready: bool = False
    info: dict | None = None

    def kill(self) -> None:
        # The worker leads its own process group (worker_main): take its children (nvcc, ptxas) with it.
        pid = getattr(self.process, "pid", None)
        if pid:
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.join(timeout=5)
        with contextlib.suppress(Exception):
            self.conn.close()


class WorkerPool:
    """Keeps ``size`` workers for one device started and ready."""

    def __init__(self, device: str, size: int = 2, start_timeout: float = 120.0):
        self.device = device
        self.size = max(1, size)
        self.start_timeout = start_timeout
        self._lock = threading.Lock()
        self._idle: list[Worker] = []
        self._closed = False
        for _ in range(self.size):
            self._idle.append(self._spawn())

    def _spawn(self) -> Worker:
        parent, child = _ctx.Pipe(duplex=True)
        p = _ctx.Process(target=worker_main, args=(child, self.device), daemon=True)
        p.start()
        child.close()
        return Worker(p, parent, time.monotonic())

    def acquire(self) -> Worker:
        """A ready worker (waits for its start-up); a replacement starts immediately."""
        with self._lock:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            w = self._idle.pop(0) if self._idle else self._spawn()
            self._idle.append(self._spawn())
        deadline = w.started + self.start_timeout
        while not w.ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not w.process.is_alive():
                w.kill()
                raise RuntimeError(f"guard worker for {self.device} failed to start (exit code {w.process.exitcode})")
            if w.conn.poll(min(remaining, 1.0)):
                kind, info = w.conn.recv()
                if kind == "ready":
                    w.ready, w.info = True, info
        return w

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
