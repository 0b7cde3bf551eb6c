"""Offline search agents: operators that read the board, deduplicate and explain their moves."""

import random

from kernelarc.agents.base import AgentContext
from kernelarc.agents.search import SearchAgent, offline_team
from kernelarc.board import Conditions, Entry, Kind
from kernelarc.families import families_for
from kernelarc.models import Candidate, Status, Verdict
from kernelarc.plateau import Action, PlateauEvent
from kernelarc.tasks import load_builtin


def _ctx(task, findings, seen=frozenset(), **kw):
    return AgentContext(task=task, target=None, champion=None, champion_verdict=None, findings=findings, history=[],
                        seen=seen, **kw)  # fmt: skip


def _entry(fam, knobs, status, latency, gain, cid="x", agent="other"):
    kind = Kind.win if status is Status.champion else Kind.trap
    return Entry(agent=agent, strategy="exploit", candidate_id=cid, family=fam.name, knobs=knobs, status=status,
                 gain=gain, lesson="measured", kind=kind, conditions=Conditions(latency_ms=latency))  # fmt: skip


def test_proposals_are_new_valid_and_explained():
    task = load_builtin("rmsnorm", cpu=True)
    agent = SearchAgent("a0-generalist", "generalist", task, seed=0)
    prop = agent.propose(_ctx(task, []), 4)
    assert len(prop.candidates) == 4
    assert len({c.id for c in prop.candidates}) == 4
    for c in prop.candidates:
        assert c.rationale and c.family and "def run" in c.source
    again = agent.propose(_ctx(task, [], frozenset(c.id for c in prop.candidates)), 4)
    assert not {c.id for c in again.candidates} & {c.id for c in prop.candidates}


def test_board_findings_change_what_an_agent_builds_on():
    """With the board, agents build on its best point; without it, on their own starts."""
    task = load_builtin("rmsnorm", cpu=True)
    fam = families_for("rmsnorm")[0]
    good = dict(fam.start)
    k = next(kn for kn in fam.knobs if kn.strategy == "scheduling")
    good[k.name] = k.values[-1]
    finding = _entry(fam, good, Status.champion, 0.5, 0.5)
    with_board = SearchAgent("a", "exploit", task, seed=1).propose(_ctx(task, [finding]), 6)
    without = SearchAgent("a", "exploit", task, seed=1).propose(_ctx(task, []), 6)
    assert any("board" in c.rationale for c in with_board.candidates)
    assert not any("board" in c.rationale for c in without.candidates)


def test_trap_values_are_avoided():
    """A knob value that failed on the board is drawn far less often than without the trap."""
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    base = dict(fam.start)

    def draws(fails):
        agent = SearchAgent("a", "generalist", task, seed=5, families=[fam])
        return sum(agent._mutate(fam, base, {}, fails, lead="scheduling")[0]["num_stages"] == 3 for _ in range(300))

    trap = {(fam.name, "num_stages", repr(3)): 3.0}
    assert draws(trap) < draws({}) / 2


def test_focus_leads_with_its_class_and_the_generalist_moves_every_knob():
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    base = dict(fam.start)
    owned = {k.name for k in fam.knobs if k.strategy == "scheduling"}
    focus = SearchAgent("a", "scheduling", task, seed=2, families=[fam])
    moved_other = False
    for _ in range(60):
        new, _note = focus._mutate(fam, base, {}, {}, lead="scheduling")
        changed = {k for k in new if new[k] != base.get(k)}
        assert changed & owned or not changed  # the lead move is a scheduling knob
        moved_other |= bool(changed - owned)
    assert moved_other  # ... and a coupled move may take any other knob
    gen = SearchAgent("g", "generalist", task, seed=2, families=[fam])
    moved = set()
    for _ in range(300):
        new, _ = gen._mutate(fam, base, {}, {})
        moved |= {k for k in new if new[k] != base.get(k)}
    assert moved == {k.name for k in fam.knobs}


def test_a_step_that_gained_is_continued():
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    agent = SearchAgent("a", "exploit", task, seed=4, families=[fam])
    knob = fam.knob("num_stages")
    parent_pt = dict(fam.start, num_stages=knob.values[0])
    child_pt = dict(fam.start, num_stages=knob.values[1])
    parent = Candidate(source=fam.render(parent_pt), language="triton", family=fam.name, knobs=parent_pt)
    child = Candidate(source=fam.render(child_pt), language="triton", family=fam.name, knobs=child_pt,
                      parent=parent.id)  # fmt: skip
    agent._lat[parent.id] = 2.0
    agent._parents[child.id] = (parent.id, parent_pt)
    agent.observe(child, Verdict(candidate_id=child.id, status=Status.correct_slower, latency_ms=1.4))
    cont = agent._continue(set())
    assert cont is not None
    assert cont.knobs["num_stages"] == knob.values[2] and "continuing" in cont.rationale


def test_an_infeasible_move_is_repaired_by_moving_the_coupled_knobs():
    """A 128x256 tile on 4 warps spills its accumulator (infeasible): the move is kept and the
    nearest feasible point moves the other knobs (more warps / fewer stages) instead."""
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


