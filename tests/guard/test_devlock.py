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
