"""Offline search agents: board-guided, deduplicating, strategy-owned moves."""

from kernelarc.agents.base import AgentContext
from kernelarc.agents.search import SearchAgent
from kernelarc.families import families_for
from kernelarc.models import Finding, Status
from kernelarc.tasks import load_builtin


def _ctx(task, findings, seen=frozenset()):
    return AgentContext(task=task, target=None, champion=None, champion_verdict=None, findings=findings, history=[],
                        seen=seen)  # fmt: skip


def test_proposals_are_new_valid_and_explained():
    task = load_builtin("rmsnorm", cpu=True)
    agent = SearchAgent("a0-tiling", "tiling", task, seed=0)
    prop = agent.propose(_ctx(task, []), 4)
    assert len(prop.candidates) == 4
    assert len({c.id for c in prop.candidates}) == 4
    for c in prop.candidates:
        assert c.rationale and c.family and "def run" in c.source
    again = agent.propose(_ctx(task, [], frozenset(c.id for c in prop.candidates)), 4)
    assert not {c.id for c in again.candidates} & {c.id for c in prop.candidates}


def test_board_findings_change_what_an_agent_builds_on():
    """memory.limit bounds the findings; with them, agents build on the board's best point."""
    task = load_builtin("rmsnorm", cpu=True)
    fam = families_for("rmsnorm")[0]
    good = dict(fam.start)
    k = next(kn for kn in fam.knobs if kn.strategy == "scheduling")
    good[k.name] = k.values[-1]
    finding = Finding(agent="other", strategy="scheduling", candidate_id="x", family=fam.name, knobs=good,
                      status=Status.correct_slower, gain=0.5, lesson="faster")  # fmt: skip
    with_board = SearchAgent("a", "tiling", task, seed=1).propose(_ctx(task, [finding] * 1), 6)
    without = SearchAgent("a", "tiling", task, seed=1).propose(_ctx(task, []), 6)
    assert any("board" in c.rationale for c in with_board.candidates)
    assert not any("board" in c.rationale for c in without.candidates)


def test_strategy_owns_its_knobs():
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    agent = SearchAgent("a", "scheduling", task, seed=2, families=[fam])
    base = dict(fam.start)
    owned = {k.name for k in fam.knobs if k.strategy == "scheduling"}
    for _ in range(20):
        new, _note = agent._mutate(fam, base, {}, {})
        changed = {k for k in new if new[k] != base.get(k)}
        assert changed <= owned


def test_a_step_that_gained_is_continued():
    from kernelarc.models import Verdict

    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    agent = SearchAgent("a", "scheduling", task, seed=4, families=[fam])
    knob = next(k for k in fam.knobs if k.name == "num_stages")
    parent_pt = dict(fam.start, num_stages=knob.values[0])
    child_pt = dict(fam.start, num_stages=knob.values[1])
    from kernelarc.models import Candidate

    parent = Candidate(source=fam.render(parent_pt), language="triton", family=fam.name, knobs=parent_pt)
    child = Candidate(source=fam.render(child_pt), language="triton", family=fam.name, knobs=child_pt,
                      parent=parent.id)  # fmt: skip
    agent._score[parent.id] = 0.5
    agent._parents[child.id] = (parent.id, parent_pt)
    agent.observe(child, Verdict(candidate_id=child.id, status=Status.correct_slower, speedup_vs_champion=0.7))
    cont = agent._continue(set())
    assert cont is not None
    assert cont.knobs["num_stages"] == knob.values[2] and "continuing" in cont.rationale


def test_an_infeasible_move_is_repaired_by_moving_the_coupled_knobs():
    """A 128x256 tile on 4 warps spills its accumulator (infeasible): the move is kept and the
    nearest feasible point moves the other knobs (more warps / fewer stages) instead."""
    import random

    from kernelarc.agents.surrogate import repair

    fam = next(f for f in families_for("matmul") if f.name == "matmul.persistent_tma")
    point = dict(fam.start, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4)
    assert not fam.valid(point)
    fixed = repair(fam, point, ["BLOCK_M", "BLOCK_N", "BLOCK_K"], random.Random(0))
    assert fixed is not None and fam.valid(fixed)
    assert (fixed["BLOCK_M"], fixed["BLOCK_N"], fixed["BLOCK_K"]) == (128, 256, 64)
    assert fixed["num_warps"] >= 8 or fixed.get("WARP_SPECIALIZE")


