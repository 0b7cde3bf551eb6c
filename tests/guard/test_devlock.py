"""Two guards (threads or processes) that share a device never hold its lock at the same time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from kernelarc.guard.devlock import DeviceLock


def test_locks_with_one_key_exclude_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELARC_DEVICE_LOCK_DIR", str(tmp_path))
    a, b = DeviceLock("cuda:0", key="gpu-test"), DeviceLock("cuda:0", key="gpu-test")
    assert a.path == b.path and a.path.parent == tmp_path
    a.acquire()
    got = threading.Event()
    t = threading.Thread(target=lambda: (b.acquire(), got.set()))
    t.start()
    assert not got.wait(0.5), "a second guard of the same device took the lock while the first held it"
    a.release()
    assert got.wait(5)
    b.release()
    t.join()


def _holder(tmp_path, take: str) -> subprocess.Popen:
    """Another process that takes the lock file ``tmp_path/x.lock`` (``take``: "acquire()" or "acquire_shared()")
    and keeps it for a minute; returned once it holds it."""
    code = (
        "import time; from pathlib import Path; from kernelarc.guard.devlock import DeviceLock\n"
        f"l = DeviceLock('cuda:0', key='gpu-test'); l.path = Path({str(tmp_path)!r}) / 'x.lock'\n"
        f"tok = l.{take}; print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "held":
        proc.kill()
        proc.wait()
        raise AssertionError("the other process did not take the lock")
    return proc


def test_another_process_waits_and_a_dead_holder_frees_the_device(tmp_path):
    holder = _holder(tmp_path, "acquire()")
    try:
        mine = DeviceLock("cuda:0", key="gpu-test")
        mine.path = tmp_path / "x.lock"
        got = threading.Event()
        t = threading.Thread(target=lambda: (mine.acquire(), got.set()), daemon=True)
        t.start()
        assert not got.wait(0.5)
        holder.kill()  # the kernel drops a dead process's flock
        assert got.wait(10)
        mine.release()
    finally:
        holder.kill()
        holder.wait()


def test_cpu_has_no_cross_process_lock():
    lock = DeviceLock("cpu")
    assert lock.path is None
    with lock:
        time.sleep(0)


def test_a_timed_acquire_gives_up_and_leaves_the_lock_usable(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELARC_DEVICE_LOCK_DIR", str(tmp_path))
    holder, waiter = DeviceLock("cuda:0", key="gpu-test"), DeviceLock("cuda:0", key="gpu-test")
    holder.acquire()
    t = time.monotonic()
    assert waiter.acquire(timeout=0.3) is False
    assert 0.25 <= time.monotonic() - t < 30
    holder.release()
    assert waiter.acquire(timeout=2) is True  # neither its semaphore nor a file descriptor leaked
    waiter.release()
    assert waiter.acquire(timeout=0) is True
    waiter.release()


def test_an_evaluation_stops_waiting_for_the_gpu_at_the_sessions_deadline(tmp_path, monkeypatch):
    """Suite shards share one GPU: a candidate of one shard must not wait past its session's end while
    another shard measures (on the H200 one waited 86 s on a 48 s budget)."""
    from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
    from kernelarc.models import Status
    from kernelarc.tasks import load_builtin

    monkeypatch.setenv("KERNELARC_DEVICE_LOCK_DIR", str(tmp_path))
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=1))
    g._gpu = DeviceLock("cuda:0", key="gpu-shared")  # as two processes on one GPU see it
    other = DeviceLock("cuda:0", key="gpu-shared")
    other.acquire()
    try:
        t = time.monotonic()
        ev = g.evaluate(reference_candidate(task), trusted=True, deadline=time.time() + 1.0)
        assert time.monotonic() - t < 15
        assert ev.verdict.status is Status.timeout
        assert "for the GPU" in ev.verdict.errors[0] and "session's time ran out" in ev.verdict.errors[0]
    finally:
        other.release()
        g.close()


# -- warm-ups take the lock shared (devlock.py's docstring says why) -----------------------------------
def _pair(tmp_path, monkeypatch) -> tuple[DeviceLock, DeviceLock]:
    monkeypatch.setenv("KERNELARC_DEVICE_LOCK_DIR", str(tmp_path))
    return DeviceLock("cuda:0", key="gpu-test"), DeviceLock("cuda:0", key="gpu-test")


def test_warm_ups_share_the_device_and_hold_a_timing_back(tmp_path, monkeypatch):
    timer, warm = _pair(tmp_path, monkeypatch)
    a, b = warm.acquire_shared(timeout=1), warm.acquire_shared(timeout=1)
    assert isinstance(a, int) and isinstance(b, int), "two warm-ups run together"
    assert timer.acquire(timeout=0.3) is False, "a timing started beside a warm-up"
    warm.release_shared(a)
    assert timer.acquire(timeout=0.3) is False, "a timing started beside the second warm-up"
    warm.release_shared(b)
    assert timer.acquire(timeout=2) is True
    assert warm.acquire_shared(timeout=0.3) is False, "a warm-up started during a timing"
    timer.release()
    c = warm.acquire_shared(timeout=2)
    assert isinstance(c, int)
    warm.release_shared(c)
    assert timer.acquire(timeout=0) is True  # no descriptor kept a lock
    timer.release()


def test_a_waiting_timing_goes_before_warm_ups_that_come_after_it(tmp_path, monkeypatch):
    timer, warm = _pair(tmp_path, monkeypatch)
    first = warm.acquire_shared(timeout=1)
    got = threading.Event()
    t = threading.Thread(target=lambda: (timer.acquire(), got.set()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while _gate_is_free(timer) and time.monotonic() < deadline:  # until the timer waits past the turnstile
        time.sleep(0.01)
    assert not _gate_is_free(timer) and not got.is_set()
    assert warm.acquire_shared(timeout=0.3) is False, "a later warm-up overtook the waiting timing"
    warm.release_shared(first)
    assert got.wait(5)
    timer.release()
    t.join()
    later = warm.acquire_shared(timeout=2)
    assert isinstance(later, int)
    warm.release_shared(later)


def _gate_is_free(lock: DeviceLock) -> bool:
    import fcntl
    import os

    fd = os.open(str(lock.path) + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_warm_up_in_another_process_holds_a_timing_back(tmp_path):
    warm = _holder(tmp_path, "acquire_shared()")
    try:
        timer = DeviceLock("cuda:0", key="gpu-test")
        timer.path = tmp_path / "x.lock"
        assert timer.acquire(timeout=0.5) is False
        warm.kill()  # a dead warm-up's shared lock goes with it
        assert timer.acquire(timeout=10) is True
        timer.release()
    finally:
        warm.kill()
        warm.wait()


def test_without_a_cross_process_lock_a_warm_up_waits_for_nothing():
    lock = DeviceLock("cpu")
    with lock:  # even beside an in-process timing: the CPU has no time-sliced device
        assert lock.acquire_shared(timeout=0) is None
    lock.release_shared(None)


def _slow_first_call(marker: Path) -> str:
    """A candidate whose first call (a warm-up's) says it started, then takes 4 s, as a JIT compile would."""
    return f"""import time
import torch
_CALLS = [0]
def run(x, weight):
    _CALLS[0] += 1
    if _CALLS[0] == 1:
        open({str(marker)!r}, "w").close()
        time.sleep(4.0)
        open({str(marker)!r} + ".done", "w").close()
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""


def _timing_waits_for_the_warm_up(tmp_path, monkeypatch, warmup_lock_s: float) -> bool:
    """Whether another process's timing, asked for once a guard's candidate has started its warm-up's 4 s first
    call, got the device only after that call ended."""
    from cpu_guard import judging_beside_another_process

    with judging_beside_another_process(tmp_path, monkeypatch, _slow_first_call, "", warmup_lock_s=warmup_lock_s) as (
        other,
        marker,
        res,
    ):
        assert other.acquire(timeout=30)
        waited = Path(str(marker) + ".done").exists()
        other.release()
    assert "v" in res, res.get("e")
    assert res["v"].verdict.correct, res["v"].verdict.errors
    return waited


def test_a_guard_warms_up_under_the_shared_lock_for_at_most_warmup_lock_s(tmp_path, monkeypatch):
    assert _timing_waits_for_the_warm_up(tmp_path / "a", monkeypatch, 30.0)  # the 4 s first call held it back
    assert not _timing_waits_for_the_warm_up(tmp_path / "b", monkeypatch, 0.3)  # let go after 0.3 s (1 s polls)


def test_only_a_wait_for_another_process_counts_as_a_foreign_wait(tmp_path):
    """``foreign_wait_s``: what the session's budget does not count (SearchSession._budget_spent_s). Waiting for
    another thread of this process (its semaphore) is the session's own time; waiting for another process is not."""
    mine = DeviceLock("cuda:0", key="gpu-test")
    mine.path = tmp_path / "x.lock"
    mine.acquire()  # held by one thread of this process ...
    t = threading.Thread(target=lambda: (mine.acquire(), mine.release()), daemon=True)
    t.start()
    time.sleep(0.4)  # ... another waits for it
    mine.release()
    t.join(5)
    assert mine.foreign_wait_s < 0.2, mine.foreign_wait_s
    holder = _holder(tmp_path, "acquire()")
    try:
        got = threading.Event()
        t = threading.Thread(target=lambda: (mine.acquire(), got.set()), daemon=True)
        t.start()
        time.sleep(0.6)
        assert 0.4 < mine.foreign_wait_now() < 5  # a wait in progress counts as it goes
        holder.kill()
        assert got.wait(10)
        mine.release()
        assert 0.5 < mine.foreign_wait_s < 10, mine.foreign_wait_s
    finally:
        holder.kill()
        holder.wait()


def test_only_waits_behind_another_process_move_an_evaluations_end(tmp_path):
    """The CPU suite on new problems: with two evaluations in flight on one device, the one that waited for the
    other got the session's whole wait allowance on top of its timeout (a 60 s session ran 240 s). The end moves on
    by the waits behind another process only (up to the allowance); a wait behind this process stops at the end."""
    from kernelarc.guard.drive import Hard, wait_until

    mine = DeviceLock("cuda:0", key="gpu-test")
    mine.path = tmp_path / "x.lock"
    mine.acquire()  # this process's other evaluation holds the device
    got: list = []
    hard = Hard(time.monotonic() + 0.5, allowance=30.0, foreign=mine.foreign_wait_now)
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: got.append(wait_until(mine.acquire, hard, poll_s=0.2)), daemon=True)
    th.start()
    th.join(10)
    assert got == [False] and time.monotonic() - t0 < 3, (got, time.monotonic() - t0)
    mine.release()

    holder = _holder(tmp_path, "acquire()")  # another process holds it for 1.5 s: the end moves on, the wait goes on
    try:
        hard = Hard(time.monotonic() + 0.5, allowance=30.0, foreign=mine.foreign_wait_now)
        threading.Timer(1.5, holder.kill).start()
        t0 = time.monotonic()
        assert wait_until(mine.acquire, hard, poll_s=0.2) is True
        assert 1.2 < time.monotonic() - t0 < 10
        assert hard.now() > hard.at + 0.7  # moved on by the foreign wait
        mine.release()
    finally:
        holder.kill()
        holder.wait()
    # and never beyond the allowance
    holder = _holder(tmp_path, "acquire()")
    try:
        hard = Hard(time.monotonic() + 0.3, allowance=0.5, foreign=mine.foreign_wait_now)
        t0 = time.monotonic()
        assert wait_until(mine.acquire, hard, poll_s=0.2) is False
        assert 0.7 < time.monotonic() - t0 < 3
    finally:
        holder.kill()
        holder.wait()
