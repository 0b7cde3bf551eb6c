"""Output buffers: raw bytes the judge owns and reads with the dtype and shape it expects.

The worker never hands the judge an object: it copies each output, in logical (row-major) order,
into a byte buffer the judge created, at offsets the judge computed from the task (``layout``).
The judge views those bytes as the dtype and shape the task declares; whatever the worker wrote
there is only ever numbers to compare. The buffer is a file mapped by both (in /dev/shm where it
fits, else in the temp directory), on a GPU too: the worker copies device -> host into it and the
judge moves the bytes back to its device. No CUDA IPC: a worker killed mid-job would leave the
judge's shared device memory referenced for good. The worker maps the file while it is still
privileged, before it drops to its own uid (the file is the judge's, mode 0600). On a GPU both sides
page-lock their mapping (``cudaHostRegister``), so that the copies run at DMA speed: pageable, the
device -> host -> device round trip of one 256 MB output took some 55 ms on an H200, a third of the
guard's time per candidate; page-locked, a few.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch

from kernelarc.tasks.inputs import torch_dtype
from kernelarc.tasks.loader import Task

ALIGN = 256


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...] | None  # None: a Python scalar output (travels in the message)
    dtype: torch.dtype | None
    offset: int = 0
    nbytes: int = 0


def layout(task: Task, wl: int) -> list[Slot]:
    slots, off = [], 0
    for name, spec in task.definition.outputs.items():
        shape = task.shape(name, wl)
        if shape is None:
            slots.append(Slot(name, None, None))
            continue
        dt = torch_dtype(spec.dtype)
        nb = math.prod(shape) * dt.itemsize
        slots.append(Slot(name, tuple(shape), dt, off, nb))
        off += -(-nb // ALIGN) * ALIGN
    return slots


def buffer_bytes(task: Task, workloads: list[int]) -> int:
    total = 0
    for wl in workloads:
        slots = [s for s in layout(task, wl) if s.shape is not None]
        if slots:
            total = max(total, slots[-1].offset + slots[-1].nbytes)
    return max(total, ALIGN)


def view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    assert slot.shape is not None and slot.dtype is not None
    return buf[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class JudgeBuffer:
    """The judge's side: allocation, the handle the worker opens, and reading outputs back."""

    def __init__(self, device: str, nbytes: int, pin_now: bool = True):
        self.device = torch.device(device)
        self.nbytes = nbytes
        self._pinning: threading.Thread | None = None
        self._closed = threading.Lock()
        shm = None
        with contextlib.suppress(OSError):
            st = os.statvfs("/dev/shm")
            if nbytes < st.f_bavail * st.f_frsize // 2:  # a small /dev/shm (containers: 64 MB) would SIGBUS
                shm = "/dev/shm"
        fd, self.path = tempfile.mkstemp(prefix="kernelarc-out-", dir=shm)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        self.pinned = False
        if self.device.type == "cuda":
            if pin_now:
                self.pinned = pin(self.tensor)
            else:  # a pool's buffer: page-locked while its worker starts (both take a while), off the judge's path
                self._pinning = threading.Thread(target=self._pin, name="kernelarc-buffer-pin", daemon=True)
                self._pinning.start()

    def _pin(self) -> None:
        self.pinned = pin(self.tensor)

    def ready(self) -> JudgeBuffer:
        """Wait for a background page-locking to end (before the first copy from the buffer)."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        return self

    def handle(self) -> tuple:
        return ("file", self.path, self.nbytes)

    def read(self, slot: Slot) -> torch.Tensor:
        return view(self.tensor, slot).to(self.device, copy=True)

    def close(self) -> None:
        if not self._closed.acquire(blocking=False):  # closed already, or being closed by another thread
            return
        self.ready()
        if self.pinned:
            self.pinned = False
            unpin(self.tensor)
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None  # type: ignore[assignment]


def open_buffer(handle: tuple | list, page_lock: bool = False) -> torch.Tensor:
    """The worker's side: map the judge's buffer (and, with ``page_lock``, page-lock the mapping)."""
    if handle[0] != "file":
        raise ValueError(f"unknown buffer handle {handle[0]!r}")
    _, path, nbytes = handle
    t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if page_lock:
        pin(t)
    return t


def pin(t: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory for fast copies to and from the GPU; False where the driver refuses
    (the copies then stay pageable: slower, as correct)."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    try:  # portable: page-locked for every CUDA context of the process, whichever thread registers it
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1)) == 0
    except Exception:  # noqa: BLE001 - a speed-up, never a reason to fail
        return False


def unpin(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def scalar_values(task: Task, wl: int, outs: list[Any]) -> list[Any]:
    """``outs`` with each scalar output (shape null) that came as a 0-d tensor replaced by its value, as NVIDIA's
    harness takes it (a loss from F.cross_entropy): in the worker for a candidate's outputs, in the judge for the
    reference's. ``outs`` itself where there is none (a cached seed's outputs stay the same object)."""
    # through torch.Tensor's own methods: a function the candidate set on the output (``out.item = ...``) would
    # shadow the method and run where the worker reads it, after the clock
    at = [i for i, name in enumerate(task.definition.outputs) if i < len(outs) and task.shape(name, wl) is None
          and type(outs[i]) is torch.Tensor and torch.Tensor.dim(outs[i]) == 0]  # fmt: skip
    if not at:
        return outs
    return [torch.Tensor.item(o) if i in at else o for i, o in enumerate(outs)]


def scalar(value: Any) -> bool | int | float:
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    return float(value)
