"""The suite's shared GPU memory pool (suite.memory_pool_gb): reservations, waiters first, dead processes
dropped; a problem refused for memory runs again right away with the cap its plan needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from test_memory import _problem as _memory_problem
from test_suite import ARGS, RMSNORM, ROOT, _problem, _suite

from kernelarc.guard.memory import GB, HEADROOM, Footprint, cap_needed_gb, plan_memory
from kernelarc.memory_pool import MemoryPool, PoolTooSmall
from kernelarc.suite import MEMORY_RETRIES, ProblemResult, ProblemStatus, memory_retry_gb
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
    big.join(10)
    plain.join(10)
    assert not big.is_alive() and not plain.is_alive()
    assert order == ["big", "s3"] and pool.reserved_gb() == pytest.approx(8.0)


def test_waiters_are_served_first_come(tmp_path):
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02)
    pool.acquire("s1", 10.0)
    order: list[str] = []
    threads = []
    for name in ("first", "second"):
        threads.append(threading.Thread(target=lambda n=name: (pool.acquire(n, 6.0, priority=True), order.append(n))))
        threads[-1].start()
        time.sleep(0.2)
    pool.release("s1")
    time.sleep(0.5)
    assert order == ["first"]  # 6 + 6 > 10: the second waits for the first
    pool.release("first")
    threads[1].join(10)
    assert order == ["first", "second"]


def test_a_dead_process_holds_no_memory_whatever_its_pid_becomes(tmp_path):
    """A holder keeps an flock on its entry: alive it holds its memory; killed (-9, no cleanup) its entry goes,
    though the ledger still names its pid (which another process may reuse)."""
    folder = tmp_path / "pool"
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from kernelarc.memory_pool import MemoryPool; "
            f"MemoryPool({str(folder)!r}, 10.0).acquire('other', 9.0); print('held', flush=True); "
            "time.sleep(600)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        pool = MemoryPool(folder, 10.0, poll_s=0.02)
        with pytest.raises(TimeoutError):
            pool.acquire("mine", 8.0, timeout_s=0.3)  # alive: its 9 GB stand
        (entry,) = folder.glob("*.json")
        stale = json.loads(entry.read_text())
        holder.kill()
        holder.wait()
        entry.write_text(json.dumps({**stale, "pid": os.getpid()}))  # as if its pid were reused by a live process
        assert pool.acquire("mine", 8.0, timeout_s=2) < 1.5
        assert pool.reserved_gb() == pytest.approx(8.0)
    finally:
        holder.kill()
        holder.wait()


def test_an_interrupted_wait_leaves_nothing_behind(tmp_path):
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02)
    pool.acquire("a", 8.0)
    with pytest.raises(TimeoutError):
        pool.acquire("big", 9.0, priority=True, timeout_s=0.2)
    assert len(list((tmp_path / "pool").glob("*.json"))) == 1  # the waiter's entry went with it
    pool.acquire("b", 2.0, timeout_s=1)  # no waiter left to hold plain requests back


def test_a_waiter_that_needs_more_also_waits_for_the_devices_own_free_memory(tmp_path):
    """The ledger counts plans: processes can hold more than they planned (L2/004's 32 GB re-run, granted by the
    ledger, died of CUDA out of memory with 155 MB free), so a priority request waits for the device too; a plain
    one does not; after the grace period the request goes ahead (the guard's own plan then says what is missing)."""
    free = [3.0]
    pool = MemoryPool(tmp_path / "pool", 10.0, poll_s=0.02, device_free_gb=lambda: free[0], device_grace_s=30)
    got = threading.Event()
    t = threading.Thread(target=lambda: (pool.acquire("big", 7.0, priority=True), got.set()), daemon=True)
    t.start()
    assert not got.wait(0.4), "the ledger's room was granted while the device had 3 GB free"
    free[0] = 8.0
    assert got.wait(5)
    t.join()
    pool.release("big")
    free[0] = 0.5
    pool.acquire("share", 4.0, timeout_s=1)  # a plain share never waits for the device
    pool.release("share")
    impatient = MemoryPool(tmp_path / "pool2", 10.0, poll_s=0.02, device_free_gb=lambda: 0.5, device_grace_s=0.2)
    t0 = time.monotonic()
    impatient.acquire("big", 7.0, priority=True, timeout_s=10)
    assert 0.15 < time.monotonic() - t0 < 5
    unknown = MemoryPool(tmp_path / "pool3", 10.0, poll_s=0.02, device_free_gb=lambda: None)
    unknown.acquire("big", 7.0, priority=True, timeout_s=1)  # no GPU (or no answer): the ledger alone decides


def test_the_memory_a_process_holds_counts_as_open_to_its_own_reservation(monkeypatch):
    """L2/024 on the H100: its retry with the whole 77 GB pool waited out the pool's grace on an idle 79.2 GB card,
    4 GB of which its own process held; what the allocator still holds is part of the reservation's use."""
    import torch

    from kernelarc import suite

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(74.7 * GB), int(79.2 * GB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 4 * GB)
    assert suite._device_free_gb() == pytest.approx(78.7) and emptied
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert suite._device_free_gb() is None


def test_the_need_read_from_a_refusal_is_a_cap_the_plan_accepts(tmp_path):
    t = load_task(_memory_problem(tmp_path, sizes=(16, 4096)))
    run = load_module(t.definition.reference, "memory_probe").run
    refused = plan_memory(t, [0, 1], "cpu", memory_gb=0.04, run=run)
    assert 1 in refused.verdicts and "the guard needs" in refused.verdicts[1]
    need = cap_needed_gb("; ".join(refused.errors()))
    assert need is not None and need > 0.04
    assert plan_memory(t, [0, 1], "cpu", memory_gb=need, run=run).runnable == [0, 1]
    assert cap_needed_gb("the task's reference failed in the guard (timeout)") is None


def test_inputs_and_outputs_over_the_cap_name_a_lower_bound_that_leads_to_a_runnable_cap(tmp_path):
    """On the H200 (L2/024, an 11 GB share): "its inputs and outputs alone take 12.03 GB, above the cap" named no
    need, so the suite's pool never ran it again. The refusal now names one input set's need without the
    reference's working memory (it never ran); a plan with that cap runs the reference and names the whole need
    where the bound fell short, and the suite's retries follow the needs up."""
    t = load_task(_memory_problem(tmp_path, sizes=(16, 4096)))
    run = load_module(t.definition.reference, "memory_probe").run
    refused = plan_memory(t, [1], "cpu", memory_gb=0.02, run=run)  # workload 1 moves 32 MB
    assert "alone take" in refused.verdicts[1] and "the guard needs" in refused.verdicts[1]
    caps = [0.02]
    while need := cap_needed_gb("; ".join(plan_memory(t, [1], "cpu", memory_gb=caps[-1], run=run).errors())):
        assert need > caps[-1]
        caps.append(need)
        assert len(caps) <= MEMORY_RETRIES
    assert plan_memory(t, [1], "cpu", memory_gb=caps[-1], run=run).runnable == [1]


def _bounded_probe(cap_gb: float, in_gb: float, out_gb: float, peak_gb: float) -> Footprint:
    """What dry_run finds on a GPU under a cap: not run where the inputs and outputs alone exceed its usable
    memory, out of memory (over_cap) where the reference's inputs and peak do, else the measured peak."""
    usable = cap_gb * HEADROOM * GB
    fp = Footprint(1, int(in_gb * GB), int(out_gb * GB), int(out_gb * GB) // 2, int(out_gb * GB))
    if (in_gb + out_gb) * GB > usable:
        fp.error, fp.unrun = "its inputs and outputs alone take more, above the cap", True
    elif (in_gb + peak_gb) * GB > usable:
        fp.error, fp.over_cap = "the reference alone runs out of memory within the cap", True
    else:
        fp.peak_bytes, fp.measured = int(peak_gb * GB), True
    return fp


@pytest.mark.parametrize("pool_gb", [77.0, 137.0])
@pytest.mark.parametrize("sizes", [(6.0, 6.0, 10.0), (1.0, 1.0, 18.0)], ids=["io-bound", "peak-bound"])
def test_a_probe_out_of_memory_under_its_cap_leads_the_retries_to_a_runnable_cap(pool_gb, sizes):
    """A dry run bounded by its share (run DT, H100: an unbounded probe held 46.7 GB under an 11 GB share and
    another shard's reservation ran out) knows only that the reference needs more than the cap. Its refusal names
    twice the usable memory as a lower bound, so that the suite's retries (at most MEMORY_RETRIES runs, clamped to
    the pool) reach a cap that runs the problem: one with 12 GB of inputs and outputs (L2/024-sized), one with an
    18 GB working set beside 2 GB of inputs and outputs (its judge and two workers, the champion's and a challenger's,
    within the smaller pool)."""
    share, caps = 11.0, [11.0]
    row = ProblemResult(problem="p", status=ProblemStatus.failed)
    while True:
        plan = plan_memory(None, [1], "cuda", memory_gb=caps[-1], footprints={1: _bounded_probe(caps[-1], *sizes)})
        if plan.runnable == [1]:
            break
        row.reason = "; ".join(plan.errors())
        need = memory_retry_gb(row, share, pool_gb) if len(caps) == 1 else cap_needed_gb(row.reason)
        assert need is not None and min(need, pool_gb) > caps[-1], (caps, row.reason)
        caps.append(min(need, pool_gb))
        assert len(caps) <= MEMORY_RETRIES, caps
    assert caps[-1] <= pool_gb


def test_a_probe_out_of_memory_names_twice_its_usable_memory():
    over = plan_memory(None, [1], "cuda", memory_gb=20.0, footprints={1: _bounded_probe(20.0, 1.0, 1.0, 40.0)})
    assert "within the cap" in over.verdicts[1] and "at least" in over.verdicts[1]
    assert cap_needed_gb(over.verdicts[1]) >= 2 * 20.0


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_problem_refused_for_memory_runs_again_with_the_cap_it_needs(tmp_path, isolation):
    """A 0.004 GB share is too small for one input set of a 128 x 4096 rmsnorm; with a 2 GB pool the suite runs it
    again right away with the cap its plan named, and its row is that run's."""
    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    tree = tmp_path / "tree"
    p = _problem(tree, "L1/001_rmsnorm", "rmsnorm", ref)
    wl = {
        "uuid": "big",
        "axes": {"M": 128, "N": 4096},
        "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}},
    }
    (p / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    _problem(tree, "L1/002_small", "small", "import torch\n\ndef run(x, weight):\n    return x * weight\n")
    assert "budget.candidates=2" in ARGS
    # (suite.memory_estimate off: on the CPU the sizes-only estimate is the dry run's plan, and no run is refused)
    r = _suite(tmp_path, tree, "guard.memory_gb=0.004", "suite.memory_pool_gb=2", f"suite.claims={tmp_path / 'claims'}",
               "budget.candidates=1", f"suite.isolation={isolation}", "suite.memory_estimate=false")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(guard.memory_gb=" in r.stdout  # the second run says its cap
    # right away, before the next problem: a suite cut by its time limit never reaches the end of its queue
    assert r.stdout.index("(guard.memory_gb=") < r.stdout.index("L1/002_small ...")
    rows = {x["problem"]: x for x in json.loads(next((tmp_path / ".kernelarc").rglob("table.json")).read_text())}
    row = rows["L1/001_rmsnorm"]
    assert row["status"] in ("improved", "baseline"), row
    assert "runs again" not in (row["reason"] or "")
    assert rows["L1/002_small"]["status"] in ("improved", "baseline")
    assert not list((tmp_path / "claims" / "memory").glob("*.json"))  # every reservation released


def test_a_pool_needs_claims_and_a_share(tmp_path):
    tree = tmp_path / "tree"
    _problem(tree, "L1/001_x", "x", "import torch\n\ndef run(x, weight):\n    return x\n")
    r = _suite(tmp_path, tree, "suite.memory_pool_gb=2")
    assert r.returncode == 2 and "suite.memory_pool_gb needs suite.claims" in r.stderr
    r = _suite(tmp_path, tree, "suite.memory_pool_gb=2", f"suite.claims={tmp_path / 'c'}")
    assert r.returncode == 2 and "needs guard.memory_gb" in r.stderr


def test_the_cap_a_failed_row_runs_again_with():
    from kernelarc.suite import OOM_SHARES

    def row(reason, status=ProblemStatus.failed):
        return ProblemResult(problem="p", status=status, reason=reason)

    oom = ("the task's reference failed in the guard (runtime_error): out of memory: CUDA out of memory. Tried to "
           "allocate 516.00 MiB")  # fmt: skip
    assert memory_retry_gb(row(oom), 11, 138) == OOM_SHARES * 11
    assert memory_retry_gb(row(oom), 60, 138) == 138  # at most the pool
    assert memory_retry_gb(row(oom), 138, 138) is None  # the whole pool already: nothing more to give
    assert memory_retry_gb(row(oom, ProblemStatus.baseline), 11, 138) is None
    assert memory_retry_gb(row("the task's reference failed in the guard (incorrect): nan"), 11, 138) is None
    assert memory_retry_gb(row("the guard needs 30.00 GB for one input set"), 11, 138) == cap_needed_gb(
        "the guard needs 30.00 GB for one input set"
    )
    assert memory_retry_gb(row("the guard needs 300.00 GB for one input set at least"), 11, 138) == 138  # the pool
    assert memory_retry_gb(row("the guard needs 300.00 GB for one input set"), 138, 138) is None


OOM_FIRST_PROCESS = """
import os
import torch

MARK = {mark!r}


def run(x, weight):
    # out of memory in every call of the first process that calls it (the first session of the problem, as when
    # other shards held the GPU), correct in any later one
    if not os.path.exists(MARK):
        with open(MARK, "w") as f:
            f.write(str(os.getpid()))
    with open(MARK) as f:
        if f.read() == str(os.getpid()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 516.00 MiB")
    return x * weight
"""


def test_a_reference_out_of_the_shared_memory_runs_again_with_more_shares(tmp_path):
    tree = tmp_path / "tree"
    _problem(tree, "L1/001_oom", "oom", OOM_FIRST_PROCESS.format(mark=str(tmp_path / "first_pid")))
    r = _suite(tmp_path, tree, "guard.memory_gb=0.5", "suite.memory_pool_gb=4", f"suite.claims={tmp_path / 'claims'}",
               "budget.candidates=1", "suite.isolation=process")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "first_pid").exists()
    assert "out of memory" in r.stdout and "(guard.memory_gb=1.5" in r.stdout, r.stdout[-3000:]
    (row,) = json.loads(next((tmp_path / ".kernelarc").rglob("table.json")).read_text())
    assert row["status"] in ("improved", "baseline"), row


OOM_FIRST_PROCESSES = """
import os
import torch

MARKS = {marks!r}


def run(x, weight):
    # out of memory in every call of the first two processes that call it (other shards over their shares, as
    # L2/024 met on the H100 with its 55.4 GB reservation held), correct in any later one
    pid = str(os.getpid())
    seen = open(MARKS).read().split() if os.path.exists(MARKS) else []
    if pid not in seen and len(seen) < 2:
        with open(MARKS, "a") as f:
            f.write(pid + "\\n")
        seen.append(pid)
    if pid in seen:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
    return x * weight
"""


def test_a_reservation_out_of_memory_beside_others_runs_once_more_with_the_same_cap(tmp_path):
    marks = tmp_path / "pids"
    tree = tmp_path / "tree"
    _problem(tree, "L1/001_oom", "oom", OOM_FIRST_PROCESSES.format(marks=str(marks)))
    r = _suite(tmp_path, tree, "guard.memory_gb=0.5", "suite.memory_pool_gb=4", f"suite.claims={tmp_path / 'claims'}",
               "budget.candidates=1", "suite.isolation=process")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(marks.read_text().split()) == 2  # two processes ran out
    assert "(guard.memory_gb=1.5" in r.stdout and "with 1.5 GB reserved" in r.stdout, r.stdout[-3000:]
    (row,) = json.loads(next((tmp_path / ".kernelarc").rglob("table.json")).read_text())
    assert row["status"] in ("improved", "baseline"), row


def test_which_failures_ran_out_beside_other_processes():
    from kernelarc.suite import ran_out_beside_others

    def row(reason):
        return ProblemResult(problem="p", status=ProblemStatus.failed, reason=reason)

    assert ran_out_beside_others(row("the task's reference failed in the guard (runtime_error): out of memory: CUDA"))
    assert not ran_out_beside_others(row("workload 1: the guard needs 30.00 GB for one input set"))
    assert not ran_out_beside_others(row("workload 8: the reference alone runs out of memory within the cap's 9.9 GB"))
    assert not ran_out_beside_others(row("the task's reference failed in the guard (incorrect): nan"))


def test_a_first_run_starts_with_the_cap_its_workloads_need_beside_each_other(tmp_path):
    """suite.memory_estimate: where the definition's sizes show that the share holds each workload alone but not
    all of them (the plan would leave the largest out, and the row would count one workload fewer: L2/001 and
    L2/008 at an 11 GB share once the champion's worker was counted), the first run gets the smallest cap, in
    0.5 GB steps within the pool, that holds them all."""
    from hydra import compose, initialize_config_dir

    from kernelarc.suite import first_cap_gb

    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    p = _problem(tmp_path / "tree", "L1/001_rmsnorm", "rmsnorm", ref)
    inputs = {"x": {"type": "random"}, "weight": {"type": "random"}}
    wls = [{"uuid": f"m{m}", "axes": {"M": m, "N": 4096}, "inputs": inputs} for m in (64, 512)]
    (p / "workload.jsonl").write_text("\n".join(json.dumps(w) for w in wls) + "\n")
    task = load_task(p)

    def runs(gb: float, which: list[int]) -> bool:
        plan = plan_memory(task, which, "cpu", memory_gb=gb, seeds=1, parallel=1, prestart=0, hp_reference=False)
        return len(plan.runnable) == len(which)

    alone = next(gb / 1000 for gb in range(1, 500) if runs(gb / 1000, [1]))
    both = next(gb / 1000 for gb in range(1, 500) if runs(gb / 1000, [0, 1]))
    assert alone < both < 0.5
    share = (alone + both) / 2
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["suite.workloads=2", "guard.seeds=1", "executor.prestart=0"])
    first = first_cap_gb(cfg, p, True, share, 2.0)
    assert first == 0.5 and runs(first, [0, 1]) and not runs(share, [0, 1])
    assert first_cap_gb(cfg, p, True, both, 2.0) is None  # the share holds them all
    assert first_cap_gb(cfg, p, True, share, share) is None  # nothing in the pool does: the run's refusal says so
