"""What budget.minutes counts (SessionPhases._budget_spent_s): the session's own work, not the measurement of the
task's reference (a cost the problem sets) nor waits for a device another process holds (suite shards on one GPU);
and with one evaluation slot, torch.compile is measured after the search instead of holding the slot."""

from __future__ import annotations

import json
import time

from test_compile_beside import SlowCompileGuard, _build, _session

REF_S = 3.0


class SlowReference(SlowCompileGuard):
    """The reference's measurement takes REF_S (L1/094's Python loop took 10 s a call on the H200)."""

    def evaluate(self, cand, champion=None, **kw):
        if cand.strategy == "reference":
            time.sleep(REF_S)
        return super().evaluate(cand, champion, **kw)


def test_the_references_measurement_does_not_use_up_the_budget(tmp_path):
    # a 2.4 s budget behind a 3 s reference: counted, no candidate would be judged
    s, summary, _ = _session(tmp_path, 0.5, "budget.minutes=0.04", guard_cls=SlowReference)
    assert summary["evaluated"] >= 1, summary
    assert s.reference_s >= REF_S
    (meta,) = tmp_path.rglob("session.json")
    state = json.loads(meta.read_text())
    assert state["budget_s"] <= state["elapsed_s"] - REF_S + 0.01, state


def test_waits_for_a_device_held_elsewhere_are_not_counted_up_to_the_budget(tmp_path):
    s, guards = _build(tmp_path, 0.5, "budget.minutes=1")
    (g,) = guards
    wait = {"s": 0.0}
    g.device_wait_s = lambda: wait["s"]  # what a real guard's DeviceLock reports
    s.t0 = time.monotonic() - 100.0
    assert abs(s._budget_spent_s() - 100.0) < 1.0
    wait["s"] = 30.0
    assert abs(s._budget_spent_s() - 70.0) < 1.0
    # the reference's own waits are inside its (uncounted) measurement: not taken off twice
    s.reference_s, s.reference_wait_s = 20.0, 10.0
    assert abs(s._budget_spent_s() - 60.0) < 1.0
    # at most budget.minutes of waits are not counted: a session runs at most twice its budget for them
    wait["s"] = 500.0
    assert abs(s._budget_spent_s() - (100.0 - 20.0 - 60.0)) < 1.0
    assert abs(s._time_left_s() - (60.0 - 20.0)) < 1.0


def test_a_guard_that_cannot_tell_its_waits_counts_them(tmp_path):
    s, guards = _build(tmp_path, 0.5, "budget.minutes=1")
    assert not hasattr(guards[0], "device_wait_s")  # the simulated guard
    s.t0 = time.monotonic() - 10.0
    assert abs(s._budget_spent_s() - 10.0) < 1.0


def test_with_one_slot_torch_compile_is_measured_after_the_search(tmp_path):
    s, summary, guard = _session(tmp_path, 2.0, "executor.parallel=1")
    kinds = [(r.kind, r.candidate.strategy) for r in s.records]
    at = kinds.index(("baseline", "torch.compile"))
    assert all(k == "candidate" for k, _ in kinds[1:at]) and at > 1, kinds
    assert kinds.count(("baseline", "torch.compile")) == 1  # once, after the budget
    assert summary["evaluated"] == 6 and summary["compile_after_budget_s"] is not None
    assert "after the search" in summary["baseline_notes"]["torch.compile"]
    assert s.records[at].champion_id == guard.compile_champions[-1]  # beside the champion of the search's end


def test_the_judges_reference_outputs_are_not_counted(tmp_path):
    """Checking a candidate computes the reference on each checked input set (10 s a call on L1/094): the
    problem's cost, like the reference's own measurement; during that measurement it is not taken off twice."""
    s, guards = _build(tmp_path, 0.5, "budget.minutes=1")
    (g,) = guards
    s.t0 = time.monotonic() - 100.0
    g.reference_s = 25.0  # what a real guard accumulates (Guard.reference)
    assert abs(s._budget_spent_s() - 75.0) < 1.0
    s.reference_s, s.reference_judge_s = 20.0, 5.0  # 5 of the 25 were inside the reference's measurement
    assert abs(s._budget_spent_s() - (100.0 - 20.0 - 20.0)) < 1.0


def test_an_evaluations_deadline_leaves_room_for_the_waits_not_counted(tmp_path):
    """torch.compile beside the search timed out after 95-99 s waiting for the device behind L1/094's timings on the
    H200: its deadline (the budget left plus one timeout) did not move with the waits the budget no longer counts."""
    s, guards = _build(tmp_path, 0.5, "budget.minutes=1")
    assert s._wait_allowance_s() == 0.0  # the simulated guard does not report its waits
    (g,) = guards
    wait = {"s": 20.0}
    g.device_wait_s = lambda: wait["s"]
    assert abs(s._wait_allowance_s() - 40.0) < 1e-6
    wait["s"] = 200.0
    assert s._wait_allowance_s() == 0.0  # the allowance spent: the plain deadline again
