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

    def acquire(self) -> bool:
        self._sem.acquire()
        if self.path is not None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process measures on this GPU
                self._fd = fd
            except OSError as e:  # an unusable lock folder must not stop the search: threads stay serialised
                log.warning("cross-process device lock %s unavailable: %s", self.path, e)
                self._fd = None
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
