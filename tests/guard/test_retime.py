"""A workload whose champion ran past the consistency factor is timed again before its comparison is void
(drive.Driver.time_workload): a transient slowdown of the shared GPU passes, a persistent one stays void."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_consistency import FAST, guard, slow  # noqa: F401 - module-scoped fixtures

from kernelarc.guard.drive import Clock, Driver, Side
from kernelarc.guard.protocol import Cmd, Kind, TimerMethod, Timing
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status


class _Scripted(Driver):
    """A driver whose workers answer every timing command from a script: the champion's per-call latency in
    each timing attempt (a warm-up burst starts an attempt); the challenger's is always 1.0 ms."""

    def __init__(self, champion_ms: list[float], retimes: int = 2):
        cfg = replace(GuardSettings(), retimes=retimes, timed_checks=0, champion_checks=0, rounds=4)
        super().__init__(SimpleNamespace(cfg=cfg, device="cuda:0"), Clock(60.0), {"warnings": [], "phases": {}})
        self.champion_ms, self.attempt = champion_ms, {"candidate": -1, "champion": -1}
        self.champ_ref, self.consistency = {0: 1.0}, 1.5

    def command(self, side, cmd, expect, meanwhile=None, **f):
        assert cmd is Cmd.time
        if f.get("warm"):
            self.attempt[side.label] += 1
        ms = self.champion_ms[self.attempt[side.label]] if side.label == "champion" else 1.0
        return Timing(kind=Kind.timing, wl=0, method=TimerMethod.events, samples_ms=[ms] * max(f["n"], 1))

    def cross_check(self, wl, cand, champ):  # the integrity rules are tested on real workers elsewhere
        pass


def _sides() -> tuple[Side, Side]:
    return Side("candidate", None, None), Side("champion", None, None)  # type: ignore[arg-type]


def test_a_transient_slowdown_is_timed_again_and_the_clear_timing_kept():
    drv = _Scripted([4.0, 1.1])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(champ.samples[0]) == {1.1} and set(cand.samples[0]) == {1.0}  # the first attempt's samples gone
    assert len(drv.res["warnings"]) == 1 and "timed again" in drv.res["warnings"][0], drv.res["warnings"]
    assert "4 ms beside the challenger vs 1 ms when crowned" in drv.res["warnings"][0]


def test_a_persistent_slowdown_is_timed_retimes_times_more_and_stays_slow():
    drv = _Scripted([4.0, 4.0, 4.0, 1.0])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(champ.samples[0]) == {4.0}  # the last attempt's, for the decision to void
    assert len(drv.res["warnings"]) == 2


@pytest.mark.parametrize("champion_ms", [[1.4], [0.2]])
def test_a_consistent_or_faster_champion_is_timed_once(champion_ms):
    drv = _Scripted(champion_ms)
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert drv.res["warnings"] == [] and set(champ.samples[0]) == {champion_ms[0]}


def test_no_retimes_without_a_crowned_latency_or_with_retimes_off():
    for drv in (_Scripted([4.0, 1.0], retimes=0), _Scripted([4.0, 1.0])):
        if drv.cfg.retimes:
            drv.champ_ref = {}
        cand, champ = _sides()
        drv.time_workload(0, cand, champ)
        assert drv.res["warnings"] == [] and set(champ.samples[0]) == {4.0}


def test_on_a_real_guard_a_champion_that_stays_slow_is_timed_again_and_voided(guard, slow):  # noqa: F811
    cand, lat = slow
    ref = {w: ms / 10 for w, ms in lat.items()}  # as if crowned at a tenth of what it measures now
    v = guard.evaluate(Candidate(source=FAST, language="pytorch"), cand, champion_reference=ref).verdict
    assert v.status is Status.correct_slower, (v.status, v.warnings)
    assert any("inconsistent comparison" in w for w in v.warnings), v.warnings
    again = [w for w in v.warnings if "timed again" in w]
    assert len(again) == guard.cfg.retimes * len(lat), v.warnings
