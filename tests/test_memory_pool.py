"""The suite's shared GPU memory pool (suite.memory_pool_gb): reservations, waiters first, dead processes
dropped; a problem refused for memory runs again at the end of the queue with the cap its plan needs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from test_memory import _problem as _memory_problem
from test_suite import ARGS, RMSNORM, _problem, _suite

from kernelarc.guard.memory import cap_needed_gb, plan_memory
from kernelarc.memory_pool import MemoryPool, PoolTooSmall
from kernelarc.tasks import load_task
from kernelarc.tasks.inputs import load_module


def test_reservations_add_up_and_a_request_waits_for_room(tmp_path):
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02)
    pool.acquire("a", 6.0)
    pool.acquire("b", 4.0)
    assert pool.reserved_gb() == pytest.approx(10.0)
    got = threading.Event()
    t = threading.Thread(target=lambda: (pool.acquire("c", 3.0), got.set()))
    t.start()
    assert not got.wait(0.3)  # full: it waits
    pool.release("b")
    assert got.wait(5)
    t.join()
    assert pool.reserved_gb() == pytest.approx(9.0)
    with pytest.raises(PoolTooSmall, match="more than suite.memory_pool_gb=10"):
        pool.acquire("huge", 11.0)


def test_a_waiter_that_needs_more_goes_before_plain_requests(tmp_path):
    """While a problem that needs more than a share waits, no process starts a new one: the pool drains."""
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02)
    pool.acquire("s1", 4.0)
    pool.acquire("s2", 4.0)
    order: list[str] = []
    big = threading.Thread(target=lambda: (pool.acquire("big", 7.0, priority=True), order.append("big")))
    big.start()
    time.sleep(0.2)
    plain = threading.Thread(target=lambda: (pool.acquire("s3", 1.0), order.append("s3")))
    plain.start()
    time.sleep(0.3)
    assert order == []  # s3 would fit (9 of 10 GB) but the waiter is first
    pool.release("s1")
    time.sleep(0.3)
    assert order == []  # 4 + 7 > 10: still waiting, s3 still held back
    pool.release("s2")
    big.join(5)
    assert order[0] == "big"
    plain.join(5)
    assert order == ["big", "s3"] and pool.reserved_gb() == pytest.approx(8.0)


def test_a_dead_process_holds_no_memory(tmp_path):
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02)
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)
    (tmp_path / "pool" / "gone.json").write_text(json.dumps({"gb": 9.0, "pid": dead, "since": 0.0, "wait": True}))
    assert pool.acquire("mine", 8.0, timeout_s=2) < 1.0
    assert not (tmp_path / "pool" / "gone.json").exists()


def test_the_need_read_from_a_refusal_is_a_cap_the_plan_accepts(tmp_path):
    t = load_task(_memory_problem(tmp_path, sizes=(16, 4096)))
    run = load_module(t.definition.reference, "memory_probe").run
    refused = plan_memory(t, [0, 1], "cpu", memory_gb=0.04, run=run)
    assert 1 in refused.verdicts and "the guard needs" in refused.verdicts[1]
    need = cap_needed_gb("; ".join(refused.errors()))
    assert need is not None and need > 0.04
    assert plan_memory(t, [0, 1], "cpu", memory_gb=need, run=run).runnable == [0, 1]
    assert cap_needed_gb("the task's reference failed in the guard (timeout)") is None


def test_a_problem_refused_for_memory_runs_again_with_the_cap_it_needs(tmp_path):
    """A 0.01 GB share is too small for one input set of a 512 x 4096 rmsnorm; with a 2 GB pool the suite runs it
    again at the end with the cap its plan named, and its row is that run's."""
    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    tree = tmp_path / "tree"
    p = _problem(tree, "L1/001_rmsnorm", "rmsnorm", ref)
    wl = {
        "uuid": "big",
        "axes": {"M": 512, "N": 4096},
        "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}},
    }
    (p / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    assert "budget.candidates=2" in ARGS
    r = _suite(tmp_path, tree, "guard.memory_gb=0.01", "suite.memory_pool_gb=2", f"suite.claims={tmp_path / 'claims'}",
               "budget.candidates=1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(guard.memory_gb=" in r.stdout  # the second run says its cap
    (row,) = json.loads(next((tmp_path / ".kernelarc").rglob("table.json")).read_text())
    assert row["status"] in ("improved", "baseline"), row
    assert not list((tmp_path / "claims" / "memory").glob("*.json"))  # every reservation released


def test_a_pool_needs_claims_and_a_share(tmp_path):
    tree = tmp_path / "tree"
    _problem(tree, "L1/001_x", "x", "import torch\n\ndef run(x, weight):\n    return x\n")
    r = _suite(tmp_path, tree, "suite.memory_pool_gb=2")
    assert r.returncode == 2 and "suite.memory_pool_gb needs suite.claims" in r.stderr
    r = _suite(tmp_path, tree, "suite.memory_pool_gb=2", f"suite.claims={tmp_path / 'c'}")
    assert r.returncode == 2 and "needs guard.memory_gb" in r.stderr
