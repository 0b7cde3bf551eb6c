"""One device, one measurement at a time, across threads *and* processes.

A guard serialises the checked and timed phases of its candidates on its device with a lock.
Several KernelArc processes can share one GPU (suite shards, a Hydra joblib sweep, two users'
sessions): each guard's in-process lock alone would let their timings overlap, and every
figure measured while another process ran on the GPU would be wrong. ``DeviceLock`` therefore
also holds an exclusive ``flock`` on a file named after the physical device (its UUID where
torch reports one, so ``CUDA_VISIBLE_DEVICES`` remapping cannot give two processes different
names for one GPU). The file lock is released by the kernel when the holder dies, so a killed
session never leaves the device locked.

Warm-ups (a candidate's JIT compilation and first calls, Inductor's and Triton's autotuning) run kernels too,
outside the exclusive lock: on one GPU, kernels of another process time-slice with the measured ones, so a
warm-up elsewhere made measured calls slower in an unknown share of their bursts (the eighth session's H200
suite: 24 of 159 comparisons void, the champion 1.5-5x slower beside a challenger than when crowned, with every
measured worker alone on two quiet CPUs). With ``guard.warmup_lock_s`` set, a warm-up takes the lock *shared*
(``acquire_shared``): warm-ups run together, and no timing starts until the warm-ups in progress end. A
turnstile file gives a waiting timer precedence over warm-ups that arrive after it, so that a stream of
warm-ups cannot starve it. (Off by default: with eight sessions on the H200 it halved the candidates judged
within a budget for a void rate of 11% instead of 14.5%.)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_DIR_ENV = "KERNELARC_DEVICE_LOCK_DIR"


def device_key(device: str) -> str | None:
    """A name for the physical device behind ``device`` (None: no cross-process lock, e.g. the CPU)."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        idx = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
        if uuid:
            return f"gpu-{uuid}"
    except Exception as e:  # noqa: BLE001 - no properties: fall back to the visible index
        log.debug("no device uuid for %s: %s", device, e)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return f"gpu-{visible or 'all'}-{device.replace(':', '')}"


class DeviceLock:
    """Acquire/release (and context manager) over a thread semaphore plus a per-device file lock."""

    def __init__(self, device: str, cross_process: bool = True, key: str | None = None):
        self._sem = threading.Semaphore(1)
        self._fd: int | None = None
        self.path: Path | None = None
        # Seconds this lock's holder-to-be waited for the device while another process held it (the file lock;
        # the thread semaphore lets one thread at a time wait there, so these intervals never overlap): the time
        # a session spent blocked by other sessions on the GPU, which its budget does not count (SearchSession)
        self.foreign_wait_s = 0.0
        self._foreign_since: float | None = None
        key = key or (device_key(device) if cross_process else None)
        if key is not None:
            base = Path(os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir())
            self.path = base / f"kernelarc-{''.join(c if c.isalnum() or c in '-_' else '_' for c in key)}.lock"

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the device; with ``timeout`` (seconds), give up after that long and return False, so
        that a session whose time is spent stops waiting for a GPU another process is measuring on."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        if not self._sem.acquire(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0)):
            return False
        if self.path is None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:  # an unusable lock folder must not stop the search: threads stay serialised
            log.warning("cross-process device lock %s unavailable: %s", self.path, e)
            self._fd = None
            return True
        gate = self._open_gate()
        self._foreign_since = time.monotonic()
        try:
            # the turnstile, held while this timer waits: warm-ups that come after it wait behind it
            taken = (gate is None or _flock(gate, fcntl.LOCK_EX, deadline)) and _flock(fd, fcntl.LOCK_EX, deadline)
        except OSError as e:
            log.warning("cross-process device lock %s unavailable: %s", self.path, e)
            os.close(fd)
            self._fd = None
            return True
        finally:
            self.foreign_wait_s += time.monotonic() - self._foreign_since
            self._foreign_since = None
            if gate is not None:
                os.close(gate)  # (closing drops its flock)
        if not taken:  # blocked while another process measured on this GPU until the deadline
            os.close(fd)
            self._sem.release()
            return False
        self._fd = fd
        return True

    def foreign_wait_now(self) -> float:
        """``foreign_wait_s`` including a wait in progress."""
        since = self._foreign_since
        return self.foreign_wait_s + (time.monotonic() - since if since is not None else 0.0)

    def acquire_shared(self, timeout: float | None = None) -> int | bool | None:
        """Take the device shared, for a warm-up: any number of holders, none while a timing holds it, and none
        past a timing that waits (the turnstile). Returns the token for ``release_shared`` (None where there is
        no cross-process lock: nothing to wait for), or False after ``timeout`` seconds."""
        if self.path is None:
            return None
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            log.debug("shared device lock %s unavailable: %s", self.path, e)
            return None
        try:
            gate = self._open_gate()
            if gate is not None:
                try:  # passes the turnstile without keeping it: a warm-up never holds a timer behind another
                    passed = _flock(gate, fcntl.LOCK_SH, deadline)
                finally:
                    os.close(gate)
                if not passed:
                    os.close(fd)
                    return False
            if not _flock(fd, fcntl.LOCK_SH, deadline):
                os.close(fd)
                return False
        except OSError as e:
            log.debug("shared device lock %s unavailable: %s", self.path, e)
            os.close(fd)
            return None
        return fd

    @staticmethod
    def release_shared(token: int | bool | None) -> None:
        if token is not None and token is not False and token is not True:
            with contextlib.suppress(OSError):
                os.close(token)  # closing the descriptor drops its flock

    def _open_gate(self) -> int | None:
        try:
            return os.open(str(self.path) + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._sem.release()

    def __enter__(self) -> DeviceLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _flock(fd: int, op: int, deadline: float | None) -> bool:
    """``flock(fd, op)``, waiting until ``deadline`` (a ``time.monotonic()`` instant; None: for ever); False when
    it passed."""
    if deadline is None:
        fcntl.flock(fd, op)
        return True
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
