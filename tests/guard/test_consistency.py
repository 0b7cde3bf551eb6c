"""The consistency rule on a real guard: a champion measured much slower beside a challenger than when it
was crowned voids the comparison; one measured faster only raises the bar.

Why the slower side stays void even when the champion, re-timed alone right then, is as slow: in a CPU
session on FlashInfer 024 (``executor.parallel=2``), the torch.compile champion's worker measured 16-24 ms
per call, alone too, against 0.03-0.27 ms when it was crowned, while a shape dispatch that runs the very same
torch.compile code measured 0.16 ms. A guard that took the re-timed measurement as the reference (commits
581ac76..eb8d194, reverted) crowned that dispatch 13x faster than the champion, though it was 2.3x slower than
torch.compile measured healthy. A champion far from its crowned self is a comparison nobody can trust."""

from __future__ import annotations

import pytest
from cpu_guard import rmsnorm_cpu_guard

from kernelarc.models import Candidate, Status

RMS = """import torch


def _rms(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""
FAST = RMS + "\n\ndef run(x, weight):\n    return _rms(x, weight)\n"
# correct and slower: the same result, recomputed
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


def crowned_within(attempts: int, judge, never: str | None = None):
    """``judge()``'s verdict once it crowns the challenger, after at most ``attempts`` tries: on this CPU a host's
    noise (a gain inside the noise bar, a champion slowed side by side) can decide one try. No try may carry a
    warning containing ``never``."""
    for _ in range(attempts):
        v = judge()
        assert never is None or not any(never in w for w in v.warnings), v.warnings
        if v.status is Status.champion:
            break
    assert v.status is Status.champion, (v.status, v.warnings)
    return v


@pytest.fixture(scope="module")
def guard():
    with rmsnorm_cpu_guard(prestart=2) as g:
        yield g


@pytest.fixture(scope="module")
def slow(guard):
    cand = Candidate(source=SLOW, language="pytorch")
    crowned = guard.evaluate(cand).verdict
    assert crowned.correct, crowned.errors
    return cand, {w.index: w.latency_ms for w in crowned.workloads}


def test_a_champion_far_slower_than_when_crowned_voids_the_comparison(guard, slow):
    cand, lat = slow
    # as if crowned at a tenth of what it measures now: the comparison is void, however fast the challenger
    ref = {w: ms / 10 for w, ms in lat.items()}
    v = guard.evaluate(Candidate(source=FAST, language="pytorch"), cand, champion_reference=ref).verdict
    assert v.status is Status.correct_slower, (v.status, v.warnings)
    assert any("inconsistent comparison" in w for w in v.warnings), v.warnings


def test_a_champion_faster_than_when_crowned_is_compared(guard, slow):
    cand, lat = slow
    # as if crowned at ten times what it measures now (a busy machine then): only a higher bar
    ref = {w: ms * 10 for w, ms in lat.items()}
    # A loaded 2-core CI host once spread the samples 13x, so the gain stayed inside the noise bar: that is the
    # noise rule, not this one; such an attempt is made again (three at most), none may call the champion inconsistent
    fast = Candidate(source=FAST, language="pytorch")
    crowned_within(3, lambda: guard.evaluate(fast, cand, champion_reference=ref).verdict, never="inconsistent")


def test_a_trusted_baseline_is_void_only_past_the_slack(guard, slow):
    """torch.compile (trusted) beside a champion a few times slower than when crowned is compared (a shared GPU
    slows every champion so); beside one far slower, the comparison is void: a CPU session crowned a torch.compile
    70x slower than the reference once the reference ran 228x slower beside it than alone."""
    cand, lat = slow
    cfg = guard.cfg
    bound = cfg.consistency_factor * cfg.trusted_slack
    fast = Candidate(source=FAST, language="pytorch")
    within = {w: ms / (cfg.consistency_factor * 2) for w, ms in lat.items()}  # void for a challenger, not for it
    # On this CPU the 10x-work champion runs only about 1.8x the challenger's time (a call's fixed cost), near the
    # noise bar: an attempt the noise decided is made again (three at most); none may be void
    crowned_within(3, lambda: guard.evaluate(fast, cand, trusted=True, champion_reference=within).verdict,
                   never="inconsistent comparison")  # fmt: skip
    beyond = {w: ms / (bound * 3) for w, ms in lat.items()}
    v = guard.evaluate(fast, cand, trusted=True, champion_reference=beyond).verdict
    assert v.status is Status.correct_slower, (v.status, v.warnings)
    assert any("inconsistent comparison" in w for w in v.warnings), v.warnings
