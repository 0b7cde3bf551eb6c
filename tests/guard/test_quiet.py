"""Quiet cores: while a guard holds the device lock, the workers it measures run on CPUs of their own
(``KERNELARC_QUIET_CPUS``), and go back to the judge's CPUs after (kernelarc/guard/quiet.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kernelarc.guard import quiet
from kernelarc.guard.judge import Guard, GuardConfig
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin

needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell them apart")


def _allowed(pid: int) -> set[str]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out |= {ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list")}
    return out


def test_cpu_lists_parse_and_bad_ones_are_refused():
    assert quiet.parse_cpus("0-1,4") == {0, 1, 4}
    assert quiet.parse_cpus(" 3 ") == {3}
    for bad in ("", "2-1", "a", "-1"):
        with pytest.raises(ValueError):
            quiet.parse_cpus(bad)


def test_unset_or_malformed_variable_means_no_quiet_cores(monkeypatch):
    monkeypatch.delenv(quiet.ENV, raising=False)
    assert quiet.from_env() is None
    monkeypatch.setenv(quiet.ENV, "x-y")
    assert quiet.from_env() is None
    monkeypatch.setenv(quiet.ENV, "0")
    assert quiet.from_env().cpus == {0}
    monkeypatch.setenv(quiet.ENV, str(2**40))  # no such CPU: refused here, not an OverflowError mid-evaluation
    assert quiet.from_env() is None


@needs_two
def test_every_thread_of_a_process_moves_and_comes_back():
    cpus = sorted(os.sched_getaffinity(0))
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(30,)).start()\n"
    p = subprocess.Popen([sys.executable, "-c", code + "time.sleep(30)"])
    try:
        for _ in range(100):  # its threads started
            if len(os.listdir(f"/proc/{p.pid}/task")) >= 4:
                break
            time.sleep(0.05)
        q = quiet.QuietCores({cpus[-1]}, home=set(cpus[:-1]))
        q.enter([p.pid])
        assert _allowed(p.pid) == {str(cpus[-1])}
        q.leave([p.pid])
        assert str(cpus[-1]) not in ",".join(_allowed(p.pid))
        q.enter([p.pid, 2**22 + 7])  # a process that is gone is skipped
    finally:
        p.kill()
        p.wait()


# correct only when the worker runs on exactly the quiet CPU while it is checked and timed
PROBE = """import os

import torch


def run(x, weight):
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    return y if os.sched_getaffinity(0) == {{{cpu}}} else y + 1
"""


@needs_two
def test_a_guard_measures_its_workers_on_the_quiet_cpus(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(quiet.ENV, str(cpus[-1]))
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=1))
    try:
        assert g.quiet is not None and g.quiet.cpus == {cpus[-1]}
        ok = g.evaluate(Candidate(source=PROBE.format(cpu=cpus[-1]), language="pytorch"), timeout_s=20).verdict
        assert ok.correct, (ok.status, ok.errors)
        other = g.evaluate(Candidate(source=PROBE.format(cpu=cpus[0]), language="pytorch"), timeout_s=20).verdict
        assert other.status is Status.incorrect, (other.status, other.errors)
    finally:
        g.close()
    # without the variable the workers stay on the judge's CPUs
    monkeypatch.delenv(quiet.ENV)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=1))
    try:
        assert g.quiet is None
        v = g.evaluate(Candidate(source=PROBE.format(cpu=cpus[-1]), language="pytorch"), timeout_s=20).verdict
        assert v.status is Status.incorrect, (v.status, v.errors)
    finally:
        g.close()
