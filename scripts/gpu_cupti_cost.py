"""Where the guard's CUPTI timing spends its time on the GPU (issue 15's cost per candidate).

Times bursts of a two-kernel call three ways, for several burst sizes: CUDA events only; CUPTI with every
buffer forced out after each burst (the guard today); CUPTI with the bursts' records taken once at the end
(what deferring the flush to a workload's end would cost). Prints milliseconds of host wall time per burst,
the forced flush's share, and the records per burst; asserts nothing. ``python3 scripts/gpu_cupti_cost.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

from kernelarc.guard import timer as timer_mod
from kernelarc.guard.protocol import TimerMethod


def main() -> None:
    dev = torch.device("cuda:0")
    x = torch.randn(4096, 2048, device=dev)
    w = torch.randn(2048, device=dev)

    def fn(a, b):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * b

    for quiet in (False, True):
        timer_mod._QUIET = quiet
        t = timer_mod.Timer(torch, dev, 256 << 20, 200_000, use_cupti=True)
        if t.method is not TimerMethod.cupti:
            print("cupti-python not importable:", t.notes)
            return
        print("query API records " + ("off" if quiet else "on (all API records)"))
        _table(t, torch, dev, x, w, fn)


def _table(t, torch, dev, x, w, fn) -> None:
    setup = lambda k: [x, w]  # noqa: E731
    print(f"{'n':>4} {'events ms/burst':>16} {'cupti ms/burst':>15} {'of it: flush':>13} {'deferred ms/burst':>18} "
          f"{'records/burst':>14}")  # fmt: skip
    for n in (5, 20, 80):
        ev, cu, fl, de, recs = [], [], [], [], []
        for _ in range(8):
            t0 = time.perf_counter()
            t._events(n, setup, fn, None, None)
            ev.append((time.perf_counter() - t0) * 1e3)
        t.burst(n, setup, fn, None)  # the session is open
        sess = t._session
        for _ in range(8):
            t0 = time.perf_counter()
            stamps: list = []
            torch.cuda.synchronize(dev)
            sess.take()
            t._events(n, setup, fn, None, stamps)
            t1 = time.perf_counter()
            launches, spans = sess.take()
            t2 = time.perf_counter()
            cu.append((t2 - t0) * 1e3)
            fl.append((t2 - t1) * 1e3)
            recs.append(len(launches) + sum(len(v) for v in spans.values()))
        torch.cuda.synchronize(dev)
        sess.take()
        t0 = time.perf_counter()
        for _ in range(8):
            t._events(n, setup, fn, None, [])
        sess.take()
        de.append((time.perf_counter() - t0) * 1e3 / 8)
        med = statistics.median
        print(f"{n:>4} {med(ev):>16.1f} {med(cu):>15.1f} {med(fl):>13.1f} {med(de):>18.1f} {med(recs):>14.0f}")
    print(f"  {sess.quieted} query APIs without records; method after the bursts: {t.method.value} {t.notes}")
    t._close_session()


if __name__ == "__main__":
    main()
