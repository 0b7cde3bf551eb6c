"""Quiet cores: the processes being measured run on CPU cores that nothing else uses.

The device lock (``devlock.py``) gives one guard at a time the GPU, not the CPU. Where several sessions share a
machine (``scripts/gpu_suite.sh`` runs eight on one H200's 16 cores), the others compile (Inductor, Triton, nvcc)
while one times, and a launch-bound call's host side is descheduled between its kernels: on the H200 (seventh
session, runs W and X) the same kernels read 2-8x apart within a session, 28 of 289 comparisons were void (the
champion more than 1.5x slower beside the challenger than when crowned), and L1/001's torch.compile, 2.33x
the reference side by side, was not crowned for the spread of its samples.

With ``KERNELARC_QUIET_CPUS`` set (a CPU list, e.g. ``0-1``), every thread of the workers a guard measures is
moved onto those CPUs while it holds the device lock, and back to the judge's own CPUs when it lets go. On a
machine with one GPU only the lock's holder is on them at any time, so the quiet CPUs are the measured process's
alone when every session is started off them (``taskset -c 2-15``, as ``gpu_suite.sh`` does with
``QUIET_CPUS=2``); with several GPUs the holders of each device's lock share them (give each GPU's sessions
their own list). Unset, nothing moves. A thread that cannot be moved (gone, or not permitted) is skipped:
quiet cores sharpen measurements; they are never a reason for a verdict.

A candidate can read its own CPU affinity and so tell its warm-up from its checked and timed calls; it cannot
tell a checked call from a timed one (both run under the lock), so the secret of which call is checked stands.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)

ENV = "KERNELARC_QUIET_CPUS"


def parse_cpus(text: str) -> set[int]:
    """``"0-1,4"`` -> {0, 1, 4}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a, b = int(lo), int(hi) if sep else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError("no CPU named")
    return cpus


def threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (empty once it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid] if _alive(pid) else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pin(pids: list[int], cpus: set[int]) -> int:
    """Move every thread of ``pids`` onto ``cpus`` (one gone or not permitted is skipped); how many threads it
    tried. The threads are listed again until no new one appears (a thread started while the others moved
    inherits its parent's CPUs), three times at most."""
    done: set[int] = set()
    for _ in range(3):
        todo = [tid for pid in pids for tid in threads(pid) if tid not in done]
        if not todo:
            break
        for tid in todo:
            done.add(tid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(tid, cpus)
    return len(done)


class QuietCores:
    """Moves measured workers onto the quiet CPUs (``enter``) and back to the judge's CPUs (``leave``)."""

    def __init__(self, cpus: set[int], home: set[int] | None = None):
        self.cpus = set(cpus)
        self.home = set(home) if home is not None else set(os.sched_getaffinity(0))
        self._warned = False

    def enter(self, pids: list[int]) -> None:
        try:
            pin(pids, self.cpus)
        except (OSError, ValueError, OverflowError) as e:  # e.g. a CPU outside this machine's cpuset
            if not self._warned:
                self._warned = True
                log.warning("quiet cores %s unusable (%s): workers stay where they run", sorted(self.cpus), e)
            self.leave(pids)  # any thread that did move goes back

    def leave(self, pids: list[int]) -> None:
        with contextlib.suppress(OSError, ValueError, OverflowError):
            pin(pids, self.home)


def from_env() -> QuietCores | None:
    """The quiet cores ``KERNELARC_QUIET_CPUS`` names, or None (unset, empty, or not a CPU list: a warning)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        cpus = parse_cpus(text)
        n = os.cpu_count() or 1
        if max(cpus) >= n:
            raise ValueError(f"this machine has CPUs 0-{n - 1}")
    except ValueError as e:
        log.warning("%s=%r ignored: %s", ENV, text, e)
        return None
    return QuietCores(cpus)
