"""A workload whose champion ran past the consistency factor is timed again before its comparison is void
(drive.Driver.time_workload): a transient slowdown of the shared GPU passes, a persistent one stays void."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_consistency import FAST, crowned_within, guard, slow  # noqa: F401 - module-scoped fixtures

from kernelarc.guard.drive import Clock, Driver, Side, Stop
from kernelarc.guard.protocol import Cmd, Kind, Ok, Outputs, Tag, TimerMethod, Timing
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status


class _Scripted(Driver):
    """A driver whose workers answer every timing command from a script: each side's per-call latency in each
    timing attempt (a warm-up burst starts an attempt); the challenger's last entry holds for later attempts."""

    def __init__(self, champion_ms: list[float], retimes: int = 2, challenger_ms: list[float] | None = None):
        # calls per burst fixed: the driver sizes them from the warm-up's wall time, which a busy host varies
        cfg = replace(GuardSettings(), retimes=retimes, timed_checks=0, champion_checks=0, rounds=4, min_iters=40,
                      max_iters=40)  # fmt: skip
        super().__init__(
            SimpleNamespace(cfg=cfg, device="cuda:0", fresh_inputs=lambda wl: False, stale_inputs=lambda wl: None),
            Clock(60.0),
            {"warnings": [], "phases": {}},
        )
        self.script = {"champion": champion_ms, "candidate": challenger_ms or [1.0]}
        self.attempt = {"candidate": -1, "champion": -1}
        self.champ_ref = {0: 1.0}  # the consistency factor: the GPU's 1.5 (the settings' default)
        self.checked: list[tuple[float, ...]] = []

    def command(self, side, cmd, expect, meanwhile=None, **f):
        assert cmd is Cmd.time
        if f.get("warm"):
            self.attempt[side.label] += 1
        script = self.script[side.label]
        ms = script[min(self.attempt[side.label], len(script) - 1)]
        return Timing(kind=Kind.timing, wl=0, method=TimerMethod.events, samples_ms=[ms] * max(f["n"], 1))

    def cross_check(self, wl, cand, champ):  # the integrity rules themselves are tested on real workers elsewhere
        self.checked.append(tuple(sorted(set(cand.samples[wl]) | set(champ.samples[wl]))))
        assert len(cand.unexplained[wl]) == len(champ.unexplained[wl]) == self.cfg.rounds  # this timing's alone


class _Checked(_Scripted):
    """The challenger's checked timed calls (``timed_checks`` a timing) take ``checked_ms`` per timing attempt, its
    other calls 1 ms: a memo keyed on content pays on the calls whose inputs repeat, never on the checked ones."""

    def __init__(self, checked_ms: list[float]):
        super().__init__([1.0], challenger_ms=[1.0])
        self.cfg = replace(self.cfg, timed_checks=2)
        self.checked_ms = checked_ms

    def command(self, side, cmd, expect, meanwhile=None, **f):
        if cmd is Cmd.stage:
            return Ok(kind=Kind.ok)
        msg = super().command(side, cmd, expect, meanwhile, **f)
        if f.get("check") and side.label == "candidate":
            samples = list(msg.samples_ms)
            samples[f["check_at"]] = self.checked_ms[min(self.attempt["candidate"], len(self.checked_ms) - 1)]
            out = Outputs.model_construct(kind=Kind.outputs, tag=Tag.timed, wl=0)
            return msg.model_copy(update={"samples_ms": samples, "check": out})
        return msg

    def compare(self, side, msg, wl, seed, j):  # the outputs' check itself is tested on real workers elsewhere
        return None


def _sides() -> tuple[Side, Side]:
    return Side("candidate", None, None), Side("champion", None, None)  # type: ignore[arg-type]


def test_a_transient_slowdown_is_timed_again_and_the_clear_timing_kept():
    drv = _Scripted([4.0, 1.1])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(champ.samples[0]) == {1.1}  # the champion's first timing is gone
    assert len(drv.res["warnings"]) == 1 and "timed again" in drv.res["warnings"][0], drv.res["warnings"]
    assert "4 ms beside the challenger vs 1 ms when crowned" in drv.res["warnings"][0]
    assert drv.checked == [(1.0, 4.0), (1.0, 1.1)]  # every timing passed the integrity checks on its own


def test_the_challengers_timings_are_pooled_so_a_retime_is_no_re_roll_for_it():
    drv = _Scripted([4.0, 1.1], challenger_ms=[3.0, 0.5])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(cand.samples[0]) == {3.0, 0.5} and set(champ.samples[0]) == {1.1}
    n = len(cand.samples[0]) // 2
    assert cand.samples[0] == [3.0] * n + [0.5] * n


