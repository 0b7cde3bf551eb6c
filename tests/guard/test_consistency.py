"""The consistency rule on a machine that got slower since the champion was crowned.

Beside a challenger the champion must not run much slower than when it was crowned: what a challenger that
steals its GPU or CPU would show. On the H200, with seven sessions sharing the machine, champions ran 1.6-4x
slower beside later challengers than when crowned, and composed candidates several times faster were judged
correct_slower for it. The guard now re-times the champion alone on such a workload; that measurement is
the reference there."""

from __future__ import annotations

import pytest
from cpu_guard import rmsnorm_cpu_guard

from kernelarc.guard.decision import median
from kernelarc.models import Candidate, Status

RMS = """import torch


def _rms(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""
FAST = RMS + "\n\ndef run(x, weight):\n    return _rms(x, weight)\n"
# correct and about ten times slower: the same result, recomputed
SLOW = (
    RMS
    + """

def run(x, weight):
    out = _rms(x, weight)
    for _ in range(9):
        out = _rms(x, weight)
    return out
"""
)


@pytest.fixture(scope="module")
def guard():
    with rmsnorm_cpu_guard(prestart=2) as g:
        yield g


def test_a_champion_slower_now_than_when_crowned_is_re_timed_alone(guard):
    slow = Candidate(source=SLOW, language="pytorch")
    crowned = guard.evaluate(slow).verdict
    assert crowned.correct, crowned.errors
    # as if crowned on a machine three times faster than this one is now
    ref = {w.index: w.latency_ms / 3 for w in crowned.workloads}
    ev = guard.evaluate(Candidate(source=FAST, language="pytorch"), slow, champion_reference=ref)
    v = ev.verdict
    notes = [w for w in v.warnings if "re-timed alone" in w]
    assert notes, v.warnings
    assert v.status is Status.champion, (v.status, v.warnings)
    assert not any("inconsistent" in w for w in v.warnings), v.warnings
    assert v.speedup_vs_champion and v.speedup_vs_champion > 1.2  # ten times the work; call overhead on a CPU
    # the champion's side-by-side samples are untouched by the re-timing: the decision's ratio is theirs
    wl = v.workloads[0].index
    assert v.workloads[0].champion_ms == pytest.approx(median(ev.champion_samples[wl]))


def test_a_champion_as_fast_as_when_crowned_is_not_re_timed(guard):
    slow = Candidate(source=SLOW, language="pytorch")
    crowned = guard.evaluate(slow).verdict
    ref = {w.index: w.latency_ms for w in crowned.workloads}
    v = guard.evaluate(Candidate(source=FAST, language="pytorch"), slow, champion_reference=ref).verdict
    assert v.status is Status.champion, (v.status, v.warnings)
    assert not any("re-timed alone" in w for w in v.warnings), v.warnings
