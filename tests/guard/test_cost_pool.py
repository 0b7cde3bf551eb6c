"""The guard's time per candidate (issue 15): no evaluation waits for a worker start when the pool is warm, the
pool's size follows from what the evaluations in flight consume, and a champion's worker serves several
evaluations while every challenger still gets a fresh one and the champion's timed outputs are checked.

Counts starts, waits and worker pids; no timing assertion."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernelarc.guard.judge import Guard, GuardConfig, champion_key, reference_candidate
from kernelarc.guard.pool import WorkerPool
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin

GOOD = """import torch
def run(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""
# A champion that does no work at all (as a champion that skips work once crowned would, on the calls it
# thinks unchecked): its worker is never given a check outside timing, so only a checked timed call finds it.
LAZY_CHAMPION = "import torch\ndef run(x, weight):\n    return torch.empty_like(x)\n"


def _cfg(**kw) -> GuardConfig:
    base = dict(timeout_s=60, target_ms=4, min_iters=3, max_iters=12, seeds=2, workloads=[0], prestart=2)
    return GuardConfig(**{**base, **kw})


def _wait_ready(pool: WorkerPool, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while pool.idle_ready() < n:
        assert time.monotonic() < deadline, "pool workers did not start"
        time.sleep(0.2)


def _cand(tag: str) -> Candidate:
    return Candidate(source=GOOD + f"\n# {tag}\n", language="pytorch")


@pytest.fixture(scope="module")
def task():
    return load_builtin("rmsnorm", cpu=True)


def test_pool_size_follows_what_the_evaluations_in_flight_consume():
    # a Guard used directly keeps what its caller chose
    assert GuardSettings(prestart=1).pool_size() == 1
    # the session's: a challenger per evaluation in flight, plus the next champion's worker
    s = GuardSettings(prestart=2).resolved(on_cpu=True, prestart=2, workloads=None, parallel=3)
    assert (s.in_flight, s.prestart, s.pool_size(), s.resident_workers()) == (3, 2, 4, 5)
    # single-use champion workers: two per evaluation
    assert GuardSettings(prestart=2, in_flight=3, champion_reuse=0).pool_size() == 6
    assert GuardSettings(prestart=2, in_flight=3, champion_reuse=0).resident_workers() == 6
    # executor.prestart above the need wins
    assert GuardSettings(prestart=9, in_flight=3).pool_size() == 9


def test_the_memory_plan_counts_the_resident_workers(task):
    from kernelarc.guard import memory

    g = Guard(task, None, "cpu", _cfg(prestart=1, in_flight=3))
    seen = {}
    real = memory.plan_memory

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    memory.plan_memory, orig = spy, memory.plan_memory
    try:
        memory.memory_plan(g)
    finally:
        memory.plan_memory = orig
    assert seen["prestart"] == g.cfg.resident_workers() == 5


def test_a_warm_pool_means_no_evaluation_waits_and_the_champion_worker_serves_again(task):
    g = Guard(task, None, "cpu", _cfg())
    try:
        champ = reference_candidate(task)
        _wait_ready(g.pool, g.pool.size)
        waits0 = g.pool.stats.waits
        ev1 = g.evaluate(_cand("one"), champ)
        assert ev1.verdict.correct, ev1.verdict.errors
        assert g.pool.stats.waits == waits0, "the first evaluation waited for a worker start"
        first = g._champ
        assert first is not None and first.key == champion_key(champ) and first.ready and first.users == 0
        champ_pid = first.worker.process.pid
        starts = g.pool.stats.starts
        _wait_ready(g.pool, g.pool.size)
        waits1 = g.pool.stats.waits
        ev2 = g.evaluate(_cand("two"), champ)
        assert ev2.verdict.correct, ev2.verdict.errors
        assert all(w.champion_ms for w in ev2.verdict.workloads)
        # the same champion worker (no start, no compile: no champion_setup phase); one fresh challenger worker
        assert g._champ is first and first.worker.process.pid == champ_pid and first.worker.alive()
        assert "champion_setup" in ev1.verdict.phases and "champion_setup" not in ev2.verdict.phases
        assert g.pool.stats.starts == starts + 1
        assert g.pool.stats.waits == waits1
        # a new champion: a new worker, the old one killed
        new = Candidate(source=GOOD + "\n# crowned\n", language="pytorch")
        ev3 = g.evaluate(_cand("three"), new)
        assert ev3.verdict.correct, ev3.verdict.errors
        assert g._champ is not first and g._champ.key == champion_key(new)
        first.worker.process.wait(timeout=10)
        assert not first.worker.alive()
    finally:
        g.close()


def test_challenger_workers_are_fresh_and_never_the_champions(task):
    g = Guard(task, None, "cpu", _cfg())
    pids = []
    real = g.pool.acquire

    def acquire():
        w = real()
        pids.append(w.process.pid)
        return w

    g.pool.acquire = acquire
    try:
        champ = reference_candidate(task)
        for tag in ("a", "b", "c"):
            assert g.evaluate(_cand(tag), champ).verdict.correct
        champ_pid = g._champ.worker.process.pid
        # acquisitions: challenger a, the champion, challenger b, challenger c
        assert len(pids) == 4 and len(set(pids)) == 4 and pids[1] == champ_pid
    finally:
        g.close()


def test_champion_worker_retired_after_champion_reuse_evaluations(task):
    g = Guard(task, None, "cpu", _cfg(champion_reuse=2))
    try:
        champ = reference_candidate(task)
        seen = []
        for tag in ("a", "b", "c"):
            assert g.evaluate(_cand(tag), champ).verdict.correct
            seen.append(g._champ.worker.process.pid)
        assert seen[0] == seen[1] != seen[2]
    finally:
        g.close()


def test_single_use_champion_workers_when_reuse_is_off(task):
    g = Guard(task, None, "cpu", _cfg(champion_reuse=0))
    try:
        champ = reference_candidate(task)
        starts = g.pool.stats.starts
        for tag in ("a", "b"):
            assert g.evaluate(_cand(tag), champ).verdict.correct
            assert g._champ is None
        assert g.pool.stats.starts == starts + 4  # a challenger and a champion each time
    finally:
        g.close()


def test_a_lazy_champion_is_caught_by_its_checked_timed_call(task):
    g = Guard(task, None, "cpu", _cfg(workloads=[0, 1]))
    try:
        lazy = Candidate(source=LAZY_CHAMPION, language="pytorch")
        v = g.evaluate(_cand("vs lazy"), lazy).verdict
        # checked, so correct; its timing stopped with the champion's: not compared, not promoted
        assert v.status is Status.correct_slower, (v.status, v.errors, v.warnings)
        assert any("champion output produced while timed is wrong" in w for w in v.warnings), v.warnings
        assert any("not compared" in w for w in v.warnings), v.warnings
        assert not v.errors, v.errors  # the champion's failure is not the challenger's
        assert g._champ is None  # retired, not reused
    finally:
        g.close()


def test_a_champion_that_fails_to_set_up_leaves_the_challenger_unjudged_not_correct(task):
    g = Guard(task, None, "cpu", _cfg())
    try:
        broken = Candidate(
            source="import torch\nimport not_a_module\ndef run(x, weight):\n    return x\n", language="pytorch"
        )
        v = g.evaluate(_cand("vs broken"), broken).verdict
        assert v.status is Status.runtime_error, (v.status, v.errors)
        assert any("before the candidate was checked" in e for e in v.errors), v.errors
        assert any("champion worker failed" in w for w in v.warnings), v.warnings
        assert g._champ is None
        assert g.evaluate(_cand("vs reference"), reference_candidate(task)).verdict.correct
    finally:
        g.close()


def test_two_evaluations_in_flight_share_one_champion_worker(task):
    g = Guard(task, None, "cpu", _cfg(prestart=3))
    try:
        champ = reference_candidate(task)
        out: dict[str, object] = {}

        def run(tag: str) -> None:
            out[tag] = g.evaluate(_cand(tag), champ).verdict

        ts = [threading.Thread(target=run, args=(t,)) for t in ("x", "y")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        assert all(out[t].correct for t in ("x", "y")), out
        assert g._champ is not None and g._champ.uses == 2 and g._champ.users == 0
    finally:
        g.close()


def test_an_idle_worker_that_died_is_replaced_not_handed_out():
    pool = WorkerPool("cpu", size=2, start_timeout=120)
    try:
        _wait_ready(pool, 2)
        dead = pool._idle[0]
        dead.process.kill()
        dead.process.wait(timeout=10)
        w = pool.acquire()
        assert w is not dead and w.alive() and w.ready
        assert pool.stats.replaced_dead == 1 and pool.stats.waits == 0
        w.kill()
    finally:
        pool.close()


def test_pool_workers_bring_their_output_buffer_and_release_it_with_them(task):
    # Each pool worker maps its output buffer while it starts (on a GPU also page-locking it there), so an
    # evaluation takes the worker's buffer instead of making (and page-locking) one of its own.
    import os

    g = Guard(task, None, "cpu", _cfg())
    try:
        used = []
        real = g._buffer_of

        def spy(w, nbytes):
            buf = real(w, nbytes)
            used.append((w, buf))
            return buf

        g._buffer_of = spy
        ev = g.evaluate(_cand("buffer"), reference_candidate(task))
        assert ev.verdict.correct, ev.verdict.errors
        assert len(used) == 2  # the challenger's and the champion's worker
        for w, buf in used:
            assert buf is w.buffer and buf.nbytes >= 1
        (w, buf), _ = used
        w.process.wait(timeout=10)
        deadline = time.monotonic() + 20
        while os.path.exists(buf.path or "") and time.monotonic() < deadline:
            time.sleep(0.1)  # the killed challenger's cleanup closes its buffer
        assert buf.path is None or not os.path.exists(buf.path)
        # a worker whose buffer is too small for the evaluation gets one of its own, released with it
        w2 = g.pool.acquire()
        try:
            own = real(w2, w2.buffer.nbytes + 1)
            assert own is not w2.buffer and own in w2.keep and own.nbytes == w2.buffer.nbytes + 1
        finally:
            w2.kill()
        assert own.path is None and w2.buffer.path is None
    finally:
        g.close()


def test_the_float64_reference_runs_only_where_it_is_asked_for(task):
    # The float64 run feeds the rel_err metric only: the timed checks' fresh seeds skip it, a seed computed
    # without it gets it (and keeps its outputs) when a correctness check asks later.
    g = Guard(task, None, "cpu", _cfg())
    runs = []
    real = g._ref_mod.run

    def spy(*args):
        runs.append(args[0].dtype)
        return real(*args)

    g._ref_mod.run = spy
    try:
        outs, hp = g.reference(0, 123, hp=False)
        assert hp is None and runs and all(d != torch.float64 for d in runs)
        n = len(runs)
        outs2, hp2 = g.reference(0, 123, hp=True)
        assert outs2 is outs and runs[n:] == [torch.float64]  # only the missing float64 run
        assert hp2 is not None and hp2[0].dtype == torch.float64
        assert torch.allclose(hp2[0].float(), outs[0].float(), atol=2e-2, rtol=2e-2)
        assert g.reference(0, 123, hp=False)[1] is hp2 and len(runs) == n + 1  # cached, float64 included
    finally:
        g.close()
