"""Guard worker pool: a worker that dies before it can speak the protocol is reported with its own log."""

from __future__ import annotations

import pytest

from kernelarc.guard import pool as pool_mod


def test_worker_start_failure_carries_the_workers_log(monkeypatch):
    # a worker that dies during start-up, after writing its reason to stderr (as an import error or a
    # failed CUDA start-up would)
    boot = "import sys; sys.stderr.write('Traceback: CUDA start-up failed (planted)\\n'); sys.exit(3)"
    monkeypatch.setattr(pool_mod, "_BOOT", boot)
    pool = pool_mod.WorkerPool("cpu", size=1, start_timeout=60)
    try:
        with pytest.raises(RuntimeError) as e:
            pool.acquire()
    finally:
        pool.close()
    msg = str(e.value)
    assert "failed to start" in msg and "exit code 3" in msg, msg
    assert "worker log:" in msg and "CUDA start-up failed (planted)" in msg, msg
