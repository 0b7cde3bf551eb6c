"""Proposals sized to the free evaluation slots (kernelarc.allot), in the product's loop: an agent is asked
only for candidates that can start now, so none waits in a queue proposed blind to the verdicts ahead of it."""

from __future__ import annotations

import shutil

import pytest

from kernelarc.ablate import AblateConfig, build_run
from kernelarc.allot import allot, credit, frontier_wins

TEAM = ["a0", "a1", "a2", "a3"]


def test_free_slots_go_one_per_agent_idle_and_least_served_first():
    assert allot(TEAM, 3, 2) == {"a0": 1, "a1": 1, "a2": 1}
    # a0..a2 in flight: the slot a0's verdict freed goes to a3, which has had nothing yet
    assert allot(TEAM, 1, 2, busy={"a1": 1, "a2": 1}, queued={"a0": 1, "a1": 1, "a2": 1}) == {"a3": 1}
    # all idle, equally served: team order
    assert allot(TEAM, 1, 2, queued=dict.fromkeys(TEAM, 5)) == {"a0": 1}
    # more slots than agents: the second round of the share goes to each again before anyone gets a third
    assert allot(TEAM[:2], 5, 3) == {"a0": 3, "a1": 2}
    assert allot(TEAM[:2], 5, 2) == {"a0": 2, "a1": 2}  # agents.per_round caps one request
    # the plateau breaker's redirected agent is served first, even when busy and most served
    assert allot(TEAM, 1, 2, busy={"a3": 1}, queued={"a3": 9}, first=["a3"]) == {"a3": 1}
    assert allot(TEAM, 0, 2) == {} and allot(TEAM, -1, 2) == {}


def test_bad_shares_are_refused():
    with pytest.raises(ValueError, match="per_round"):
        allot(TEAM, 3, 0)
    with pytest.raises(ValueError, match="unique"):
        allot(["a", "a"], 3, 1)


def test_weights_share_the_budget_by_win_rate_and_starve_nobody():
    # a0 has won often: it is served until its share over its weight is the others' (3 of 4 idle slots here)
    w = {"a0": 0.6, "a1": 0.2, "a2": 0.2, "a3": 0.2}
    assert allot(TEAM, 1, 2, queued={"a0": 2, "a1": 1, "a2": 1, "a3": 1}, weight=w) == {"a0": 1}
    assert allot(TEAM, 1, 2, queued={"a0": 4, "a1": 1, "a2": 1, "a3": 1}, weight=w) == {"a1": 1}
    with pytest.raises(ValueError, match="positive"):
        allot(TEAM, 1, 2, weight={"a0": 0.0})

    class C:
        def __init__(self, i):
            self.id = i

    wins = {"w1", "w2"}
    got = credit({"a": [(C("w1"), None), (C("w2"), None)], "b": [(C("x"), None)] * 4, "c": []}, wins.__contains__)
    assert got == {"a": 3 / 4, "b": 1 / 6, "c": 1 / 2}


def test_a_win_moves_the_frontier_a_weak_familys_first_kernel_does_not():
    from kernelarc.models import Candidate, Status, Verdict

    def judged(fam, ms, status=Status.correct_slower):
        c = Candidate(source=f"# {fam} {ms}", language="triton", family=fam)
        return c, Verdict(candidate_id=c.id, status=status, latency_ms=ms)

    seq = [judged("a", 2.0), judged("b", 3.0), judged("a", 1.5), judged("a", 1.495), judged(None, 9.0, Status.champion),
           judged("b", 1.0, Status.incorrect)]  # fmt: skip
    assert frontier_wins(seq) == {seq[0][0].id, seq[2][0].id, seq[4][0].id}


def _spied_run(count: int, per_round: int, budget: int = 24, *extra: str) -> tuple[list[dict], object]:
    """A real session (simulated guard) whose agents and slot count are watched, and the calls they saw."""
    session, state = build_run(AblateConfig(budget=budget), ["+task=matmul", f"agents.per_round={per_round}", *extra],
                               count, 16, True, 0)  # fmt: skip
    calls: list[dict] = []
    for agent in session.agents:
        real = agent.propose

        def spy(ctx, n, real=real, name=agent.name):
            calls.append({"agent": name, "n": n, "busy": sum(session.busy.values()), "seen_verdicts": len(ctx.history),
                          "records": len(session.records)})  # fmt: skip
            return real(ctx, n)

        agent.propose = spy
    try:
        session.run()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return calls, session


def test_a_lone_agent_keeps_every_slot_busy_proposing_one_at_a_time():
    calls, s = _spied_run(count=1, per_round=2)
    slots = s.settings.parallel
    assert slots == 3 and sum(r.kind == "candidate" for r in s.records) == 24
    # never more than the free slots (candidates of its own queued or in flight count against them)
    assert all(c["busy"] + c["n"] <= slots for c in calls), calls
    # the first request is capped by agents.per_round, the session asks again for the last free slot
    assert [c["n"] for c in calls[:2]] == [2, 1]
    # from then on one candidate per verdict, proposed while the other two are in flight
    steady = calls[2:]
    assert steady and sum(c["n"] == 1 and c["busy"] == slots - 1 for c in steady) >= len(steady) - 2


def test_a_team_shares_the_slots_and_each_proposal_sees_the_verdict_before_it():
    calls, s = _spied_run(4, 2, 24, "agents.credit=false")
    assert all(c["n"] == 1 for c in calls), calls  # one free slot at a time after the start: one candidate
    assert [c["agent"] for c in calls[:4]] == [a.name for a in s.agents]  # the start, then the idle fourth
    per = [sum(r.kind == "candidate" and r.candidate.agent == a.name for r in s.records) for a in s.agents]
    assert per == [6, 6, 6, 6], per
    # each request after the first three comes right after a verdict: the records grew since the last request
    recs = [c["records"] for c in calls[3:]]
    assert all(b > a for a, b in zip(recs, recs[1:], strict=False)), recs


def test_with_credit_the_agents_that_win_get_more_of_the_budget():
    """agents.credit (the default): a member's share of the slots follows its win rate (frontier moves)."""
    _, s = _spied_run(4, 2, 48)
    assert s.settings.credit
    judged = {a.name: s.history[a.name] for a in s.agents}
    wins = frontier_wins([(r.candidate, r.verdict) for r in s.records if r.kind == "candidate"])
    rate = {a: (sum(c.id in wins for c, _ in h) + 1) / (len(h) + 2) for a, h in judged.items()}
    n = {a: len(h) for a, h in judged.items()}
    assert sum(n.values()) == 48 and min(n.values()) >= 4, n  # nobody starved
    best, worst = max(rate, key=rate.get), min(rate, key=rate.get)
    assert n[best] > n[worst], (n, rate)
