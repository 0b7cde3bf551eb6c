"""The CPU guard the guard tests judge against: built-in rmsnorm, small timing targets, the reference
measured as the first champion and the baselines set."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kernelarc.guard.devlock import DeviceLock
from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin


@contextlib.contextmanager
def rmsnorm_cpu_guard(prestart: int) -> Iterator[Guard]:
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=prestart))
    try:
        ref = g.evaluate(reference_candidate(task), trusted=True)
        assert ref.verdict.status is Status.champion, ref.verdict.errors
        g.set_baselines(ref, None)
        yield g
    finally:
        g.close()


@contextlib.contextmanager
def judging_beside_another_process(
    tmp_path: Path, monkeypatch, source: Callable[[Path], str], wait_for: str, **cfg: float
) -> Iterator[tuple[DeviceLock, Path, dict]]:
    """A CPU guard whose device lock is a GPU's cross-process one, judging ``source(marker)`` (trusted) in a thread
    until the candidate creates the file ``marker`` + ``wait_for``: yields the lock as another process on that GPU
    sees it, the marker (in a folder the worker's own uid may write) and the result (``"v"``: the evaluation, once
    the block has released the lock and the thread ended; ``"e"``: what it raised)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("KERNELARC_DEVICE_LOCK_DIR", str(tmp_path))
    shared = Path(tempfile.mkdtemp(prefix="kernelarc-test-", dir="/tmp"))
    shared.chmod(0o777)  # the worker may run as its own uid
    marker = shared / "warming"
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=60, target_ms=5, min_iters=3, max_iters=20, prestart=1, **cfg))
    g._gpu = DeviceLock("cuda:0", key="gpu-shared")  # as two processes on one GPU see it
    res: dict = {}

    def evaluate() -> None:
        try:
            res["v"] = g.evaluate(Candidate(source=source(marker), language="pytorch"), trusted=True)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            res["e"] = e

    t = threading.Thread(target=evaluate, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 60
        while not Path(str(marker) + wait_for).exists() and "e" not in res and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(str(marker) + wait_for).exists(), res.get("e")
        yield DeviceLock("cuda:0", key="gpu-shared"), marker, res
    finally:
        t.join(90)
        g.close()
