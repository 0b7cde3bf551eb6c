"""Pre-started, single-use worker processes.

Starting a process that imports torch and initialises CUDA costs seconds; the pool keeps
enough such processes ready (``GuardSettings.pool_size``: what the evaluations in flight take) so
that isolation does not slow the search. Each process takes exactly one job (a challenger's
evaluation, or one champion's evaluations) and is then killed; the pool starts its replacement
as soon as it is taken.

A worker is a plain ``python`` subprocess (no multiprocessing: nothing is unpickled on the
judge's side) in its own session, stdin closed, stdout and stderr on a log file the judge
created, talking to the judge over one socket (``protocol.Channel``). Its identity (uid,
private directories) comes from ``sandbox``; killing a worker kills every process it left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelarc.guard.benchlock import open_for_worker
from kernelarc.guard.protocol import Channel, ProtocolError, Ready
from kernelarc.guard.sandbox import Identity, sandbox

log = logging.getLogger(__name__)

_BOOT = "from kernelarc.guard.worker import main; main()"
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


@dataclass
class Worker:
    process: subprocess.Popen
    chan: Channel
    started: float
    ident: Identity
    log_path: str
    ready: bool = False
    info: dict | None = None
    keep: list[Any] = field(default_factory=list)  # judge-side resources the worker maps (output buffer)
    since: int = 0  # the worker's start time in clock ticks after boot: its processes started later
    buffer: Any = None  # the output buffer it mapped (and page-locked) while starting, the pool's (buffers.py)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self, wait: bool = True) -> None:
        """SIGKILL the worker, its session and group and every process of its identity, at once; with
        ``wait=False`` the reaping, the repeated sweeps and the release of its uid slot finish in a
        background thread (``WorkerPool.close`` joins them)."""
        pid = self.process.pid
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.kill()
        since = self.since
        with contextlib.suppress(Exception):
            sandbox().kill_all(self.ident, pid, since, rounds=1)
        self.chan.close()
        if wait:
            self._cleanup()
        else:
            t = threading.Thread(target=self._cleanup, name="kernelarc-worker-cleanup", daemon=True)
            t.start()
            _CLEANUPS.append(t)

    def _cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.process.wait(timeout=10)
        with contextlib.suppress(Exception):
            sandbox().release(self.ident, self.process.pid, self.since)
        for x in self.keep:  # the buffers it mapped: unlocked and unlinked once it is gone
            with contextlib.suppress(Exception):
                x.close()
        self.keep.clear()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


_CLEANUPS: list[threading.Thread] = []


def join_cleanups(timeout: float = 30.0) -> None:
    """Wait for the background cleanups of killed workers."""
    deadline = time.monotonic() + timeout
    while _CLEANUPS:
        t = _CLEANUPS.pop()
        t.join(max(deadline - time.monotonic(), 0.0))


def _spawn(device: str, buffer_bytes: int = 0, bench_lock: tuple[Path | None, float] = (None, 0.0)) -> Worker:
    """A worker process; with ``buffer_bytes``, an output buffer of that size that it maps (and, on a GPU,
    page-locks) while it starts, where an evaluation's own buffer would pay for it on the judge's path; with
    ``bench_lock`` (the device's lock file, seconds), the descriptors its warm-ups' benchmarking locks (benchlock)."""
    sb = sandbox()
    ident = sb.allocate()
    judge_end, worker_end = socket.socketpair()
    fd, log_path = tempfile.mkstemp(prefix="kernelarc-worker-", suffix=".log")
    # Candidate code reads its environment: no credentials of the judge's reach it (nor, through its
    # log, a verdict).
    env = {k: v for k, v in os.environ.items() if not _SECRET.search(k)}
    env.update(sb.env(ident))
    # The worker imports kernelarc the way this process does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    # torch.compile compiles in the worker itself instead of a subprocess pool (no stray children).
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    buf = None
    if buffer_bytes > 0:
        from kernelarc.guard.buffers import JudgeBuffer

        buf = JudgeBuffer(device, buffer_bytes, pin_now=False)
    argv = [str(worker_end.fileno()), device] + ([buf.path, str(buf.nbytes)] if buf is not None else [])
    lock_fds, lock_env = open_for_worker(*bench_lock)
    env.update(lock_env)
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", _BOOT, *argv],
            pass_fds=(worker_end.fileno(), *lock_fds),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            env=env,
            cwd=ident.tmp,
        )
    except BaseException:
        if buf is not None:
            buf.close()
        raise
    finally:
        worker_end.close()
        os.close(fd)
        for lfd in lock_fds:
            os.close(lfd)
    w = Worker(p, Channel(judge_end), time.monotonic(), ident, log_path, since=sb.start_ticks(p.pid), buffer=buf)
    if buf is not None:
        w.keep.append(buf)
    return w


def _log_tail(path: str, n: int = 400) -> str:
    """The end of a worker's own log (its stderr before it could speak the protocol), for a start
    failure's message: a crash at import or CUDA start-up says why there and nowhere else."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f"; worker log: ...{' | '.join(text.splitlines()[-6:])}" if text else ""


class _NotStarted(Exception):
    """The worker died, or its start-up outlasted the pool's timeout, before it said it was ready."""


@dataclass
class PoolStats:
    """What a pool did: workers started, and acquisitions that found no started worker ready (and waited)."""

    starts: int = 0
    acquired: int = 0
    waits: int = 0
    wait_s: float = 0.0
    replaced_dead: int = 0


class WorkerPool:
    """Keeps ``size`` workers for one device started: every acquisition starts its replacement at once, so
    the next one finds a worker that started while the previous candidates were judged."""

    def __init__(self, device: str, size: int = 2, start_timeout: float = 120.0, buffer_bytes: int = 0,
                 bench_lock: tuple[Path | None, float] = (None, 0.0)):  # fmt: skip
        self.device = device
        self.bench_lock = bench_lock  # (the device's lock file, seconds): see _spawn
        self.size = max(1, size)
        self.buffer_bytes = buffer_bytes  # each worker's output buffer, made at its start (0: none)
        self.start_timeout = start_timeout
        self._lock = threading.Lock()
        self._idle: list[Worker] = []
        self._closed = False
        self.stats = PoolStats()
        for _ in range(self.size):
            self._idle.append(self._spawn())

    def _spawn(self) -> Worker:
        self.stats.starts += 1
        return _spawn(self.device, self.buffer_bytes, self.bench_lock)

    @staticmethod
    def _poll(w: Worker) -> None:
        """Take a started worker's Ready message if it is there (never blocks)."""
        if w.ready or not w.chan.readable(0):
            return
        with contextlib.suppress(Exception):  # a bad start shows in acquire, which reports it
            msg = w.chan.recv_message(0.5)
            if isinstance(msg, Ready):
                w.ready, w.info = True, {"pid": msg.pid}

    def idle_ready(self) -> int:
        """How many idle workers have said they are ready."""
        with self._lock:
            for w in self._idle:
                self._poll(w)
            return sum(w.ready for w in self._idle)

    def acquire(self) -> Worker:
        """A ready worker (a ready one first; else the oldest, whose start-up it waits for); a replacement
        starts immediately. A worker that died while idle is replaced, not handed out."""
        with self._lock:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            for w in list(self._idle):
                self._poll(w)
                if not w.alive():  # died while idle (killed, out of memory): its start is lost
                    self._idle.remove(w)
                    w.kill(wait=False)
                    self.stats.replaced_dead += 1
            ready = [w for w in self._idle if w.ready]
            w = ready[0] if ready else (self._idle[0] if self._idle else self._spawn())
            if w in self._idle:
                self._idle.remove(w)
            while len(self._idle) < self.size:
                self._idle.append(self._spawn())
            self.stats.acquired += 1
            waited = not w.ready
            if waited:
                self.stats.waits += 1
        t0 = time.monotonic()
        deadline = w.started + self.start_timeout
        try:
            while not w.ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not w.alive():
                    raise _NotStarted()
                if w.chan.readable(min(remaining, 1.0)):
                    msg = w.chan.recv_message(remaining)
                    if isinstance(msg, Ready):
                        w.ready, w.info = True, {"pid": msg.pid}
        except _NotStarted:
            raise self._start_failure(w, "", wait_s=0) from None
        except (EOFError, TimeoutError, OSError, ProtocolError) as e:
            # a worker that closed its end is usually exiting: its last words are still being written
            raise self._start_failure(w, f": {e}", wait_s=3) from None
        except RuntimeError:
            w.kill()
            raise
        finally:
            if waited:
                with self._lock:
                    self.stats.wait_s += time.monotonic() - t0
        return w

    def _start_failure(self, w: Worker, detail: str, wait_s: float) -> RuntimeError:
        """Kill a worker that did not start; the error says how it ended and the end of its own log
        (read before kill(), whose cleanup removes the log)."""
        try:
            code = w.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        tail = _log_tail(w.log_path)
        w.kill()
        why = "still running" if code is None else f"exit code {code}"
        return RuntimeError(f"guard worker for {self.device} failed to start{detail} ({why}){tail}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
        join_cleanups()
