"""Two guards (threads or processes) that share a device never hold its lock at the same time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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


def test_another_process_waits_and_a_dead_holder_frees_the_device(tmp_path):
    code = (
        "import sys, time; from kernelarc.guard.devlock import DeviceLock\n"
        f"l = DeviceLock('cuda:0', key='gpu-test'); l.path = __import__('pathlib').Path({str(tmp_path)!r}) / 'x.lock'\n"
        "l.acquire(); print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
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