def test_a_persistent_slowdown_is_timed_retimes_times_more_and_stays_slow():
    drv = _Scripted([4.0, 4.0, 4.0, 1.0])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(champ.samples[0]) == {4.0}  # the last attempt's, for the decision to void
    assert len(drv.res["warnings"]) == 2 and len(drv.checked) == 3


@pytest.mark.parametrize(("champion_ms", "challenger_ms"), [([1.4], [1.0]), ([0.2], [1.0]), ([4.0, 1.0], [5.0])])
def test_a_consistent_champion_or_a_hopeless_challenger_is_timed_once(champion_ms, challenger_ms):
    """A champion within the factor needs no second timing; nor does a challenger slower than even the slowed
    champion (no faster than a champion at its crowned speed either)."""
    drv = _Scripted(champion_ms, challenger_ms=challenger_ms)
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert drv.res["warnings"] == [] and set(champ.samples[0]) == {champion_ms[0]} and len(drv.checked) == 1


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
    # timed again before the void: as often as the evaluation's clock leaves room for, which a loaded CI host
    # shortens (one workload was timed once more instead of twice there); the bound is on those past the factor,
    # beside which a loaded host can add one for noise and one for the judge's clock per workload
    again = [w for w in v.warnings if "timed again" in w]
    assert 1 <= len([w for w in again if "when crowned" in w]) <= guard.cfg.retimes * len(lat), v.warnings
    assert len(again) <= (guard.cfg.retimes + 2) * len(lat), v.warnings


def test_a_trusted_baseline_is_timed_again_past_the_plain_factor_and_judged_within_its_slack(guard, slow):  # noqa: F811
    """torch.compile (trusted) beside a champion running 3.35x its crowned time: timed again like any challenger (Y's
    L1/072 crowned torch.compile, slower than the reference alone, while the reference ran 2x its crowned time),
    and, still so after that, compared within the slack, not void."""
    cand, lat = slow
    # crowned at 1/sqrt(slack) of the void bound (the plain factor 1.5 * sqrt(5) = 3.35x below what it measures
    # alone): the geometric middle of the plain factor and the slack's, so that a 2.2x swing of this machine's
    # load either way changes nothing. A swing past that (side by side the champion has run 2.4x its time alone on
    # a loaded CI host), or a gain the noise hides, is this host's doing: the attempt is made again, three at most,
    # with the champion measured afresh right before
    factor = guard.cfg.consistency_factor * guard.cfg.trusted_slack**0.5
    fast = Candidate(source=FAST, language="pytorch")

    def judge():
        now = {w.index: w.latency_ms for w in guard.evaluate(cand).verdict.workloads}
        ref = {w: ms / factor for w, ms in now.items()}
        return guard.evaluate(fast, cand, champion_reference=ref, trusted=True).verdict

    v = crowned_within(3, judge)
    # timed again at least once; how often depends on the load (a retime that comes back within the plain factor
    # ends that workload's retimes, as it should): a CI host once read the champion 4.8x its crowned time there
    # Only the retimes for a champion past the plain factor ("when crowned") are bounded by cfg.retimes; a loaded
    # host can add one more per workload for a gain inside the noise ("undecided") and one for the judge's clock
    # (CI once read 5 retimes over the 2 workloads, against a bound of 4 on all of them)
    again = [w for w in v.warnings if "timed again" in w]
    crowned = [w for w in again if "when crowned" in w]
    assert 1 <= len(crowned) <= guard.cfg.retimes * len(lat), v.warnings
    assert len(again) <= (guard.cfg.retimes + 2) * len(lat), v.warnings
    assert not any("inconsistent comparison" in w for w in v.warnings), v.warnings


class _Noisy(_Scripted):
    """Each timing's samples spread around the scripted latency: every other call ``spread`` times slower."""

    def __init__(self, champion_ms, challenger_ms, spread):
        super().__init__(champion_ms, challenger_ms=challenger_ms)
        self.spread = spread
        self.champ_ref = {0: 100.0}  # crowned slow: only the noise can ask for another timing

    def command(self, side, cmd, expect, meanwhile=None, **f):
        msg = super().command(side, cmd, expect, meanwhile, **f)
        spread = self.spread[min(self.attempt[side.label], len(self.spread) - 1)]
        ms = msg.samples_ms[0]
        samples = [ms * (spread if i % 2 else 1.0) for i in range(len(msg.samples_ms))]
        return Timing(kind=Kind.timing, wl=0, method=TimerMethod.events, samples_ms=samples)