def test_transplant_ports_a_win_to_another_family():
    task = load_builtin("matmul", cpu=True)
    tiled = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    best = tiled.check_point(dict(tiled.start, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3))
    win = _entry(tiled, best, Status.champion, 1.5, 0.2)
    agent = SearchAgent("a3", "transplant", task, seed=0)
    cands = [c for _ in range(8) for c in agent.propose(_ctx(task, [win]), 1).candidates]
    ported = [c for c in cands if "transplanting" in c.rationale]
    assert ported, [c.rationale for c in cands]
    for c in ported:
        assert c.family != tiled.name and c.knobs["BLOCK_M"] == 128 and c.knobs["BLOCK_N"] == 128


def test_offline_team_puts_operators_first_and_one_agent_is_the_generalist():
    from kernelarc.app import relevant_strategies

    names = ["exploit", "explore", "transplant", "tiling", "memory", "precision", "fusion", "scheduling",
             "algorithmic"]  # fmt: skip
    assert offline_team(names, 1, "matmul") == ["generalist"]
    assert offline_team(names, 4, "matmul") == ["exploit", "explore", "transplant", "tiling"]
    # GEMM families have no precision or fusion knob: no agent is spent on them while others can move something
    assert "precision" not in offline_team(names, 7, "matmul")
    assert "fusion" in offline_team(names[3:], 4, "fused_add_rmsnorm")
    assert offline_team(["fusion"], 1, "matmul") == ["fusion"]
    knob_classes = names[3:]
    assert relevant_strategies(knob_classes, "matmul")[:4] == ["tiling", "memory", "scheduling", "algorithmic"]
    assert sorted(relevant_strategies(knob_classes, "matmul")) == sorted(knob_classes)


def test_a_plateau_redirect_takes_the_first_candidate_to_its_target_family():
    task = load_builtin("matmul", cpu=True)
    fams = {f.name: f for f in families_for("matmul")}
    tiled = fams["matmul.tiled"]
    other = next(f for n, f in fams.items() if n != tiled.name and f.language == "triton")
    champ = Candidate(source=tiled.render(tiled.start), language="triton", family=tiled.name, knobs=dict(tiled.start))
    verdict = Verdict(candidate_id=champ.id, status=Status.champion, latency_ms=1.0)
    ev = PlateauEvent(10, 10, Action.climb_family, other.name, other.language, tiled.name, ["a1"])
    best = dict(other.start)
    found = _entry(other, best, Status.correct_slower, 1.3, -0.3, cid="y")
    ctx = AgentContext(task=task, target=None, champion=champ, champion_verdict=verdict, findings=[found],
                       history=[], seen=frozenset(), redirect=ev.instruction, plateau=ev)  # fmt: skip
    agent = SearchAgent("a1", "exploit", task, seed=3, families=[tiled, other])
    cands = agent.propose(ctx, 2).candidates
    first = cands[0]
    assert first.family == other.name and first.parent == "y" and "plateau" in first.rationale
    changed = {k for k in first.knobs if first.knobs[k] != best.get(k)}
    assert changed and len(changed) <= 4, changed  # a local step (plus any feasibility repair)
    assert cands[1].family == tiled.name  # the redirect is spent: back to exploiting the champion


def _known_ctx(task, fam, points):
    """A board of correct points of ``fam``: (knobs, latency_ms) each."""
    entries = [_entry(fam, k, Status.correct_slower, lat, -0.5, cid=f"p{i}") for i, (k, lat) in enumerate(points)]
    return _ctx(task, entries)


def test_a_failure_is_blamed_on_the_move_that_broke_it_not_on_every_value():
    """A compile error one knob away from a correct point suspects that knob's value only; the failed
    point's other values (here its good tile width) stay as likely as before."""
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    ok = {**fam.start, "BLOCK_N": 128, "num_stages": 3}
    bad = {**ok, "num_stages": 6}
    ctx = _known_ctx(task, fam, [(ok, 2.0)])
    ctx.findings.append(_entry(fam, bad, Status.compile_error, None, None, cid="bad"))
    info = SearchAgent("a", "exploit", task, seed=0, families=[fam])._info(ctx)
    assert info.fails[(fam.name, "num_stages", repr(6))] == 1.0
    assert info.fails.get((fam.name, "BLOCK_N", repr(128)), 0.0) == 0.0
    # with no correct point nearby every value is suspected, weakly
    lone = SearchAgent("a", "exploit", task, seed=0, families=[fam])._info(_ctx(task, [ctx.findings[-1]]))
    assert 0 < lone.fails[(fam.name, "BLOCK_N", repr(128))] < 1.0


