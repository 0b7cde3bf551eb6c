"""guard.bench_lock_s: a warm-up's GPU benchmarking (Triton's do_bench, Inductor's benchmarker) waits for other
processes' timings on the device, through descriptors of the device's lock file the judge passes its workers."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kernelarc.guard import benchlock
from kernelarc.guard.benchlock import BenchLock, open_for_worker
from kernelarc.guard.devlock import DeviceLock


def _lock(tmp_path: Path, budget_s: float) -> tuple[BenchLock, Path]:
    path = tmp_path / "dev.lock"
    fds, env = open_for_worker(path, budget_s)
    assert len(fds) == 2 and env[benchlock.ENV].startswith(f"{fds[0]},{fds[1]},")
    return BenchLock(fds[0], fds[1], budget_s), path


def test_no_descriptors_without_a_lock_file_or_a_budget(tmp_path):
    assert open_for_worker(None, 10.0) == ((), {})
    assert open_for_worker(tmp_path / "x.lock", 0.0) == ((), {})
    assert benchlock.install({}) is None


def test_armed_benchmarking_waits_for_a_timing_and_a_timer_waits_for_it(tmp_path):
    bl, path = _lock(tmp_path, budget_s=5.0)
    timer = DeviceLock("cuda:0", key="t")
    timer.path = path
    assert timer.acquire(timeout=1)  # another process's timing holds the device
    threading.Timer(0.5, timer.release).start()
    bench = bl.wrap(lambda: "ran")
    bench()  # not armed (outside a warm-up): no wait
    assert bl.waited_s < 0.2 and bl.calls == 0
    bl.armed = True
    t = time.monotonic()
    assert bench() == "ran"
    assert time.monotonic() - t >= 0.4 and 0.4 <= bl.waited_s < 3 and bl.calls == 1
    with bl.hold():  # while it benchmarks, no timing starts
        assert not timer.acquire(timeout=0.3)
        with bl.hold():  # nested: taken once
            assert bl.calls == 2
    assert timer.acquire(timeout=1)  # released on the way out
    timer.release()


def test_a_worker_waits_its_budget_at_most_then_benchmarks_unlocked(tmp_path):
    bl, path = _lock(tmp_path, budget_s=0.4)
    bl.armed = True
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a timing that does not end
    try:
        for _ in range(3):
            with bl.hold():
                pass
    finally:
        os.close(fd)
    assert 0.4 <= bl.waited_s < 1.0 and bl.calls == 0 and bl.left_s() == 0


def test_install_hooks_triton_and_inductor_as_they_are_imported(tmp_path):
    """In a fresh interpreter (as a worker): Triton's do_bench wrapped at once, Inductor's benchmarking when first
    imported (by the meta-path hook, so that a worker that never compiles does not pay for the import)."""
    pytest.importorskip("triton")
    fds, env = open_for_worker(tmp_path / "dev.lock", 3.0)
    code = """
import sys, torch
from kernelarc.guard import benchlock
bl = benchlock.install()
import triton.testing as tt
assert tt.do_bench._kernelarc_bench_lock is bl
assert benchlock.INDUCTOR not in sys.modules
import torch._inductor.runtime.benchmarking as b
if hasattr(b, "set_gpu_benchmark_lock_context"):
    assert b._gpu_benchmark_lock_context == bl.hold
else:
    assert b.benchmarker.benchmark_gpu._kernelarc_bench_lock is bl
bl.armed = True
with b.maybe_gpu_benchmark_lock() if hasattr(b, "maybe_gpu_benchmark_lock") else bl.hold():
    pass
assert bl.calls == 1
print("hooked")
"""
    try:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, pass_fds=fds,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    assert out.returncode == 0 and "hooked" in out.stdout, out.stderr[-2000:]


def test_inductor_before_2_13_gets_its_benchmarker_wrapped(tmp_path):
    bl, _ = _lock(tmp_path, budget_s=1.0)

    class Benchmarker:
        def benchmark_gpu(self, fn):
            return fn()

    mod = type(sys)("fake_benchmarking")
    mod.benchmarker = Benchmarker()
    benchlock._patch_inductor(bl, mod)
    bl.armed = True
    assert mod.benchmarker.benchmark_gpu(lambda: 7) == 7 and bl.calls == 1


def _first_call_benchmarks(marker: Path) -> str:
    return f"""import time
import torch
import triton.testing
_N = [0]


def run(x, weight):
    _N[0] += 1
    if _N[0] == 1:  # the warm-up's first call: autotuning-like benchmarking
        open({str(marker)!r} + ".ready", "w").close()
        time.sleep(0.5)
        try:
            triton.testing.do_bench(lambda: None)  # (no GPU here: it raises once past the lock)
        except Exception:
            pass
        open({str(marker)!r} + ".done", "w").close()
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""


@pytest.mark.parametrize("bench_lock_s", [20.0, 0.0])
def test_a_guards_warm_up_benchmarking_waits_for_another_process_timing(tmp_path, monkeypatch, bench_lock_s):
    """End to end through a real worker (its own uid where the judge is root): the descriptors reach it, its
    benchmarking waits while another process times, and the judge does not charge the wait to the candidate."""
    pytest.importorskip("triton")
    from cpu_guard import judging_beside_another_process

    with judging_beside_another_process(tmp_path, monkeypatch, _first_call_benchmarks, ".ready",
                                        bench_lock_s=bench_lock_s) as (other, marker, res):  # fmt: skip
        assert other.acquire(timeout=30), res.get("e")  # another process's timing, before the benchmarking
        time.sleep(2.0)
        held_back = not Path(str(marker) + ".done").exists()
        other.release()
    assert "v" in res, res.get("e")
    v = res["v"].verdict
    assert v.correct, v.errors
    if bench_lock_s:
        assert held_back and v.phases.get("gpu_wait_bench", 0.0) >= 1.0, v.phases
    else:
        assert not held_back and "gpu_wait_bench" not in v.phases
