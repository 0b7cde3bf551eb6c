"""CPU workers get a share of the cores: with two evaluations in flight on a 2-core machine, torch's default
(every core in every worker) made 0.05 ms calls read 12-48 ms beside a busy worker, and the judge-clock rule
rejected honest candidates for it (FlashInfer 024 on the CPU, ``executor.parallel=2``)."""

from __future__ import annotations

import os

from kernelarc.guard.judge import Guard, GuardConfig
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin

# correct only in a worker with exactly {n} intra-op threads (the guard's share), wrong otherwise
PROBE = """import torch


def run(x, weight):
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    return y if torch.get_num_threads() == {n} else y + 1
"""


def test_cpu_workers_share_the_cores_over_the_evaluations_in_flight():
    task = load_builtin("rmsnorm", cpu=True)
    cfg = GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=1, in_flight=2)
    g = Guard(task, None, "cpu", cfg)
    try:
        want = max(1, (os.cpu_count() or 1) // 2)
        assert g.cpu_threads() == want
        ok = g.evaluate(Candidate(source=PROBE.format(n=want), language="pytorch"), timeout_s=20).verdict
        assert ok.correct, (ok.status, ok.errors)
        other = g.evaluate(Candidate(source=PROBE.format(n=want + 1), language="pytorch"), timeout_s=20).verdict
        assert other.status is Status.incorrect, (other.status, other.errors)
    finally:
        g.close()
