"""One device, one measurement at a time, across threads *and* processes.

A guard serialises the checked and timed phases of its candidates on its device with a lock.
Several KernelArc processes can share one GPU (suite shards, a Hydra joblib sweep, two users'
sessions): each guard's in-process lock alone would let their timings overlap, and every
figure measured while another process ran on the GPU would be wrong. ``DeviceLock`` therefore
also holds an exclusive ``flock`` on a file named after the physical device (its UUID where
torch reports one, so ``CUDA_VISIBLE_DEVICES`` remapping cannot give two processes different
names for one GPU). The file lock is released by the kernel when the holder dies, so a killed
session never leaves the device locked.
"""

from __future__ import annotations

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
        try:
            if deadline is None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process measures on this GPU
            else:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            os.close(fd)
                            self._sem.release()
                            return False
                        time.sleep(0.02)
        except OSError as e:
            log.warning("cross-process device lock %s unavailable: %s", self.path, e)
            os.close(fd)
            self._fd = None
            return True
        self._fd = fd
        return True

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