def test_surrogate_ranks_by_what_was_measured():
    from kernelarc.agents.surrogate import Surrogate

    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    obs = [(dict(fam.start, BLOCK_N=bn), speed) for bn, speed in [(16, 0.2), (32, 0.4), (64, 0.6), (128, 0.9)]]
    model = Surrogate(fam, obs)
    assert model.ready
    assert model.score(dict(fam.start, BLOCK_N=128), explore=0) > model.score(dict(fam.start, BLOCK_N=16), explore=0)
    assert not Surrogate(fam, obs[:2]).ready  # too little data: the agent falls back to its first draw


def test_exploring_agents_port_the_best_point_to_another_family():
    from kernelarc.models import Finding

    task = load_builtin("matmul", cpu=True)
    tiled = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    best = tiled.check_point(dict(tiled.start, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3))
    finding = Finding(agent="a0", strategy="tiling", candidate_id="x", family=tiled.name, knobs=best,
                      status=Status.correct_slower, gain=-0.05, lesson="close to the library")  # fmt: skip
    agent = SearchAgent("a3", "algorithmic", task, seed=0)
    cands = [c for _ in range(12) for c in agent.propose(_ctx(task, [finding]), 1).candidates]
    ported = [c for c in cands if "port" in c.rationale or "at the best" in c.rationale]
    assert ported, [c.rationale for c in cands]
    for c in ported:
        assert c.family != tiled.name and c.knobs["BLOCK_M"] == 128 and c.knobs["BLOCK_N"] == 128


def test_offline_agents_are_spent_on_strategies_that_can_move_something():
    from kernelarc.app import relevant_strategies

    names = ["tiling", "memory", "precision", "fusion", "scheduling", "algorithmic"]
    # GEMM families have no precision or fusion knob: four agents get tiling, memory, scheduling, algorithmic
    assert relevant_strategies(names, "matmul")[:4] == ["tiling", "memory", "scheduling", "algorithmic"]
    # fused_add_rmsnorm has a fusion knob (where the residual is stored)
    assert "fusion" in relevant_strategies(names, "fused_add_rmsnorm")[:4]
    # every strategy is kept (in the user's order after the relevant ones)
    assert sorted(relevant_strategies(names, "matmul")) == sorted(names)
    assert relevant_strategies(["fusion"], "matmul") == ["fusion"]


def test_exploring_agents_climb_a_tried_family_from_its_best_point():
    """A family that is not the champion's, with a measured point, is stepped from that point (one local
    move), not only restarted at its start or ported onto."""
    from kernelarc.models import Candidate, Verdict

    task = load_builtin("matmul", cpu=True)
    fams = {f.name: f for f in families_for("matmul")}
    tiled = fams["matmul.tiled"]
    other = next(f for n, f in fams.items() if n != tiled.name and f.language == "triton")
    champ = Candidate(source=tiled.render(tiled.start), language="triton", family=tiled.name, knobs=dict(tiled.start))
    best = dict(other.start)
    finding = Finding(agent="a0", strategy="tiling", candidate_id="y", family=other.name, knobs=best,
                      status=Status.correct_slower, gain=-0.3, lesson="slower start")  # fmt: skip
    verdict = Verdict(candidate_id=champ.id, status=Status.champion)
    ctx = AgentContext(task=task, target=None, champion=champ, champion_verdict=verdict, findings=[finding],
                       history=[], seen=frozenset(), redirect="explore: plateau")  # fmt: skip
    agent = SearchAgent("a1", "scheduling", task, seed=3, families=[tiled, other])
    cands = [c for _ in range(16) for c in agent.propose(ctx, 1).candidates]
    climbed = [c for c in cands if "climbing" in c.rationale]
    assert climbed, [c.rationale for c in cands]
    for c in climbed:
        assert c.family == other.name and c.parent == "y" and c.knobs != best
        changed = {k for k in c.knobs if c.knobs[k] != best.get(k)}
        assert changed and len(changed) <= 4, changed  # a local step (plus any feasibility repair)
