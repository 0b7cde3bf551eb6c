"""GPU memory shared by the suite processes of one claims queue (``suite.memory_pool_gb``).

Several suite processes (``scripts/gpu_suite.sh``'s shards) run sessions on one GPU, each planning up to
``guard.memory_gb`` for itself (kernelarc.guard.memory). A fixed share fits most problems; a few need more
than the share for a single input set (on the H200 suite, 8 shards x 17 GB: L2/004 needs 24 GB and L2/024
47 GB) and used to fail. With a pool, every session reserves its cap from a ledger the processes share, and
a problem refused for memory runs again right away (before its process takes the next problem) with the cap
it needs, once that much of the pool is free: while it waits, no process starts a new problem, so the others
drain and release their shares (first come, first served among the waiters). The GPU's memory is never planned twice.

The ledger is a folder: one JSON file per reservation or waiter (``{"key", "gb", "pid", "since", "wait"}``),
read and changed under an ``flock`` of the folder's ``.lock``. Its holder keeps an ``flock`` on its own
entry for as long as it holds or waits, so an entry whose lock can be taken belongs to a process that is gone
(killed, crashed: the kernel dropped its locks) and is removed; a reused process id cannot keep it alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class PoolTooSmall(ValueError):
    """A reservation larger than the whole pool: it could never be granted."""


class MemoryPool:
    """A ledger of GB reserved on one GPU by cooperating processes (see the module docstring)."""

    def __init__(self, folder: Path, total_gb: float, *, poll_s: float = 2.0,
                 device_free_gb: Callable[[], float | None] | None = None, device_grace_s: float = 300.0):  # fmt: skip
        if total_gb <= 0:
            raise ValueError(f"suite.memory_pool_gb must be positive, got {total_gb}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.total_gb = float(total_gb)
        self.poll_s = poll_s
        self.device_free_gb = device_free_gb  # the device memory open to this process (None: not known)
        self.device_grace_s = device_grace_s
        self._held: dict[Path, int] = {}  # this process's entries -> the descriptor holding their flock
        self._thread_lock = threading.Lock()  # the folder's flock is per open file: threads take this first

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, (self.folder / ".lock").open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _path(self, key: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)[:80]
        return self.folder / f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:10]}.json"

    def _entries(self) -> dict[Path, dict]:
        """Live entries (under the lock); those whose holder is gone are removed."""
        out = {}
        for p in self.folder.glob("*.json"):
            if p not in self._held:
                try:
                    fd = os.open(p, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # held: its process is alive
                else:
                    log.info("memory pool: %s's holder is gone; its entry is dropped", p.name)
                    p.unlink(missing_ok=True)
                    continue
                finally:
                    os.close(fd)
            try:
                e = json.loads(p.read_text())
                out[p] = {"gb": float(e["gb"]), "since": float(e.get("since", 0.0)), "wait": bool(e.get("wait"))}
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-written by a holder between its lock and its write: it holds nothing yet
        return out

    def _write(self, path: Path, entry: dict) -> None:
        """Create or update this process's entry, holding its flock (under the folder's lock)."""
        fd = self._held.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: a dead holder's entry was dropped
            self._held[path] = fd
        data = json.dumps(entry).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def reserved_gb(self) -> float:
        with self._locked():
            return sum(e["gb"] for e in self._entries().values() if not e["wait"])

    def acquire(self, key: str, gb: float, *, priority: bool = False, timeout_s: float | None = None,
                on_wait: Callable[[float, float], None] | None = None) -> float:  # fmt: skip
        """Reserve ``gb`` under ``key`` (unique among the processes), waiting while the pool lacks it; returns the
        seconds waited. ``priority``: a problem that needs more than the usual share registers as a waiter, and
        while any waiter is registered only the earliest one may reserve (the others, and every plain request,
        wait). ``on_wait(free_gb, waited_s)`` is called once when a wait begins. TimeoutError after
        ``timeout_s``; PoolTooSmall where ``gb`` exceeds the pool."""
        if gb > self.total_gb:
            raise PoolTooSmall(f"needs {gb:.1f} GB, more than suite.memory_pool_gb={self.total_gb:g}")
        path = self._path(key)
        t0 = time.monotonic()
        since = time.time()
        told = False
        ledger_ok_since: float | None = None  # when the ledger first had room for this priority request
        try:
            while True:
                with self._locked():
                    entries = self._entries()
                    entries.pop(path, None)
                    used = sum(e["gb"] for e in entries.values() if not e["wait"])
                    waiters = sorted((e["since"], str(p)) for p, e in entries.items() if e["wait"])
                    first = not waiters or (priority and (since, str(path)) <= waiters[0])
                    entry = {"key": key, "gb": gb, "pid": os.getpid(), "since": since}
                    if first and used + gb <= self.total_gb + 1e-9:
                        ledger_ok_since = ledger_ok_since or time.monotonic()
                        if not priority or self._device_has(gb, time.monotonic() - ledger_ok_since):
                            self._write(path, {**entry, "wait": False})
                            return time.monotonic() - t0
                    else:
                        ledger_ok_since = None
                    if priority:
                        self._write(path, {**entry, "wait": True})
                    free = self.total_gb - used
                if not told and on_wait is not None:
                    on_wait(free, time.monotonic() - t0)
                    told = True
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{gb:.1f} GB of the memory pool not free within {timeout_s:.0f} s")
                time.sleep(self.poll_s)
        except BaseException:
            self.release(key)
            raise

    def _device_has(self, gb: float, waited_s: float) -> bool:
        """Whether the device has ``gb`` free (unknown counts as yes; so does waiting ``device_grace_s``)."""
        if self.device_free_gb is None or waited_s >= self.device_grace_s:
            return True
        try:
            free = self.device_free_gb()
        except Exception as e:  # noqa: BLE001 - a failed query must not stop the suite
            log.debug("device free memory unknown: %s", e)
            return True
        if free is None or free >= gb:
            return True
        log.debug("memory pool: room for %.1f GB in the ledger, but the device has %.1f GB free", gb, free)
        return False

    def release(self, key: str) -> None:
        path = self._path(key)
        with self._locked():
            fd = self._held.pop(path, None)
            if fd is not None:
                path.unlink(missing_ok=True)
                os.close(fd)

    @contextlib.contextmanager
    def reserved(self, key: str, gb: float, **kw) -> Iterator[float]:
        try:
            yield self.acquire(key, gb, **kw)
        finally:
            self.release(key)