def test_a_large_gain_hidden_by_noise_is_timed_again_on_both_sides():
    """torch.compile 2.4-243x faster by the medians stayed correct_slower on the H200 for its spread: timed again,
    the quiet timing replaces both sides' samples."""
    drv = _Noisy([2.0], challenger_ms=[1.0], spread=[20.0, 1.0])  # 2x by the medians, 2.8x needed
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert len(drv.res["warnings"]) == 1 and "inside the noise" in drv.res["warnings"][0], drv.res["warnings"]
    assert set(cand.samples[0]) == {1.0} and set(champ.samples[0]) == {2.0}


def test_a_tie_hidden_by_noise_is_not_timed_again():
    drv = _Noisy([1.1], challenger_ms=[1.0], spread=[20.0, 1.0])
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert drv.res["warnings"] == [] and len(drv.checked) == 1


def test_noise_is_not_timed_again_where_no_crowned_latency_checks_the_champion():
    """The incumbent's and the final side-by-side comparisons pass no crowned latency: there nothing would catch a
    champion slowed on purpose, so a noisy draw is not drawn again."""
    drv = _Noisy([2.0], challenger_ms=[1.0], spread=[20.0, 1.0])
    drv.champ_ref = {}
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert drv.res["warnings"] == [] and len(drv.checked) == 1


def test_a_noisy_timing_does_not_use_up_the_inconsistent_champions_retimes():
    drv = _Noisy([2.0, 40.0, 40.0, 15.0], challenger_ms=[1.0], spread=[20.0, 1.0])
    drv.champ_ref = {0: 15.0}  # the noisy first timing's champion median (21 ms) is within 1.5x of it
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    # noisy (2x inside the noise) -> inconsistent -> inconsistent -> consistent: four timings, the last one kept
    assert len(drv.checked) == 4 and len(drv.res["warnings"]) == 3, drv.res["warnings"]
    assert "inside the noise" in drv.res["warnings"][0] and set(champ.samples[0]) == {15.0}


HACK = Status.rejected_hack
# (share within the tolerance, the same input set's untimed check: None passes, else its error) -> status
NEAR = [(0.987, None, Status.incorrect), (0.72, None, HACK), (0.72, "out: 72.0% within", Status.incorrect),
        (0.3, "out: 30.0% within", HACK), (0.0, "out: 0.0% within", HACK),
        (None, "out is float32[4]", HACK)]  # fmt: skip


@pytest.mark.parametrize(("matched", "again", "status"), NEAR)
def test_a_timed_output_outside_the_tolerance_is_a_hack_only_where_its_inputs_untimed_pass(matched, again, status):
    """L2/028 on the H200: a composed candidate whose checks passed, then 98.7% of a checked timed call's gradient
    within the tolerance (torch.compile missed it too), was rejected_hack: a near miss is incorrect. Run I1 (H200):
    a composed rope candidate at 72% within a tolerance torch.compile met on 73%, twice rejected_hack. Outputs far
    mostly within it are checked again on the same input set, untimed: a kernel that skips or cheapens its work while
    timed passes there (a hack); one wrong on those inputs whenever it runs fails (incorrect). Outputs far off, or of
    the wrong shape or dtype (None), are a hack outright (a kernel skipping work from some call on would skip it in
    the second look too)."""
    from kernelarc.guard.drive import Stop
    from kernelarc.guard.protocol import Outputs, Tag

    drv = _Scripted([1.0])
    asked = []

    def check(buf, msg, wl, seed, j, res):
        res.setdefault("errors", []).append("workload 0 (a checked timed call): out: ...")
        res["failed_matched"] = matched
        return False

    drv.g._check_outputs = check
    drv.untimed_again = lambda side, wl, seed: asked.append((side.label, wl, seed)) or again
    msg = Outputs(kind=Kind.outputs, tag=Tag.timed, wl=0, outputs=[])
    cand, _ = _sides()
    with pytest.raises(Stop) as e:
        drv.compare(cand, msg, 0, 7, -1)
    assert e.value.status is status, e.value.message
    assert asked == ([("candidate", 0, 7)] if matched == 0.72 else [])  # only the mostly right get a second look
    if matched == 0.72 and again is not None:
        assert again in e.value.message