def test_knobs_measured_without_effect_make_near_duplicates():
    """Two single-knob pairs of SWAP_AB that timed alike make the knob inert: a point differing from a
    measured one only in SWAP_AB is a near-duplicate, one differing in a tile size is not; flat pairs
    chain (GROUP_M 4~8 and 8~16 make 4~16), and a steep pair keeps a knob alive."""
    task = load_builtin("matmul", cpu=True)
    fam = next(f for f in families_for("matmul") if f.name == "matmul.tiled")
    a = {**fam.start, "BLOCK_N": 128}
    b = {**fam.start, "BLOCK_N": 256}
    pts = [(a, 2.0), ({**a, "SWAP_AB": True}, 2.005), (b, 1.5), ({**b, "SWAP_AB": True}, 1.497),
           ({**a, "GROUP_M": 4}, 1.8), ({**a, "GROUP_M": 8}, 1.8), ({**a, "GROUP_M": 16}, 1.801)]  # fmt: skip
    info = SearchAgent("a", "exploit", task, seed=0, families=[fam])._info(_known_ctx(task, fam, pts))
    assert info.inert(fam.name, "SWAP_AB") and not info.inert(fam.name, "BLOCK_N")
    assert info.near_duplicate(fam.name, {**b, "SWAP_AB": True, "MEMORY": fam.start["MEMORY"]})
    assert not info.near_duplicate(fam.name, {**a, "BLOCK_N": 64})
    assert info.equivalent(fam.name, "GROUP_M", 4, 16) and not info.equivalent(fam.name, "GROUP_M", 1, 4)
    assert info.near_duplicate(fam.name, {**a, "GROUP_M": 16, "SWAP_AB": True})
    # the agent's moves from b do not time SWAP_AB again
    agent = SearchAgent("a", "exploit", task, seed=3, families=[fam])
    ctx = _known_ctx(task, fam, pts)
    for _ in range(5):
        for c in agent.propose(ctx, 4).candidates:
            assert not info.near_duplicate(fam.name, c.knobs), c.rationale


def test_family_records_on_the_board_are_wins_for_transplant():
    """While the library leads, a family record (kind win, status correct_slower) is a win the
    transplant operator ports to the other families."""
    task = load_builtin("matmul", cpu=True)
    fams = families_for("matmul")
    tiled = next(f for f in fams if f.name == "matmul.tiled")
    rec = _entry(tiled, {**tiled.start, "BLOCK_M": 128, "BLOCK_N": 128}, Status.correct_slower, 1.4, -0.2, cid="rec")
    rec.kind = Kind.win
    info = SearchAgent("t", "transplant", task, seed=0)._info(_ctx(task, [rec]))
    assert [w[2] for w in info.wins] == ["rec"]


def test_a_plateau_redirect_ports_the_best_design_before_climbing_the_target():
    """The breaker's target family gets the session's best point ported first (its tile shape, warps,
    stages); only once that port is measured does the redirect climb the target from its own best."""
    task = load_builtin("matmul", cpu=True)
    fams = {f.name: f for f in families_for("matmul")}
    tiled, other = fams["matmul.tiled"], fams["matmul.persistent_tma"]
    good = {**tiled.start, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3}
    champ = Candidate(source=tiled.render(good), language="triton", family=tiled.name, knobs=good)
    verdict = Verdict(candidate_id=champ.id, status=Status.champion, latency_ms=1.0)
    ev = PlateauEvent(10, 10, Action.climb_family, other.name, other.language, tiled.name, ["a1"])
    found = _entry(other, dict(other.start), Status.correct_slower, 3.0, -0.6, cid="y")

    def first(seen=frozenset()):
        ctx = AgentContext(task=task, target=None, champion=champ, champion_verdict=verdict, findings=[found],
                           history=[], seen=seen, redirect=ev.instruction, plateau=ev)  # fmt: skip
        return SearchAgent("a1", "exploit", task, seed=3, families=[tiled, other]).propose(ctx, 1).candidates[0]

    c = first()
    assert c.family == other.name and "porting" in c.rationale
    assert all(c.knobs[k] == good[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages"))
    again = first(frozenset({c.id}))
    assert again.family == other.name and again.parent == "y" and "climbing" in again.rationale


def test_transplant_opens_an_untried_family_at_its_start_point():
    """A family's first kernel is its start point whichever operator opens it: a port into an untried family
    comes after that family's start (on the H200 a port opened softmax.rowblock 25% slower than its start
    point, and no later proposal went back to it)."""
    task = load_builtin("softmax", cpu=True)
    fams = {f.name: f for f in families_for("softmax")}
    online = fams["softmax.online"]
    win = _entry(online, dict(online.start, num_warps=4), Status.champion, 1.5, 0.2)
    agent = SearchAgent("a2", "transplant", task, seed=0)
    seen: set[str] = set()
    firsts: dict[str, Candidate] = {}
    for _ in range(12):
        for c in agent.propose(_ctx(task, [win], frozenset(seen)), 1).candidates:
            seen.add(c.id)
            firsts.setdefault(c.family, c)
    opened = {n: c for n, c in firsts.items() if n != online.name}
    assert opened, [c.rationale for c in firsts.values()]
    for name, c in opened.items():
        assert c.knobs == fams[name].check_point(fams[name].start), c.rationale
