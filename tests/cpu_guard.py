"""The CPU guard the guard tests judge against: built-in rmsnorm, small timing targets, the reference
measured as the first champion and the baselines set."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Status
from kernelarc.tasks import load_builtin


@contextlib.contextmanager
def rmsnorm_cpu_guard(prestart: int) -> Iterator[Guard]:
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=prestart))
    try:
        ref = g.evaluate(reference_candidate(task), trusted=True)
        assert ref.verdict.status is Status.champion, ref.verdict.errors
        g.set_baselines(ref, None)
        yield g
    finally:
        g.close()