def test_a_trusted_baselines_timed_output_outside_the_tolerance_is_incorrect():
    """L1/061 on the H200: torch.compile (trusted: the judge's own compile of the reference) read rejected_hack for
    a one-element gradient sum off on one timed input set (0% matched: a scalar is all or nothing)."""
    from kernelarc.guard.drive import Stop
    from kernelarc.guard.protocol import Outputs, Tag

    drv = _Scripted([1.0])
    drv.trusted = True

    def check(buf, msg, wl, seed, j, res):
        res["failed_matched"] = 0.0
        return False

    drv.g._check_outputs = check
    with pytest.raises(Stop) as e:
        drv.compare(_sides()[0], Outputs(kind=Kind.outputs, tag=Tag.timed, wl=0, outputs=[]), 0, 1, -1)
    assert e.value.status is Status.incorrect, e.value.message


class _ClockBroken(_Scripted):
    """The judge-clock rule broken in the timings listed (by attempt): a loaded host in one, a forged timer in all."""

    def __init__(self, broken: set[int]):
        super().__init__([1.0, 1.0, 1.0], challenger_ms=[0.9, 0.5, 0.5])
        self.broken = broken

    def clock_check(self, wl, cand, champ):
        return "the judge's clock saw more" if self.attempt["candidate"] in self.broken else None


def test_a_timing_that_breaks_the_judge_clock_once_is_timed_again_and_its_samples_dropped():
    drv = _ClockBroken({0})
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert set(cand.samples[0]) == {0.5}  # the broken timing's samples are not kept, unlike an inconsistent one's
    assert len(drv.res["warnings"]) == 1 and "judge's clock" in drv.res["warnings"][0], drv.res["warnings"]


@pytest.mark.parametrize("broken", [{0, 1}, {0, 1, 2}])
def test_a_timer_forged_in_the_second_timing_too_is_rejected(broken):
    drv = _ClockBroken(broken)
    cand, champ = _sides()
    with pytest.raises(Stop) as e:
        drv.time_workload(0, cand, champ)
    assert e.value.status is Status.rejected_hack and "judge's clock" in e.value.message


def test_the_judges_own_baseline_is_not_rejected_by_the_judge_clock():
    """L2/008 on the H100: torch.compile of the reference spent ~96 ms a call outside its kernels' 30 ms span (host
    work) in every timing, and the judge-clock rule rejected it as a hack. The judge's own baselines forge no
    timer: the rule's break is a warning there, and their span is compared as any other side's."""
    drv = _ClockBroken({0, 1, 2})
    drv.baseline = True
    cand, champ = _sides()
    drv.time_workload(0, cand, champ)
    assert cand.samples[0] and drv.res["warnings"], drv.res["warnings"]
    assert all("a baseline" in w for w in drv.res["warnings"]), drv.res["warnings"]
    # searched code judged trusted (the final side by side) keeps the rule
    drv = _ClockBroken({0, 1, 2})
    drv.trusted = True
    with pytest.raises(Stop) as e:
        drv.time_workload(0, *_sides())
    assert e.value.status is Status.rejected_hack


def test_only_the_judges_own_sources_are_baselines():
    from kernelarc.guard.judge import compiled_candidate, is_judge_baseline, reference_candidate
    from kernelarc.models import Candidate
    from kernelarc.tasks import load_builtin

    task = load_builtin("rmsnorm")
    ref, comp = reference_candidate(task), compiled_candidate(task)
    assert is_judge_baseline(task, ref, True) and is_judge_baseline(task, comp, True)
    assert not is_judge_baseline(task, ref, False)  # untrusted: never
    forged = Candidate(source=comp.source + "\n# same name, other code\n", language="pytorch", agent="baseline",
                       strategy="torch.compile")  # fmt: skip
    assert not is_judge_baseline(task, forged, True)


def test_checked_timed_calls_that_stand_out_are_timed_again_then_rejected():
    """A content memo (the red team's c02) runs its checked calls (new inputs) at full cost and the rest at once:
    timed again once, then rejected as skipping work. Slow checked calls in one timing only (interference) are
    the noise the second timing clears; checked calls within ``skip_factor`` of the median are no sign at all."""
    drv = _Checked([5.0])
    cand, champ = _sides()
    with pytest.raises(Stop) as stop:
        drv.time_workload(0, cand, champ)
    assert stop.value.status is Status.rejected_hack and "work skipped on inputs seen before" in str(stop.value)
    assert len([w for w in drv.res["warnings"] if "timed again" in w]) == 1
    for script in ([5.0, 1.0], [1.4]):
        drv = _Checked(script)
        cand, champ = _sides()
        drv.time_workload(0, cand, champ)
        assert len(drv.res["warnings"]) == len(script) - 1, drv.res["warnings"]
