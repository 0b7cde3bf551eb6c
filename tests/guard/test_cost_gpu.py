"""On the GPU: one CUPTI activity session per worker (kernelarc/guard/timer.py) times as one session per burst
did, and every burst of it sees every iteration's kernels (no fallback to CUDA events). Prints the time per
burst both ways (what the session saves); asserts only agreement, never a duration."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from kernelarc.guard import timer as timer_mod
from kernelarc.guard.protocol import TimerMethod

pytestmark = pytest.mark.gpu


def _bursts(one_session: bool, bursts: int = 20, n: int = 20):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda:0")
    real = timer_mod._ONE_SESSION
    timer_mod._ONE_SESSION = one_session
    try:
        t = timer_mod.Timer(torch, dev, 64 << 20, 200_000, use_cupti=True)
        if t.method is not TimerMethod.cupti:
            pytest.skip("cupti-python not importable")
        x = torch.randn(4096, 2048, device=dev)
        w = torch.randn(2048, device=dev)

        def fn(a, b):  # two kernels per call: a span, not one kernel's time
            y = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
            return y * b

        cupti, events, walls = [], [], []
        for _ in range(bursts):
            t0 = time.perf_counter()
            s, e, _ = t.burst(n, lambda k: [x, w], fn, None)
            walls.append(time.perf_counter() - t0)
            assert t.method is TimerMethod.cupti, t.notes  # no fallback to events
            assert e is not None and len(s) == len(e) == n and all(v > 0 for v in s), (s, e)
            cupti += s
            events += e
        t._close_session()
        return statistics.median(cupti), statistics.median(events), statistics.median(walls)
    finally:
        timer_mod._ONE_SESSION = real


def test_one_cupti_session_per_worker_times_as_one_per_burst():
    cu1, ev1, wall1 = _bursts(True)
    cu0, ev0, wall0 = _bursts(False)
    print(f"one session: cupti {cu1:.4f} ms events {ev1:.4f} ms, {wall1 * 1e3:.1f} ms per burst; "
          f"a session per burst: cupti {cu0:.4f} ms events {ev0:.4f} ms, {wall0 * 1e3:.1f} ms per burst")  # fmt: skip
    # the span never exceeds the events around it (the judge's cross-check), both ways
    assert cu1 <= ev1 * 1.2 + 0.02 and cu0 <= ev0 * 1.2 + 0.02
    # the same kernels, timed alike (generous: two runs of a shared GPU)
    assert 0.7 < cu1 / cu0 < 1.4, (cu1, cu0)
